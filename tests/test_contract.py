"""One contract for every way a :class:`cuda_program_cas.CacheStore` can be opened.

The ``config`` fixture yields the same small object for four configurations: a plain
local cache, a capped one, one reopened ``read_only=True`` after a writable store
filled it, and an empty local cache layered over a shared store that holds the
seeded entries. Each contract item runs against all four; an item that needs
writes skips for the read-only one. Everything is real files under ``tmp_path``.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from conftest import run_python

import cuda_program_cas
from cuda_program_cas import CacheStore, LayoutError, ReadOnlyCacheError

MiB = 1 << 20
CAP = 4 * MiB  # large enough for everything a test here stores (the largest value is 1 MiB)
CONFIGS = ["local", "capped", "read_only", "layered"]


class Config:
    """A store under test, and ``seed`` to give it entries the way that configuration gets them."""

    def __init__(self, name: str, tmp_path: Path) -> None:
        self.name = name
        self.root = tmp_path / "cas"
        self.shared_root = tmp_path / "shared"
        self.writable = name != "read_only"
        # Where seeded entries are written: the shared store for "layered", else the cache itself.
        self.source = self.shared_root if name == "layered" else self.root
        self.cap = CAP if name == "capped" else None
        CacheStore(self.source, max_size_bytes=self.cap)  # creates the layout
        self.store = self._open()

    def _open(self) -> CacheStore:
        if self.name == "read_only":
            return CacheStore(self.root, read_only=True)
        if self.name == "layered":
            return CacheStore(self.root, shared=[self.shared_root])
        return CacheStore(self.root, max_size_bytes=self.cap)

    def seed(self, entries: dict[str | bytes, bytes]) -> None:
        """Store ``entries`` through a writable store, then reopen ``self.store`` (counters start at 0)."""
        writer = CacheStore(self.source, max_size_bytes=self.cap)
        for key, data in entries.items():
            assert writer.put(key, data), key
        self.store = self._open()

    def need_writes(self) -> None:
        if not self.writable:
            pytest.skip("needs a writable cache; the read-only configuration drops every write")


@pytest.fixture(params=CONFIGS)
def config(request: pytest.FixtureRequest, tmp_path: Path) -> Config:
    return Config(request.param, tmp_path)


def tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root`` (the root included) with its inode, size and mtime."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            path = os.path.normpath(os.path.join(dirpath, name))
            st = os.lstat(path)
            found[os.path.relpath(path, root)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return found


def value(n: int, tag: str = "v") -> bytes:
    return (f"{tag}:{n}:".encode() * (n // 4 + 1))[:n]


SIZES = [0, 1, 100, 4096, 65537, MiB]


def test_round_trip(config: Config) -> None:
    entries: dict[str | bytes, bytes] = {f"size-{n}": value(n) for n in SIZES}
    config.seed(entries)
    for key, data in entries.items():
        assert config.store.get(key) == data, key
    stats = config.store.stats()
    assert (stats.hits, stats.misses) == (len(SIZES), 0)
    if config.name == "layered":
        assert stats.shared_hits == len(SIZES)  # each came from the shared store
        for key, data in entries.items():  # ... and was copied in: now a local hit
            assert config.store.get(key) == data
        assert config.store.stats().shared_hits == len(SIZES)
    else:
        assert stats.shared_hits == 0


def test_str_and_bytes_keys_are_one_key(config: Config) -> None:
    config.seed({"text": b"from str", b"raw": b"from bytes", "ключ": b"utf-8"})
    assert config.store.get(b"text") == b"from str"
    assert config.store.get("raw") == b"from bytes"
    assert config.store.get("ключ".encode()) == b"utf-8"
    assert config.store.get("ключ") == b"utf-8"


def test_miss_returns_none_and_counts(config: Config) -> None:
    config.seed({"present": b"here"})
    assert config.store.get("absent") is None
    assert config.store.get(b"absent too") is None
    stats = config.store.stats()
    assert (stats.hits, stats.misses, stats.shared_hits) == (0, 2, 0)


def test_identical_content_is_stored_once(config: Config) -> None:
    config.need_writes()
    data = value(50_000, "same")
    first = config.store.put("one", data)
    second = config.store.put(b"two", data)
    assert first is cuda_program_cas.WriteResult.STORED
    assert second is cuda_program_cas.WriteResult.DEDUPLICATED
    assert first and second
    stats = config.store.stats()
    assert (stats.entries, stats.blobs, stats.writes, stats.dedup_writes) == (2, 1, 2, 1)
    assert stats.logical_bytes == 2 * len(data)
    assert stats.stored_bytes < 2 * len(data)
    assert config.store.get("one") == config.store.get("two") == data


def test_overwrite_returns_new_bytes(config: Config) -> None:
    config.need_writes()
    config.seed({"k": b"old value"})  # layered: the old value is in the shared store
    assert config.store.put("k", b"new value")
    assert config.store.get("k") == b"new value"
    assert config.store.get(b"k") == b"new value"


def test_delete(config: Config) -> None:
    config.need_writes()
    assert config.store.put("gone", b"soon")
    config.store.delete(b"gone")
    assert config.store.get("gone") is None
    with pytest.raises(KeyError):
        config.store.delete("gone")
    with pytest.raises(KeyError):
        config.store.delete("never stored")


def test_clear_empties(config: Config) -> None:
    config.need_writes()
    for i in range(5):
        assert config.store.put(f"k{i}", value(1000 + i))
    assert len(config.store) == 5
    config.store.clear()
    assert len(config.store) == 0
    assert all(config.store.get(f"k{i}") is None for i in range(5))
    stats = config.store.stats()
    assert (stats.entries, stats.blobs) == (0, 0)
    assert config.store.put("after", b"still works")
    assert config.store.get("after") == b"still works"


def test_stats_add_up(config: Config) -> None:
    config.seed({f"k{i}": value(100 * i + 1) for i in range(6)})
    gets = hits = 0
    for rnd in range(3):
        for i in range(10):
            data = config.store.get(f"k{i}")
            gets += 1
            hits += data is not None
            assert (data is not None) == (i < 6), (rnd, i)
    stats = config.store.stats()
    assert stats.hits + stats.misses == gets
    assert (stats.hits, stats.misses) == (hits, gets - hits)
    assert stats.shared_hits == (6 if config.name == "layered" else 0)
    assert stats.max_size_bytes == config.cap
    assert stats.corrupt == stats.errors == stats.evictions == 0
    if config.writable:
        assert len(config.store) == 6  # layered: the shared hits were copied in
        assert stats.entries == 6


def test_value_that_can_never_fit_is_dropped(config: Config) -> None:
    if config.name != "capped":
        pytest.skip("only a capped cache drops a value larger than its cap")
    result = config.store.put("huge", bytes(CAP + 1))
    assert result is cuda_program_cas.WriteResult.DROPPED
    assert not result
    assert config.store.get("huge") is None
    assert config.store.stats().dropped_writes == 1


def test_read_only_drops_every_write_refuses_removal_and_changes_nothing(config: Config) -> None:
    if config.name != "read_only":
        pytest.skip("only the read-only configuration drops writes")
    config.seed({"a": b"alpha", b"b": value(20_000)})
    before = tree(config.root)
    store = config.store
    # A write is dropped and counted (the caller keeps its program); removal cannot be done and raises.
    assert store.put("new", b"data") is cuda_program_cas.WriteResult.DROPPED
    assert store.put("a", b"alpha") is cuda_program_cas.WriteResult.DROPPED  # even a write that would deduplicate
    assert store.counters()["dropped_writes"] == 2
    with pytest.raises(ReadOnlyCacheError):
        store.delete("a")
    with pytest.raises(ReadOnlyCacheError):
        store.delete("absent")
    with pytest.raises(ReadOnlyCacheError):
        store.clear()
    for _ in range(3):  # reads (hits and misses), len and stats write nothing either
        assert store.get("a") == b"alpha"
        assert store.get("b") == value(20_000)
        assert store.get("absent") is None
    assert len(store) == 2
    assert store.get("new") is None
    stats = store.stats()
    assert (stats.entries, stats.hits, stats.misses, stats.writes, stats.dropped_writes) == (2, 6, 4, 0, 2)
    assert tree(config.root) == before


def test_read_only_open_of_missing_path_raises_layout_error(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    with pytest.raises(LayoutError):
        CacheStore(missing, read_only=True)
    assert not missing.exists()


_NO_CUDA = textwrap.dedent(
    """
    import sys
    sys.modules["cuda.core"] = None
    sys.modules["cuda.core.utils"] = None

    import cuda_program_cas
    from cuda_program_cas import CacheStore, ReadOnlyCacheError, WriteResult

    root, shared = sys.argv[1], sys.argv[2]
    seed = CacheStore(shared)
    assert seed.put("s", b"shared bytes") is WriteResult.STORED

    store = CacheStore(root, max_size_bytes=1 << 20, shared=[shared])
    assert store.put("k", b"x" * 1000) is WriteResult.STORED
    assert store.put(b"k2", b"x" * 1000) is WriteResult.DEDUPLICATED
    assert store.get(b"k") == store.get("k2") == b"x" * 1000
    assert store.get("absent") is None
    assert store.get("s") == b"shared bytes"
    store.delete("k2")
    try:
        store.delete("k2")
    except KeyError:
        pass
    else:
        sys.exit("delete of an absent key did not raise KeyError")
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.shared_hits, stats.dedup_writes) == (3, 1, 1, 1), stats
    store.clear()
    assert len(store) == 0

    ro = CacheStore(shared, read_only=True)
    assert ro.get("s") == b"shared bytes"
    assert ro.put("t", b"t") is WriteResult.DROPPED
    try:
        ro.clear()
    except ReadOnlyCacheError:
        pass
    else:
        sys.exit("clear on a read-only store did not raise ReadOnlyCacheError")

    loaded = [n for n, m in sys.modules.items() if (n == "cuda.core" or n.startswith("cuda.core.")) and m is not None]
    if loaded:
        sys.exit(f"cuda.core was imported: {loaded}")
    print("ok")
    """
)


def test_contract_without_cuda_core(tmp_path: Path) -> None:
    result = run_python(_NO_CUDA, str(tmp_path / "cas"), str(tmp_path / "shared"), timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")
