"""Reference-aware LRU eviction: plan from a snapshot, then execute.

Least recently used manifests go first (recency is the manifest's mtime, which a
hit refreshes). A blob goes only when the last manifest naming it is gone, and
only if nobody wrote or freshened it since the scan began. Orphan blobs (named by
no manifest at scan time) wait out a grace period: a writer stores its blob
before its manifest.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from index import Index

from ._blobs import BlobStore
from ._scan import ManifestInfo, Snapshot

__all__ = ["EvictionPlan", "EvictionResult", "execute_plan", "plan_lru"]


@dataclass(slots=True)
class EvictionPlan:
    """What to remove, in order, and what that is expected to free."""

    snapshot: Snapshot
    #: Manifests to remove (invalid and dangling first, then least recently used).
    manifests: list[ManifestInfo] = field(default_factory=list)
    #: Orphan blobs past their grace period.
    orphans: list[str] = field(default_factory=list)
    #: Expected bytes freed, blobs whose last reference goes included.
    expected_freed: int = 0
    #: Blobs expected to go because their last manifest goes.
    expected_blobs: int = 0
    #: Progress, for a plan carried out in steps (see :func:`execute_plan`).
    done_orphans: int = 0
    done_manifests: int = 0
    refs_left: Counter[str] | None = None
    freed_so_far: int = 0

    @property
    def finished(self) -> bool:
        return self.done_orphans >= len(self.orphans) and self.done_manifests >= len(self.manifests)


#: What proves a blob untouched between two scans (a freshen changes mtime and ctime).
Identity = tuple[int, int, int, int]


def identity(st: os.stat_result) -> Identity:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(slots=True)
class EvictionResult:
    manifests_removed: int = 0
    blobs_removed: int = 0
    bytes_freed: int = 0
    stored_bytes_after: int = 0
    #: Blobs whose last manifest went but which were too young to remove with it,
    #: with their identity at the scan: see ``retired`` in :func:`plan_lru`.
    retired: dict[str, Identity] = field(default_factory=dict)


def plan_lru(
    snap: Snapshot,
    target_bytes: int,
    *,
    orphan_grace_ns: int,
    now_ns: int | None = None,
    retired: dict[str, Identity] | None = None,
) -> EvictionPlan:
    """Plan removals until the stored bytes would be at most ``target_bytes``.

    ``retired`` holds blobs an earlier pass of the same evictor left behind when it
    removed their last manifest (too young to tell from a blob a writer had just
    freshened). One that is still an orphan now, untouched since (same identity),
    goes without waiting out the grace period: a writer deduplicating against it
    would have freshened it, and a writer between its blob and its manifest would
    have committed that manifest long before this second scan.
    """
    now = snap.started_ns if now_ns is None else now_ns
    plan = EvictionPlan(snap)
    total = snap.stored_bytes
    refs = snap.refs.copy()
    retired = retired or {}
    for digest in snap.orphans():
        st = snap.blobs[digest]
        if st.st_mtime_ns < now - orphan_grace_ns or retired.get(digest) == identity(st):
            plan.orphans.append(digest)
            plan.expected_freed += st.st_size
            total -= st.st_size
    # Garbage manifests cost bytes and serve nothing: they go first, whatever the target.
    broken = [m for m in snap.manifests if m.manifest is None or snap.is_dangling(m)]
    for info in broken:
        plan.manifests.append(info)
        plan.expected_freed += info.stat.st_size
        total -= info.stat.st_size
    if total <= target_bytes:
        return plan
    live = sorted(
        (m for m in snap.manifests if m.manifest is not None and not snap.is_dangling(m)),
        key=lambda m: m.stat.st_mtime_ns,
    )
    for info in live:
        if total <= target_bytes:
            break
        assert info.manifest is not None
        plan.manifests.append(info)
        plan.expected_freed += info.stat.st_size
        total -= info.stat.st_size
        digest = info.manifest.digest
        refs[digest] -= 1
        if refs[digest] == 0:
            size = snap.blobs[digest].st_size
            plan.expected_freed += size
            plan.expected_blobs += 1
            total -= size
    return plan


def execute_plan(plan: EvictionPlan, index: Index, blobs: BlobStore, *, budget: int | None = None) -> EvictionResult:
    """Carry a plan out (or its next ``budget`` steps), tolerating files that changed or vanished.

    A step is one orphan blob, or one manifest with its blob when it was the last
    to name it. Orphans go first (they hold space and serve nobody), then
    manifests, each before its blob. A plan carried out in steps remembers where
    it is; every removal re-checks the file, so a step taken later still keeps
    whatever was used, rewritten or freshened since the scan.
    """
    snap = plan.snapshot
    result = EvictionResult()
    if plan.refs_left is None:
        plan.refs_left = snap.refs.copy()
    refs = plan.refs_left
    cutoff = snap.cutoff_ns
    steps = 0
    while plan.done_orphans < len(plan.orphans) and (budget is None or steps < budget):
        digest = plan.orphans[plan.done_orphans]
        plan.done_orphans += 1
        steps += 1
        # Only if untouched since the scan (the plan judged it by that mtime): a
        # writer may have freshened it since.
        freed = blobs.remove_if_older(digest, snap.blobs[digest].st_mtime_ns + 1)
        if freed:
            result.blobs_removed += 1
            result.bytes_freed += freed
    while plan.done_manifests < len(plan.manifests) and (budget is None or steps < budget):
        info = plan.manifests[plan.done_manifests]
        plan.done_manifests += 1
        steps += 1
        if not index.remove_if_unchanged(info.key_id, info.stat):
            continue  # used, rewritten or removed since the scan: keep whatever is there now
        result.manifests_removed += 1
        result.bytes_freed += info.stat.st_size
        if info.manifest is None:
            continue
        digest = info.manifest.digest
        refs[digest] -= 1
        if refs[digest] == 0 and digest in snap.blobs:
            # Only the mtime decides: a blob freshened by a deduplicating writer is
            # indistinguishable from one written just before the scan, so both stay
            # (the latter retired, for the next pass to take if still untouched).
            freed = blobs.remove_if_older(digest, cutoff)
            if freed:
                result.blobs_removed += 1
                result.bytes_freed += freed
            else:
                result.retired[digest] = identity(snap.blobs[digest])
    plan.freed_so_far += result.bytes_freed
    result.stored_bytes_after = max(0, snap.stored_bytes - plan.freed_so_far)
    return result
