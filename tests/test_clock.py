"""Clocks that jump: an mtime in the future is not believed as "young" or "recently used" forever.

The rule (cuda_program_cas._disk.files.trusted_mtime_ns): a file time more than a day ahead of the file
system's clock counts as the oldest possible. Files get their future times here
from os.utime, as a restored backup, a copy from a node with a wrong clock, or a
clock set back after a while leaves them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from conftest import write_orphan

from cuda_program_cas import CacheStore, collect, publish
from cuda_program_cas._disk.files import FUTURE_MTIME_NS
from cuda_program_cas._verbs.gc import SHARED_MIN_GRACE_S
from cuda_program_cas._verbs.repack import repack
from cuda_program_cas.index import key_id

#: 1 January 2030, as a node whose clock ran years ahead stamps its files.
Y2030_NS = 1_893_456_000 * 10**9
#: A manifest of a 1000..9999-byte blob.
MANIFEST_BYTES = len(b"cpcas2 ") + 64 + 1 + 64 + 1 + 4 + 1


def value(i: int, size: int = 1000) -> bytes:
    return i.to_bytes(4, "big") * (size // 4)


def date(path: Path | str, ns: int) -> None:
    os.utime(path, ns=(ns, ns))


def blob_path(root: Path, digest: str) -> Path:
    return root / "blobs" / digest[:2] / digest[2:]


def manifest_path(root: Path, key: str) -> Path:
    kid = key_id(key)
    return root / "index" / kid[:2] / kid[2:]


def test_orphans_dated_in_the_future_are_collected(cache_dir: Path) -> None:
    CacheStore(cache_dir).put("live", b"kept")
    future = [write_orphan(cache_dir, value(i)) for i in range(30)]
    for digest in future:
        date(blob_path(cache_dir, digest), Y2030_NS)
    # Within the day believed: a writer on a clock a little ahead is still in its grace period.
    near = write_orphan(cache_dir, b"a writer a minute ahead")
    date(blob_path(cache_dir, near), time.time_ns() + 60 * 10**9)

    report = collect(cache_dir, grace_s=0)
    assert report.plan["orphan_blobs"]["count"] == 30
    assert not any(blob_path(cache_dir, d).exists() for d in future)
    assert blob_path(cache_dir, near).exists()
    assert CacheStore(cache_dir).get("live") == b"kept"
    # The default grace period (an hour) does not keep them either: they are not young.
    again = [write_orphan(cache_dir, value(100 + i)) for i in range(3)]
    for digest in again:
        date(blob_path(cache_dir, digest), Y2030_NS)
    assert collect(cache_dir).plan["orphan_blobs"]["count"] == 3


def test_orphans_dated_in_the_future_do_not_hold_the_cap(cache_dir: Path) -> None:
    entry = 1000 + MANIFEST_BYTES
    cap = 40 * entry
    store = CacheStore(cache_dir, max_size_bytes=cap)
    for i in range(30):
        date(blob_path(cache_dir, write_orphan(cache_dir, value(10_000 + i))), Y2030_NS)
    for i in range(38):
        store.put(f"k{i}", value(i))
    live = sum(store.get(f"k{i}") == value(i) for i in range(38))
    assert live == 38
    assert store.inner.snapshot().stored_bytes <= cap


def test_max_age_expires_entries_dated_in_the_future(cache_dir: Path) -> None:
    store = CacheStore(cache_dir)
    for i in range(4):
        store.put(f"k{i}", value(i))
    for i in range(2):
        date(manifest_path(cache_dir, f"k{i}"), Y2030_NS)
    report = collect(cache_dir, max_age_s=30 * 86400, grace_s=0)
    assert report.plan["expired_entries"]["count"] == 2
    assert [store.get(f"k{i}") is not None for i in range(4)] == [False, False, True, True]


def test_gc_max_size_evicts_entries_dated_in_the_future_first(cache_dir: Path) -> None:
    store = CacheStore(cache_dir)
    for i in range(6):
        store.put(f"k{i}", value(i))
    now = time.time_ns()
    for i in range(6):
        date(manifest_path(cache_dir, f"k{i}"), now - (60 - i) * 10**9)  # k0 least recently used
    date(manifest_path(cache_dir, "k5"), Y2030_NS)
    collect(cache_dir, max_size=4 * (1000 + MANIFEST_BYTES), grace_s=0)
    assert [store.get(f"k{i}") is not None for i in range(6)] == [False, True, True, True, True, False]


def test_the_cap_evicts_an_entry_dated_in_the_future_first(cache_dir: Path) -> None:
    entry = 1000 + MANIFEST_BYTES
    store = CacheStore(cache_dir, max_size_bytes=10 * entry)
    for i in range(10):
        store.put(f"k{i}", value(i))
    now = time.time_ns()
    for i in range(10):
        date(manifest_path(cache_dir, f"k{i}"), now - (60 - i) * 10**9)
    date(manifest_path(cache_dir, "k9"), Y2030_NS)
    store.put("new", value(99))
    assert store.get("k9") is None
    assert store.get("k0") == value(0) and store.get("new") == value(99)


def test_a_hit_on_an_entry_dated_in_the_future_brings_it_back_to_now(cache_dir: Path) -> None:
    store = CacheStore(cache_dir)
    store.put("k", b"v")
    manifest = manifest_path(cache_dir, "k")
    date(manifest, Y2030_NS)
    reader = CacheStore(cache_dir)
    assert reader.get("k") == b"v"
    reader.flush()
    assert abs(manifest.stat().st_mtime_ns - time.time_ns()) < FUTURE_MTIME_NS // 24


def test_temp_files_dated_in_the_future_are_stale(cache_dir: Path) -> None:
    CacheStore(cache_dir)
    temp = cache_dir / "tmp" / "1234-deadbeef00000000.tmp"
    temp.write_bytes(b"a crashed writer's")
    date(temp, Y2030_NS)
    report = collect(cache_dir)
    assert report.temp_files_removed == 1 and not temp.exists()


def test_max_age_expires_packed_entries_dated_in_the_future(tmp_path: Path) -> None:
    src = CacheStore(tmp_path / "src")
    for i in range(3):
        src.put(f"k{i}", value(i))
    date(manifest_path(tmp_path / "src", "k0"), Y2030_NS)  # a pack entry keeps its manifest's time
    publish([tmp_path / "src"], tmp_path / "store", pack=True)
    report = collect(tmp_path / "store", max_age_s=30 * 86400, grace_s=SHARED_MIN_GRACE_S)
    assert report.packs["entries_dropped"] == 1
    node = CacheStore(tmp_path / "node", shared=[tmp_path / "store"])
    assert [node.get(f"k{i}") is not None for i in range(3)] == [False, True, True]


def test_packs_dated_in_the_future_wait_out_no_grace_period(tmp_path: Path) -> None:
    src = CacheStore(tmp_path / "src")
    src.put("a", value(1))
    store = tmp_path / "store"
    publish([tmp_path / "src"], store)  # a loose entry
    src.put("b", value(2))
    publish([tmp_path / "src"], store, pack=True)  # a pack of the new one
    repack(store)  # one pack of both; the first one retires, the loose copy of "a" is now covered
    packs = store / "packs"
    retired = list((packs / "retired").iterdir())
    assert len(retired) == 1
    for path in [*retired, *packs.glob("*.cpk")]:
        date(path, Y2030_NS)

    report = collect(store, grace_s=SHARED_MIN_GRACE_S)
    assert report.packs["retired_removed"] == 1  # not young for years: gone like an old one
    assert report.packs["loose_removed"] == 1  # the loose copy the pack holds
    node = CacheStore(tmp_path / "node", shared=[store])
    assert node.get("a") == value(1) and node.get("b") == value(2)
