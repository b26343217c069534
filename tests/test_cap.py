"""The size cap: reference-aware LRU eviction down to a low watermark.

Recency is the manifest mtime; tests set it explicitly (``os.utime``) where an
order is needed, instead of sleeping between writes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from blake3 import blake3
from conftest import read_only

import cuda_program_cas._disk.remove
import cuda_program_cas._local.cap
import cuda_program_cas._local.touch
from cuda_program_cas import CacheStore, ContentAddressedProgramCache, digest_of
from cuda_program_cas.index import key_id

MANIFEST_BYTES = len(b"cpcas2 ") + 64 + 1 + 64 + 1 + 4 + 1  # a manifest of a 1000..9999-byte blob


def value(i: int, size: int = 1000) -> bytes:
    """Distinct, deterministic content per ``i``."""
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def mpath(root: Path, key: str) -> Path:
    kid = key_id(key)
    return root / "index" / kid[:2] / kid[2:]


def bpath(root: Path, data: bytes) -> Path:
    digest = blake3(data).hexdigest()
    return root / "blobs" / digest[:2] / digest[2:]


def age(path: Path, seconds_ago: float) -> None:
    t = time.time_ns() - int(seconds_ago * 1e9)
    os.utime(path, ns=(t, t))


def write_orphan(root: Path, data: bytes) -> None:
    """A blob with no manifest, as a writer that died between the two leaves it."""
    path = bpath(root, data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def on_disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for sub in ("index", "blobs") for p in (root / sub).rglob("*") if p.is_file())


# -- the bound -------------------------------------------------------------------


def test_stored_bytes_never_exceed_the_cap(cache_dir: Path) -> None:
    cap = 20_000
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=cap)
    for i in range(60):
        cache[f"k{i}"] = value(i)
        stats = cache.stats()
        assert stats.stored_bytes <= cap, (i, stats)
        assert stats.stored_bytes == on_disk_bytes(cache_dir)
    assert cache.stats().evictions > 0
    assert cache["k59"] == value(59)  # the newest entry is there


def test_a_shared_blob_counts_once(cache_dir: Path) -> None:
    data = value(1, 4000)
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=8000)
    for i in range(20):
        cache[f"k{i}"] = data
    stats = cache.stats()
    assert stats.logical_bytes == 20 * 4000  # far over the cap as if each key had a copy...
    assert stats.stored_bytes == 4000 + 20 * MANIFEST_BYTES  # ...but the blob is stored once
    assert stats.evictions == 0
    assert stats.entries == 20


def test_a_value_larger_than_the_cap_does_not_stay(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=5000)
    cache["small"] = value(1)
    cache["huge"] = value(2, 50_000)
    assert cache.stats().stored_bytes <= 5000


# -- LRU order -------------------------------------------------------------------


def test_recently_read_keys_survive(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=12 * (1000 + MANIFEST_BYTES))
    for i in range(10):
        cache[f"k{i}"] = value(i)
    for i in range(10):  # k0 oldest ... k9 newest
        age(mpath(cache_dir, f"k{i}"), 100 - i)
        age(bpath(cache_dir, value(i)), 100)  # blobs as old as their keys: this is about LRU order
    reader = ContentAddressedProgramCache(cache_dir)
    assert reader["k0"] == value(0)  # reading makes the two oldest the most recent
    assert reader["k1"] == value(1)
    for i in range(10, 14):  # over the cap: evict to 80 %
        cache[f"k{i}"] = value(i)
    alive = {i for i in range(14) if cache.get(f"k{i}") is not None}
    assert {0, 1} <= alive
    assert {10, 11, 12, 13} <= alive
    assert 2 not in alive and 3 not in alive  # the least recently used went first
    evicted = set(range(14)) - alive
    assert evicted == set(range(2, 2 + len(evicted)))  # and strictly in LRU order
    assert cache.stats().evictions == len(evicted)


# -- reference awareness -----------------------------------------------------------


def test_a_shared_blob_goes_only_with_its_last_key(cache_dir: Path) -> None:
    store = CacheStore(cache_dir)
    shared, own = value(1), value(2)
    store.put("a", shared)
    store.put("b", own)
    store.put("c", shared)
    age(mpath(cache_dir, "a"), 30)
    age(mpath(cache_dir, "b"), 20)
    age(mpath(cache_dir, "c"), 10)
    for data in (shared, own):
        age(bpath(cache_dir, data), 60)

    # Remove one manifest's worth: "a" goes, but "c" still names the shared blob.
    snap = store.inner.snapshot()
    result = store.inner.evict_to(snap, snap.stored_bytes - 1)
    assert result.manifests_removed == 1
    assert result.blobs_removed == 0
    assert bpath(cache_dir, shared).exists()
    assert store.get("a") is None
    assert store.get("c") == shared

    age(mpath(cache_dir, "c"), 5)  # "b" is now the oldest, then "c"
    snap = store.inner.snapshot()
    result = store.inner.evict_to(snap, 0)
    assert result.manifests_removed == 2
    assert result.blobs_removed == 2  # each blob went with its last key
    assert result.bytes_freed == snap.stored_bytes
    assert not bpath(cache_dir, shared).exists()
    assert not bpath(cache_dir, own).exists()


@pytest.mark.parametrize("same_instant", [False, True], ids=["old-blob", "blob-stamped-at-the-scan"])
def test_a_blob_freshened_after_the_scan_began_survives(cache_dir: Path, same_instant: bool) -> None:
    store = CacheStore(cache_dir)
    data, other = value(1), value(2)
    store.put("old", data)
    store.put("gone", other)
    for path in (mpath(cache_dir, "old"), mpath(cache_dir, "gone"), bpath(cache_dir, data), bpath(cache_dir, other)):
        age(path, 60)
    snap = store.inner.snapshot()  # the evictor's scan: "old" is the only key naming `data`
    if same_instant:
        # Stamped by the file system's clock at the very instant the scan began: it
        # cannot be told from a blob a writer freshened just after, so it must stay.
        os.utime(bpath(cache_dir, other), ns=(snap.cutoff_ns, snap.cutoff_ns))
        snap.blobs[digest_of(other)] = bpath(cache_dir, other).stat()
    CacheStore(cache_dir).put("new", data)  # a writer deduplicates against it: freshened
    result = store.inner.evict_to(snap, 0)
    assert result.manifests_removed == 2
    assert bpath(cache_dir, data).exists()  # freshened after the scan began: kept
    assert store.get("new") == data
    assert store.get("old") is None
    if not same_instant:
        assert result.blobs_removed == 1  # `other`, not the freshened one
        assert not bpath(cache_dir, other).exists()
    else:
        assert result.blobs_removed == 0
        assert bpath(cache_dir, other).exists()
        # Retired: the next pass of the same evictor takes it, still untouched,
        # without waiting out the orphan grace period.
        again = store.inner.evict_to(store.inner.snapshot(), 0)
        assert again.manifests_removed == 1  # "new"
        # `other` goes (and `data` with its last key "new", unless it was freshened
        # within a tick of this second scan, which depends on the clock).
        assert again.blobs_removed >= 1
        assert not bpath(cache_dir, other).exists()


def test_orphans_wait_out_the_grace_period(cache_dir: Path) -> None:
    store = CacheStore(cache_dir)
    store.put("k", value(0))
    age(mpath(cache_dir, "k"), 60)
    age(bpath(cache_dir, value(0)), 60)
    young, old = value(1), value(2)
    # A writer that died between its blob and its manifest leaves an orphan.
    write_orphan(cache_dir, young)
    write_orphan(cache_dir, old)
    age(bpath(cache_dir, old), cuda_program_cas._local.cap.ORPHAN_GRACE_S + 60)
    age(bpath(cache_dir, young), cuda_program_cas._local.cap.ORPHAN_GRACE_S - 60)

    # Even a target of zero leaves a young orphan alone: its manifest may be on the way.
    snap = store.inner.snapshot()
    result = store.inner.evict_to(snap, 0)
    assert bpath(cache_dir, young).exists()
    assert not bpath(cache_dir, old).exists()
    assert result.blobs_removed == 2  # the old orphan, and the blob of "k"

    store.put("late", young)  # the writer's manifest arrives: the blob is there
    assert store.get("late") == young


def test_orphans_are_collected_under_the_cap_once_past_grace(cache_dir: Path) -> None:
    cap = 10_000
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=cap)
    orphan = value(99, 3000)
    write_orphan(cache_dir, orphan)
    age(bpath(cache_dir, orphan), cuda_program_cas._local.cap.ORPHAN_GRACE_S + 1)
    for i in range(8):
        cache[f"k{i}"] = value(i)
    assert not bpath(cache_dir, orphan).exists()  # an old orphan goes before any live key
    assert cache.stats().stored_bytes <= cap


def test_garbage_manifests_go_before_live_keys(cache_dir: Path) -> None:
    store = CacheStore(cache_dir)
    store.put("live", value(1))
    store.put("dangling", value(2))
    store.put("garbled", value(3))
    bpath(cache_dir, value(2)).unlink()
    mpath(cache_dir, "garbled").write_bytes(b"not a manifest")
    age(mpath(cache_dir, "live"), 1000)  # the oldest of all, yet it is kept
    snap = store.inner.snapshot()
    result = store.inner.evict_to(snap, snap.stored_bytes - 1)
    assert result.manifests_removed == 2
    assert store.get("live") == value(1)


# -- amortised eviction ------------------------------------------------------------


class ScanCounter:
    """Counts full scans (instrumentation: the real scan runs)."""

    def __init__(self) -> None:
        self.full = 0
        self.quick = 0
        self._real = cuda_program_cas._local.cap.take_snapshot

    def __call__(self, *args, **kwargs):
        if kwargs.get("read_manifests", True):
            self.full += 1
        else:
            self.quick += 1
        return self._real(*args, **kwargs)


def test_eviction_goes_to_the_low_watermark_so_writes_do_not_scan_each_time(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 100 * (1000 + MANIFEST_BYTES)
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=cap)
    for i in range(100):  # fill to just under the cap
        cache[f"fill{i}"] = value(i)
    scans = ScanCounter()
    monkeypatch.setattr(cuda_program_cas._local.cap, "take_snapshot", scans)
    writes = 400
    for i in range(writes):
        cache[f"k{i}"] = value(1000 + i)
    low = int(cap * cuda_program_cas._local.cap.LOW_WATERMARK)
    # Each eviction frees at least cap - low, so 400 writes at the cap need at
    # most about writes * size / (cap - low) scans, not one per write.
    bound = writes * (1000 + MANIFEST_BYTES) // (cap - low) + 2
    assert 1 <= scans.full <= bound, (scans.full, bound)
    assert scans.full < writes // 10
    monkeypatch.undo()
    stats = cache.stats()
    assert stats.stored_bytes <= cap
    assert stats.evictions >= writes - 100


def test_one_eviction_lands_at_the_low_watermark(cache_dir: Path) -> None:
    cap = 2 * cuda_program_cas._local.cap.MIN_ENTRIES_FOR_WATERMARK * (1000 + MANIFEST_BYTES)
    store = CacheStore(cache_dir, max_size_bytes=cap)
    i = 0
    while store.stats().evictions == 0:
        store.put(f"k{i}", value(i))
        i += 1
    low = int(cap * cuda_program_cas._local.cap.LOW_WATERMARK)
    after = store.stats().stored_bytes
    assert after <= low
    assert after > low - 2 * (1000 + MANIFEST_BYTES)  # not much further than needed


# -- one evictor at a time ---------------------------------------------------------------

_HOLD_LOCK = textwrap.dedent(
    """
    import sys, filelock
    lock = filelock.FileLock(sys.argv[1], timeout=0)
    lock.acquire(blocking=False)
    print("held", flush=True)
    sys.stdin.read()  # hold until the test closes our stdin
    """
)


@contextlib.contextmanager
def lock_held_elsewhere(lock_path: Path) -> Iterator[None]:
    """Another process holds the cache's eviction lock for the duration of the block."""
    with subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(lock_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:
        assert holder.stdin is not None and holder.stdout is not None
        try:
            assert holder.stdout.readline().strip() == "held"
            yield
        finally:
            holder.stdin.close()  # the holder exits, releasing the lock
            holder.wait(timeout=30)


def test_a_writer_does_not_wait_for_a_running_evictor(cache_dir: Path) -> None:
    cap = 10 * (1000 + MANIFEST_BYTES)
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=cap)
    with lock_held_elsewhere(cache_dir / "evict.lock"):

        def write_past_the_cap() -> None:
            for i in range(30):
                cache[f"k{i}"] = value(i)

        writer = threading.Thread(target=write_past_the_cap, daemon=True)
        writer.start()
        writer.join(30)
        assert not writer.is_alive(), "a writer waited for the eviction lock"
        stats = cache.stats()
        assert stats.evictions == 0  # another process is evicting: this one left it alone
        assert stats.entries == 30
        assert stats.stored_bytes > cap
    cache["one more"] = value(100)  # the lock is free: the next write over the cap evicts
    stats = cache.stats()
    assert stats.evictions > 0
    assert stats.stored_bytes <= cap


