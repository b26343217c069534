"""Integrity: every read is checked, and nothing damaged on disk is ever returned.

Damaged blobs are misses, moved to ``quarantine/`` and counted; damaged manifests
are misses; a dangling manifest is removed only if it is still the file that was
read; symlinks are never followed.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from blake3 import blake3

from cuda_program_cas import CacheStore, ContentAddressedProgramCache
from cuda_program_cas.index import key_id

DATA = bytes(range(256)) * 40  # 10 KB, like a small cubin


def manifest_path(cache_dir: Path, key: str) -> Path:
    kid = key_id(key)
    return cache_dir / "index" / kid[:2] / kid[2:]


def blob_path(cache_dir: Path, data: bytes = DATA) -> Path:
    digest = blake3(data).hexdigest()
    return cache_dir / "blobs" / digest[:2] / digest[2:]


def quarantined(cache_dir: Path) -> list[Path]:
    q = cache_dir / "quarantine"
    return sorted(q.iterdir()) if q.is_dir() else []


def rewrite_in_place(path: Path, data: bytes) -> None:
    """Change a file's bytes without a new inode, keeping its mtime (as a disk fault would)."""
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.truncate(0)
        fh.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x40
    return bytes(out)


@pytest.fixture
def cache(cache_dir: Path) -> ContentAddressedProgramCache:
    c = ContentAddressedProgramCache(cache_dir)
    c["k"] = DATA
    return c


