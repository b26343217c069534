"""The size cap of one cache instance: count writes, plan evictions, carry them out.

The cap counts stored bytes (unique blobs plus manifests) and the files in ``tmp/``. An instance
counts its own writes between listings; over the cap, one scan plans a reference-aware LRU
eviction (:func:`plan_lru`, ``gc --max-size``'s too), carried out at once down to the cap, then
(from :data:`MIN_ENTRIES_FOR_WATERMARK` entries) on to the low watermark, :data:`EVICT_STEP`
removals per later write: one scan pays for many. A removal that fails does not drop the write:
the eviction is planned again without that file (:data:`MAX_FAILED_REMOVALS` a pass), said once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Container, Mapping

from cuda_program_cas._base.events import LOGGER, evicted
from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._disk.classify import Condition, classify
from cuda_program_cas._disk.files import FileId
from cuda_program_cas._disk.layout import Layout
from cuda_program_cas._disk.remove import RemovalPlan, RemovalResult, Remover, removable_orphans
from cuda_program_cas._disk.scan import ManifestInfo, Snapshot, take_snapshot
from cuda_program_cas.index import lru_units, partners_of

from .stats import Counters
from .touch import apply_pending

__all__ = ["EVICT_STEP", "ORPHAN_GRACE_S", "SizeCap", "plan_lru"]

#: Eviction brings the stored bytes down to this fraction of the cap.
LOW_WATERMARK = 0.8
#: Below this many live entries a scan is cheap: evict only down to the cap.
MIN_ENTRIES_FOR_WATERMARK = 64
#: Blobs no manifest names are kept this long: a writer stores the blob first.
ORPHAN_GRACE_S = 600.0
#: Removals each write carries out of an eviction under way, once under the cap.
EVICT_STEP = 64
#: A capped writer lists the cache again after writing this fraction of the cap.
REMEASURE_FRACTION = 8
#: Removals that may fail in one pass of an eviction before it stops until the next write.
MAX_FAILED_REMOVALS = 8


class SizeCap:
    """Keeps one store instance's cache under ``max_bytes`` (None: evicts only when asked).

    ``recency()``: key id -> this process's last read (ns), finer than a manifest's mtime.
    """

    def __init__(
        self,
        max_bytes: int | None,
        lay: Layout,
        remover: Remover,
        counters: Counters,
        *,
        recency: Callable[[], Mapping[str, int]],
        note: Callable[[str, int, str], None],
    ) -> None:
        self.max_bytes = max_bytes
        self._note = note
        self._lay = lay
        self._remover = remover
        self._counters = counters
        self._recency = recency
        self._approx: int | None = None  # stored bytes as this instance believes them
        self._since_measure = 0  # bytes this instance wrote since it last listed the cache
        self._plan: RemovalPlan | None = None  # an eviction under way, carried out a step per write
        self._retired: dict[str, FileId] = {}  # see removable_orphans
        self._mutex = threading.Lock()  # one evictor per instance
        self._count_lock = threading.Lock()
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        # A thread of the parent may have been counting or evicting: the child measures afresh.
        self._mutex = threading.Lock()
        self._count_lock = threading.Lock()
        self._plan = None
        self._measure(None)

    def account(self, added: int, *, written: str | None = None) -> None:
        """Count a write of ``added`` bytes (key id ``written``); evict when over the cap.

        Other writers are not seen: the cache is listed again after each eighth of the cap written here.
        """
        max_bytes = self.max_bytes
        if max_bytes is None:
            return
        with self._count_lock:
            self._since_measure += added
            approx = self._approx
            if approx is not None:
                approx += added
                self._approx = approx
                if (
                    self._plan is None
                    and approx <= max_bytes
                    and self._since_measure <= max_bytes // REMEASURE_FRACTION
                ):
                    return
        self.enforce(protect=written)

    def enforce(self, *, protect: str | None = None) -> RemovalResult | None:
        """Bring the stored bytes under the cap, then a step of :data:`EVICT_STEP` toward the low watermark.

        One evictor at a time (a writer that finds one goes on). A failure is said, retried by the next call.
        """
        max_bytes = self.max_bytes
        if max_bytes is None or not self._mutex.acquire(blocking=False):
            return None
        try:
            return self._enforce(max_bytes, protect)
        except OSError as exc:  # listing the cache, its lock file: the next write tries again
            self._counters.add("eviction_failures")
            self._failed(exc)
            return None
        finally:
            self._mutex.release()

    def _enforce(self, max_bytes: int, protect: str | None) -> RemovalResult | None:
        if self._plan is None and (self._approx is None or self._approx <= max_bytes):
            lay = self._lay
            stored = take_snapshot(lay.index, lay.blobs, read_manifests=False, temp_dir=lay.tmp).stored_bytes
            self._measure(stored)
            if stored <= max_bytes:
                return None
        with self._lay.collector_lock() as held:
            if not held:
                return None
            total = RemovalResult()
            failure: OSError | None = None
            stuck: set[str] = set()  # files this pass could not remove
            while True:
                must_free = 0
                if self._plan is None:
                    self._remover.sweep_temp()  # a crashed writer's temp files count, and go first
                    apply_pending()  # the scan sees this process's reads, in every instance
                    lay = self._lay
                    snap = take_snapshot(lay.index, lay.blobs, clock_dir=lay.tmp, temp_dir=lay.tmp)
                    total.stored_bytes_after = snap.stored_bytes
                    if snap.stored_bytes <= max_bytes:  # another process evicted meanwhile, or this pass did
                        break
                    self._plan = self._plan_for(snap, max_bytes, protect, stuck)
                    must_free = snap.stored_bytes - max_bytes
                result, failed = self._carry_out(self._plan, EVICT_STEP, must_free)
                total.add(result)
                if failed is None:
                    break
                # The plan counted on that file's bytes: plan again without it, as far as it takes.
                failure = failed
                self._plan = None
                name = failed.filename
                # A file that fails again, or one this pass cannot name, would fail every pass: stop.
                if not isinstance(name, str) or name in stuck or len(stuck) >= MAX_FAILED_REMOVALS:
                    break
                stuck.add(name)
        self._measure(total.stored_bytes_after)
        if failure is not None:
            self._failed(failure)
        return total

    def _plan_for(self, snap: Snapshot, max_bytes: int, protect: str | None, stuck: set[str]) -> RemovalPlan:
        """The eviction of ``snap``; ``stuck``: paths that cannot go."""
        lay = self._lay
        held = {
            os.path.basename(os.path.dirname(p)) + os.path.basename(p): os.path.dirname(os.path.dirname(p))
            for p in stuck
        }
        kept_kids = frozenset(name for name, top in held.items() if top == lay.index)
        kept_blobs = frozenset(name for name, top in held.items() if top == lay.blobs)
        live = sum(1 for m in snap.manifests if m.manifest is not None)
        target = int(max_bytes * LOW_WATERMARK) if live >= MIN_ENTRIES_FOR_WATERMARK else max_bytes
        plan = plan_lru(
            snap,
            target,
            cap_bytes=max_bytes,
            orphan_grace_ns=int(ORPHAN_GRACE_S * 1e9),
            retired=self._retired,
            protect=(protect,) if protect else (),
            keep_manifests=kept_kids,
            keep_blobs=kept_blobs,
            recency=self._recency(),
        )
        self._retired = {}
        return plan

    def evict_to(self, snap: Snapshot, target_bytes: int) -> RemovalResult:
        """Reference-aware LRU down to ``target_bytes`` from a snapshot, all at once (the caller holds the lock)."""
        plan = plan_lru(snap, target_bytes, orphan_grace_ns=int(ORPHAN_GRACE_S * 1e9), retired=self._retired)
        self._retired = {}
        result, failure = self._carry_out(plan, None, 0)
        if failure is not None:
            raise failure  # the caller reports it
        return result

    def reset(self) -> None:
        with self._mutex:
            self._plan = None
            self._measure(None)

    def _measure(self, stored_bytes: int | None) -> None:
        """The stored bytes as listed now (None: list them again at the next write)."""
        with self._count_lock:
            self._approx = stored_bytes
            self._since_measure = 0

    def _failed(self, exc: OSError) -> None:
        self._plan = None
        self._measure(None)
        self._note(
            "eviction failed", exc.errno or 0, f"{exc}; the entries around it are evicted instead, at each write"
        )

    def _carry_out(self, plan: RemovalPlan, budget: int | None, must_free: int) -> tuple[RemovalResult, OSError | None]:
        """Carry out the plan's next steps; with the removal that failed and stopped them, if one did."""
        t0 = time.perf_counter_ns()
        apply_pending()  # the remover keeps an entry whose manifest was touched since the plan's scan
        result = RemovalResult()
        failure: OSError | None = None
        try:
            if must_free > 0:
                result.add(self._remover.execute(plan, until_freed=must_free))
            if budget is None or budget > result.steps:
                result.add(self._remover.execute(plan, budget=None if budget is None else budget - result.steps))
        except OSError as exc:
            failure = exc  # what the failed call freed before is not counted: the caller lists the cache again
            self._counters.add("eviction_failures")
        result.stored_bytes_after = max(0, plan.snapshot.stored_bytes - plan.freed_so_far)
        self._counters.add("evictions", result.manifests_removed)
        if (result.manifests_removed or result.blobs_removed) and LOGGER.isEnabledFor(logging.DEBUG):
            evicted(self._lay.root, result.manifests_removed, result.blobs_removed, result.bytes_freed, t0)
        self._retired.update(result.retired)
        if plan is self._plan and plan.finished:
            self._plan = None
        return result, failure


