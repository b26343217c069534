"""The garbage collector: scan, plan, then execute (or only report the plan).

What goes, in the order it is carried out:

- stale temp files (older than an hour: a crashed writer's);
- invalid manifests (empty, truncated, garbled), dangling ones (blob missing) and
  ones whose size disagrees with their blob's; with ``verify``, the manifests of
  blobs that fail their hash;
- with ``max_age_s``, entries not used for longer than that;
- with ``max_size``, least recently used entries until the stored bytes are at
  most ``max_size`` (reference-aware: a blob goes with its last manifest);
- blobs whose last manifest this run removed, unless written or freshened after
  the scan began (a writer that just deduplicated against one keeps it);
- orphan blobs (named by no manifest at scan time) older than ``grace_s``;
- with ``verify``, blobs that fail their hash, moved to ``quarantine/``.

Manifests go before blobs; every removal re-checks that the file is still the
one the scan saw (a blob: not written or freshened since the scan began), so
entries written, replaced or used while the collector runs are kept. Manifests
written after the scan began are never chosen. One collector at a time: the
cache's ``evict.lock`` (shared with size-cap eviction) is taken without
blocking; a busy lock raises :class:`CollectorBusyError`.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field

from index import Index

from ._blobs import BlobStore
from ._errors import CacheError
from ._evict import plan_lru
from ._layout import Layout, is_shared_store, stale_temp_files
from ._report import ProblemLog
from ._scan import ManifestInfo, Snapshot, take_snapshot
from ._verify import ProgressFn, check_blob, open_cache

__all__ = ["SHARED_MIN_GRACE_S", "CollectorBusyError", "GcReport", "collect"]

#: The shortest grace period a shared store is collected with. Nodes never touch a
#: shared store, so its mtimes only say when something was published or freshened;
#: a publish keeps its blobs as orphans until its manifests land, and an NFS client
#: may serve a removed manifest from its attribute cache for ``actimeo`` seconds
#: (60 s by default) and then open the blob it names. An hour covers both widely.
SHARED_MIN_GRACE_S = 3600.0

#: Categories of the plan, in the order they are reported.
CATEGORIES = (
    "invalid_manifests",
    "dangling_manifests",
    "size_mismatch_manifests",
    "corrupt_blob_manifests",
    "expired_entries",
    "evicted_entries",
    "unreferenced_blobs",
    "orphan_blobs",
    "corrupt_blobs",
    "temp_files",
)


class CollectorBusyError(CacheError):
    """Another collector or a size-cap eviction holds the cache's lock."""


@dataclass(slots=True)
class GcReport(ProblemLog):
    """What a collection found and did (``dry_run``: what it would do).

    ``*_before`` describe the cache as the scan saw it; ``*_after`` subtract what
    this run removed (concurrent writers may have added more meanwhile). Bytes
    are stored bytes as the size cap counts them: unique blobs plus manifests.
    """

    root: str
    dry_run: bool
    #: Collected as a shared store (see :func:`collect`).
    shared: bool = False
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
    #: Problems found that this run did not fix (each one line).
    problems: list[str] = field(default_factory=list)
    problem_count: int = 0

    @property
    def entries_after(self) -> int:
        return self.entries_before - self.entries_removed

    @property
    def blobs_after(self) -> int:
        return self.blobs_before - self.blobs_removed

    @property
    def bytes_after(self) -> int:
        return max(0, self.bytes_before - self.bytes_freed)

    def as_dict(self) -> dict[str, object]:
        out = ProblemLog.as_dict(self)
        out["entries_after"] = self.entries_after
        out["blobs_after"] = self.blobs_after
        out["bytes_after"] = self.bytes_after
        return out