def test_enforce_cap_returns_none_while_another_process_holds_the_lock(cache_dir: Path) -> None:
    store = CacheStore(cache_dir, max_size_bytes=5000)
    for i in range(3):
        store.put(f"k{i}", value(i))
    with lock_held_elsewhere(cache_dir / "evict.lock"):
        for i in range(3, 10):
            store.put(f"k{i}", value(i))
        assert store.inner.enforce_cap() is None
        assert store.stats().stored_bytes > 5000
    for blob in (cache_dir / "blobs").glob("*/*"):
        age(blob, 60)  # written a minute ago: old enough to go with their last key
    result = store.inner.enforce_cap()
    assert result is not None and result.manifests_removed > 0
    assert store.stats().stored_bytes <= 5000


# -- recency touches ---------------------------------------------------------------------


def test_a_hit_touches_an_old_manifest(cache_dir: Path) -> None:
    ContentAddressedProgramCache(cache_dir)["k"] = b"v"
    manifest = mpath(cache_dir, "k")
    age(manifest, 10)
    before = time.time_ns()
    # The touch is queued by the hit and lands when the instance goes (here at once).
    assert ContentAddressedProgramCache(cache_dir)["k"] == b"v"
    assert manifest.stat().st_mtime_ns >= before - 20_000_000  # coarse fs clock