def plan_lru(
    snap: Snapshot,
    target_bytes: int,
    *,
    cap_bytes: int | None = None,
    orphan_grace_ns: int,
    retired: dict[str, FileId] | None = None,
    protect: Container[str] = (),
    keep_manifests: frozenset[str] = frozenset(),
    keep_blobs: frozenset[str] = frozenset(),
    recency: Mapping[str, int] | None = None,
) -> RemovalPlan:
    """Plan removals until the stored bytes would be at most ``target_bytes``.

    Garbage and removable orphans first; then the least recently used live entries (a front-door
    record with its results; a blob with the last manifest naming it). ``cap_bytes``: when garbage
    alone gets under it, no live entry goes. ``protect``: key ids never chosen. ``keep_*``: never
    removed. ``recency``: key id -> this process's last read (ns), where later than the mtime.
    """
    plan = RemovalPlan(snap, keep_blobs=keep_blobs)
    total = snap.stored_bytes
    plan.orphans = [d for d in removable_orphans(snap, orphan_grace_ns, retired) if d not in keep_blobs]
    total -= sum(snap.blobs[d].st_size for d in plan.orphans)
    live = []
    for info in snap.manifests:
        if info.key_id in keep_manifests:
            continue  # its bytes stay: it counts in total, and is no candidate
        if classify(info, snap) is Condition.OK:
            live.append(info)
        else:
            plan.manifests.append(info)
            total -= info.stat.st_size
    refs = snap.refs.copy()

    def remove(info: ManifestInfo) -> None:
        nonlocal total
        assert info.manifest is not None
        plan.manifests.append(info)
        total -= info.stat.st_size
        digest = info.manifest.digest
        refs[digest] -= 1
        if refs[digest] == 0 and digest not in keep_blobs:
            total -= snap.blobs[digest].st_size

    # A live record or result whose partner is garbage serves nothing either (see cuda_program_cas.index).
    partners = partners_of(plan.manifests, live)
    if partners:
        going = {info.key_id for info in partners}
        live = [info for info in live if info.key_id not in going]
        for info in partners:
            remove(info)
    if total <= target_bytes or (cap_bytes is not None and total <= cap_bytes):
        return plan
    recent = recency or {}

    def last_use(info: ManifestInfo) -> int:
        return max(snap.mtime_ns(info.stat), recent.get(info.key_id, 0))

    # A front-door record and its results are one unit, as recent as its latest member.
    for unit in lru_units(live, last_use):
        if total <= target_bytes:
            break
        if any(info.key_id in protect for info in unit):
            continue
        for info in unit:
            remove(info)
    return plan
