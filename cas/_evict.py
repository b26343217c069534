"""Reference-aware LRU eviction planning: which manifests and blobs to remove to reach a size.

Least recently used manifests go first (recency is the manifest's mtime, which a
hit refreshes, or this process's own later reads). A front-door record and its
results go together (:mod:`cas._groups`). A blob goes only when the last
manifest naming it goes. Garbage manifests and removable orphans go before any
live entry. Carrying the plan out is :meth:`cas._remove.Remover.execute`'s.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

from ._classify import Condition, classify
from ._files import FileId
from ._groups import lru_units, partners_of
from ._remove import RemovalPlan, removable_orphans
from ._scan import ManifestInfo, Snapshot

__all__ = ["plan_lru"]


def plan_lru(
    snap: Snapshot,
    target_bytes: int,
    *,
    cap_bytes: int | None = None,
    orphan_grace_ns: int,
    retired: dict[str, FileId] | None = None,
    protect: Container[str] = (),
    recency: Mapping[str, int] | None = None,
) -> RemovalPlan:
    """Plan removals until the stored bytes would be at most ``target_bytes``.

    ``cap_bytes``: when removing garbage and removable orphans alone brings the
    cache under this, no live entry is chosen (the low watermark below the cap
    amortises scans; it is no reason to evict what is in use).

    ``retired``: blobs an earlier pass left behind when it removed their last
    manifest (see :func:`cas._remove.removable_orphans`). ``protect``: key ids
    never chosen (the entry a write has just stored). ``recency``: key id -> the
    time (ns) this process last read it, where that is later than the
    manifest's mtime (a hit touches the manifest at most once a second).
    """
    plan = RemovalPlan(snap)
    total = snap.stored_bytes
    plan.orphans = removable_orphans(snap, orphan_grace_ns, retired)
    total -= sum(snap.blobs[d].st_size for d in plan.orphans)
    live = []
    for info in snap.manifests:
        if classify(info, snap) is Condition.OK:
            live.append(info)
        else:
            # Garbage costs bytes and serves nothing: it goes first, whatever the target.
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
        if refs[digest] == 0:
            total -= snap.blobs[digest].st_size

    # A live record or result whose partner is garbage serves nothing either (see cas._groups).
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