def test_the_hit_itself_makes_no_write(cache_dir: Path) -> None:
    ContentAddressedProgramCache(cache_dir)["k"] = b"v"
    manifest = mpath(cache_dir, "k")
    # The process's touch thread may land the touch between the hit and the stat
    # below (a pass a second): three tries in a row cannot all meet it.
    for _ in range(3):
        age(manifest, 10)
        stamped = manifest.stat().st_mtime_ns
        reader = ContentAddressedProgramCache(cache_dir)
        assert reader["k"] == b"v"
        unchanged = manifest.stat().st_mtime_ns == stamped
        reader.close()
        assert manifest.stat().st_mtime_ns > stamped  # queued, and landed by close()
        if unchanged:
            return
    pytest.fail("the manifest changed during the hit itself, three times")


def wait_for_mtime_change(path: Path, than: int, within_s: float = 10.0) -> float:
    """Seconds until ``path``'s mtime differs from ``than`` (a condition polled, with a deadline)."""
    t0 = time.monotonic()
    while path.stat().st_mtime_ns == than:
        if time.monotonic() - t0 > within_s:
            pytest.fail(f"{path} was not touched within {within_s} s")
        time.sleep(0.02)
    return time.monotonic() - t0


def test_touches_land_within_a_second_without_a_flush(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    for k in ("k", "later"):
        cache[k] = b"v"
        age(mpath(cache_dir, k), 60)
    manifest = mpath(cache_dir, "k")
    old = manifest.stat().st_mtime_ns
    assert cache["k"] == b"v"
    # A process that keeps using the cache: the lookup a second later applies the queue.
    t0 = time.monotonic()
    while manifest.stat().st_mtime_ns == old:
        assert time.monotonic() - t0 < 10, "not touched within 10 s of use"
        cache.get("absent")
        time.sleep(0.02)
    assert manifest.stat().st_mtime_ns > old + 50 * 10**9
    # From then on the process's thread lands touches while it is idle too.
    later = mpath(cache_dir, "later")
    old = later.stat().st_mtime_ns
    assert cache["later"] == b"v"
    wait_for_mtime_change(later, old)


def test_a_key_read_again_within_the_second_is_touched_once(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = b"v"
    manifest = mpath(cache_dir, "k")
    age(manifest, 60)
    assert cache["k"] == b"v"
    cache.store.flush()
    first = manifest.stat().st_mtime_ns
    t_first = time.monotonic()
    for _ in range(5):
        assert cache["k"] == b"v"
    cache.store.flush()
    if time.monotonic() - t_first < 0.9:  # still within the second: no second touch
        assert manifest.stat().st_mtime_ns == first
    time.sleep(1.05)  # the interval itself is what is tested
    assert cache["k"] == b"v"  # a second later, the same instance touches again
    cache.store.flush()
    assert manifest.stat().st_mtime_ns > first


def test_readers_of_one_key_touch_it_once_a_second_between_them(cache_dir: Path) -> None:
    # Two instances (as two processes would) read the same old entry: the first to
    # apply its queue touches the manifest, the second finds it under a second old
    # and leaves it: one metadata write, not one per reader.
    ContentAddressedProgramCache(cache_dir)["k"] = b"v"
    manifest = mpath(cache_dir, "k")
    age(manifest, 100)
    old = manifest.stat().st_mtime_ns
    first, second = ContentAddressedProgramCache(cache_dir), ContentAddressedProgramCache(cache_dir)
    assert first["k"] == b"v" and second["k"] == b"v"
    first.store.flush()
    touched = manifest.stat()
    assert touched.st_mtime_ns > old
    second.store.flush()
    again = manifest.stat()
    assert (again.st_mtime_ns, again.st_ctime_ns) == (touched.st_mtime_ns, touched.st_ctime_ns)


def test_a_read_only_hit_never_touches(cache_dir: Path) -> None:
    ContentAddressedProgramCache(cache_dir)["k"] = b"v"
    manifest = mpath(cache_dir, "k")
    age(manifest, 100)
    stamped = manifest.stat().st_mtime_ns
    reader = ContentAddressedProgramCache(cache_dir, read_only=True)
    assert reader["k"] == b"v"
    reader.close()
    cuda_program_cas._local.touch.apply_pending()
    assert manifest.stat().st_mtime_ns == stamped


def test_the_touch_uses_mtime_not_atime(cache_dir: Path) -> None:
    # Eviction must see a read even on a noatime mount: the manifest mtime moves.
    ContentAddressedProgramCache(cache_dir)["k"] = b"v"
    manifest = mpath(cache_dir, "k")
    age(manifest, 100)
    old = manifest.stat().st_mtime_ns
    assert ContentAddressedProgramCache(cache_dir)["k"] == b"v"
    assert manifest.stat().st_mtime_ns > old + 50 * 10**9


def test_a_queued_touch_never_follows_a_symlink(cache_dir: Path, tmp_path: Path) -> None:
    # The manifest read is replaced by a symlink before its touch lands: the
    # symlink is touched (or nothing), never the file it points to.
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = b"v"
    target = tmp_path / "outside"
    target.write_bytes(b"not the cache's")
    age(target, 100)
    stamped = target.stat().st_mtime_ns
    manifest = mpath(cache_dir, "k")
    age(manifest, 100)
    cache.store.flush()
    assert cache["k"] == b"v"
    manifest.unlink()
    manifest.symlink_to(target)
    cache.store.flush()
    assert target.stat().st_mtime_ns == stamped


def test_a_read_at_exit_is_recorded(cache_dir: Path) -> None:
    # A short job reads and exits at once, without close(): its reads still land.
    ContentAddressedProgramCache(cache_dir)["k"] = b"v"
    manifest = mpath(cache_dir, "k")
    age(manifest, 100)
    old = manifest.stat().st_mtime_ns
    code = (
        "import cuda_program_cas, sys; "
        f"c = cuda_program_cas.ContentAddressedProgramCache({str(cache_dir)!r}); sys.exit(c['k'] != b'v')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert manifest.stat().st_mtime_ns > old + 50 * 10**9


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_touches_with_its_own_thread(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    cache["k"] = b"v"
    manifest = mpath(cache_dir, "k")
    age(manifest, 100)
    old = manifest.stat().st_mtime_ns
    cuda_program_cas._local.touch.ensure_thread()  # the parent has its thread (a second into a cache's use)
    pid = os.fork()
    if pid == 0:  # the child: read, then wait for its touch thread; never runs atexit
        ok = cache["k"] == b"v"
        t0 = time.monotonic()
        while manifest.stat().st_mtime_ns == old and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        os._exit(0 if ok and manifest.stat().st_mtime_ns != old else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_large_eviction_is_carried_out_a_step_per_write(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No single write pays for removing a fifth of a large cache: one scan plans the
    # eviction, then each write over the cap removes at most _EVICT_STEP entries.
    step = cuda_program_cas._local.cap.EVICT_STEP
    n = 6 * step
    cap = n * (100 + MANIFEST_BYTES)
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=cap)
    for i in range(n):
        cache[f"k{i}"] = value(i, 100)
    for f in [*(cache_dir / "index").glob("*/*"), *(cache_dir / "blobs").glob("*/*")]:
        age(f, 60)  # written a minute ago, oldest key first
    for i in range(n):
        age(mpath(cache_dir, f"k{i}"), 60 - i / n)
    scans = ScanCounter()
    monkeypatch.setattr(cuda_program_cas._local.cap, "take_snapshot", scans)

    removed = []
    for i in range(12):
        before = len(cache)
        cache[f"new{i}"] = value(10_000 + i, 100)
        removed.append(before + 1 - len(cache))
    assert max(removed) <= step  # never more than a step per write
    assert scans.full == 1  # one scan planned all of it
    assert sum(removed) >= n - int(n * cuda_program_cas._local.cap.LOW_WATERMARK)  # down to the low watermark
    assert cache.stats().stored_bytes <= cap
    alive = [i for i in range(n) if cache.get(f"k{i}") is not None]
    assert alive == list(range(n - len(alive), n))  # the least recently used went, in order
    assert all(cache.get(f"new{i}") == value(10_000 + i, 100) for i in range(12))


def test_a_step_of_a_plan_keeps_a_key_read_since_the_scan(cache_dir: Path) -> None:
    store = CacheStore(cache_dir, max_size_bytes=10**9)
    for i in range(10):
        store.put(f"k{i}", value(i))
        age(mpath(cache_dir, f"k{i}"), 60 - i)
    snap = store.inner.snapshot()
    plan = cuda_program_cas._local.cap.plan_lru(snap, 0, orphan_grace_ns=10**12)
    assert store.get("k0") == value(0)  # read after the scan: a touch of its manifest is queued
    store.flush()  # it lands (within a second without this, see test_touches_land_within_a_second)
    remover = cuda_program_cas._disk.remove.Remover(store.inner.layout)
    remover.execute(plan, budget=3)
    assert store.get("k0") == value(0)  # planned first, kept: it was used since
    assert not mpath(cache_dir, "k1").exists() and not mpath(cache_dir, "k2").exists()
    assert mpath(cache_dir, "k3").exists()  # beyond this step's budget
    remover.execute(plan)
    assert plan.finished
    assert [i for i in range(10) if mpath(cache_dir, f"k{i}").exists()] == [0]


# -- deletes, rewrites and tight caps ------------------------------------------------------
#
# A blob whose last key was deleted or overwritten is garbage at once: it must not
# make eviction take live entries (each case below lost every live entry once).


def test_rewriting_one_key_keeps_it(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=5000)
    for i in range(3):
        cache["a"] = value(i, 2000)
    assert len(cache) == 1
    assert cache["a"] == value(2, 2000)
    assert cache.stats().stored_bytes <= 5000


def test_deleted_keys_make_room_for_the_next_write(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=5000)
    cache["a"] = value(1, 2000)
    cache["b"] = value(2, 2000)
    del cache["a"]
    del cache["b"]
    cache["c"] = value(3, 2000)
    assert cache["c"] == value(3, 2000)
    assert cache.stats().evictions == 0


def test_many_rewrites_of_one_key_never_evict_the_live_entries(cache_dir: Path) -> None:
    cap = 1 << 20
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=cap)
    for i in range(200):
        cache[f"live{i}"] = value(i, 4096)
    for n in range(300):
        cache["hot"] = value(10_000 + n, 4096)
    stats = cache.stats()
    assert stats.stored_bytes <= cap
    assert stats.evictions == 0
    assert all(cache.get(f"live{i}") == value(i, 4096) for i in range(200))
    assert cache["hot"] == value(10_299, 4096)


def test_a_tight_cap_evicts_only_what_the_write_needs_in_read_order(cache_dir: Path) -> None:
    # All within one second: the read of "a" counts although its manifest is not touched.
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=5000)
    cache["a"] = value(1, 2000)
    cache["b"] = value(2, 2000)
    assert cache["a"] == value(1, 2000)
    cache["c"] = value(3, 2000)
    assert cache.get("a") == value(1, 2000)
    assert cache.get("b") is None
    assert cache.get("c") == value(3, 2000)
    assert cache.stats().evictions == 1


def test_a_write_never_evicts_the_entry_it_just_wrote(cache_dir: Path) -> None:
    cache = ContentAddressedProgramCache(cache_dir, max_size_bytes=2500)
    for i in range(5):
        cache[f"k{i}"] = value(i, 2000)
        assert cache[f"k{i}"] == value(i, 2000)
        assert len(cache) == 1


def test_at_rest_one_writer_is_always_within_the_cap(cache_dir: Path) -> None:
    cap = 64 * 1024
    store = CacheStore(cache_dir, max_size_bytes=cap)
    live: dict[str, bytes] = {}
    for n in range(600):
        key = f"k{n % 40}"
        if n % 7 == 3 and key in live:
            with contextlib.suppress(KeyError):  # evicted meanwhile
                store.delete(key)
            del live[key]
        else:
            live[key] = value(n, 1000 + 37 * (n % 50))
            assert store.put(key, live[key])
        assert store.stats().stored_bytes <= cap, n
    # What was evicted went in LRU order; what is there is right.
    for key, data in live.items():
        got = store.get(key)
        assert got is None or got == data
    assert store.get(key) == live[key]  # the last write is there


@pytest.mark.mount
def test_a_stored_value_is_landed_when_its_eviction_fails_and_the_cap_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from cuda_program_cas import WriteResult

    root = tmp_path / "cas"
    store = CacheStore(root, max_size_bytes=1500)
    assert store.put("stuck", value(0, 300)) is WriteResult.STORED
    shard = mpath(root, "stuck").parent
    # Keys whose manifests go elsewhere: a write into the read-only shard would be a real drop.
    keys = [k for k in (f"k{i}" for i in range(40)) if mpath(root, k).parent != shard][:8]
    with read_only(shard):
        for n, key in enumerate(keys, 1):
            # The least recently used entry cannot be removed: the write is stored all the same,
            # and the entries after it are evicted instead, so the cache stays under its cap.
            assert store.put(key, value(n, 300)) is WriteResult.STORED, key
            assert store.get(key) == value(n, 300)
            assert store.inner.snapshot().stored_bytes <= 1500, (key, store.inner.snapshot().stored_bytes)
        assert store.get("stuck") == value(0, 300)
        assert store.counters()["dropped_writes"] == 0
    warned = [r.getMessage() for r in caplog.records if "eviction failed" in r.getMessage()]
    assert len(warned) == 1 and "Read-only file system" in warned[0]
    # Said once, counted each time: the instance's counts, and the cache's lifetime ones (stats).
    failures = store.stats().eviction_failures
    assert failures >= len(keys) - 2, failures  # the first writes fit under the cap; each later one met it
    store.close()
    from cuda_program_cas import stats as lifetime_stats

    assert lifetime_stats(root).counters["eviction_failures"] == failures
    store = CacheStore(root, max_size_bytes=1500)
    # Writable again: it is evicted in its turn (3 entries fit; 5 newer ones come).
    for n in range(5):
        assert store.put(f"after{n}", value(100 + n, 300)) is WriteResult.STORED
        assert store.inner.snapshot().stored_bytes <= 1500
    assert not mpath(root, "stuck").exists()


@pytest.mark.mount
def test_garbage_that_cannot_be_removed_neither_stalls_nor_overfills_the_cache(tmp_path: Path) -> None:
    from cuda_program_cas import WriteResult

    root = tmp_path / "cas"
    store = CacheStore(root, max_size_bytes=1500)
    junk = mpath(root, "junk")
    junk.parent.mkdir(parents=True)
    junk.write_bytes(b"cpcas2 not a manifest\n")  # garbage: every plan takes it first, whatever the target
    keys = [k for k in (f"k{i}" for i in range(40)) if mpath(root, k).parent != junk.parent][:8]
    sizes: list[int] = []
    results: list[WriteResult] = []

    def writes() -> None:
        for n, key in enumerate(keys, 1):
            results.append(store.put(key, value(n, 300)))
            sizes.append(store.inner.snapshot().stored_bytes)

    with read_only(junk.parent):
        # In a thread: an eviction that plans the same stuck file again and again never returns.
        writer = threading.Thread(target=writes, daemon=True)
        writer.start()
        writer.join(timeout=60)
        assert not writer.is_alive(), "an eviction retried the file it cannot remove without end"
    assert results == [WriteResult.STORED] * len(keys)
    assert max(sizes) <= 1500, sizes  # the live entries around it went instead
    assert junk.exists() and store.get(keys[-1]) == value(len(keys), 300)
