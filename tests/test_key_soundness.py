"""No lookup returns bytes stored for another key, whatever the store's manifests hold.

A manifest names its key (``cpcas2 <key id> <digest> <size>``), so one copied or
renamed onto another key's path is a miss counted in ``corrupt`` (and removed from
a writable cache). The examples take each path that parses manifests (the readers,
gc, verify, stats, publish, repack, import). The property test builds stores read
locally (writable and read-only), as a shared directory and over a real nginx,
moves, copies and rewrites manifests between key paths (lines naming another key,
truncated ones), and checks that every lookup returns bytes the key was stored
with, or misses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.nginx import nginx_or_skip

from cuda_program_cas import CacheStore, collect, digest_of, publish, repack, stats, verify
from cuda_program_cas.index import Manifest, key_id

KEYS = ("k0", "k1", "k2", "k3")
#: Each key's bytes: distinct, of distinct sizes (a size never tells two keys apart by chance).
VALUES = {k: f"the bytes of {k};".encode() * (20 + 7 * i) for i, k in enumerate(KEYS)}
DIGESTS = {k: digest_of(v) for k, v in VALUES.items()}
KIDS = {k: key_id(k) for k in KEYS}

#: The property's examples (CI: these defaults, derandomized; a few seconds on 2 cores).
EXAMPLES = int(os.environ.get("CPCAS_KEYS_EXAMPLES", "150"))


def manifest_path(root: Path, key: str) -> Path:
    kid = KIDS[key]
    return root / "index" / kid[:2] / kid[2:]


def keyed_line(named: str, of: str) -> bytes:
    """A manifest naming key ``named``, mapping it to ``of``'s bytes."""
    return Manifest(DIGESTS[of], len(VALUES[of]), KIDS[named]).encode()


def make_store(root: Path) -> None:
    """Every key stored with its bytes."""
    store = CacheStore(root)
    for key, data in VALUES.items():
        store.put(key, data)
    store.close()


# -- the finding, and each path that parses manifests ------------------------------------------------


def test_a_manifest_copied_onto_another_keys_path_is_a_miss_counted_in_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "cas"
    store = CacheStore(root)
    store.put("k0", VALUES["k0"])
    store.put("k1", VALUES["k1"])
    path = manifest_path(root, "k0")
    path.write_bytes(keyed_line("k1", "k1"))  # k1's manifest, at k0's path
    assert store.get("k0") is None  # was k1's verified bytes
    assert store.counters()["corrupt"] == 1
    assert not path.exists()  # removed, as any damaged manifest is
    assert store.get("k1") == VALUES["k1"]
    assert store.get("k0") is None and store.counters()["misses"] == 2


@pytest.fixture
def server(tmp_path: Path):
    with nginx_or_skip(tmp_path / "nginx", tmp_path / "served") as n:
        yield n


@pytest.mark.parametrize("reader", ["read-only", "shared directory", "http"])
def test_every_reader_of_a_store_refuses_another_keys_manifest(tmp_path: Path, reader: str, request) -> None:
    if reader == "http":
        server = request.getfixturevalue("server")
        root = server.root
        where = server.read_url("")
    else:
        root = tmp_path / "store"
        where = str(root)
    make_store(root)
    path = manifest_path(root, "k0")
    path.write_bytes(keyed_line("k1", "k1"))
    node = CacheStore(root, read_only=True) if reader == "read-only" else CacheStore(tmp_path / "node", shared=[where])
    assert node.get("k0") is None
    assert node.counters()["corrupt"] == 1
    assert path.read_bytes() == keyed_line("k1", "k1")  # a store this process does not own is only read
    assert node.get("k1") == VALUES["k1"]


