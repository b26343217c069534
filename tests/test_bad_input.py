"""Bad input gets a clear exception naming the value, and nothing half-written on disk."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from cuda.core import ObjectCode

from cuda_program_cas import CacheStore, ContentAddressedProgramCache, LayoutError, ReadOnlyCacheError


def listing(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with a file's bytes (None for a directory)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = None
        for name in filenames:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = Path(path).read_bytes()
    return out


@pytest.fixture
def cache(cache_dir: Path) -> ContentAddressedProgramCache:
    c = ContentAddressedProgramCache(cache_dir)
    c["existing"] = b"value"
    return c


BAD_KEYS = [
    pytest.param(1, "int", id="int"),
    pytest.param(1.5, "float", id="float"),
    pytest.param(None, "NoneType", id="None"),
    pytest.param(["k"], "list", id="list"),
    pytest.param(("k",), "tuple", id="tuple"),
    pytest.param(memoryview(b"k"), "memoryview", id="memoryview"),
    pytest.param(object(), "object", id="object"),
]


@pytest.mark.parametrize(("key", "type_name"), BAD_KEYS)
def test_bad_keys_are_rejected_everywhere(
    cache: ContentAddressedProgramCache, cache_dir: Path, key: object, type_name: str
) -> None:
    before = listing(cache_dir)
    operations = {
        "set": lambda: cache.__setitem__(key, b"v"),
        "set-objectcode": lambda: cache.__setitem__(key, ObjectCode.from_cubin(b"v")),
        "get": lambda: cache.get(key),
        "getitem": lambda: cache[key],
        "del": lambda: cache.__delitem__(key),
        "update": lambda: cache.update([(key, b"v")]),
    }
    for name, op in operations.items():
        with pytest.raises(TypeError) as info:
            op()
        message = str(info.value)
        assert "str or bytes" in message, name
        assert type_name in message, name
    assert listing(cache_dir) == before
    assert cache.stats().misses == 0  # a bad key is an error, not a miss


def test_bad_key_is_reported_before_a_path_backed_value_is_read(cache_dir: Path, tmp_path: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    missing = ObjectCode.from_cubin(str(tmp_path / "does-not-exist.cubin"))
    with pytest.raises(TypeError, match="int"):
        cache[7] = missing


BAD_VALUES = [
    pytest.param("text", "str", id="str"),
    pytest.param(1, "int", id="int"),
    pytest.param(None, "NoneType", id="None"),
    pytest.param([1, 2], "list", id="list"),
    pytest.param({"a": b"b"}, "dict", id="dict"),
    pytest.param(object(), "object", id="object"),
]


@pytest.mark.parametrize(("value", "type_name"), BAD_VALUES)
def test_bad_values_are_rejected(
    cache: ContentAddressedProgramCache, cache_dir: Path, value: object, type_name: str
) -> None:
    before = listing(cache_dir)
    with pytest.raises(TypeError) as info:
        cache["k"] = value
    message = str(info.value)
    assert type_name in message
    assert "bytes" in message and "ObjectCode" in message
    assert listing(cache_dir) == before
    assert cache.get("k") is None


def test_a_long_bad_value_is_named_briefly(cache: ContentAddressedProgramCache) -> None:
    with pytest.raises(TypeError) as info:
        cache["k"] = "x" * 10_000
    assert len(str(info.value)) < 300


def test_store_level_put_wants_bytes(cache_dir: Path) -> None:
    store = CacheStore(cache_dir)
    before = listing(cache_dir)
    for value in (bytearray(b"v"), "v", memoryview(b"v")):
        with pytest.raises(TypeError, match=type(value).__name__):
            store.put("k", value)  # type: ignore[arg-type]
    assert listing(cache_dir) == before


@pytest.mark.parametrize(
    ("bad", "exc"),
    [
        pytest.param(True, TypeError, id="True"),
        pytest.param(False, TypeError, id="False"),
        pytest.param(1.5, TypeError, id="float"),
        pytest.param(1e9, TypeError, id="float-integral"),
        pytest.param("10", TypeError, id="str"),
        pytest.param("10G", TypeError, id="str-with-unit"),
        pytest.param(0, ValueError, id="zero"),
        pytest.param(-1, ValueError, id="negative"),
        pytest.param([10], TypeError, id="list"),
    ],
)
def test_bad_max_size_is_rejected_and_creates_nothing(tmp_path: Path, bad: object, exc: type[Exception]) -> None:
    where = tmp_path / "cache"
    for make in (ContentAddressedProgramCache, CacheStore):
        with pytest.raises(exc) as info:
            make(where, max_size_bytes=bad)
        assert repr(bad) in str(info.value)
        assert "max_size_bytes" in str(info.value)
        assert not os.path.lexists(where)


def test_str_max_size_hints_at_parse_size(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="parse_size"):
        ContentAddressedProgramCache(tmp_path / "c", max_size_bytes="10G")  # type: ignore[arg-type]


# -- paths -----------------------------------------------------------------------


def test_empty_path_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for make in (ContentAddressedProgramCache, CacheStore):
        with pytest.raises(ValueError, match="''"):
            make("")
    assert listing(tmp_path) == {}


def test_path_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_bytes(b"precious")
    before = listing(tmp_path)
    with pytest.raises(LayoutError, match="not a directory") as info:
        ContentAddressedProgramCache(target)
    assert str(target) in str(info.value)
    assert listing(tmp_path) == before


def test_path_below_a_file_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_bytes(b"precious")
    before = listing(tmp_path)
    with pytest.raises(OSError):
        ContentAddressedProgramCache(tmp_path / "a-file" / "cache")
    assert listing(tmp_path) == before


@pytest.mark.parametrize(
    "contents",
    [
        pytest.param({"notes.txt": b"mine"}, id="a-file"),
        pytest.param({"src/": None}, id="a-directory"),
        pytest.param({"blobs/": None, "photos/": None}, id="our-name-and-another"),
        pytest.param({".hidden": b""}, id="hidden-file"),
    ],
)
def test_directory_holding_something_else_is_refused(tmp_path: Path, contents: dict[str, bytes | None]) -> None:
    root = tmp_path / "dir"
    root.mkdir()
    for name, data in contents.items():
        if data is None:
            (root / name).mkdir()
        else:
            (root / name).write_bytes(data)
    before = listing(tmp_path)
    with pytest.raises(LayoutError, match="not a cuda-program-cas cache") as info:
        ContentAddressedProgramCache(root)
    foreign = next(n.rstrip("/") for n in contents if n.rstrip("/") != "blobs")
    assert foreign in str(info.value)
    assert listing(tmp_path) == before


def test_filestream_directory_is_refused_with_an_import_hint(tmp_path: Path) -> None:
    from cuda.core.utils import FileStreamProgramCache

    root = tmp_path / "program-cache"
    with FileStreamProgramCache(root) as fs:
        fs["k"] = b"filestream entry"
    before = listing(tmp_path)
    with pytest.raises(LayoutError, match="import-filestream"):
        ContentAddressedProgramCache(root)
    assert listing(tmp_path) == before


def test_newer_layout_version_is_refused(cache: ContentAddressedProgramCache, cache_dir: Path) -> None:
    layout = cache_dir / "layout.json"
    data = json.loads(layout.read_text())
    data["version"] += 1
    layout.write_text(json.dumps(data))
    before = listing(cache_dir)
    for make in (ContentAddressedProgramCache, CacheStore):
        with pytest.raises(LayoutError, match=r"layout version 3.*upgrade"):
            make(cache_dir)
    with pytest.raises(LayoutError, match="layout version 3"):
        ContentAddressedProgramCache(cache_dir, read_only=True)
    assert listing(cache_dir) == before


def test_other_hash_names_are_refused(cache: ContentAddressedProgramCache, cache_dir: Path) -> None:
    layout = cache_dir / "layout.json"
    data = json.loads(layout.read_text())
    data["blob_hash"] = "sha1"
    layout.write_text(json.dumps(data))
    before = listing(cache_dir)
    with pytest.raises(LayoutError, match="sha1"):
        ContentAddressedProgramCache(cache_dir)
    assert listing(cache_dir) == before


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b'{"layout": "cuda-program-cas", "vers', id="truncated"),
        pytest.param(b"\x00\xff garbage", id="garbage"),
        pytest.param(b"[1, 2]", id="not-an-object"),
        pytest.param(b'{"layout": "something-else", "version": 1}', id="foreign-name"),
        pytest.param(b'{"layout": "cuda-program-cas", "version": "1"}', id="version-str"),
    ],
)
def test_damaged_layout_file_is_repaired_when_the_rest_is_ours(
    cache: ContentAddressedProgramCache, cache_dir: Path, damage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    (cache_dir / "layout.json").write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
        reopened = ContentAddressedProgramCache(cache_dir)
    assert "damaged" in caplog.text
    assert json.loads((cache_dir / "layout.json").read_text())["layout"] == "cuda-program-cas"
    assert reopened["existing"] == b"value"  # entries carry their own checks: kept


def test_damaged_layout_file_with_foreign_contents_is_refused(cache_dir: Path) -> None:
    ContentAddressedProgramCache(cache_dir)
    (cache_dir / "layout.json").write_bytes(b"")
    (cache_dir / "stranger.txt").write_bytes(b"not ours")
    before = listing(cache_dir)
    with pytest.raises(LayoutError, match="stranger"):
        ContentAddressedProgramCache(cache_dir)
    assert listing(cache_dir) == before


def test_damaged_layout_file_is_refused_read_only(cache_dir: Path) -> None:
    ContentAddressedProgramCache(cache_dir)
    (cache_dir / "layout.json").write_bytes(b"{")
    before = listing(cache_dir)
    with pytest.raises(LayoutError, match="damaged"):
        ContentAddressedProgramCache(cache_dir, read_only=True)
    assert listing(cache_dir) == before


def test_read_only_cache_refuses_removal_clearly_and_drops_writes(
    cache: ContentAddressedProgramCache, cache_dir: Path
) -> None:
    before = listing(cache_dir)
    ro = ContentAddressedProgramCache(cache_dir, read_only=True)
    with pytest.raises(ReadOnlyCacheError, match="read-only"):
        del ro["existing"]
    with pytest.raises(ReadOnlyCacheError, match="read-only"):
        ro.clear()
    ro["new"] = b"dropped"  # not bad input: dropped and counted
    assert ro.get("new") is None and ro.counters()["dropped_writes"] == 1
    with pytest.raises(TypeError):
        ro[3] = b"x"  # type: ignore[index]  # a bad key is still bad input
    assert listing(cache_dir) == before


def test_missing_read_only_cache_is_not_created(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match="does not exist"):
        ContentAddressedProgramCache(tmp_path / "nothing", read_only=True)
    assert listing(tmp_path) == {}


def test_shared_must_be_a_sequence_of_paths(cache_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="single path"):
        ContentAddressedProgramCache(cache_dir, shared=str(tmp_path))  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["blob", "manifest"])
def test_a_directory_in_the_way_drops_the_write_and_the_compile_still_returns(cache_dir: Path, where: str) -> None:
    from conftest import compile_program

    from cuda_program_cas import ContentAddressedProgramCache, digest_of
    from cuda_program_cas.index import key_id

    reference = bytes(compile_program().code)
    cache = ContentAddressedProgramCache(cache_dir)
    store: CacheStore = cache.store
    from conftest import SAXPY
    from cuda.core import ProgramOptions
    from cuda.core.utils import make_program_cache_key

    key = make_program_cache_key(code=SAXPY, code_type="c++", options=ProgramOptions(arch="sm_80"), target_type="cubin")
    blocker = (
        store.inner.blobs.path_for(digest_of(reference))
        if where == "blob"
        else store.inner.layout.manifest_path(key_id(key))
    )
    os.makedirs(blocker)
    obj = compile_program(cache=cache)  # a miss whose store fails: the compile result still comes back
    assert bytes(obj.code) == reference
    st = cache.stats()
    assert st.dropped_writes == 1 and st.writes == 0
    assert os.listdir(cache_dir / "tmp") == []
    assert sorted(p.name for p in (cache_dir / "blobs").glob("*/*")) == (
        [os.path.basename(blocker)] if where == "blob" else []
    )