@dataclass(slots=True)
class _Plan:
    snapshot: Snapshot
    manifests: dict[str, list[ManifestInfo]] = field(default_factory=dict)
    orphans: list[str] = field(default_factory=list)
    #: digest -> stat of blobs that failed their hash.
    corrupt: dict[str, os.stat_result] = field(default_factory=dict)
    temp_files: list[tuple[str, os.stat_result]] = field(default_factory=list)
    #: Blobs expected to go with their last manifest.
    unreferenced: list[str] = field(default_factory=list)
    #: False when some manifest could not be read: no blob is provably unreferenced.
    blobs_removable: bool = True

    def all_manifests(self) -> list[ManifestInfo]:
        return [m for name in CATEGORIES if name in self.manifests for m in self.manifests[name]]


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

    ``shared``: collect it as a shared store that nodes read over NFS (default:
    when its ``layout.json`` says so, as ``publish`` marks it). Then the grace
    period must be at least :data:`SHARED_MIN_GRACE_S`, and a blob whose last
    manifest this run removes is not removed with it but freshened, so it waits
    out a whole grace period as an orphan: a node that read the manifest just
    before it went still finds the blob.

    ``wait_s``: how long to wait for the lock when another collector or evictor
    holds it (0: not at all; :class:`CollectorBusyError` is raised).
    Raises :class:`cas.LayoutError` for a path that is not a usable cache and
    :class:`cas.ReadOnlyCacheError` when it cannot be written (not for ``dry_run``).
    """
    if grace_s < 0 or (max_age_s is not None and max_age_s < 0):
        raise ValueError(f"grace_s and max_age_s must not be negative, got {grace_s!r}, {max_age_s!r}")
    if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 0):
        raise ValueError(f"max_size must be a non-negative int or None, got {max_size!r}")
    t0 = time.monotonic()
    lay, index, blobs = open_cache(root, write=not dry_run, purpose="collect garbage")
    if shared is None:
        shared = is_shared_store(lay.root)
    if shared and grace_s < SHARED_MIN_GRACE_S:
        raise ValueError(
            f"{lay.root!r} is a shared store: its grace period must be at least {SHARED_MIN_GRACE_S:.0f} s "
            f"(nodes may be reading what goes), got {grace_s:g} s"
        )
    report = GcReport(lay.root, dry_run, shared=shared)
    opts = _Options(grace_s, max_size, max_age_s, verify, dry_run, progress, shared)
    if dry_run:
        # Nothing is written, not even the lock file.
        _run(report, lay, index, blobs, opts)
        report.elapsed_s = time.monotonic() - t0
        return report
    import filelock

    lock = filelock.FileLock(lay.lock, timeout=wait_s)
    try:
        lock.acquire(timeout=wait_s, blocking=wait_s > 0)
    except filelock.Timeout:
        raise CollectorBusyError(
            f"cache {lay.root!r} is busy: another gc or a size-cap eviction holds {lay.lock}; nothing was changed"
            + ("" if wait_s else " (wait for it with --wait SECONDS)")
        ) from None
    try:
        _run(report, lay, index, blobs, opts)
    finally:
        lock.release()
    report.elapsed_s = time.monotonic() - t0
    return report


@dataclass(frozen=True, slots=True)
class _Options:
    grace_s: float
    max_size: int | None
    max_age_s: float | None
    verify: bool
    dry_run: bool
    progress: ProgressFn | None
    shared: bool = False


def _run(report: GcReport, lay: Layout, index: Index, blobs: BlobStore, opts: _Options) -> None:
    progress = opts.progress
    if progress:
        progress("scanning", 0, 0)
    snap = take_snapshot(index, blobs, clock_dir=None if opts.dry_run else lay.tmp)
    report.started_ns = snap.started_ns
    report.entries_before = len(snap.manifests)
    report.blobs_before = len(snap.blobs)
    report.bytes_before = snap.stored_bytes
    plan = _make_plan(snap, report, lay, blobs, opts)
    _fill_plan_summary(plan, report)
    if opts.dry_run:
        report.entries_removed = sum(len(v) for v in plan.manifests.values())
        deferred = plan.unreferenced if opts.shared else []
        report.blobs_deferred = len(deferred)
        report.blobs_removed = len(plan.unreferenced) - len(deferred) + len(plan.orphans) + len(plan.corrupt)
        report.bytes_freed = sum(v["bytes"] for k, v in report.plan.items() if k != "temp_files") - sum(
            plan.snapshot.blobs[d].st_size for d in deferred
        )
        report.temp_files_removed = len(plan.temp_files)
        report.temp_bytes_freed = report.plan["temp_files"]["bytes"]
        return
    if progress:
        progress("removing", 0, 0)
    _execute(plan, report, index, blobs, shared=opts.shared)


def _make_plan(snap: Snapshot, report: GcReport, lay: Layout, blobs: BlobStore, opts: _Options) -> _Plan:
    grace_s, max_size, max_age_s, progress = opts.grace_s, opts.max_size, opts.max_age_s, opts.progress
    plan = _Plan(snap)
    plan.temp_files = stale_temp_files(lay.tmp)
    for path in snap.unreadable:
        report.problem(f"manifest {path} cannot be read; its blob is unknown, so no blob was removed")
    if snap.unreadable:
        plan.blobs_removable = False
    if opts.verify:
        total = len(snap.blobs)
        for n, digest in enumerate(sorted(snap.blobs)):
            if progress and n % 64 == 0:
                progress("verifying blobs", n, total)
            state, st, detail = check_blob(blobs, digest)
            if state == "bad":
                assert st is not None
                plan.corrupt[digest] = st
            elif state == "error":
                report.problem(f"blob {blobs.path_for(digest)} cannot be read: {detail}")
        if progress:
            progress("verifying blobs", total, total)

    groups: dict[str, list[ManifestInfo]] = {name: [] for name in CATEGORIES[:6]}
    live: list[ManifestInfo] = []
    for info in snap.manifests:
        m = info.manifest
        if m is None:
            groups["invalid_manifests"].append(info)
        elif m.digest not in snap.blobs:
            groups["dangling_manifests"].append(info)
        elif snap.blobs[m.digest].st_size != m.size:
            groups["size_mismatch_manifests"].append(info)
        elif m.digest in plan.corrupt:
            groups["corrupt_blob_manifests"].append(info)
        elif max_age_s is not None and info.stat.st_mtime_ns < snap.started_ns - int(max_age_s * 1e9):
            groups["expired_entries"].append(info)
        else:
            live.append(info)

    refs: Counter[str] = Counter()
    for info in live:
        assert info.manifest is not None
        refs[info.manifest.digest] += 1
    orphan_cutoff = snap.started_ns - int(grace_s * 1e9)
    kept_blobs: dict[str, os.stat_result] = {}
    for digest, st in snap.blobs.items():
        if digest in plan.corrupt:
            continue
        if refs[digest] > 0:
            kept_blobs[digest] = st
        elif snap.refs[digest] == 0:
            if st.st_mtime_ns < orphan_cutoff and plan.blobs_removable:
                plan.orphans.append(digest)
            else:
                kept_blobs[digest] = st  # a young orphan: a writer may be about to commit its manifest
    if max_size is not None:
        # Entries written after the scan began belong to this run's writers: never chosen.
        protect_from = snap.cutoff_ns
        candidates = [m for m in live if m.stat.st_mtime_ns < protect_from]
        protected = sum(m.stat.st_size for m in live if m.stat.st_mtime_ns >= protect_from)
        rest = Snapshot(snap.started_ns, candidates, kept_blobs, refs, cutoff_ns=snap.cutoff_ns)
        grace_ns = int(grace_s * 1e9) if plan.blobs_removable else 1 << 62
        lru = plan_lru(rest, max(0, max_size - protected), orphan_grace_ns=grace_ns)
        groups["evicted_entries"] = [m for m in lru.manifests if m.manifest is not None]

    plan.manifests = {k: v for k, v in groups.items() if v}
    remaining = snap.refs.copy()
    for info in plan.all_manifests():
        if info.manifest is None:
            continue
        digest = info.manifest.digest
        remaining[digest] -= 1
        if remaining[digest] == 0 and digest in snap.blobs and digest not in plan.corrupt and plan.blobs_removable:
            plan.unreferenced.append(digest)
    return plan


def _fill_plan_summary(plan: _Plan, report: GcReport) -> None:
    blobs = plan.snapshot.blobs
    for name in CATEGORIES:
        if name in plan.manifests:
            items = plan.manifests[name]
            report.plan[name] = {"count": len(items), "bytes": sum(m.stat.st_size for m in items)}
        else:
            report.plan[name] = {"count": 0, "bytes": 0}
    for name, digests in (("unreferenced_blobs", plan.unreferenced), ("orphan_blobs", plan.orphans)):
        report.plan[name] = {"count": len(digests), "bytes": sum(blobs[d].st_size for d in digests)}
    report.plan["corrupt_blobs"] = {"count": len(plan.corrupt), "bytes": sum(s.st_size for s in plan.corrupt.values())}
    report.plan["temp_files"] = {"count": len(plan.temp_files), "bytes": sum(s.st_size for _, s in plan.temp_files)}


def _execute(plan: _Plan, report: GcReport, index: Index, blobs: BlobStore, *, shared: bool = False) -> None:
    snap = plan.snapshot
    for path, st in plan.temp_files:
        try:
            if os.lstat(path).st_mtime_ns != st.st_mtime_ns:
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            report.problem(f"temp file {path} cannot be removed: {exc.strerror}")
            continue
        report.temp_files_removed += 1
        report.temp_bytes_freed += st.st_size

    # Manifests first, each only if still the file the scan saw (used, rewritten
    # or removed since: kept). A blob goes when its last manifest went, only if
    # not written or freshened since the scan began: a writer that deduplicated
    # against it may have committed a manifest the scan did not see. The scan
    # stats blobs after manifests, so a blob whose scan stat is already newer than
    # the cutoff gets no exemption. Orphans go only if unchanged since the scan.
    cutoff = snap.cutoff_ns
    refs = snap.refs.copy()
    expected = 0
    try:
        for info in plan.all_manifests():
            if not index.remove_if_unchanged(info.key_id, info.stat):
                report.kept_changed += 1
                continue
            report.entries_removed += 1
            report.bytes_freed += info.stat.st_size
            if info.manifest is None:
                continue
            digest = info.manifest.digest
            refs[digest] -= 1
            if refs[digest] or not plan.blobs_removable or digest not in snap.blobs or digest in plan.corrupt:
                continue
            if shared:
                # A node may have read this manifest a moment ago and be about to
                # read the blob: restart its grace period instead.
                if blobs.freshen(blobs.path_for(digest), snap.blobs[digest].st_size):
                    report.blobs_deferred += 1
                continue
            expected += 1
            freed = blobs.remove_if_older(digest, cutoff)
            if freed:
                report.blobs_removed += 1
                report.bytes_freed += freed
        for digest in plan.orphans:
            expected += 1
            freed = blobs.remove_if_older(digest, snap.blobs[digest].st_mtime_ns + 1)
            if freed:
                report.blobs_removed += 1
                report.bytes_freed += freed
    except OSError as exc:
        report.problem(f"stopped removing files: {exc}")
        return
    report.kept_changed += expected - report.blobs_removed

    for digest, st in plan.corrupt.items():
        where = blobs.quarantine(digest, st)
        if where is None:
            # Changed since it was hashed (a writer stored good bytes) or gone: check again.
            state, st2, _ = check_blob(blobs, digest)
            if state == "bad" and st2 is not None:
                where = blobs.quarantine(digest, st2)
            elif state in ("ok", "missing"):
                report.kept_changed += state == "ok"
                continue
        if where is None:
            report.problem(f"corrupt blob {blobs.path_for(digest)} could not be moved to quarantine")
            continue
        report.blobs_removed += 1
        report.bytes_freed += os.stat(where).st_size