def test_gc_verify_and_stats_judge_it_as_the_reader_does(tmp_path: Path) -> None:
    root = tmp_path / "cas"
    make_store(root)
    path = manifest_path(root, "k0")
    path.write_bytes(keyed_line("k1", "k1"))
    problems = verify(root).problems
    assert [(p.kind, p.path) for p in problems] == [("misplaced_manifest", str(path))]
    assert "another key" in problems[0].detail
    assert stats(root).invalid_manifests == 1
    report = collect(root, grace_s=0)
    assert report.plan["misplaced_manifests"]["count"] == 1
    assert not path.exists()
    store = CacheStore(root, read_only=True)
    assert store.get("k0") is None and all(store.get(k) == VALUES[k] for k in KEYS[1:])


@pytest.mark.parametrize("pack", [False, True])
def test_publish_does_not_take_another_keys_manifest_for_an_entry(tmp_path: Path, pack: bool) -> None:
    src, dest = tmp_path / "node", tmp_path / "store"
    make_store(src)
    manifest_path(src, "k0").write_bytes(keyed_line("k1", "k1"))
    report = publish([src], dest, pack=pack)
    assert report.invalid_manifests == [str(manifest_path(src, "k0"))]
    shared = CacheStore(tmp_path / "reader", shared=[dest])
    assert shared.get("k0") is None  # neither a loose nor a packed entry says k0 is k1's bytes
    assert all(shared.get(k) == VALUES[k] for k in KEYS[1:])


def test_publish_replaces_another_keys_manifest_in_a_store(tmp_path: Path) -> None:
    src, dest = tmp_path / "node", tmp_path / "store"
    make_store(src)
    publish([src], dest)
    manifest_path(dest, "k0").write_bytes(keyed_line("k1", "k1"))  # not the store's entry of k0: nodes refuse it
    report = publish([src], dest)
    assert report.conflicts == 0
    assert manifest_path(dest, "k0").read_bytes() == keyed_line("k0", "k0")
    assert CacheStore(dest, read_only=True).get("k0") == VALUES["k0"]


def test_repack_does_not_pack_another_keys_manifest(tmp_path: Path) -> None:
    root = tmp_path / "store"
    make_store(root)
    manifest_path(root, "k0").write_bytes(keyed_line("k1", "k1"))
    repack(root)
    manifest_path(root, "k0").unlink(missing_ok=True)
    for key in KEYS[1:]:
        manifest_path(root, key).unlink()  # what is left to read is the pack
    shared = CacheStore(tmp_path / "reader", shared=[root])
    assert shared.get("k0") is None
    assert all(shared.get(k) == VALUES[k] for k in KEYS[1:])


def test_import_replaces_another_keys_manifest(tmp_path: Path) -> None:
    from cuda_program_cas import import_filestream

    src = tmp_path / "filestream"
    (src / "entries").mkdir(parents=True)
    entry = src / "entries" / KIDS["k0"][:2] / KIDS["k0"][2:]
    entry.parent.mkdir()
    entry.write_bytes(VALUES["k0"])  # FileStream names its entries by sha256 of the key, as we do
    root = tmp_path / "cas"
    make_store(root)
    manifest_path(root, "k0").write_bytes(keyed_line("k1", "k1"))
    report = import_filestream(src, root)
    assert report.kept_existing == 0 and report.imported == 1
    assert CacheStore(root).get("k0") == VALUES["k0"]


# -- the property ------------------------------------------------------------------------------------


@dataclass
class Line:
    """What the model knows of the file at one key's path."""

    digest: str | None  # the blob it names; None for garbage
    owner: str | None  # the key it is a manifest of; None: no key's


def _op() -> st.SearchStrategy[tuple]:
    key = st.sampled_from(KEYS)
    return st.one_of(
        st.tuples(st.just("lookup"), key),
        st.tuples(st.just("copy"), key, key, st.booleans()),  # in place (same inode) or by rename
        st.tuples(st.just("move"), key, key),
        st.tuples(st.just("keyed"), key, key, key),  # a line naming some key, of some key's bytes, at a path
        st.tuples(st.just("truncate"), key, st.integers(min_value=0, max_value=139)),
        st.tuples(st.just("delete"), key),
    )


