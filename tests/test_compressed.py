"""Shared stores hold compressed blobs: the frame's bounds, and round trips over every engine.

A writer (write-back, publish) compresses a blob once into a frame
(``cas/_base/frame.py``); a reader decodes it, bounded, before it verifies the raw
bytes' blake3 digest; a store may mix framed and raw objects; a node's local cache
keeps raw blobs. Servers are real (nginx, redis-server on loopback, started here).
"""

from __future__ import annotations

import logging
import os
import random
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zstandard
from conftest import SAXPY, compile_program
from hypothesis import example, given, settings
from hypothesis import strategies as st
from testkit.nginx import Nginx, nginx_or_skip
from testkit.redis_server import RedisServer

from cuda_program_cas import CacheStore, ContentAddressedProgramCache, digest_of, publish
from cuda_program_cas._base import frame
from cuda_program_cas._base.engine import Engine, StoreFailure
from cuda_program_cas._disk.layout import BLOBS, url_path

LIMIT = 10_000


def value(i: int, size: int = 6000) -> bytes:
    return (f"entry {i} ".encode() * (size // 8 + 1))[:size]


def _patched_content_size(body: bytes, size: int) -> bytes:
    """A zstd frame like ``body`` whose header states ``size`` as its content size (a 4-byte field)."""
    fhd = body[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    assert fcs_flag == 2, "a 4-byte content size field"
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    return body[:at] + struct.pack("<I", size) + body[at + 4 :]


def bomb_lying_frame(size: int = 1000) -> bytes:
    """Ten times ``size`` zeros, at least 10 MB, in a few hundred bytes, the header and the zstd frame both stating
    ``size``."""
    body = zstandard.ZstdCompressor().compress(bytes(max(10_000_000, 10 * size)))
    return frame.MAGIC + struct.pack("<Q", size) + _patched_content_size(body, size)


def bomb_no_size() -> bytes:
    """The header states 1,000 bytes; its zstd frame states no size and holds 10 MB."""
    body = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(10_000_000))
    return frame.MAGIC + struct.pack("<Q", 1000) + body


def bomb_over_limit() -> bytes:
    """A frame that says so: 10 MB, over the limit."""
    return frame.encode(bytes(10_000_000))


def second_frame() -> bytes:
    """A frame whose first zstd frame is the stated 1,000 bytes, followed by another of 10 MB."""
    return frame.encode(bytes(1000)) + zstandard.ZstdCompressor().compress(bytes(10_000_000))


def truncated() -> bytes:
    return frame.encode(value(1))[:-5]


def cut_header() -> bytes:
    return frame.encode(value(1))[:12]


def wrong_size() -> bytes:
    good = frame.encode(value(1))
    return frame.MAGIC + struct.pack("<Q", len(value(1)) + 1) + good[frame.HEADER_SIZE :]


BAD = {
    "bomb: frame lies about its size": (bomb_lying_frame, "does not decompress"),
    "bomb: frame states no size": (bomb_no_size, "its zstd frame no size"),
    "bomb: over the limit": (bomb_over_limit, "more than the 10,000 allowed"),
    "another frame after it": (second_frame, "does not decompress"),
    "truncated": (truncated, "does not decompress"),
    "header cut": (cut_header, "cut short"),
    "wrong stated size": (wrong_size, "but its zstd frame"),
}


# -- the frame -------------------------------------------------------------------------------


def test_a_blob_is_framed_smaller_and_decodes_to_itself() -> None:
    raw = value(3)
    stored = frame.encode(raw)
    assert stored.startswith(frame.MAGIC) and len(stored) < len(raw) // 10
    assert frame.decode(stored, len(raw)) == raw


def test_raw_objects_pass_through_and_incompressible_ones_stay_raw() -> None:
    noise = os.urandom(4096)
    assert frame.encode(noise) == noise  # compression would not make it smaller
    assert frame.decode(noise, 4096) is noise
    for raw in (b"\x7fELF" + bytes(60), b"// PTX\n.version 8.0\n", b"cpcas2 x"):
        assert frame.decode(raw, len(raw)) == raw


def test_a_large_blob_is_probed_before_it_is_compressed_and_noise_stays_raw() -> None:
    noise = os.urandom(frame.PROBE * 4)
    assert frame.encode(noise) is noise  # its first PROBE bytes did not compress: the rest is not tried
    magic = frame.MAGIC + noise
    assert frame.is_framed(frame.encode(magic)) and frame.decode(frame.encode(magic), len(magic)) == magic
    mixed = value(1) * (frame.PROBE // len(value(1)) + 1) + noise  # compressible first: compressed whole
    assert len(frame.encode(mixed)) < len(mixed) and frame.decode(frame.encode(mixed), len(mixed)) == mixed
    large = value(2) * (frame.LARGE // len(value(2)) + 2)  # over LARGE: a faster level, still a frame
    assert len(frame.encode(large)) < len(large) // 10 and frame.decode(frame.encode(large), len(large)) == large


def test_a_raw_blob_that_starts_like_a_frame_is_framed_so_it_reads_back_whole() -> None:
    raw = frame.MAGIC + os.urandom(100)
    stored = frame.encode(raw)
    assert stored != raw and len(stored) > len(raw)
    assert frame.decode(stored, len(raw)) == raw


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_frame_is_refused_with_one_clear_reason_holding_no_more_than_the_limit(case: str) -> None:
    make, why = BAD[case]
    stored = make()
    tracemalloc.start()
    try:
        with pytest.raises(StoreFailure) as caught:
            frame.decode(stored, LIMIT, "store/blobs/ab/cd")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert caught.value.kind == "damaged" and not caught.value.outage
    assert why in str(caught.value) and str(caught.value).startswith("store/blobs/ab/cd: damaged: a compressed")
    assert "\n" not in str(caught.value)
    assert peak < 64 * 1024, peak  # never the 10 MB: at most the stated 1,000 bytes and the frame


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=20_000), st.integers(min_value=1, max_value=22))
def test_decode_of_encode_is_the_blob(raw: bytes, level: int) -> None:
    assert frame.decode(frame.encode(raw, level=level), len(raw)) == raw


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=1 << 40), st.binary(max_size=300), st.integers(min_value=0, max_value=2000))
def test_decode_never_returns_more_than_its_limit_nor_raises_another_error(size: int, body: bytes, limit: int) -> None:
    for stored in (frame.MAGIC + struct.pack("<Q", size) + body, body):
        try:
            got = frame.decode(stored, limit)
        except StoreFailure as exc:  # a bad frame is damage; a raw object over the limit is too large
            assert exc.kind == ("damaged" if frame.is_framed(stored) else "too large")
        else:
            assert len(got) <= limit


