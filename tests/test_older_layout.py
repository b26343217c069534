"""A cache or store of an older layout (a pre-release version's) is refused, never read.

The directory is made as layout 1 wrote it: manifests ``cpcas1 <digest> <size>``
(no key id) and ``layout.json`` saying 1. A local cache refuses to open with one
message naming ``cuda-program-cas clear``; a shared store is a miss with one
WARNING saying the same; ``clear`` empties it and the cache opens again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from cuda_program_cas import CacheStore, ContentAddressedProgramCache, LayoutError
from cuda_program_cas._cli.main import main
from cuda_program_cas.index import parse_manifest

ENTRIES = {f"k{i}": bytes([i]) * (1000 + i) for i in range(8)}


def make_layout_1(root: Path) -> None:
    """A cache as layout 1 wrote it."""
    store = CacheStore(root)
    for key, data in ENTRIES.items():
        store.put(key, data)
    store.close()
    for path in (root / "index").glob("*/*"):
        m = parse_manifest(path.read_bytes())
        assert m is not None
        path.write_bytes(b"cpcas1 %s %d\n" % (m.digest.encode(), m.size))
    layout = root / "layout.json"
    data = json.loads(layout.read_text())
    data["version"] = 1
    layout.write_text(json.dumps(data))


def listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}


@pytest.mark.parametrize("read_only", [False, True])
def test_a_local_cache_of_layout_1_is_refused_at_open_naming_clear(tmp_path: Path, read_only: bool) -> None:
    root = tmp_path / "cas"
    make_layout_1(root)
    before = listing(root)
    with pytest.raises(LayoutError) as caught:
        CacheStore(root, read_only=read_only)
    assert f"`cuda-program-cas clear {root}`" in str(caught.value)
    assert "layout version 1" in str(caught.value) and "pre-release" in str(caught.value)
    with pytest.raises(LayoutError, match="cuda-program-cas clear"):
        ContentAddressedProgramCache(root)
    assert listing(root) == before  # nothing read on a guess, nothing rewritten


def test_a_shared_store_of_layout_1_is_a_miss_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    make_layout_1(root)
    before = listing(root)
    node = CacheStore(tmp_path / "node", shared=[str(root)])
    with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
        assert all(node.get(key) is None for key in ENTRIES)
    said = [r.getMessage() for r in caplog.records if "layout version 1" in r.getMessage()]
    assert len(said) == 1 and "cuda-program-cas clear" in said[0]
    assert node.stats().shared_hits == 0
    assert listing(root) == before


def test_the_maintenance_verbs_refuse_it_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cas"
    make_layout_1(root)
    for verb in ("gc", "stats", "verify"):
        code = main([verb, str(root)])
        err = capsys.readouterr().err
        assert code == 2, verb
        assert err.count("\n") == 1 and "cuda-program-cas clear" in err, (verb, err)


def test_clear_empties_it_and_the_cache_opens_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cas"
    make_layout_1(root)
    (root / "settings.json").write_text(json.dumps({"max_size_bytes": 1 << 20}))
    assert main(["clear", str(root), "--dry-run"]) == 0
    assert "would remove 8 entries and 8 blobs" in capsys.readouterr().out
    assert json.loads((root / "layout.json").read_text())["version"] == 1  # a dry run changes nothing
    assert main(["clear", str(root)]) == 0
    assert capsys.readouterr().out.startswith(f"cleared {root}: removed 8 entries and 8 blobs")
    assert json.loads((root / "layout.json").read_text())["version"] == 2
    assert not list((root / "index").rglob("*")) and not list((root / "blobs").rglob("*"))
    assert (root / "settings.json").exists()
    store = CacheStore(root)
    assert all(store.get(key) is None for key in ENTRIES)
    store.put("k0", ENTRIES["k0"])
    assert store.get("k0") == ENTRIES["k0"]
