"""Caches of layout version 1 (manifests without their key id) keep working.

A read-only open and a shared store read them as they are, writing nothing; a
writable open upgrades them in place (every manifest rewritten to name its key,
its recency kept, then ``layout.json`` says 2), also while another process is
reading them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from cuda_program_cas import CacheStore
from cuda_program_cas.index import parse_manifest

ENTRIES = {f"k{i}": bytes([i]) * (1000 + i) for i in range(40)}
ENTRIES["dup"] = ENTRIES["k1"]


def make_v1_cache(root: Path) -> dict[str, int]:
    """A cache as layout 1 wrote it; returns each manifest's mtime (ns), by path."""
    store = CacheStore(root)
    for key, data in ENTRIES.items():
        store.put(key, data)
    mtimes = {}
    for n, path in enumerate(sorted((root / "index").glob("*/*"))):
        m = parse_manifest(path.read_bytes())
        assert m is not None
        path.write_bytes(b"cpcas1 %s %d\n" % (m.digest.encode(), m.size))
        t = 1_700_000_000_000_000_000 + n * 1_000_000_000
        os.utime(path, ns=(t, t))
        mtimes[str(path)] = t
    layout = root / "layout.json"
    data = json.loads(layout.read_text())
    data["version"] = 1
    layout.write_text(json.dumps(data))
    return mtimes


def listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}


def test_a_layout_1_cache_is_read_as_it_is_when_read_only(tmp_path: Path) -> None:
    root = tmp_path / "v1"
    make_v1_cache(root)
    before = listing(root)
    store = CacheStore(root, read_only=True)
    for key, data in ENTRIES.items():
        assert store.get(key) == data
    assert listing(root) == before  # nothing upgraded, nothing touched
    assert json.loads((root / "layout.json").read_text())["version"] == 1


def test_a_layout_1_shared_store_is_read_by_nodes(tmp_path: Path) -> None:
    root = tmp_path / "v1"
    make_v1_cache(root)
    before = listing(root)
    node = CacheStore(tmp_path / "local", shared=[root])
    for key, data in ENTRIES.items():
        assert node.get(key) == data
    assert node.stats().shared_hits == len(ENTRIES)
    assert listing(root) == before
    local = CacheStore(tmp_path / "local")  # the copies made locally are of the new layout
    assert all(local.get(key) == data for key, data in ENTRIES.items())
    assert all(p.read_bytes().startswith(b"cpcas2 ") for p in (tmp_path / "local" / "index").glob("*/*"))


def test_a_writable_open_upgrades_in_place_keeping_recency(tmp_path: Path) -> None:
    root = tmp_path / "v1"
    mtimes = make_v1_cache(root)
    store = CacheStore(root)
    assert json.loads((root / "layout.json").read_text())["version"] == 2
    for path, mtime in mtimes.items():
        body = Path(path).read_bytes()
        kid = Path(path).parent.name + Path(path).name
        assert body.startswith(b"cpcas2 " + kid.encode()), body
        assert Path(path).stat().st_mtime_ns == mtime  # the entry's recency survives
    for key, data in ENTRIES.items():
        assert store.get(key) == data
    # A manifest copied onto another key's path is now recognised.
    (root / "index").joinpath(*_split(_kid("k2"))).write_bytes(
        (root / "index").joinpath(*_split(_kid("k3"))).read_bytes()
    )
    assert store.get("k2") is None and store.stats().corrupt == 1
    assert store.get("k3") == ENTRIES["k3"]


def _kid(key: str) -> str:
    from cuda_program_cas.index import key_id

    return key_id(key)


def _split(kid: str) -> tuple[str, str]:
    return kid[:2], kid[2:]


_READER = textwrap.dedent(
    """
    import json, sys
    from cuda_program_cas import CacheStore
    root, expected = sys.argv[1], json.load(open(sys.argv[2]))
    store = CacheStore(root, read_only=True)
    rounds = 0
    while True:
        for key, hexdata in expected.items():
            if store.get(key) != bytes.fromhex(hexdata):
                print("miss or wrong bytes for", key, flush=True)
                sys.exit(3)
        rounds += 1
        print("round", rounds, flush=True)  # the parent reads these: each is a full pass
        if sys.stdin.readline().strip() == "stop":
            sys.exit(0)
    """
)


def test_the_upgrade_is_safe_while_another_process_reads(tmp_path: Path) -> None:
    root = tmp_path / "v1"
    make_v1_cache(root)
    expected = tmp_path / "expected.json"
    expected.write_text(json.dumps({k: v.hex() for k, v in ENTRIES.items()}))
    env = dict(os.environ)
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(root), str(expected)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert reader.stdin is not None and reader.stdout is not None
    try:
        assert reader.stdout.readline().startswith("round 1")  # it reads the layout-1 cache
        reader.stdin.write("go\n")
        reader.stdin.flush()
        CacheStore(root)  # the upgrade, while the reader makes its second pass
        reader.stdin.write("go\n")  # and a third pass, wholly after the upgrade
        reader.stdin.write("stop\n")
        reader.stdin.flush()
        out, _ = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0, out
    assert out.split() == ["round", "2", "round", "3"]
    assert json.loads((root / "layout.json").read_text())["version"] == 2