# -- a directory store: mixed objects, and each bad one a miss -----------------------------------


def _store_with(tmp_path: Path, entries: dict[str, bytes]) -> Path:
    store = tmp_path / "store"
    writer = CacheStore(store)
    for k, v in entries.items():
        assert writer.put(k, v)
    writer.close()
    return store


def _blob(root: Path, data: bytes) -> Path:
    return root / url_path(BLOBS, digest_of(data))


def test_a_directory_store_mixing_raw_and_framed_blobs_is_read_by_one_node_kept_raw(tmp_path: Path) -> None:
    entries = {f"k{i}": value(i) for i in range(6)}
    store = _store_with(tmp_path, entries)
    for i in range(0, 6, 2):  # half of them framed, as a writer to another engine leaves them
        path = _blob(store, entries[f"k{i}"])
        path.write_bytes(frame.encode(path.read_bytes()))
    node = CacheStore(tmp_path / "node", shared=[str(store)])
    assert {k: node.get(k) for k in entries} == entries
    assert node.counters()["shared_hits"] == 6 and node.counters()["corrupt"] == 0
    node.close()
    for v in entries.values():  # the local cache keeps the raw binary (cuobjdump reads it)
        assert _blob(tmp_path / "node", v).read_bytes() == v


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_frame_in_a_store_is_a_miss_counted_and_said_once(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    make, why = BAD[case]
    raw = value(1) if case in ("truncated", "header cut", "wrong stated size") else bytes(1000)
    store = _store_with(tmp_path, {"k": raw})
    _blob(store, raw).write_bytes(make())
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    node = CacheStore(tmp_path / "node", shared=[str(store)])
    assert node.get("k") is None and node.get("k") is None
    assert node.counters()["corrupt"] == 2
    said = [r.getMessage() for r in caplog.records if "a compressed object" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    node.close()


# -- HTTP/WebDAV on nginx ----------------------------------------------------------------------


@pytest.fixture
def nginx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Nginx]:
    monkeypatch.delenv("CUDA_PROGRAM_CAS_HTTP_TOKEN", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with nginx_or_skip(tmp_path / "nginx") as server:
        CacheStore(server.root / "cas").close()  # laid out: layout.json, index/, blobs/
        yield server


def test_write_back_over_webdav_stores_framed_blobs_and_a_store_mixing_raw_ones_reads_kept_raw(
    nginx: Nginx, tmp_path: Path
) -> None:
    with ContentAddressedProgramCache(tmp_path / "a", shared=[f"{nginx.dav_url('cas')}|write"]) as cache:
        code = bytes(compile_program(SAXPY, cache=cache).code)
        cache.close()
        assert cache.stats().uploads == 1
    path = _blob(nginx.root / "cas", code)
    assert frame.is_framed(path.read_bytes()) and path.stat().st_size < 0.3 * len(code)
    assert _blob(tmp_path / "a", code).read_bytes() == code  # the writer's local cache keeps it raw
    with ContentAddressedProgramCache(tmp_path / "b", shared=[nginx.dav_url("cas")]) as other:
        assert bytes(compile_program(SAXPY, cache=other).code) == code
        assert other.stats().shared_hits == 1
    assert _blob(tmp_path / "b", code).read_bytes() == code
    path.write_bytes(code)  # raw, as a store written before blobs were compressed holds it: read all the same
    with ContentAddressedProgramCache(tmp_path / "c", shared=[nginx.dav_url("cas")]) as third:
        assert bytes(compile_program(SAXPY, cache=third).code) == code
        assert third.stats().shared_hits == 1
    path.write_bytes(bomb_lying_frame())
    with ContentAddressedProgramCache(tmp_path / "d", shared=[nginx.dav_url("cas")]) as fourth:
        assert bytes(compile_program(SAXPY, cache=fourth).code) == code  # a miss, compiled
        assert fourth.stats().shared_hits == 0 and fourth.counters()["corrupt"] == 1


#: Raw bytes of a large blob that compresses (24 MiB: over the 1 MiB an HTTP body may take in memory).
BIG = 24 << 20


def _traced_peak(call: Callable[[], object]) -> tuple[object, int]:
    """What ``call`` returns (or the StoreFailure it raises), and the most memory Python held meanwhile."""
    tracemalloc.start()
    try:
        try:
            got: object = call()
        except StoreFailure as exc:
            got = exc
        return got, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _engine_over(request: pytest.FixtureRequest, tmp_path: Path, kind: str, staging: Path) -> tuple[Engine, Path]:
    """An engine of ``kind`` (``http`` on the nginx fixture, or ``directory``) staging in ``staging``, and its root."""
    from cuda_program_cas._disk.direngine import DirEngine
    from cuda_program_cas._remote.http import HttpEngine

    if kind == "http":
        server: Nginx = request.getfixturevalue("nginx")
        return HttpEngine(server.read_url("cas"), staging=str(staging)), server.root / "cas"
    return DirEngine(str(tmp_path / "store"), staging=str(staging)), tmp_path / "store"


@pytest.mark.parametrize("kind", ["http", "directory"])
def test_a_large_framed_blob_or_bomb_holds_no_more_than_a_chunk_beyond_the_verified_raw_bytes(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    from cuda_program_cas._disk.intake import IN_MEMORY_BYTES

    staging = tmp_path / "staging"
    staging.mkdir()
    engine, root = _engine_over(request, tmp_path, kind, staging)
    raw = (os.urandom(1 << 16) * (BIG >> 16))[:BIG]  # 64 KiB of noise, repeated: zstd's window finds it
    name = url_path(BLOBS, digest_of(raw))
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_bytes(frame.encode(raw, level=3))
    got, peak = _traced_peak(lambda: engine.get(name, limit=BIG, digest=digest_of(raw)))
    assert got == raw
    # The raw bytes once verified (read back from a staging file), and a chunk: the 1 MiB held before they are
    # staged (and a directory's 1 MiB read at a time).
    assert peak < BIG + IN_MEMORY_BYTES + (1 << 20), peak
    # A bomb stating the size the manifest names: decompression stops there, and the raw bytes are staged as
    # they come out, never gathered in memory.
    (root / name).write_bytes(bomb_lying_frame(BIG))
    got, peak = _traced_peak(lambda: engine.get(name, limit=BIG, digest=digest_of(raw)))
    assert isinstance(got, StoreFailure) and got.kind == "damaged" and "does not decompress" in str(got), got
    assert "\n" not in str(got)
    assert peak < IN_MEMORY_BYTES + (1 << 20), peak
    assert list(staging.iterdir()) == []  # its staging file went with the refusal


@pytest.mark.mount
@pytest.mark.parametrize("room", ["2m", "512k"])  # full as the body streams in, or as the first MiB is staged
@pytest.mark.parametrize("kind", ["http", "directory"])
def test_a_large_blob_is_taken_in_memory_when_the_local_disk_is_full(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, room: str, mounts: list[Path]
) -> None:
    """A full local disk (a small tmpfs holds the staging folder): the staging file is made, its writes fail
    (ENOSPC); the body goes on in memory, as on a read-only disk, and the hit is served. A directory store's large
    hits, read whole in memory before they were staged, were misses on a full disk."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    staging = tmp_path / "staging"
    staging.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(staging)], check=True)
    mounts.append(staging)
    engine, root = _engine_over(request, tmp_path, kind, staging)
    raw = os.urandom(6 << 20)  # noise: stored as it is, more than the disk has room for
    name = url_path(BLOBS, digest_of(raw))
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_bytes(frame.encode(raw))
    assert engine.get(name, limit=8 << 20, digest=digest_of(raw)) == raw
    assert list(staging.iterdir()) == []


@pytest.mark.parametrize("bad", ["none", "truncated", "bomb: over the limit", "wrong stated size"])
def test_a_packed_store_on_a_web_server_mixing_raw_and_framed_entries_reads_over_http(
    nginx: Nginx, tmp_path: Path, bad: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """publish --pack over WebDAV frames each entry; an older pack of raw entries beside it reads too; a bad
    frame in a pack is a miss said once, and the rest of the pack reads, over HTTP as over a directory."""
    from cuda_program_cas._disk.pack import PackReader, Stored, pack_chunks, pack_name
    from cuda_program_cas._disk.packset import encode_listing
    from cuda_program_cas.index import key_id

    entries = {f"k{i}": value(i) for i in range(4)}
    assert not publish([_store_with(tmp_path, entries)], nginx.dav_url("cas"), pack=True).errors
    packs = nginx.root / "cas" / "packs"
    (framed,) = packs.glob("pack-*.cpk")
    reader = PackReader(str(framed))
    assert all(frame.is_framed(reader.read_stored(e)) for e in reader.entries())
    assert framed.stat().st_size < sum(map(len, entries.values())) // 4
    reader.close()
    # An older pack, its entries raw (as version 1 wrote them), and one entry whose frame is bad.
    older = {"raw0": value(10), "raw1": value(11)}
    inputs: list[tuple[str, str, bytes, int]] = [
        (key_id(k), digest_of(v), Stored(v, len(v)), 1) for k, v in older.items()
    ]
    if bad != "none":
        make, _why = BAD[bad]
        inputs.append((key_id("bad"), digest_of(value(1)), Stored(make(), len(value(1))), 1))
    name = pack_name()
    (packs / name).write_bytes(b"".join(pack_chunks(inputs)))
    (packs / "list").write_bytes(encode_listing([framed.name, name]))
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE", str(1 << 20))
    node = CacheStore(tmp_path / "node", shared=[nginx.read_url("cas")])
    assert {k: node.get(k) for k in {**entries, **older}} == {**entries, **older}
    if bad != "none":
        assert node.get("bad") is None and node.get("bad") is None
        said = [
            r.getMessage()
            for r in caplog.records
            if key_id("bad") in r.getMessage() and "miss key" not in r.getMessage()
        ]
        assert len(said) == 1 and "\n" not in said[0], said
        # Over this node's ceiling (10 MB stated, 1 MB read): a miss said once, not damage; else damage, one line.
        too_large = bad == "bomb: over the limit"
        assert ("not fetched" if too_large else "a compressed object") in said[0], said
        assert node.counters()["corrupt"] == (0 if too_large else 2)
    else:
        assert node.counters()["corrupt"] == 0
    node.close()


# -- Redis -------------------------------------------------------------------------------------


def test_write_back_to_redis_stores_framed_blobs_and_a_cold_nodes_warm_set_fetch_decodes_them(
    redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_PROGRAM_CAS_JOB", "compressed")
    entries = {f"k{i}": value(i) for i in range(20)}
    writer = CacheStore(tmp_path / "a", shared=[f"{redis.url}|write"])
    for k, v in entries.items():
        assert writer.put(k, v) and writer.get(k) == v
    writer.close()
    client = redis.client()
    held = {k: client.get(f"cpcas:{url_path(BLOBS, digest_of(v))}") for k, v in entries.items()}
    assert all(h.startswith(frame.MAGIC) for h in held.values())
    assert sum(map(len, held.values())) < 0.3 * sum(map(len, entries.values()))
    # One blob a bomb within the entry limit: not fetched, counted, its lookup a miss.
    client.set(f"cpcas:{url_path(BLOBS, digest_of(entries['k3']))}", bomb_lying_frame())
    node = CacheStore(tmp_path / "b", shared=[redis.url])
    assert node.inner.warm is not None and node.inner.warm.join(30)
    assert node.inner.warm.fetched == len(entries) - 1 and node.counters()["corrupt"] == 1
    got = {k: node.get(k) for k in entries}
    assert got == {k: (None if k == "k3" else v) for k, v in entries.items()}
    node.close()
    assert _blob(tmp_path / "b", entries["k0"]).read_bytes() == entries["k0"]


def test_publish_into_redis_stores_blobs_compressed_and_a_rerun_sends_nothing(
    redis: RedisServer, tmp_path: Path
) -> None:
    entries = {f"k{i}": value(i) for i in range(5)}
    src = _store_with(tmp_path, entries)
    report = publish([src], redis.url)
    assert report.blobs_published == 5 and not report.errors
    client = redis.client()
    held = [client.get(f"cpcas:{url_path(BLOBS, digest_of(v))}") for v in entries.values()]
    assert all(h.startswith(frame.MAGIC) for h in held)
    assert sum(map(len, held)) < 0.3 * sum(map(len, entries.values()))
    assert publish([src], redis.url).blobs_published == 0  # a compressed blob there is one there
    node = CacheStore(tmp_path / "node", shared=[redis.url])
    assert {k: node.get(k) for k in entries} == entries
    node.close()


# -- a store directory's maintenance: gc, verify, stats, repack and publish judge framed blobs by their raw bytes


def _framed_store(tmp_path: Path, entries: dict[str, bytes]) -> Path:
    """A store ``publish`` made: every blob framed (the source's local cache keeps them raw)."""
    src = _store_with(tmp_path, entries)
    store = tmp_path / "published"
    assert not publish([src], store).errors
    for v in entries.values():
        path = _blob(store, v)
        assert frame.is_framed(path.read_bytes()) and path.stat().st_size < 0.3 * len(v)
        assert _blob(src, v).read_bytes() == v
    return store


def test_verify_gc_and_stats_find_nothing_wrong_in_a_store_of_framed_blobs(tmp_path: Path) -> None:
    from cuda_program_cas import collect, stats, verify

    entries = {f"k{i}": value(i) for i in range(6)}
    store = _framed_store(tmp_path, entries)
    checked = verify(store)
    assert checked.problems == [] and checked.blobs_checked == 6
    assert stats(store).size_mismatch_manifests == 0
    report = collect(store)  # a damaged manifest goes whatever the grace: none here
    assert report.entries_removed == 0 and report.blobs_removed == 0 and report.problems == []
    assert {k: CacheStore(tmp_path / "node", shared=[str(store)]).get(k) for k in entries} == entries


def test_a_framed_blob_stating_another_size_is_damage_that_verify_reports(tmp_path: Path) -> None:
    from cuda_program_cas import verify

    entries = {"k": value(1)}
    store = _framed_store(tmp_path, entries)
    _blob(store, value(1)).write_bytes(wrong_size())
    kinds = {p.kind for p in verify(store).problems}
    assert kinds == {"size_mismatch", "corrupt_blob"}, kinds  # the manifest and the frame: each wrong


def test_a_local_blob_that_starts_like_a_frame_is_a_good_raw_blob_to_verify(tmp_path: Path) -> None:
    from cuda_program_cas import verify

    raw = frame.MAGIC + value(1)
    local = _store_with(tmp_path, {"k": raw})
    assert _blob(local, raw).read_bytes() == raw  # the local cache keeps it raw
    assert verify(local).problems == []
    assert CacheStore(local).get("k") == raw


def test_repack_packs_framed_blobs_framed_and_publish_finds_them_there(tmp_path: Path) -> None:
    from cuda_program_cas import repack, stats
    from cuda_program_cas._disk.pack import PackReader

    entries = {f"k{i}": value(i) for i in range(6)}
    store = _framed_store(tmp_path, entries)
    assert repack(store).problems == []
    (path,) = (store / "packs").glob("pack-*.cpk")
    reader = PackReader(str(path))
    assert all(frame.is_framed(reader.read_stored(e)) and e.size < len(value(0)) for e in reader.entries())
    reader.close()
    counted = stats(store)  # the packs' bytes, and the raw bytes their framed entries stand for
    assert counted.pack_raw_bytes == sum(map(len, entries.values())) and counted.pack_bytes < counted.pack_raw_bytes / 4
    node = CacheStore(tmp_path / "node", shared=[str(store)])
    assert {k: node.get(k) for k in entries} == entries and node.counters()["corrupt"] == 0
    node.close()
    store2 = _framed_store(tmp_path / "again", entries)
    again = publish([tmp_path / "again" / "store"], store2)
    assert again.blobs_published == 0 and not again.errors  # the framed blobs there are the right ones


@pytest.mark.parametrize("read_only", [True, False])
def test_a_store_directory_of_framed_blobs_opened_as_a_cache_reads_them_raw(tmp_path: Path, read_only: bool) -> None:
    from cuda_program_cas import verify

    entries = {f"k{i}": value(i) for i in range(4)}
    store = _framed_store(tmp_path, entries)
    opened = CacheStore(store, read_only=read_only)
    assert {k: opened.get(k) for k in entries} == entries and opened.counters()["corrupt"] == 0
    opened.close()
    assert verify(store).problems == []
    quarantine = store / "quarantine"
    assert not quarantine.exists() or not any(quarantine.iterdir())  # nothing was taken for damage


# -- a value that starts with the magic and does not compress: framed, larger than itself (issue 48) ------------


@settings(max_examples=80, deadline=None)
@given(
    st.one_of(
        st.integers(min_value=0, max_value=300_000), st.integers(min_value=-64, max_value=64).map(lambda d: 131072 + d)
    ),
    st.integers(min_value=0, max_value=2**32),
    st.sampled_from([1, 19]),
)
@example(0, 0, 19).via("empty")
@example(131071, 0, 19).via("below zstd's block")
@example(131072, 0, 19).via("zstd's block")
@example((1 << 20) + 100, 0, 19).via("over 1 MiB")
def test_room_bounds_what_encode_makes_of_incompressible_bytes(size: int, seed: int, level: int) -> None:
    noise = random.Random(seed).randbytes(size)  # a seed, not the bytes, drawn: a few bytes of hypothesis's budget
    for raw in (frame.MAGIC + noise, noise):  # framed, larger than itself, and raw: of many sizes
        stored = frame.encode(raw, level=level)
        assert len(stored) <= frame.room(len(raw)), (len(raw), len(stored))
        assert frame.decode(stored, len(raw)) == raw


def _magic_values(sizes: tuple[int, ...] = (100, (1 << 20) + 100)) -> dict[str, bytes]:
    return {f"m{n}": frame.MAGIC + os.urandom(n) for n in sizes}


@pytest.mark.parametrize("how", ["write-back", "publish loose", "publish packed"])
def test_a_store_of_values_that_start_with_the_magic_is_whole_to_verify_gc_stats_and_a_reader(
    tmp_path: Path, how: str
) -> None:
    from cuda_program_cas import collect, repack, stats, verify

    entries = {**_magic_values(), **{f"k{i}": value(i) for i in range(2)}}
    store = tmp_path / "shared"
    if how == "write-back":
        CacheStore(store).close()
        writer = CacheStore(tmp_path / "writer", shared=[f"{store}|write"])
        assert all(writer.put(k, v) for k, v in entries.items())
        writer.close()
    else:
        assert not publish([_store_with(tmp_path, entries)], store, pack=how == "publish packed").errors
    for k in [
        k for k in entries if k.startswith("m")
    ]:  # each one framed, larger than its raw bytes (else the loose ones are in a pack)
        path = _blob(store, entries[k])
        assert how == "publish packed" or len(entries[k]) < path.stat().st_size <= frame.room(len(entries[k]))
    assert verify(store).problems == []
    counted = stats(store)
    assert counted.entries == len(entries) and counted.size_mismatch_manifests == 0
    raw_bytes = counted.pack_raw_bytes if how == "publish packed" else counted.logical_bytes
    assert raw_bytes == sum(map(len, entries.values()))  # the raw bytes each framed blob stands for
    report = collect(store)
    assert report.entries_removed == 0 and report.blobs_removed == 0 and report.problems == []
    readers = [CacheStore(tmp_path / "node", shared=[str(store)])]
    if how != "publish packed":  # the store opened as a cache reads its loose blobs (a cache's reader, no packs)
        readers.append(CacheStore(store, read_only=True))
    for opened in readers:
        assert {k: opened.get(k) for k in entries} == entries and opened.counters()["corrupt"] == 0
        opened.close()
    quarantine = store / "quarantine"
    assert not quarantine.exists() or not any(quarantine.iterdir())  # nothing was taken for damage
    assert repack(store).problems == []  # its loose blobs read (framed, larger than raw) into a pack
    node = CacheStore(tmp_path / "after", shared=[str(store)])
    assert {k: node.get(k) for k in entries} == entries and node.counters()["corrupt"] == 0
    node.close()


def test_a_raw_blob_larger_than_its_manifest_is_still_damage_though_within_a_frames_room(tmp_path: Path) -> None:
    from cuda_program_cas import verify

    raw = value(1)
    store = _framed_store(tmp_path, {"k": raw})
    _blob(store, raw).write_bytes(raw + b"more")  # grown: raw, not framed
    assert {p.kind for p in verify(store).problems} == {"size_mismatch", "corrupt_blob"}
    node = CacheStore(tmp_path / "node", shared=[str(store)])
    assert node.get("k") is None and node.counters()["corrupt"] == 1
    node.close()


def test_publish_keeps_a_framed_blob_larger_than_its_raw_bytes_young_when_a_new_key_names_it(tmp_path: Path) -> None:
    raw = frame.MAGIC + os.urandom(1000)
    store = tmp_path / "shared"
    assert not publish([_store_with(tmp_path / "a", {"a": raw})], store).errors
    blob = _blob(store, raw)
    assert blob.stat().st_size > len(raw)
    os.utime(blob, (1_000_000_000, 1_000_000_000))  # old: a collector's grace would be long past
    inode = blob.stat().st_ino
    again = publish([_store_with(tmp_path / "b", {"b": raw})], store)
    assert not again.errors and again.published == 1 and again.blobs_published == 0
    # Freshened in place: neither left old for a collector nor taken for gone after the manifest and written again.
    assert blob.stat().st_mtime > 1_000_000_000 and blob.stat().st_ino == inode


def test_a_framed_blob_exactly_as_large_as_its_raw_bytes_reads_from_a_store_opened_as_a_cache(tmp_path: Path) -> None:
    from cuda_program_cas import verify

    noise = random.Random(48).randbytes(1000)
    # Zeros after the noise: some number of them makes the frame exactly as long as the raw value.
    raw = next(v for m in range(300) if len(frame.encode(v := frame.MAGIC + noise + bytes(m))) == len(v))
    store = tmp_path / "shared"
    assert not publish([_store_with(tmp_path, {"k": raw})], store).errors
    stored = _blob(store, raw).read_bytes()
    assert frame.is_framed(stored) and stored != raw and len(stored) == len(raw)
    assert verify(store).problems == []
    opened = CacheStore(store, read_only=True)  # the size matches, the digest does not: its header says framed
    assert opened.get("k") == raw and opened.counters()["corrupt"] == 0
    opened.close()
