"""No lookup returns bytes stored for another key, whatever the store's manifests hold.

A manifest of layout 2 names its key (``cpcas2 <key id> <digest> <size>``); a
layout-1 line (``cpcas1 <digest> <size>``) names none, so it would fit any key's
path. The rule (``cuda_program_cas.index.fits_key``): a layout-1 line is believed
only while the store's ``layout.json`` says 1; anywhere else it is a miss counted
in ``corrupt`` (and removed from a writable cache), as a manifest of another key is.

The examples reproduce what was found (issue 28, finding 4) and each path that
parses manifests (the readers, the upgrade, gc, verify, stats, publish, repack).
The property test builds stores of both layouts, read locally (writable and
read-only), as a shared directory and over a real nginx, moves, copies and
rewrites manifests between key paths (layout-1 lines written by hand, lines naming
another key, truncated ones), upgrades layout-1 stores under their readers, and
checks that every lookup returns bytes the key was stored with, or misses.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_degrade import tmpfs
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


def v1_line(of: str) -> bytes:
    """A layout-1 manifest of ``of``'s bytes, as layout 1 wrote it: it names no key."""
    return b"cpcas1 %s %d\n" % (DIGESTS[of].encode(), len(VALUES[of]))


def keyed_line(named: str, of: str) -> bytes:
    """A layout-2 manifest naming key ``named``, mapping it to ``of``'s bytes."""
    return Manifest(DIGESTS[of], len(VALUES[of]), KIDS[named]).encode()


def set_layout_version(root: Path, version: int) -> None:
    layout = root / "layout.json"
    data = json.loads(layout.read_text())
    data["version"] = version
    layout.write_text(json.dumps(data))


def make_store(root: Path, layout: int) -> None:
    """Every key stored with its bytes; for layout 1, rewritten as layout 1 wrote it."""
    store = CacheStore(root)
    for key, data in VALUES.items():
        store.put(key, data)
    store.close()
    if layout == 1:
        for key in KEYS:
            manifest_path(root, key).write_bytes(v1_line(key))
        set_layout_version(root, 1)


# -- the finding, and each path that parses manifests ------------------------------------------------


def test_a_layout_1_line_copied_onto_another_keys_path_is_a_miss_counted_in_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "cas"
    store = CacheStore(root)
    store.put("k0", VALUES["k0"])
    store.put("k1", VALUES["k1"])
    path = manifest_path(root, "k0")
    path.write_bytes(v1_line("k1"))  # k1's blob, named by a line that names no key, at k0's path
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
def test_every_reader_of_a_layout_2_store_refuses_a_layout_1_line(tmp_path: Path, reader: str, request) -> None:
    if reader == "http":
        server = request.getfixturevalue("server")
        root = server.root
        where = server.read_url("")
    else:
        root = tmp_path / "store"
        where = str(root)
    make_store(root, layout=2)
    path = manifest_path(root, "k0")
    path.write_bytes(v1_line("k1"))
    node = CacheStore(root, read_only=True) if reader == "read-only" else CacheStore(tmp_path / "node", shared=[where])
    assert node.get("k0") is None
    assert node.counters()["corrupt"] == 1
    assert path.read_bytes() == v1_line("k1")  # a store this process does not own is only read
    assert node.get("k1") == VALUES["k1"]


def test_gc_verify_and_stats_judge_it_as_the_reader_does(tmp_path: Path) -> None:
    root = tmp_path / "cas"
    make_store(root, layout=2)
    path = manifest_path(root, "k0")
    path.write_bytes(v1_line("k1"))
    problems = verify(root).problems
    assert [(p.kind, p.path) for p in problems] == [("misplaced_manifest", str(path))]
    assert "layout-1 manifest" in problems[0].detail and "names no key" in problems[0].detail
    assert stats(root).invalid_manifests == 1
    report = collect(root, grace_s=0)
    assert report.plan["misplaced_manifests"]["count"] == 1
    assert not path.exists()
    store = CacheStore(root, read_only=True)
    assert store.get("k0") is None and all(store.get(k) == VALUES[k] for k in KEYS[1:])


@pytest.mark.parametrize("pack", [False, True])
def test_publish_does_not_turn_a_layout_1_line_into_a_keyed_entry(tmp_path: Path, pack: bool) -> None:
    src, dest = tmp_path / "node", tmp_path / "store"
    make_store(src, layout=2)
    manifest_path(src, "k0").write_bytes(v1_line("k1"))
    report = publish([src], dest, pack=pack)
    assert report.invalid_manifests == [str(manifest_path(src, "k0"))]
    shared = CacheStore(tmp_path / "reader", shared=[dest])
    assert shared.get("k0") is None  # neither a loose nor a packed entry says k0 is k1's bytes
    assert all(shared.get(k) == VALUES[k] for k in KEYS[1:])


