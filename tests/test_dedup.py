"""Deduplication: keys whose outputs are byte-identical share one blob file on disk.

With NVRTC 13.x the SAXPY cubin does not depend on the program ``name``, an
unused ``define_macro`` or ``std``: four different cache keys, one binary.
"""

from __future__ import annotations

import os
from pathlib import Path

from conftest import compile_program

from cuda_program_cas import ContentAddressedProgramCache

CUBIN_VARIANTS = [{}, {"name": "renamed.cu"}, {"define_macro": "UNUSED_MACRO"}, {"std": "c++17"}]


def blob_files(cache_dir: Path) -> list[Path]:
    return sorted(p for p in (cache_dir / "blobs").rglob("*") if p.is_file())


def manifest_files(cache_dir: Path) -> list[Path]:
    return sorted(p for p in (cache_dir / "index").rglob("*") if p.is_file())


def test_option_variants_share_one_blob(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    codes = [bytes(compile_program(target="cubin", cache=cache, **opts).code) for opts in CUBIN_VARIANTS]
    assert len(set(codes)) == 1, "precondition: NVRTC gives these variants byte-identical cubins"
    size = len(codes[0])

    assert len(manifest_files(cache_dir)) == 4  # four distinct keys...
    (blob,) = blob_files(cache_dir)  # ...one file of content
    assert blob.read_bytes() == codes[0]

    stats = cache.stats()
    manifest_bytes = sum(p.stat().st_size for p in manifest_files(cache_dir))
    assert (stats.entries, stats.blobs) == (4, 1)
    assert (stats.writes, stats.dedup_writes, stats.misses) == (4, 3, 4)
    assert stats.logical_bytes == 4 * size
    assert stats.stored_bytes == size + manifest_bytes
    assert stats.dedup_ratio > 3.5

    # Every variant is now a hit on the same bytes.
    for opts in CUBIN_VARIANTS:
        assert bytes(compile_program(target="cubin", cache=cache, **opts).code) == codes[0]
    assert cache.stats().hits == 4


def test_ltoir_variants_share_one_blob(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    variants = [{}, {"define_macro": "UNUSED_MACRO"}, {"std": "c++17"}]
    codes = {bytes(compile_program(target="ltoir", cache=cache, **opts).code) for opts in variants}
    assert len(codes) == 1
    assert (cache.stats().entries, cache.stats().blobs, cache.stats().dedup_writes) == (3, 1, 2)


def test_different_output_gets_its_own_blob(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    compile_program(target="cubin", cache=cache)
    compile_program(target="cubin", cache=cache, arch="sm_90")
    assert len(blob_files(cache_dir)) == 2
    assert cache.stats().dedup_writes == 0


def test_deleting_one_key_keeps_the_shared_blob(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    data = b"\x7fELF" + bytes(range(256)) * 8
    for i in range(3):
        cache[f"k{i}"] = data
    del cache["k0"]
    assert cache.get("k0") is None
    assert cache["k1"] == data
    del cache["k1"]
    assert cache["k2"] == data
    assert len(blob_files(cache_dir)) == 1


def test_dedup_write_freshens_and_does_not_rewrite(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    data = b"payload" * 100
    cache["a"] = data
    (blob,) = blob_files(cache_dir)
    old = 1_000_000_000  # 2001: long before this write
    os.utime(blob, (old, old))
    before = blob.stat()
    cache["b"] = data
    after = blob.stat()
    assert after.st_ino == before.st_ino  # the same file, not a new copy renamed over it
    assert after.st_mtime > old + 1e6  # freshened: a collector sees it as young
    assert cache.stats().dedup_writes == 1
    assert blob.read_bytes() == data


def test_str_and_bytes_keys_do_not_make_two_entries(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = b"v"
    cache[b"k"] = b"v"
    assert (cache.stats().entries, cache.stats().blobs) == (1, 1)


def test_dedup_across_instances_and_reopen(cache_dir: Path) -> None:
    data = b"shared content" * 50
    ContentAddressedProgramCache(cache_dir)["first"] = data
    second = ContentAddressedProgramCache(cache_dir)
    second["second"] = data
    assert second.stats().dedup_writes == 1
    assert len(blob_files(cache_dir)) == 1
