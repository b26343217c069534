"""Errors: every exception pickles, and bad input gets a clear TypeError/ValueError and no files.

- each public exception survives ``pickle`` with its type, message and attributes
  (they cross process boundaries: multiprocessing, concurrent.futures);
- a value that is not bytes-like or an ``ObjectCode`` names its type;
- a key that is neither ``str`` nor ``bytes`` names its type;
- ``max_size_bytes`` that is not a positive ``int`` is refused, naming the value,
  before anything is created on disk.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import cuda_program_cas

DIGEST_A = "a" * 64
DIGEST_B = "b" * 64

EXCEPTIONS = {
    "CacheError": ("something went wrong",),
    "LayoutError": ("/tmp/x is not a cache directory",),
    "ReadOnlyCacheError": ("cannot put: cache '/tmp/x' was opened read-only",),
    "CorruptBlobError": ("/tmp/x/blobs/aa/" + "a" * 62, DIGEST_A, DIGEST_B),
    "CollectorBusyError": ("cache '/tmp/x' is busy",),
    "PackError": ("/tmp/x/packs/pack-0.cpk: bad trailer",),
}


@pytest.mark.parametrize("name", list(EXCEPTIONS))
def test_exception_pickles(name: str) -> None:
    cls = getattr(cuda_program_cas, name)
    assert issubclass(cls, cuda_program_cas.CacheError)
    exc = cls(*EXCEPTIONS[name])
    restored = pickle.loads(pickle.dumps(exc))
    assert type(restored) is cls
    assert str(restored) == str(exc)
    assert restored.args == exc.args
    assert vars(restored) == vars(exc)
    if name == "CorruptBlobError":
        assert (restored.path, restored.expected, restored.actual) == EXCEPTIONS[name]
        assert DIGEST_A in str(restored) and DIGEST_B in str(restored)


def test_exception_pickles_after_being_raised(tmp_path: Path) -> None:
    # A real one, as the library raises it (with a traceback and its own message).
    with pytest.raises(cuda_program_cas.LayoutError) as info:
        cuda_program_cas.CacheStore(tmp_path / "missing", read_only=True)
    restored = pickle.loads(pickle.dumps(info.value))
    assert type(restored) is cuda_program_cas.LayoutError
    assert str(restored) == str(info.value)


BAD_VALUES = ["a string", 12, None, [1, 2, 3], 1.5]


@pytest.mark.parametrize("bad", BAD_VALUES, ids=lambda v: type(v).__name__)
def test_program_cache_rejects_value_naming_its_type(tmp_path: Path, bad: object) -> None:
    pytest.importorskip("cuda.core")
    cache = cuda_program_cas.ContentAddressedProgramCache(tmp_path / "cas")
    with pytest.raises(TypeError) as info:
        cache["k"] = bad
    message = str(info.value)
    assert "bytes-like or ObjectCode" in message
    assert type(bad).__name__ in message
    assert cache.get("k") is None
    assert len(cache) == 0


@pytest.mark.parametrize("bad", BAD_VALUES, ids=lambda v: type(v).__name__)
def test_cache_store_rejects_value_naming_its_type(tmp_path: Path, bad: object) -> None:
    store = cuda_program_cas.CacheStore(tmp_path / "cas")
    with pytest.raises(TypeError, match=type(bad).__name__):
        store.put("k", bad)  # type: ignore[arg-type]
    assert store.get("k") is None
    assert len(store) == 0


BAD_KEYS = [12, None, 1.5, ("tuple",), object()]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=lambda v: type(v).__name__)
def test_cache_store_rejects_key_naming_its_type(tmp_path: Path, bad: object) -> None:
    store = cuda_program_cas.CacheStore(tmp_path / "cas")
    for call in (lambda: store.get(bad), lambda: store.put(bad, b"v"), lambda: store.delete(bad)):
        with pytest.raises(TypeError, match=type(bad).__name__):
            call()
    assert len(store) == 0


@pytest.mark.parametrize("bad", BAD_KEYS, ids=lambda v: type(v).__name__)
def test_program_cache_rejects_key_naming_its_type(tmp_path: Path, bad: object) -> None:
    pytest.importorskip("cuda.core")
    cache = cuda_program_cas.ContentAddressedProgramCache(tmp_path / "cas")

    def setitem() -> None:
        cache[bad] = b"v"  # type: ignore[index]

    def delitem() -> None:
        del cache[bad]  # type: ignore[arg-type]

    for call in (lambda: cache.get(bad), lambda: cache[bad], setitem, delitem):
        with pytest.raises(TypeError, match=type(bad).__name__):
            call()
    assert len(cache) == 0


BAD_SIZES = [True, 1.5, 0, -1, "10G"]


@pytest.mark.parametrize("bad", BAD_SIZES, ids=repr)
@pytest.mark.parametrize("kind", ["CacheStore", "ContentAddressedProgramCache"])
def test_bad_max_size_is_refused_before_anything_is_written(tmp_path: Path, kind: str, bad: object) -> None:
    if kind == "ContentAddressedProgramCache":
        pytest.importorskip("cuda.core")
    cls = getattr(cuda_program_cas, kind)
    root = tmp_path / "parent" / "cas"
    with pytest.raises((TypeError, ValueError)) as info:
        cls(root, max_size_bytes=bad)
    assert repr(bad) in str(info.value) or str(bad) in str(info.value), str(info.value)
    assert not (tmp_path / "parent").exists()
    assert list(tmp_path.iterdir()) == []