def test_publish_replaces_a_layout_1_line_in_a_layout_2_store(tmp_path: Path) -> None:
    src, dest = tmp_path / "node", tmp_path / "store"
    make_store(src, layout=2)
    publish([src], dest)
    manifest_path(dest, "k0").write_bytes(v1_line("k1"))  # not the store's entry of k0: nodes refuse it
    report = publish([src], dest)
    assert report.conflicts == 0
    assert manifest_path(dest, "k0").read_bytes() == keyed_line("k0", "k0")
    assert CacheStore(dest, read_only=True).get("k0") == VALUES["k0"]


def test_repack_does_not_pack_a_layout_1_line_of_a_layout_2_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    make_store(root, layout=2)
    manifest_path(root, "k0").write_bytes(v1_line("k1"))
    repack(root)
    manifest_path(root, "k0").unlink(missing_ok=True)
    for key in KEYS[1:]:
        manifest_path(root, key).unlink()  # what is left to read is the pack
    shared = CacheStore(tmp_path / "reader", shared=[root])
    assert shared.get("k0") is None
    assert all(shared.get(k) == VALUES[k] for k in KEYS[1:])


def test_import_replaces_a_layout_1_line_of_a_layout_2_cache(tmp_path: Path) -> None:
    from cuda_program_cas import import_filestream

    src = tmp_path / "filestream"
    (src / "entries").mkdir(parents=True)
    entry = src / "entries" / KIDS["k0"][:2] / KIDS["k0"][2:]
    entry.parent.mkdir()
    entry.write_bytes(VALUES["k0"])  # FileStream names its entries by sha256 of the key, as we do
    root = tmp_path / "cas"
    make_store(root, layout=2)
    manifest_path(root, "k0").write_bytes(v1_line("k1"))
    report = import_filestream(src, root)
    assert report.kept_existing == 0 and report.imported == 1
    assert CacheStore(root).get("k0") == VALUES["k0"]


@pytest.mark.parametrize("reader", ["read-only", "shared directory"])
def test_a_reader_opened_before_an_upgrade_refuses_a_layout_1_line_copied_after_it(tmp_path: Path, reader: str) -> None:
    root = tmp_path / "store"
    make_store(root, layout=1)
    node = CacheStore(root, read_only=True) if reader == "read-only" else CacheStore(tmp_path / "node", shared=[root])
    assert node.get("k2") == VALUES["k2"]  # it reads the layout-1 cache
    done = run_python("import sys; from cuda_program_cas import CacheStore; CacheStore(sys.argv[1])", str(root))
    assert done.returncode == 0, done.stderr  # another process upgraded it, under this one
    assert json.loads((root / "layout.json").read_text())["version"] == 2
    manifest_path(root, "k0").write_bytes(v1_line("k1"))
    assert node.get("k0") is None  # the reader saw layout.json change: layout-1 lines are no longer believed
    assert node.counters()["corrupt"] == 1
    assert all(node.get(k) == VALUES[k] for k in KEYS[1:])


def test_a_writable_open_that_finds_the_upgrade_busy_reads_on_and_follows_it(tmp_path: Path) -> None:
    import filelock

    root = tmp_path / "cas"
    make_store(root, layout=1)
    with filelock.FileLock(str(root / "evict.lock"), timeout=0):  # a collector, or another process upgrading
        store = CacheStore(root)
    assert json.loads((root / "layout.json").read_text())["version"] == 1  # not upgraded: the lock was taken
    assert all(store.get(k) == VALUES[k] for k in KEYS)  # its layout-1 lines are read, and kept
    assert all(manifest_path(root, k).read_bytes() == v1_line(k) for k in KEYS)
    CacheStore(root).close()  # the next writable open upgrades it, under this one
    manifest_path(root, "k0").write_bytes(v1_line("k1"))
    assert store.get("k0") is None and not manifest_path(root, "k0").exists()
    assert store.counters()["corrupt"] == 1


def test_an_upgrade_on_a_full_disk_leaves_layout_1_readable_and_finishes_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with tmpfs(tmp_path / "disk", size="1m") as disk:
        root = disk / "cas"
        make_store(root, layout=1)
        filler = disk / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:  # every page of the disk taken: no manifest can be rewritten
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        store = CacheStore(root)  # the upgrade fails part-way; the open does not
        assert json.loads((root / "layout.json").read_text())["version"] == 1
        assert "cannot upgrade" in caplog.text
        assert all(store.get(k) == VALUES[k] for k in KEYS)  # the lines not yet rewritten still read
        filler.unlink()
        store = CacheStore(root)  # the next writable open finishes it
        assert json.loads((root / "layout.json").read_text())["version"] == 2
        assert all(manifest_path(root, k).read_bytes() == keyed_line(k, k) for k in KEYS)
        assert all(store.get(k) == VALUES[k] for k in KEYS)


def test_a_layout_1_cache_that_lost_its_layout_json_misses_its_layout_1_lines(tmp_path: Path) -> None:
    root = tmp_path / "cas"
    make_store(root, layout=1)
    (root / "layout.json").write_text("not json")
    store = CacheStore(root)  # rewrites it: layout 2 (nothing says these lines were ever layout 1)
    assert json.loads((root / "layout.json").read_text())["version"] == 2
    assert all(store.get(k) is None for k in KEYS)
    assert store.counters()["corrupt"] == len(KEYS)


