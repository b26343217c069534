"""Property-based round trips: the cache behaves as a dict from key bytes to value bytes.

Hypothesis drives random sequences of writes (in every value form), deletes and
reads against a plain dict model, with ``str`` keys folded into their UTF-8
bytes; after each sequence a fresh instance on the same directory must agree,
and ``stats()`` must describe exactly what the model holds.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest
from cuda.core import ObjectCode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuda_program_cas import CacheStore, ContentAddressedProgramCache
from cuda_program_cas.index import parse_manifest

KEYS = st.one_of(st.text(max_size=12), st.binary(max_size=12))
# Few distinct small values, so that deduplication happens often.
VALUES = st.one_of(st.sampled_from([b"", b"a", b"same" * 50, bytes(range(256))]), st.binary(max_size=2048))
FORMS = st.sampled_from(["bytes", "bytearray", "memoryview", "objectcode"])


def as_key_bytes(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else key


def in_form(value: bytes, form: str) -> object:
    if form == "bytearray":
        return bytearray(value)
    if form == "memoryview":
        return memoryview(value)
    if form == "objectcode":
        return ObjectCode.from_cubin(value)
    return value


def other_form(key: str | bytes) -> str | bytes:
    """The same key spelled the other way, where it has one."""
    if isinstance(key, str):
        return key.encode()
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return key


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), KEYS, VALUES, FORMS),
        st.tuples(st.just("del"), KEYS),
        st.tuples(st.just("get"), KEYS),
    ),
    max_size=25,
)

_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(OPS)
def test_cache_matches_a_dict_model(ops: list[tuple]) -> None:
    model: dict[bytes, bytes] = {}
    written: set[bytes] = set()
    with tempfile.TemporaryDirectory() as root:
        cache = ContentAddressedProgramCache(root)
        for op in ops:
            key = op[1]
            kb = as_key_bytes(key)
            if op[0] == "set":
                cache[key] = in_form(op[2], op[3])
                model[kb] = op[2]
                written.add(op[2])
            elif op[0] == "del":
                if kb in model:
                    del cache[other_form(key)]
                    del model[kb]
                else:
                    try:
                        del cache[key]
                    except KeyError:
                        pass
                    else:
                        raise AssertionError(f"deleting absent key {key!r} did not raise KeyError")
            else:
                assert cache.get(key) == model.get(kb)
                assert cache.get(other_form(key)) == model.get(kb)
            assert len(cache) == len(model)

        reopened = ContentAddressedProgramCache(root)
        for kb, value in model.items():
            got = reopened[kb]
            assert type(got) is bytes
            assert got == value
        stats = reopened.stats()
        assert stats.entries == len(model)
        # Overwritten and deleted values keep their blob until a collection (not
        # the cache's job on the write path): every distinct value written is one blob.
        assert stats.blobs == len(written)
        assert stats.logical_bytes == sum(len(v) for v in model.values())
        assert stats.corrupt == 0
        assert stats.stored_bytes >= sum(len(v) for v in written)


@_SETTINGS
@given(st.binary(max_size=70_000), KEYS)
def test_store_round_trips_any_bytes(data: bytes, key: str | bytes) -> None:
    with tempfile.TemporaryDirectory() as root:
        store = CacheStore(root)
        assert store.put(key, data)
        assert store.get(key) == data
        assert store.get(other_form(key)) == data
        assert CacheStore(root, read_only=True).get(key) == data


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=120))
def test_manifest_parser_accepts_only_what_encode_writes(raw: bytes) -> None:
    # Random bytes are almost never a manifest; whatever parses must re-encode exactly.
    manifest = parse_manifest(raw)
    if manifest is not None:
        assert manifest.encode() == raw


def _single_edits(raw: bytes, alphabet: bytes) -> Iterator[bytes]:
    """Every line one byte away from ``raw``: each byte changed, or removed, and a byte added anywhere."""
    for pos in range(len(raw) + 1):
        for byte in alphabet:
            yield raw[:pos] + bytes([byte]) + raw[pos:]
            if pos < len(raw) and raw[pos] != byte:
                yield raw[:pos] + bytes([byte]) + raw[pos + 1 :]
        if pos < len(raw):
            yield raw[:pos] + raw[pos + 1 :]


@pytest.mark.parametrize("size", [0, 7, 1234, 10**15, 10**16 - 1])
def test_a_manifest_one_byte_off_parses_only_if_it_is_again_exactly_one(size: int) -> None:
    # Near-valid lines take the parser's fast path (random bytes never do). Every
    # edit of one byte is rejected unless the result is again a manifest with every
    # field valid (the constructor checks) and spelled canonically.
    from cuda_program_cas.index import Manifest

    raw = Manifest("0123456789abcdef" * 4, size, "fedcba9876543210" * 4).encode()
    assert parse_manifest(raw) is not None
    accepted = 0
    for edited in _single_edits(raw, b"0123456789abcdefABCDEFg \n\x00+-\xff"):
        manifest = parse_manifest(edited)
        if manifest is not None:
            assert Manifest(manifest.digest, manifest.size, manifest.key_id).encode() == edited
            assert manifest.size < 10**16  # sizes have at most 16 digits
            accepted += 1
    assert accepted > 0  # changing a hex digit of the digest, say, gives another valid manifest


@settings(max_examples=100, deadline=None)
@given(
    st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
    st.integers(0, 10**15),
    st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
)
def test_manifest_encode_parse_round_trip(digest: str, size: int, kid: str) -> None:
    from cuda_program_cas.index import Manifest

    manifest = Manifest(digest, size, kid)
    assert parse_manifest(manifest.encode()) == manifest
    assert parse_manifest(manifest.encode(), kid) == manifest
    assert parse_manifest(manifest.encode(), "f" * 64 if kid != "f" * 64 else "0" * 64) is None  # another key's
    assert len(manifest.encode()) < 160


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.integers(0, 10**16 - 1), st.sampled_from([0, 9, 10, 10**15, 10**16 - 1])))
def test_the_index_says_how_long_a_manifest_is(size: int) -> None:
    # The store accounts a write's manifest bytes with manifest_length, without encoding one.
    from cuda_program_cas.index import LONGEST_MANIFEST, Manifest, manifest_length

    encoded = Manifest("a" * 64, size, "b" * 64).encode()
    assert manifest_length(size) == len(encoded) <= LONGEST_MANIFEST
    assert parse_manifest(encoded) is not None
    assert len(Manifest("a" * 64, 10**16 - 1, "b" * 64).encode()) == LONGEST_MANIFEST
    assert parse_manifest(Manifest("a" * 64, 10**16, "b" * 64).encode()) is None  # 17 digits: longer than any


def test_a_manifest_is_immutable_and_compared_by_its_fields() -> None:
    # Written out rather than a frozen dataclass (issue 31: a hit imports index._manifest, builds none).
    import copy
    import pickle

    from cuda_program_cas.index import Manifest

    one = Manifest("a" * 64, 5, "b" * 64)
    assert one == Manifest("a" * 64, 5, "b" * 64) and hash(one) == hash(Manifest("a" * 64, 5, "b" * 64))
    assert one != Manifest("a" * 64, 6, "b" * 64) and one != Manifest("a" * 64, 5, "c" * 64)
    assert len({one, Manifest("a" * 64, 5, "b" * 64), Manifest("c" * 64, 5, "b" * 64)}) == 2
    assert pickle.loads(pickle.dumps(one)) == one == copy.copy(one)  # writers hand manifests to processes
    with pytest.raises(AttributeError, match="immutable"):
        one.size = 6  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        del one.digest
    assert (one.digest, one.size, one.key_id) == ("a" * 64, 5, "b" * 64)
    assert repr(one) == f"Manifest(digest={'a' * 64!r}, size=5, key_id={'b' * 64!r})"
    with pytest.raises(ValueError, match="digest"):
        Manifest("A" * 64, 5, "b" * 64)
    with pytest.raises(ValueError, match="size"):
        Manifest("a" * 64, True, "b" * 64)
