"""What a reader keeps in memory for repeated hits, and what it proves before serving it.

A hit served from memory returns the very ``bytes`` object of the hit before (a
read from the file builds a new one), which is how these tests see where a hit
came from without looking inside the reader. The memory budget is set small
(``cuda_program_cas._local.reader._HOLD_MAX_BYTES``) so that a handful of keys overflow it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from blake3 import blake3

import cuda_program_cas._local.reader
from cuda_program_cas import ContentAddressedProgramCache

SIZE = 20_000  # over the reader's 16 KiB line: its verified identity is remembered on the first read


def value(i: int) -> bytes:
    return i.to_bytes(4, "little") + bytes(SIZE - 4)


@pytest.fixture
def budget_of_ten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_program_cas._local.reader, "_HOLD_MAX_BYTES", 10 * SIZE + SIZE // 2)


def served_from_memory(cache: ContentAddressedProgramCache, keys: list[str], before: dict[str, bytes]) -> int:
    """Read ``keys`` in turn; how many came back as the same object as in ``before`` (updated)."""
    same = 0
    for k in keys:
        v = cache[k]
        same += v is before.get(k)
        before[k] = v
    return same


def twenty_keys_read_four_times(cache_dir: Path) -> tuple[ContentAddressedProgramCache, list[str], dict[str, bytes]]:
    """20 keys stored by one instance, then read in turn four times by another: what it returned last."""
    keys = [f"k{i}" for i in range(20)]
    writer = ContentAddressedProgramCache(cache_dir)
    for i, k in enumerate(keys):
        writer[k] = value(i)
    cache = ContentAddressedProgramCache(cache_dir)
    seen: dict[str, bytes] = {}
    for _ in range(4):
        served_from_memory(cache, keys, seen)
    return cache, keys, seen


def test_keys_read_in_turn_beyond_the_budget_mostly_stay_in_memory(cache_dir: Path, budget_of_ten: None) -> None:
    # Plain LRU serves none of 20 keys read in turn from a memory of 10: each read
    # pushes out the key read next. Here most of those that got in stay.
    cache, keys, seen = twenty_keys_read_four_times(cache_dir)
    assert served_from_memory(cache, keys, seen) >= 8
    assert all(cache[k] == value(i) for i, k in enumerate(keys))


def test_a_new_hot_set_takes_the_memory_in_time(cache_dir: Path, budget_of_ten: None) -> None:
    writer = ContentAddressedProgramCache(cache_dir)
    old = [f"old{i}" for i in range(10)]
    new = [f"new{i}" for i in range(10)]
    for i, k in enumerate(old + new):
        writer[k] = value(i)
    cache = ContentAddressedProgramCache(cache_dir)
    seen: dict[str, bytes] = {}
    for _ in range(300):
        served_from_memory(cache, old, seen)
    assert served_from_memory(cache, old, seen) == 10  # the old set fills the memory
    # Read half as often in all as the old set was: the old counts have aged meanwhile.
    for _ in range(150):
        served_from_memory(cache, new, seen)
    assert served_from_memory(cache, new, seen) >= 8


def rewrite_in_place(path: Path, data: bytes) -> None:
    """Same size, mtime put back: only the ctime shows the change."""
    st = path.stat()
    os.chmod(path, 0o644)
    with open(path, "r+b") as fh:
        fh.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def blob_path(root: Path, data: bytes) -> Path:
    digest = blake3(data).hexdigest()
    return root / "blobs" / digest[:2] / digest[2:]


def test_damage_to_a_blob_read_beyond_the_budget_is_caught(cache_dir: Path, budget_of_ten: None) -> None:
    # Past the budget, a repeated hit reads the file again without hashing it, once
    # an fstat proves it the file that was verified: an in-place change is caught.
    cache, keys, seen = twenty_keys_read_four_times(cache_dir)
    outside = [k for k in keys if cache[k] is not seen[k]]  # read from the file, not memory
    assert outside
    victim = outside[0]
    i = keys.index(victim)
    bad = bytearray(value(i))
    bad[100] ^= 1
    rewrite_in_place(blob_path(cache_dir, value(i)), bytes(bad))
    assert cache.get(victim) is None
    assert cache.stats().corrupt == 1
    assert all(cache.get(k) == value(j) for j, k in enumerate(keys) if k != victim)


def test_a_held_blob_replaced_on_disk_is_read_again(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = value(1)
    first = cache["k"]
    assert cache["k"] is cache["k"]  # held now
    ContentAddressedProgramCache(cache_dir)["k"] = value(2)  # another writer re-points the key
    assert cache["k"] == value(2)
    assert first == value(1)
