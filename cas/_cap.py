"""The size cap of one cache instance: count writes, plan evictions, carry them out in steps.

The cap counts stored bytes (unique blobs plus manifests). An instance counts
its own writes between listings of the cache; when its count goes over the cap,
one scan plans a reference-aware LRU eviction down to the low watermark, and
each later write carries out a step of that plan (see :mod:`cas._evict`).
"""

from __future__ import annotations

import threading

from index import Index

from ._blobs import BlobStore
from ._evict import EvictionPlan, EvictionResult, Identity, execute_plan, plan_lru
from ._layout import Layout, sweep_stale_temp_files
from ._scan import Snapshot, take_snapshot
from ._stats import Counters

__all__ = ["LOW_WATERMARK", "ORPHAN_GRACE_S", "SizeCap"]

#: Eviction brings the stored bytes down to this fraction of the cap, so one
#: scan pays for many writes.
LOW_WATERMARK = 0.8
#: Blobs no manifest names are kept this long: a writer stores the blob first.
ORPHAN_GRACE_S = 600.0
#: Removals each write over the cap carries out of an eviction plan under way.
EVICT_STEP = 64
#: A capped writer lists the cache again after writing this fraction of the cap.
REMEASURE_FRACTION = 8


class SizeCap:
    """Keeps one store instance's cache under ``max_bytes`` (None: evicts only when asked)."""

    def __init__(self, max_bytes: int | None, lay: Layout, index: Index, blobs: BlobStore, counters: Counters) -> None:
        self.max_bytes = max_bytes
        self._lay = lay
        self._index = index
        self._blobs = blobs
        self._counters = counters
        self._approx: int | None = None  # stored bytes as this instance believes them
        self._since_measure = 0  # bytes this instance wrote since it last listed the cache
        self._plan: EvictionPlan | None = None  # an eviction under way, carried out a step per write
        self._retired: dict[str, Identity] = {}  # see cas._evict.plan_lru
        self._mutex = threading.Lock()

    def account(self, added: int) -> None:
        """Count a write of ``added`` stored bytes; evict when over the cap.

        Other processes write too, and this instance does not see their writes: it
        lists the cache again (stats, no reads) after every eighth of the cap it
        writes itself, so N writers overshoot by at most about N/8 of the cap.
        While an eviction plan is under way, every write carries out a step of it.
        """
        max_bytes = self.max_bytes
        if max_bytes is None:
            return
        self._since_measure += added
        approx = self._approx
        if approx is not None:
            approx += added
            self._approx = approx
            if self._plan is None and approx <= max_bytes and self._since_measure <= max_bytes // REMEASURE_FRACTION:
                return
        self.enforce()

    def enforce(self, *, budget: int | None = EVICT_STEP) -> EvictionResult | None:
        """Bring the stored bytes under the cap (to the low watermark) if they are over it.

        One scan plans the eviction down to the low watermark; the plan is then
        carried out ``budget`` removals at a time, one portion per call (each write
        over the cap makes one), so no single write pays for removing a fifth of a
        large cache (``budget=None``: all at once). Only one evictor runs at a time
        (a non-blocking lock per process, a ``filelock`` across processes); a
        writer that finds one running goes on.
        """
        max_bytes = self.max_bytes
        if max_bytes is None or not self._mutex.acquire(blocking=False):
            return None
        try:
            if self._plan is None and (self._approx is None or self._approx <= max_bytes):
                stored = take_snapshot(self._index, self._blobs, read_manifests=False).stored_bytes
                self._measure(stored)
                if stored <= max_bytes:
                    return None
            import filelock

            lock = filelock.FileLock(self._lay.lock, timeout=0)
            try:
                lock.acquire(blocking=False)
            except filelock.Timeout:
                return None
            try:
                if self._plan is None:
                    sweep_stale_temp_files(self._lay.tmp)
                    snap = take_snapshot(self._index, self._blobs, clock_dir=self._lay.tmp)
                    if snap.stored_bytes <= max_bytes:  # another process evicted meanwhile
                        self._measure(snap.stored_bytes)
                        return EvictionResult(stored_bytes_after=snap.stored_bytes)
                    self._plan = plan_lru(
                        snap,
                        int(max_bytes * LOW_WATERMARK),
                        orphan_grace_ns=int(ORPHAN_GRACE_S * 1e9),
                        retired=self._retired,
                    )
                    self._retired = {}
                result = self._carry_out(self._plan, budget)
            finally:
                lock.release()
            self._measure(result.stored_bytes_after)
            return result
        finally:
            self._mutex.release()

    def evict_to(self, snap: Snapshot, target_bytes: int, *, orphan_grace_s: float = ORPHAN_GRACE_S) -> EvictionResult:
        """Reference-aware LRU down to ``target_bytes`` from a snapshot, all at once (the caller holds the lock)."""
        plan = plan_lru(snap, target_bytes, orphan_grace_ns=int(orphan_grace_s * 1e9), retired=self._retired)
        self._retired = {}
        return self._carry_out(plan, None)

    def reset(self) -> None:
        """Forget counts and plans (after the cache was cleared)."""
        self._plan = None
        self._approx = None
        self._since_measure = 0

    def _measure(self, stored_bytes: int) -> None:
        self._approx = stored_bytes
        self._since_measure = 0

    def _carry_out(self, plan: EvictionPlan, budget: int | None) -> EvictionResult:
        result = execute_plan(plan, self._index, self._blobs, budget=budget)
        self._counters.add("evictions", result.manifests_removed)
        self._retired.update(result.retired)
        if plan is self._plan and plan.finished:
            self._plan = None
        return result
