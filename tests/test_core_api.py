"""The mapping API of ContentAddressedProgramCache: what ProgramCacheResource promises, and more.

Values in every accepted form, str and bytes keys as one key, stats fields, the
context manager, ``len``, ``update``, ``clear``, ``key in cache``, and where the
cache lives by default.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import platformdirs
import pytest
from conftest import write_orphan
from cuda.core import ObjectCode
from cuda.core.utils import ProgramCacheResource

from cuda_program_cas import CacheStats, ContentAddressedProgramCache, default_cache_dir


def test_is_a_program_cache_resource(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    assert isinstance(cache, ProgramCacheResource)
    assert cache.path == str(cache_dir)


def test_set_get_getitem_delitem(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    assert cache.get("k") is None
    assert cache.get("k", b"default") == b"default"
    with pytest.raises(KeyError):
        cache["k"]
    cache["k"] = b"value"
    assert cache["k"] == b"value"
    assert cache.get("k") == b"value"
    assert type(cache["k"]) is bytes
    cache["k"] = b"other"  # overwrite
    assert cache["k"] == b"other"
    del cache["k"]
    assert cache.get("k") is None
    with pytest.raises(KeyError):
        del cache["k"]


def test_empty_value_round_trips(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache["empty"] = b""
    assert cache["empty"] == b""
    assert cache.get("empty", b"default") == b""


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda data: data, id="bytes"),
        pytest.param(bytearray, id="bytearray"),
        pytest.param(memoryview, id="memoryview"),
        pytest.param(lambda data: memoryview(bytearray(b"xx" + data + b"yy"))[2:-2], id="memoryview-slice"),
        pytest.param(ObjectCode.from_cubin, id="objectcode-bytes"),
        pytest.param(ObjectCode.from_ltoir, id="objectcode-ltoir"),
    ],
)
def test_value_forms_store_the_same_bytes(cache_dir: Path, make) -> None:
    data = bytes(range(256)) * 3
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = make(data)
    assert cache["k"] == data
    # Every form lands on the same blob: the second is a dedup write.
    cache["k2"] = data
    assert cache.stats().blobs == 1
    assert cache.stats().dedup_writes == 1


def test_path_backed_objectcode_is_read_at_write_time(cache_dir: Path, tmp_path: Path) -> None:
    binary = tmp_path / "k.cubin"
    binary.write_bytes(b"first content")
    cache = ContentAddressedProgramCache(cache_dir)
    cache["str-path"] = ObjectCode.from_cubin(str(binary))
    cache["pathlike"] = ObjectCode.from_cubin(binary)
    binary.write_bytes(b"changed later")
    assert cache["str-path"] == b"first content"
    assert cache["pathlike"] == b"first content"
    binary.unlink()
    assert cache["str-path"] == b"first content"
    with pytest.raises(FileNotFoundError, match=r"k\.cubin"):
        cache["gone"] = ObjectCode.from_cubin(str(binary))
    assert cache.get("gone") is None


def test_mutating_a_bytearray_after_storing_changes_nothing(cache_dir: Path) -> None:
    buf = bytearray(b"original")
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = buf
    cache["m"] = memoryview(buf)
    buf[:] = b"mutated!"
    assert cache["k"] == b"original"
    assert cache["m"] == b"original"
    assert cache.stats().corrupt == 0


def test_str_and_bytes_keys_are_the_same_key(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = b"v1"
    assert cache[b"k"] == b"v1"
    cache[b"k"] = b"v2"
    assert cache["k"] == b"v2"
    assert len(cache) == 1
    cache["ключ"] = b"unicode"
    assert cache["ключ".encode()] == b"unicode"
    del cache["ключ".encode()]
    assert cache.get("ключ") is None
    # The key is the exact bytes: no normalisation of case or whitespace.
    assert cache.get("K") is None
    assert cache.get(b"k ") is None


def test_keys_are_exact_bytes_not_utf8_decoded(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache[b"\xff\xfe"] = b"raw"
    cache[b"\x00"] = b"nul"
    assert cache[b"\xff\xfe"] == b"raw"
    assert cache[b"\x00"] == b"nul"
    assert cache.get(b"") is None
    cache[""] = b"empty key"
    assert cache[b""] == b"empty key"


def test_len_counts_keys_not_blobs(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    assert len(cache) == 0
    for i in range(5):
        cache[f"k{i}"] = b"same bytes"
    cache["other"] = b"other bytes"
    assert len(cache) == 6
    assert cache.stats().blobs == 2
    del cache["k0"]
    assert len(cache) == 5


def test_update_accepts_mapping_and_pairs(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache.update({"a": b"1", b"b": bytearray(b"2")})
    cache.update([("c", memoryview(b"3")), (b"d", ObjectCode.from_cubin(b"4"))])
    cache.update(iter([("e", b"5")]))
    assert [cache[k] for k in "abcde"] == [b"1", b"2", b"3", b"4", b"5"]
    assert len(cache) == 5


def test_update_is_not_transactional_but_stops_at_a_bad_value(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    with pytest.raises(TypeError, match="int"):
        cache.update([("a", b"1"), ("b", 2), ("c", b"3")])
    assert cache["a"] == b"1"
    assert cache.get("b") is None
    assert cache.get("c") is None


def test_clear_removes_entries_and_blobs(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache.update({f"k{i}": bytes([i]) * 100 for i in range(10)})
    cache["dup"] = bytes([0]) * 100
    cache.clear()  # right after the writes: their blobs go too
    assert len(cache) == 0
    stats = cache.stats()
    assert (stats.entries, stats.blobs, stats.stored_bytes, stats.logical_bytes) == (0, 0, 0, 0)
    assert cache.get("k1") is None
    assert not any(p.is_file() for p in (cache_dir / "blobs").rglob("*"))
    assert not any(p.is_file() for p in (cache_dir / "index").rglob("*"))
    # The cache still works after a clear.
    cache["k1"] = b"again"
    assert cache["k1"] == b"again"


def test_clear_keeps_a_young_orphan(cache_dir: Path) -> None:
    # A blob no manifest names yet may be a concurrent writer's, between its blob
    # and its manifest: clear() leaves it for the collector's grace period.
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = b"named"
    orphan = b"in flight"
    write_orphan(cache_dir, orphan)
    cache.clear()
    stats = cache.stats()
    assert (stats.entries, stats.blobs, stats.stored_bytes) == (0, 1, len(orphan))


def test_contains_raises_type_error_pointing_to_get(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = b"v"
    with pytest.raises(TypeError, match=r"cache\.get\(key\)"):
        "k" in cache  # noqa: B015
    with pytest.raises(TypeError, match=r"cache\.get\(key\)"):
        b"absent" in cache  # noqa: B015


def test_iteration_is_refused_clearly(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = b"v"
    with pytest.raises(TypeError, match="hashed"):
        list(cache)


def test_context_manager_and_close(cache_dir: Path) -> None:
    with ContentAddressedProgramCache(cache_dir) as cache:
        assert isinstance(cache, ContentAddressedProgramCache)
        cache["k"] = b"v"
    # close() releases nothing that a later call needs; reopening sees the data.
    cache.close()
    cache.close()
    assert cache["k"] == b"v"
    with ContentAddressedProgramCache(cache_dir) as again:
        assert again["k"] == b"v"


def test_context_manager_does_not_swallow_exceptions(cache_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), ContentAddressedProgramCache(cache_dir) as cache:
        cache["k"] = b"v"
        raise RuntimeError("boom")
    assert ContentAddressedProgramCache(cache_dir)["k"] == b"v"


def test_stats_fields_and_counters(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    stats = cache.stats()
    assert isinstance(stats, CacheStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.hits = 5  # type: ignore[misc]
    assert stats == CacheStats(entries=0, blobs=0, logical_bytes=0, stored_bytes=0, blob_bytes=0, max_size_bytes=None)
    assert stats.dedup_ratio == 1.0

    a, b = b"a" * 1000, b"b" * 500
    cache["k1"] = a
    cache["k2"] = a  # same content: dedup write
    cache["k3"] = b
    assert cache["k1"] == a
    assert cache["k3"] == b
    assert cache.get("missing") is None
    with pytest.raises(KeyError):
        cache["missing too"]

    stats = cache.stats()
    assert stats.entries == 3
    assert stats.blobs == 2
    assert stats.logical_bytes == 2500
    manifest_bytes = sum(p.stat().st_size for p in (cache_dir / "index").rglob("*") if p.is_file())
    assert manifest_bytes > 0
    assert stats.stored_bytes == 1500 + manifest_bytes
    assert stats.dedup_ratio == pytest.approx(2500 / 1500)
    assert stats.manifest_bytes == manifest_bytes
    assert (stats.hits, stats.misses, stats.writes, stats.dedup_writes) == (2, 2, 3, 1)
    assert (stats.evictions, stats.corrupt, stats.dropped_writes, stats.errors) == (0, 0, 0, 0)
    assert stats.max_size_bytes is None


def test_stats_counters_belong_to_the_instance_disk_figures_do_not(cache_dir: Path) -> None:
    first = ContentAddressedProgramCache(cache_dir)
    first["k"] = b"v"
    second = ContentAddressedProgramCache(cache_dir)
    assert second.stats().writes == 0
    assert second.stats().entries == 1
    assert second["k"] == b"v"
    assert first.stats().hits == 0
    assert second.stats().hits == 1


def test_overwrite_with_new_content_keeps_one_entry(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = b"old" * 10
    cache["k"] = b"new" * 10
    stats = cache.stats()
    assert stats.entries == 1
    assert stats.logical_bytes == 30
    assert cache["k"] == b"new" * 10


# -- where the cache lives ------------------------------------------------------


def test_default_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    where = tmp_path / "from-env"
    monkeypatch.setenv("CUDA_PROGRAM_CAS_DIR", str(where))
    assert default_cache_dir() == where
    cache = ContentAddressedProgramCache()
    assert cache.path == str(where)
    cache["k"] = b"v"
    assert (where / "layout.json").is_file()
    assert ContentAddressedProgramCache(where)["k"] == b"v"


def test_default_dir_from_platformdirs_when_env_unset_or_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Point the per-user cache root at tmp_path through the variables
    # platformdirs itself reads, so the real home directory is never touched.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "xdg"))
    expected = platformdirs.user_cache_path("cuda-python", appauthor=False, opinion=False) / "program-cas"
    if not str(expected).startswith(str(tmp_path)):
        pytest.skip(f"platformdirs on this platform ignores XDG_CACHE_HOME/LOCALAPPDATA ({expected})")
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv("CUDA_PROGRAM_CAS_DIR", raising=False)
        else:
            monkeypatch.setenv("CUDA_PROGRAM_CAS_DIR", value)
        assert default_cache_dir() == expected
        cache = ContentAddressedProgramCache()
        assert cache.path == str(expected)
    assert expected.parent.name == "cuda-python"
    assert (expected / "layout.json").is_file()


def test_max_size_from_environment(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_SIZE", "10M")
    assert ContentAddressedProgramCache(cache_dir).stats().max_size_bytes == 10 * 2**20
    monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_SIZE", "1.5GiB")
    assert ContentAddressedProgramCache(cache_dir).stats().max_size_bytes == 3 * 2**29
    monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_SIZE", "4096")
    assert ContentAddressedProgramCache(cache_dir).stats().max_size_bytes == 4096
    # An explicit argument wins over the environment, None included.
    assert ContentAddressedProgramCache(cache_dir, max_size_bytes=None).stats().max_size_bytes is None
    assert ContentAddressedProgramCache(cache_dir, max_size_bytes=777).stats().max_size_bytes == 777
    monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_SIZE", "")
    assert ContentAddressedProgramCache(cache_dir).stats().max_size_bytes is None


@pytest.mark.parametrize("bad", ["lots", "0", "-5M", "10X", "1e9"])
def test_bad_max_size_in_environment_is_one_warning_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, bad: str
) -> None:
    """A bad value never fails a job: one WARNING per process, and the variable is ignored."""
    import cuda_program_cas._base.config

    monkeypatch.setattr(cuda_program_cas._base.config, "_seen", set())  # this process may have warned about it already
    monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_SIZE", bad)
    with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
        for _ in range(3):
            assert ContentAddressedProgramCache(tmp_path / "cas").stats().max_size_bytes is None
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"cuda-program-cas: CUDA_PROGRAM_CAS_MAX_SIZE={bad!r} is ignored: ")


def test_repr_names_the_path_and_cap(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=1 << 20)
    text = repr(cache)
    assert str(cache_dir) in text
    assert "1048576" in text


def test_repeated_hits_see_another_instances_overwrite_and_delete(cache_dir: Path) -> None:
    # Repeated hits are served from verified bytes kept in memory once two stats
    # prove the files unchanged; a change by another process must still be seen.
    reader = ContentAddressedProgramCache(cache_dir)
    writer = ContentAddressedProgramCache(cache_dir)
    for size in (100, 100_000):
        first, second = b"1" * size, b"2" * size
        writer["k"] = first
        for _ in range(4):
            assert reader["k"] == first
        writer["k"] = second
        for _ in range(2):
            assert reader["k"] == second
        del writer["k"]
        assert reader.get("k") is None
        writer["k"] = first
        assert reader["k"] == first
        writer.clear()
        assert reader.get("k") is None