# -- the property ------------------------------------------------------------------------------------


@dataclass
class Line:
    """What the model knows of the file at one key's path."""

    digest: str | None  # the blob it names; None for garbage
    owner: str | None  # the key it is a manifest of, by the store's layout; None: no key's
    unkeyed: bool  # a layout-1 line


def _op() -> st.SearchStrategy[tuple]:
    key = st.sampled_from(KEYS)
    return st.one_of(
        st.tuples(st.just("lookup"), key),
        st.tuples(st.just("copy"), key, key, st.booleans()),  # in place (same inode) or by rename
        st.tuples(st.just("move"), key, key),
        st.tuples(st.just("v1"), key, key),  # a layout-1 line of one key's bytes, written at a key's path
        st.tuples(st.just("keyed"), key, key, key),  # a line naming some key, of some key's bytes, at a path
        st.tuples(st.just("truncate"), key, st.integers(min_value=0, max_value=139)),
        st.tuples(st.just("delete"), key),
        st.tuples(st.just("upgrade")),
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

    def __init__(self, root: Path, node_dir: Path, layout: int, view: str, url: str | None) -> None:
        self.root = root
        self.layout = layout
        self.view = view
        make_store(root, layout)
        if view == "writable":
            self.node = CacheStore(root)  # a layout-1 cache is upgraded here
            self.layout = 2
        elif view == "read-only":
            self.node = CacheStore(root, read_only=True)
        else:
            self.node = CacheStore(node_dir, shared=[url if view == "http" else str(root)])
        self.lines: dict[str, Line | None] = {k: Line(DIGESTS[k], k, self.layout == 1) for k in KEYS}
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
            self._put(dst, self._moved(line, dst))
        elif kind == "v1":
            dst, of = op[1], op[2]
            _write(manifest_path(self.root, dst), v1_line(of), False)
            # Layout 1 cannot tell whose a line is: at its path, it is that key's. Layout 2 believes none.
            self._put(dst, Line(DIGESTS[of], dst if self.layout == 1 else None, True))
        elif kind == "keyed":
            dst, named, of = op[1], op[2], op[3]
            _write(manifest_path(self.root, dst), keyed_line(named, of), False)
            self._put(dst, Line(DIGESTS[of], named, False))
        elif kind == "truncate":
            dst, n = op[1], op[2]
            path = manifest_path(self.root, dst)
            if self.lines[dst] is None or n >= path.stat().st_size:
                return
            os.truncate(path, n)  # never a whole line: the newline goes first
            self._put(dst, Line(None, None, False))
        elif kind == "delete":
            if self.lines[op[1]] is not None:
                manifest_path(self.root, op[1]).unlink()
                self.lines[op[1]] = None
        elif kind == "upgrade" and self.layout == 1:
            CacheStore(self.root).close()  # another writable open, under this example's reader
            self.layout = 2
            for key, line in self.lines.items():
                if line is not None and line.unkeyed:  # rewritten to name the key of its path
                    self.lines[key] = Line(line.digest, line.owner, False)

    def _moved(self, line: Line, dst: str) -> Line:
        if line.unkeyed:
            return Line(line.digest, dst if self.layout == 1 else None, True)
        return line

    def lookup(self, key: str) -> None:
        got = self.node.get(key)
        line = self.lines[key]
        if got is not None:
            assert digest_of(got) in self.stored[key], f"{key} returned bytes it was never stored with: {got[:20]!r}"
        elif self._believed(line, key):
            raise AssertionError(
                f"{key} missed, but its path holds its own manifest ({self.view}, layout {self.layout})"
            )


def _run(data: st.DataObject, base: Path, counter: list[int], url_of, drawn: set[tuple[str, int]]) -> None:
    view = data.draw(st.sampled_from(["writable", "read-only", "shared directory", "http"]), label="view")
    if view == "http" and url_of is None:
        view = "shared directory"
    layout = data.draw(st.sampled_from([1, 2]), label="layout")
    ops = data.draw(st.lists(_op(), max_size=20), label="ops")
    if view == "http":
        # The HTTP reader reads layout.json once per process (docs/guarantees.md): a store is not
        # upgraded under it here.
        ops = [op for op in ops if op[0] != "upgrade"]
    counter[0] += 1
    drawn.add((view, layout))
    name = f"ex{counter[0]}"
    root = base / name
    example = _Example(root, base.parent / "nodes" / name, layout, view, url_of(name) if url_of else None)
    for op in ops + [("lookup", k) for k in KEYS]:
        example.step(op)


def test_every_lookup_returns_the_keys_own_bytes_or_misses(tmp_path: Path) -> None:
    with nginx_or_skip(tmp_path / "nginx", tmp_path / "served") as server:
        counter = [0]
        drawn: set[tuple[str, int]] = set()

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
        assert drawn == {(v, n) for v in ("writable", "read-only", "shared directory", "http") for n in (1, 2)}