# -- damaged blobs -------------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda d: flip(d, 0), id="flip-first"),
        pytest.param(lambda d: flip(d, len(d) // 2), id="flip-middle"),
        pytest.param(lambda d: flip(d, len(d) - 1), id="flip-last"),
        pytest.param(lambda d: d[:-1], id="truncated-by-one"),
        pytest.param(lambda d: d[: len(d) // 2], id="truncated-half"),
        pytest.param(lambda d: b"", id="emptied"),
        pytest.param(lambda d: d + b"\0", id="grown-by-one"),
        pytest.param(lambda d: bytes(len(d)), id="zeroed"),
    ],
)
def test_damaged_blob_is_a_counted_quarantined_miss(
    cache: ContentAddressedProgramCache, cache_dir: Path, damage
) -> None:
    blob = blob_path(cache_dir)
    bad = damage(DATA)
    rewrite_in_place(blob, bad)

    assert cache.get("k") is None
    with pytest.raises(KeyError):
        cache["k"]
    stats = cache.stats()
    assert stats.corrupt == 1
    assert stats.hits == 0
    assert not blob.exists()
    (moved,) = quarantined(cache_dir)
    assert moved.read_bytes() == bad
    assert moved.name.startswith(blake3(DATA).hexdigest())
    assert not manifest_path(cache_dir, "k").exists()
    assert stats.entries == 0
    # Storing it again heals the entry.
    cache["k"] = DATA
    assert cache["k"] == DATA
    assert cache.stats().dedup_writes == 0  # the bad blob was not trusted as "already stored"


def test_damage_after_a_verified_hit_is_still_caught(cache: ContentAddressedProgramCache, cache_dir: Path) -> None:
    # Hits remember what they verified. An in-place change (same size, mtime put
    # back) changes the ctime, so a read of the file hashes it again.
    for _ in range(3):
        assert cache["k"] == DATA  # the last ones from memory
    rewrite_in_place(blob_path(cache_dir), flip(DATA, 1234))
    # Memory holds the verified bytes: still the right ones, whatever became of the file.
    assert cache["k"] == DATA
    other = ContentAddressedProgramCache(cache_dir)  # reads the file: the damage is caught
    for _ in range(3):
        assert other.get("k") is None
    assert other.stats().corrupt == 1
    assert cache.get("k") is None  # the entry is gone for everyone now


def test_damage_after_a_verified_hit_in_another_instance(cache_dir: Path) -> None:
    reader = ContentAddressedProgramCache(cache_dir)
    ContentAddressedProgramCache(cache_dir)["k"] = DATA
    assert reader["k"] == DATA
    assert reader["k"] == DATA
    bad = flip(DATA, 7)
    # Replaced by rename with bad bytes of the same size: a new inode.
    tmp = cache_dir / "tmp" / "evil"
    tmp.write_bytes(bad)
    os.replace(tmp, blob_path(cache_dir))
    assert reader["k"] == DATA  # from memory: verified, right
    fresh = ContentAddressedProgramCache(cache_dir)
    assert fresh.get("k") is None
    assert fresh.stats().corrupt == 1
    assert reader.get("k") is None


def test_large_blob_damage_is_caught(cache_dir: Path) -> None:
    big = os.urandom(3 << 20)
    cache = ContentAddressedProgramCache(cache_dir)
    cache["big"] = big
    assert cache["big"] == big  # read once: its file identity is remembered as verified, its bytes are not held
    rewrite_in_place(blob_path(cache_dir, big), flip(big, (3 << 20) - 10))
    assert cache.get("big") is None  # the identity changed (ctime): hashed again
    assert cache.stats().corrupt == 1


def test_shared_corrupt_blob_is_never_returned_for_any_key(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    for key in ("a", "b", "c"):
        cache[key] = DATA
    rewrite_in_place(blob_path(cache_dir), flip(DATA, 99))
    assert [cache.get(k) for k in ("a", "b", "c")] == [None, None, None]
    assert cache.stats().corrupt == 1  # moved aside once; the other keys then dangle
    assert len(quarantined(cache_dir)) == 1
    assert cache.stats().entries == 0


def test_read_only_cache_counts_but_does_not_move(cache: ContentAddressedProgramCache, cache_dir: Path) -> None:
    rewrite_in_place(blob_path(cache_dir), flip(DATA, 5))
    ro = ContentAddressedProgramCache(cache_dir, read_only=True)
    assert ro.get("k") is None
    assert ro.stats().corrupt == 1
    assert blob_path(cache_dir).exists()
    assert manifest_path(cache_dir, "k").exists()
    assert quarantined(cache_dir) == []


# -- damaged manifests -----------------------------------------------------------


def _valid_line(cache_dir: Path) -> bytes:
    return manifest_path(cache_dir, "k").read_bytes()


@pytest.mark.parametrize(
    "garble",
    [
        pytest.param(lambda line: b"", id="empty"),
        pytest.param(lambda line: line[:-1], id="no-newline"),
        pytest.param(lambda line: line[: len(line) // 2], id="truncated"),
        pytest.param(lambda line: line[:7], id="tag-only"),
        pytest.param(lambda line: line + b"x", id="trailing-junk"),
        pytest.param(lambda line: line + line, id="doubled"),
        pytest.param(lambda line: b" " + line, id="leading-space"),
        pytest.param(lambda line: line.replace(b"cpcas2", b"cpcas3"), id="future-tag"),
        pytest.param(lambda line: line.upper(), id="uppercase"),
        pytest.param(lambda line: line.replace(b"\n", b"\r\n"), id="crlf"),
        pytest.param(lambda line: os.urandom(len(line)), id="random-bytes"),
        pytest.param(lambda line: bytes(len(line)), id="zeroed"),
        pytest.param(lambda line: line[:-1] + b" 0\n", id="extra-field"),
        pytest.param(lambda line: line.rsplit(b" ", 1)[0] + b" -1\n", id="negative-size"),
        pytest.param(lambda line: line.rsplit(b" ", 1)[0] + b" 01\n", id="leading-zero-size"),
        pytest.param(lambda line: line.rsplit(b" ", 1)[0] + b" 99999999999999999999\n", id="huge-size"),
        pytest.param(lambda line: b"cpcas1 " + b"z" * 64 + b" 10\n", id="non-hex-digest"),
        pytest.param(lambda line: b"cpcas1 " + b"0" * 63 + b" 10\n", id="short-digest"),
        pytest.param(lambda line: b"cpcas1 ../../../../../../etc/passwd 10\n", id="path-digest"),
        pytest.param(lambda line: line + b"\0" * 300, id="oversized-padded"),
        pytest.param(lambda line: b"x" * 1_000_000, id="oversized-megabyte"),
    ],
)
def test_damaged_manifest_is_a_counted_miss(cache: ContentAddressedProgramCache, cache_dir: Path, garble) -> None:
    mpath = manifest_path(cache_dir, "k")
    rewrite_in_place(mpath, garble(_valid_line(cache_dir)))
    assert cache.get("k") is None
    assert cache.stats().corrupt == 1
    assert cache.stats().hits == 0
    # The blob is fine and stays (another key may share it); the bad manifest goes.
    assert blob_path(cache_dir).read_bytes() == DATA
    assert not mpath.exists()
    cache["k"] = DATA
    assert cache["k"] == DATA


def test_manifest_naming_another_blob_with_wrong_size_is_a_miss(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = DATA
    cache["other"] = b"other content"
    line = _valid_line(cache_dir)
    digest = line.split()[1]
    other_digest = blake3(b"other content").hexdigest().encode()
    # The other key's blob, with this key's size: never returned.
    rewrite_in_place(manifest_path(cache_dir, "k"), line.replace(digest, other_digest))
    assert cache.get("k") is None
    assert cache.stats().hits == 0
    assert cache.stats().corrupt == 1
    assert not manifest_path(cache_dir, "k").exists()
    # The blob is intact (it hashes to its name): only the manifest lied, so the
    # key that rightly shares the blob keeps it.
    assert quarantined(cache_dir) == []
    assert cache["other"] == b"other content"


def test_manifest_with_wrong_size_for_an_intact_blob_keeps_the_blob(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = DATA
    cache["twin"] = DATA
    line = _valid_line(cache_dir)
    for wrong in (len(DATA) - 1, len(DATA) + 1, 0):
        rewrite_in_place(manifest_path(cache_dir, "k"), line.rsplit(b" ", 1)[0] + b" %d\n" % wrong)
        assert cache.get("k") is None
        assert quarantined(cache_dir) == []
        assert cache["twin"] == DATA
        cache["k"] = DATA
    assert cache.stats().corrupt == 3


def test_manifest_that_is_a_directory_or_fifo_is_a_miss(cache: ContentAddressedProgramCache, cache_dir: Path) -> None:
    mpath = manifest_path(cache_dir, "k")
    mpath.unlink()
    mpath.mkdir()
    assert cache.get("k") is None
    mpath.rmdir()
    if not hasattr(os, "mkfifo"):
        return
    os.mkfifo(mpath)
    # A FIFO must not block the reader (nobody will ever write to it).
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(cache.get("k")), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "a lookup blocked on a FIFO manifest"
    assert result == [None]


def test_blob_that_is_a_directory_or_fifo_is_a_miss(cache: ContentAddressedProgramCache, cache_dir: Path) -> None:
    blob = blob_path(cache_dir)
    blob.unlink()
    blob.mkdir()
    assert cache.get("k") is None
    assert blob.is_dir()
    if not hasattr(os, "mkfifo"):
        return
    blob.rmdir()
    cache["k"] = DATA  # a new manifest (the dangling one may have gone)
    blob.unlink()
    os.mkfifo(blob)
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(cache.get("k")), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "a lookup blocked on a FIFO blob"
    assert result == [None]


# -- dangling manifests ----------------------------------------------------------


def test_dangling_manifest_is_a_miss_and_removed(cache: ContentAddressedProgramCache, cache_dir: Path) -> None:
    blob_path(cache_dir).unlink()
    assert cache.get("k") is None
    assert not manifest_path(cache_dir, "k").exists()
    assert cache.stats().corrupt == 0  # a collected blob is normal, not damage
    cache["k"] = DATA
    assert cache["k"] == DATA


def test_dangling_manifest_replaced_meanwhile_is_kept(cache_dir: Path) -> None:
    """A writer re-points the key between the reader's manifest read and its cleanup."""
    reader = ContentAddressedProgramCache(cache_dir)
    writer = ContentAddressedProgramCache(cache_dir)
    writer["k"] = DATA
    blob_path(cache_dir).unlink()
    remover = reader.store._local.remover
    real_remove = remover.manifest
    raced: list[bool] = []

    def writer_gets_in_first(kid: str, st: os.stat_result | None = None) -> bool:
        # Instrumentation of the window, not a replacement: the real removal runs.
        writer["k"] = b"new content"
        removed = real_remove(kid, st)
        raced.append(removed)
        return removed

    remover.manifest = writer_gets_in_first  # type: ignore[method-assign]
    assert reader.get("k") is None
    assert raced == [False]
    del remover.manifest
    assert manifest_path(cache_dir, "k").exists()
    assert reader["k"] == b"new content"


def test_the_remover_refuses_a_replaced_manifest(cache_dir: Path) -> None:
    from cuda_program_cas._disk.layout import Layout
    from cuda_program_cas._disk.remove import Remover

    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = b"one"
    target = manifest_path(cache_dir, "k")
    before = target.stat()
    cache["k"] = b"two"  # a new file replaces it
    remover = Remover(Layout(str(cache_dir)))
    kid = key_id("k")
    assert not remover.manifest(kid, before)
    assert cache["k"] == b"two"
    assert remover.manifest(kid, target.stat())
    assert not target.exists()
    assert not remover.manifest(kid, before)


# -- symlinks are never followed -----------------------------------------------


def test_symlinked_manifest_is_not_followed(
    cache: ContentAddressedProgramCache, cache_dir: Path, tmp_path: Path
) -> None:
    mpath = manifest_path(cache_dir, "k")
    outside = tmp_path / "outside-manifest"
    outside.write_bytes(mpath.read_bytes())  # a perfectly valid manifest, elsewhere
    mpath.unlink()
    mpath.symlink_to(outside)
    assert cache.get("k") is None
    assert cache.stats().hits == 0
    assert outside.read_bytes().startswith(b"cpcas2 ")
    assert blob_path(cache_dir).exists()


def test_symlinked_blob_is_not_followed(cache: ContentAddressedProgramCache, cache_dir: Path, tmp_path: Path) -> None:
    blob = blob_path(cache_dir)
    outside = tmp_path / "outside-blob"
    outside.write_bytes(DATA)  # even the right bytes are not read through a link
    blob.unlink()
    blob.symlink_to(outside)
    assert cache.get("k") is None
    assert cache.stats().hits == 0
    assert outside.read_bytes() == DATA  # not moved, not removed
    assert blob.is_symlink()


def test_symlinked_blob_is_not_trusted_as_already_stored(cache_dir: Path, tmp_path: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = DATA
    blob = blob_path(cache_dir)
    outside = tmp_path / "outside-blob"
    outside.write_bytes(DATA)
    blob.unlink()
    blob.symlink_to(outside)
    cache["k2"] = DATA
    assert cache["k2"] == DATA
    assert not blob.is_symlink()
    assert outside.read_bytes() == DATA


def test_store_level_reads_never_raise_for_disk_problems(cache_dir: Path) -> None:
    """CacheStore (no CUDA) behaves the same: a miss, never an exception."""
    store = CacheStore(cache_dir)
    store.put("k", DATA)
    rewrite_in_place(manifest_path(cache_dir, "k"), b"garbage")
    assert store.get("k") is None
    store.put("k", DATA)
    rewrite_in_place(blob_path(cache_dir), DATA[:10])
    assert store.get("k") is None
    assert store.stats().corrupt == 2


def test_blob_store_read_verifies_and_names_the_corruption(cache_dir: Path) -> None:
    from cuda_program_cas import BlobStore, CacheStore, CorruptBlobError, digest_of

    store = CacheStore(cache_dir)
    data = b"good bytes" * 100
    digest = digest_of(data)
    store.put("k", data)
    blobs: BlobStore = store.inner.blobs
    assert blobs.read(digest, len(data))[0] == data
    path = Path(blobs.path_for(digest))
    path.write_bytes(b"evil bytes" * 100)  # same size, other bytes
    with pytest.raises(CorruptBlobError) as err:
        blobs.read(digest, len(data))
    assert err.value.expected == digest and err.value.actual == digest_of(b"evil bytes" * 100)
    assert err.value.stat is not None and err.value.stat.st_ino == path.stat().st_ino
    path.write_bytes(b"short")
    with pytest.raises(CorruptBlobError, match="5 bytes instead of 1000"):
        blobs.read(digest, len(data))