def _write(path: Path, data: bytes, in_place: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if in_place:
        path.write_bytes(data)
    else:
        tmp = path.with_name(path.name + ".new")
        tmp.write_bytes(data)
        os.replace(tmp, path)


class _Example:
    """One store, one reader of it, and the model: which digests each key was ever stored with."""

    def __init__(self, root: Path, node_dir: Path, view: str, url: str | None) -> None:
        self.root = root
        self.view = view
        make_store(root)
        if view == "writable":
            self.node = CacheStore(root)
        elif view == "read-only":
            self.node = CacheStore(root, read_only=True)
        else:
            self.node = CacheStore(node_dir, shared=[url if view == "http" else str(root)])
        self.lines: dict[str, Line | None] = {k: Line(DIGESTS[k], k) for k in KEYS}
        #: key -> every digest it was stored with (a hit copied locally may be served after its line changed).
        self.stored = {k: {DIGESTS[k]} for k in KEYS}

    def _believed(self, line: Line | None, key: str) -> bool:
        return line is not None and line.digest is not None and line.owner == key

    def _put(self, key: str, line: Line | None) -> None:
        self.lines[key] = line
        if line is not None and line.owner == key and line.digest is not None:
            self.stored[key].add(line.digest)

    def step(self, op: tuple) -> None:
        for key in KEYS:  # a writable cache removes what it refused
            if not manifest_path(self.root, key).exists():
                self.lines[key] = None
        kind = op[0]
        if kind == "lookup":
            self.lookup(op[1])
        elif kind in ("copy", "move"):
            src, dst = op[1], op[2]
            line = self.lines[src]
            if src == dst or line is None:
                return
            data = manifest_path(self.root, src).read_bytes()
            if kind == "copy":
                _write(manifest_path(self.root, dst), data, op[3])
            else:
                manifest_path(self.root, dst).parent.mkdir(parents=True, exist_ok=True)
                os.replace(manifest_path(self.root, src), manifest_path(self.root, dst))
                self.lines[src] = None
            self._put(dst, line)
        elif kind == "keyed":
            dst, named, of = op[1], op[2], op[3]
            _write(manifest_path(self.root, dst), keyed_line(named, of), False)
            self._put(dst, Line(DIGESTS[of], named))
        elif kind == "truncate":
            dst, n = op[1], op[2]
            path = manifest_path(self.root, dst)
            if self.lines[dst] is None or n >= path.stat().st_size:
                return
            os.truncate(path, n)  # never a whole line: the newline goes first
            self._put(dst, Line(None, None))
        elif kind == "delete" and self.lines[op[1]] is not None:
            manifest_path(self.root, op[1]).unlink()
            self.lines[op[1]] = None

    def lookup(self, key: str) -> None:
        got = self.node.get(key)
        line = self.lines[key]
        if got is not None:
            assert digest_of(got) in self.stored[key], f"{key} returned bytes it was never stored with: {got[:20]!r}"
        elif self._believed(line, key):
            raise AssertionError(f"{key} missed, but its path holds its own manifest ({self.view})")


def _run(data: st.DataObject, base: Path, counter: list[int], url_of, drawn: set[str]) -> None:
    view = data.draw(st.sampled_from(["writable", "read-only", "shared directory", "http"]), label="view")
    if view == "http" and url_of is None:
        view = "shared directory"
    ops = data.draw(st.lists(_op(), max_size=20), label="ops")
    counter[0] += 1
    drawn.add(view)
    name = f"ex{counter[0]}"
    root = base / name
    example = _Example(root, base.parent / "nodes" / name, view, url_of(name) if url_of else None)
    for op in ops + [("lookup", k) for k in KEYS]:
        example.step(op)


def test_every_lookup_returns_the_keys_own_bytes_or_misses(tmp_path: Path) -> None:
    with nginx_or_skip(tmp_path / "nginx", tmp_path / "served") as server:
        counter = [0]
        drawn: set[str] = set()

        @settings(
            max_examples=EXAMPLES,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(st.data())
        def prop(data: st.DataObject) -> None:
            _run(data, server.root, counter, lambda name: server.read_url(f"{name}/"), drawn)

        prop()
        assert drawn == {"writable", "read-only", "shared directory", "http"}
