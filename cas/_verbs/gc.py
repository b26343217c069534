"""The garbage collector: scan, plan, then execute (or only report the plan).

What goes, in order: stale temp files (older than an hour); invalid, dangling and
size-mismatched manifests (with ``verify``, also those of blobs that fail their hash) and
their group partners (a front-door record goes with its results); with ``max_age_s``
entries unused for longer; with ``max_size`` least recently used entries until the stored
bytes fit; blobs whose last manifest went, unless written or freshened after the scan
began; orphan blobs older than ``grace_s``; with ``verify``, corrupt blobs, moved to
``quarantine/``.

Manifests go before blobs, and every removal re-checks that the file is still the one the
scan saw, so entries written, replaced or used meanwhile are kept. One collector at a
time: the cache's ``evict.lock`` (shared with size-cap eviction) is taken without blocking.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import Counter
from dataclasses import dataclass, field

from cuda_program_cas._base.errors import CollectorBusyError
from cuda_program_cas._base.events import collected
from cuda_program_cas._disk.blobs import BlobState, BlobStore
from cuda_program_cas._disk.classify import Condition, classify
from cuda_program_cas._disk.layout import is_shared_store, stale_temp_files
from cuda_program_cas._disk.remove import RemovalPlan, Remover, removable_orphans
from cuda_program_cas._disk.scan import ManifestInfo, Snapshot, take_snapshot
from cuda_program_cas._local.cap import plan_lru
from cuda_program_cas._local.touch import apply_pending
from cuda_program_cas.index import lru_units, partners_of

from .common import SHARED_MIN_GRACE_S, MaintainedCache, ProgressFn, Report, check_blobs, not_created, open_cache
from .packs import collect_packs

__all__ = ["CATEGORIES", "SHARED_MIN_GRACE_S", "GcReport", "collect", "collected_as_shared"]

#: Categories of the plan, in the order they are reported.
CATEGORIES = (
    "invalid_manifests",
    "misplaced_manifests",
    "dangling_manifests",
    "size_mismatch_manifests",
    "corrupt_blob_manifests",
    "partner_entries",
    "expired_entries",
    "evicted_entries",
    "unreferenced_blobs",
    "orphan_blobs",
    "corrupt_blobs",
    "temp_files",
)
_CATEGORY_OF = {
    Condition.INVALID: "invalid_manifests",
    Condition.MISPLACED: "misplaced_manifests",
    Condition.DANGLING: "dangling_manifests",
    Condition.SIZE_MISMATCH: "size_mismatch_manifests",
    Condition.CORRUPT_BLOB: "corrupt_blob_manifests",
}


@dataclass(slots=True)
class GcReport(Report):
    """What a collection found and did (``dry_run``: what it would do).

    ``*_before``: the cache as the scan saw it; ``*_after`` subtract what this run removed.
    Bytes are stored bytes as the size cap counts them: unique blobs plus manifests.
    """

    root: str
    dry_run: bool
    shared: bool = False
    #: False where no cache has been created yet.
    exists: bool = True
    started_ns: int = 0
    elapsed_s: float = 0.0
    entries_before: int = 0
    blobs_before: int = 0
    bytes_before: int = 0
    entries_removed: int = 0
    blobs_removed: int = 0
    bytes_freed: int = 0
    temp_files_removed: int = 0
    temp_bytes_freed: int = 0
    #: Chosen by the plan but kept because it changed (used, rewritten, freshened) meanwhile.
    kept_changed: int = 0
    #: Shared stores: blobs whose last entry went, kept (freshened) to wait out the grace period.
    blobs_deferred: int = 0
    #: category -> {"count", "bytes"} as planned (see ``CATEGORIES``).
    plan: dict[str, dict[str, int]] = field(default_factory=dict)
    #: The store's packs: retired packs and covered loose entries removed, packed entries dropped.
    packs: dict[str, object] = field(default_factory=dict)
    entries_after: int = 0
    blobs_after: int = 0
    bytes_after: int = 0


def collected_as_shared(root: str | os.PathLike[str], shared: bool | None = None) -> bool:
    """Whether :func:`collect` collects ``root`` as a shared store (``shared`` None: as its ``layout.json`` says)."""
    if not_created(root):
        return bool(shared)
    cache = open_cache(root, write=False, allow_damaged=True)
    return is_shared_store(cache.lay.root) if shared is None else shared


@dataclass(slots=True)
class _Plan:
    removal: RemovalPlan
    categories: dict[str, list[ManifestInfo]] = field(default_factory=dict)
    #: digest -> stat of blobs that failed their hash.
    corrupt: dict[str, os.stat_result] = field(default_factory=dict)
    temp_files: list[tuple[str, os.stat_result]] = field(default_factory=list)
    #: Blobs expected to go (or, on a shared store, wait) with their last manifest.
    unreferenced: list[str] = field(default_factory=list)


def collect(
    root: str | os.PathLike[str],
    *,
    grace_s: float = 3600.0,
    max_size: int | None = None,
    max_age_s: float | None = None,
    verify: bool = False,
    dry_run: bool = False,
    progress: ProgressFn | None = None,
    wait_s: float = 0.0,
    shared: bool | None = None,
) -> GcReport:
    """Collect garbage in the cache at ``root`` and report what went.

    ``shared`` (default: as its ``layout.json`` says): the grace period must be at least
    :data:`SHARED_MIN_GRACE_S`, and a blob whose last manifest goes is freshened instead, to
    wait out a grace period as an orphan: a node that read the manifest just before still
    finds it. ``wait_s``: how long to wait for a busy lock, else :class:`CollectorBusyError`.
    """
    if grace_s < 0 or (max_age_s is not None and max_age_s < 0):
        raise ValueError(f"grace_s and max_age_s must not be negative, got {grace_s!r}, {max_age_s!r}")
    if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 0):
        raise ValueError(f"max_size must be a non-negative int or None, got {max_size!r}")
    t0 = time.monotonic()
    if not_created(root):  # an empty cache, as stats reports it: nothing to collect, nothing created
        report = GcReport(os.path.abspath(os.fspath(root)), dry_run, shared=bool(shared), exists=False)
        report.plan = {name: {"count": 0, "bytes": 0} for name in CATEGORIES}
        return report
    cache = open_cache(root, write=not dry_run, purpose="collect garbage")
    lay = cache.lay
    if shared is None:
        shared = is_shared_store(lay.root)
    if shared and grace_s < SHARED_MIN_GRACE_S:
        raise ValueError(
            f"{lay.root!r} is collected as a shared store: its grace period must be at least "
            f"{SHARED_MIN_GRACE_S:.0f} s (nodes may be reading what goes), got {grace_s:g} s"
        )
    report = GcReport(lay.root, dry_run, shared=shared)
    # A dry run writes nothing, not even the lock file.
    with contextlib.nullcontext(True) if dry_run else lay.collector_lock(wait_s) as held:
        if not held:
            raise CollectorBusyError(
                f"cache {lay.root!r} is busy: another gc or a size-cap eviction holds {lay.lock}; nothing was changed"
                + ("" if wait_s else " (wait for it with --wait SECONDS)")
            )
        if progress:
            progress("scanning", 0, 0)
        # Packs first: loose entries a pack has held for a grace period go, their blobs freshened
        # so that they wait out a grace period of their own as orphans.
        remover = None if dry_run else cache.remover
        packed = collect_packs(lay, remover, grace_s=grace_s, max_age_s=max_age_s, max_size=max_size)
        report.packs = {k: v for k, v in dataclasses.asdict(packed).items() if k != "problems"}
        for text in packed.problems:
            report.problem(text)
        if not dry_run:
            apply_pending()  # what this process read counts (a dry run writes nothing, touches neither)
        snap = take_snapshot(lay.index, lay.blobs, clock_dir=None if dry_run else lay.tmp)
        report.started_ns = snap.started_ns
        report.entries_before = len(snap.manifests)
        report.blobs_before = len(snap.blobs)
        report.bytes_before = snap.stored_bytes
        plan = _make_plan(
            snap, report, cache, progress, grace_s=grace_s, max_size=max_size, max_age_s=max_age_s, verify=verify
        )
        _fill_plan_summary(plan, report)
        if remover is None:
            freed, _ = plan.removal.expected()
            report.entries_removed = len(plan.removal.manifests)
            report.blobs_deferred = len(plan.unreferenced) if shared else 0
            orphans = len(plan.removal.orphans) + len(plan.corrupt)
            report.blobs_removed = len(plan.unreferenced) - report.blobs_deferred + orphans
            report.bytes_freed = freed + sum(st.st_size for st in plan.corrupt.values())
            report.temp_files_removed = len(plan.temp_files)
            report.temp_bytes_freed = report.plan["temp_files"]["bytes"]
        else:
            if progress:
                progress("removing", 0, 0)
            _execute(plan, report, remover, cache.blobs)
    report.elapsed_s = time.monotonic() - t0
    report.entries_after = report.entries_before - report.entries_removed
    report.blobs_after = report.blobs_before - report.blobs_removed
    report.bytes_after = max(0, report.bytes_before - report.bytes_freed)
    entries, blobs, freed = report.entries_removed, report.blobs_removed, report.bytes_freed
    collected(report.root, dry_run=dry_run, entries=entries, blobs=blobs, freed=freed, elapsed_s=report.elapsed_s)
    return report


def _make_plan(
    snap: Snapshot,
    report: GcReport,
    cache: MaintainedCache,
    progress: ProgressFn | None,
    *,
    grace_s: float,
    max_size: int | None,
    max_age_s: float | None,
    verify: bool,
) -> _Plan:
    lay, blobs = cache.lay, cache.blobs
    removal = RemovalPlan(snap, shared=report.shared)
    plan = _Plan(removal)
    plan.temp_files = stale_temp_files(lay.tmp)
    for path in snap.unreadable:
        report.problem(f"manifest {path} cannot be read; its blob is unknown, so no blob was removed")
    if snap.unreadable:
        removal.blobs_removable = False
    if verify:
        for digest, check in check_blobs(snap, blobs, progress).items():
            if check.state is BlobState.CORRUPT:
                assert check.stat is not None
                plan.corrupt[digest] = check.stat
            elif check.state is BlobState.UNREADABLE:
                report.problem(f"blob {blobs.path_for(digest)} cannot be read: {check.detail}")
    removal.keep_blobs = frozenset(plan.corrupt)

    groups: dict[str, list[ManifestInfo]] = {name: [] for name in CATEGORIES[:8]}
    live: list[ManifestInfo] = []
    for info in snap.manifests:
        condition = classify(info, snap, plan.corrupt)
        if condition.bad:
            groups[_CATEGORY_OF[condition]].append(info)
        else:
            live.append(info)
    # A front-door record and its results are one unit (see cuda_program_cas.index): the partners
    # of a bad one go with it, and a unit expires when its latest member does.
    bad = [m for name in CATEGORIES[:5] for m in groups[name]]
    groups["partner_entries"] = partners = partners_of(bad, live)
    if partners:
        going = {m.key_id for m in partners}
        live = [m for m in live if m.key_id not in going]
    if max_age_s is not None:
        expire_before = snap.started_ns - int(max_age_s * 1e9)

        def used(info: ManifestInfo) -> int:
            return snap.mtime_ns(info.stat)  # a time from a wrong clock, a day or more ahead, counts as 0

        for unit in lru_units(live, used):
            if max(map(used, unit)) < expire_before:
                groups["expired_entries"].extend(unit)
        expired = {m.key_id for m in groups["expired_entries"]}
        live = [m for m in live if m.key_id not in expired]

    refs: Counter[str] = Counter()
    for info in live:
        assert info.manifest is not None
        refs[info.manifest.digest] += 1
    kept_blobs = {d: st for d, st in snap.blobs.items() if d not in plan.corrupt}
    if removal.blobs_removable:
        removal.orphans = [d for d in removable_orphans(snap, int(grace_s * 1e9)) if d not in plan.corrupt]
        for digest in removal.orphans:
            kept_blobs.pop(digest)
    if max_size is not None:
        # Entries written after the scan began belong to this run's writers: never chosen.
        protect = {m.key_id for m in live if snap.mtime_ns(m.stat) >= snap.cutoff_ns}
        for digest in [d for d in kept_blobs if refs[d] == 0 and snap.refs[d]]:
            kept_blobs.pop(digest)  # named only by manifests that go anyway
        rest = Snapshot(snap.started_ns, live, kept_blobs, refs, cutoff_ns=snap.cutoff_ns, framed=snap.framed)
        grace_ns = int(grace_s * 1e9) if removal.blobs_removable else 1 << 62
        lru = plan_lru(rest, max_size, orphan_grace_ns=grace_ns, protect=protect)
        groups["evicted_entries"] = [m for m in lru.manifests if m.manifest is not None]

    plan.categories = {k: v for k, v in groups.items() if v}
    removal.manifests = [m for name in CATEGORIES if name in plan.categories for m in plan.categories[name]]
    _, plan.unreferenced = removal.expected()
    return plan


def _fill_plan_summary(plan: _Plan, report: GcReport) -> None:
    blobs = plan.removal.snapshot.blobs
    for name in CATEGORIES:
        items = plan.categories.get(name, [])
        report.plan[name] = {"count": len(items), "bytes": sum(m.stat.st_size for m in items)}
    for name, digests in (("unreferenced_blobs", plan.unreferenced), ("orphan_blobs", plan.removal.orphans)):
        report.plan[name] = {"count": len(digests), "bytes": sum(blobs[d].st_size for d in digests)}
    report.plan["corrupt_blobs"] = {"count": len(plan.corrupt), "bytes": sum(s.st_size for s in plan.corrupt.values())}
    report.plan["temp_files"] = {"count": len(plan.temp_files), "bytes": sum(s.st_size for _, s in plan.temp_files)}


def _execute(plan: _Plan, report: GcReport, remover: Remover, blobs: BlobStore) -> None:
    for path, st in plan.temp_files:
        try:
            if not remover.temp_file(path, st):
                continue
        except OSError as exc:
            report.problem(f"temp file {path} cannot be removed: {exc.strerror}")
            continue
        report.temp_files_removed += 1
        report.temp_bytes_freed += st.st_size
    try:
        result = remover.execute(plan.removal)
    except OSError as exc:
        report.problem(f"stopped removing files: {exc}")
        return
    report.entries_removed += result.manifests_removed
    report.blobs_removed += result.blobs_removed
    report.bytes_freed += result.bytes_freed
    report.blobs_deferred += result.blobs_deferred
    report.kept_changed += result.kept_changed + len(result.retired)

    for digest, st in plan.corrupt.items():
        where = remover.quarantine(digest, st)
        if where is None:
            # Changed since it was hashed (a writer stored good bytes) or gone: check again.
            check = blobs.check(digest)
            if check.state is BlobState.CORRUPT and check.stat is not None:
                where = remover.quarantine(digest, check.stat)
            elif check.state in (BlobState.OK, BlobState.MISSING):
                report.kept_changed += check.state is BlobState.OK
                continue
        if where is None:
            report.problem(f"corrupt blob {blobs.path_for(digest)} could not be moved to quarantine")
            continue
        report.blobs_removed += 1
        report.bytes_freed += os.stat(where).st_size
