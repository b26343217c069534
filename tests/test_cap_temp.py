"""The size cap counts the files in tmp/ too, and removes a crashed writer's stale ones.

A temp file takes disk like any other file of the cache: a writer in flight (a big
blob on its way), or one that died mid-write and left its temp file behind.
FileStreamProgramCache counts them; so does this cache.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from cuda_program_cas import CacheStore
from cuda_program_cas._disk.layout import STALE_TMP_S

#: A manifest of a 1000..9999-byte blob.
MANIFEST_BYTES = len(b"cpcas2 ") + 64 + 1 + 64 + 1 + 4 + 1
ENTRY = 1000 + MANIFEST_BYTES


def value(i: int, size: int = 1000) -> bytes:
    return i.to_bytes(4, "big") * (size // 4)


def temp_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "tmp").iterdir() if p.is_file())


def test_the_cap_counts_temp_files(cache_dir: Path) -> None:
    cap = 10 * ENTRY
    store = CacheStore(cache_dir, max_size_bytes=cap)
    # Another writer's blob on its way: young, so it stays, and it takes half the cap.
    (cache_dir / "tmp" / "4242-0123456700000000.tmp").write_bytes(b"\0" * (5 * ENTRY))
    for i in range(10):
        store.put(f"k{i}", value(i))
    assert store.inner.snapshot().stored_bytes + temp_bytes(cache_dir) <= cap
    alive = [i for i in range(10) if store.get(f"k{i}") is not None]
    assert 3 <= len(alive) <= 5 and alive == list(range(10 - len(alive), 10))  # the oldest went


def test_stale_temp_files_go_when_the_cap_is_enforced(cache_dir: Path) -> None:
    cap = 10 * ENTRY
    store = CacheStore(cache_dir, max_size_bytes=cap)
    # A writer that crashed two hours ago (after this store was opened: opening sweeps too).
    stale = cache_dir / "tmp" / "4242-0123456700000001.tmp"
    stale.write_bytes(b"\0" * (8 * ENTRY))
    old = time.time_ns() - int(2 * STALE_TMP_S * 1e9)
    os.utime(stale, ns=(old, old))
    for i in range(9):
        store.put(f"k{i}", value(i))
    assert not stale.exists()
    assert all(store.get(f"k{i}") == value(i) for i in range(9))  # the stale file went, no entry did
    assert store.inner.snapshot().stored_bytes <= cap
