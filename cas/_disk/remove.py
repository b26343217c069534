"""The remover: every file the cache removes goes through here, under one rule set.

Cap eviction, ``clear`` and ``gc`` hand a :class:`RemovalPlan` to :meth:`Remover.execute`;
``delete`` and the read path use the single-file methods. The rules:

- A manifest goes only if it is still the file the scan saw (same identity).
- Manifests go before blobs. A blob goes with its last manifest only if nobody wrote or
  freshened it since the scan began (a deduplicating writer keeps it; its re-check after
  committing its manifest covers the rest). A younger one is *retired*: the next pass
  takes it if still untouched.
- On a shared store a blob whose last manifest goes is freshened instead (a node may be
  about to open it), and waits out the grace period as an orphan.
- An orphan is planned only past its grace period (a writer stores its blob before its
  manifest), when retired, or when :meth:`Remover.retire` marked it; it goes only if
  unchanged since the scan.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field

from .files import FileId, file_id, is_sharing_violation, same_file, trusted_mtime_ns, with_sharing_retry
from .layout import Layout, stale_temp_files
from .scan import ManifestInfo, Snapshot

__all__ = ["RemovalPlan", "RemovalResult", "Remover", "removable_orphans"]


@dataclass(slots=True)
class RemovalPlan:
    """What to remove, in order; carried out by :meth:`Remover.execute`, at once or in steps."""

    snapshot: Snapshot
    manifests: list[ManifestInfo] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    #: A shared store: blobs whose last manifest goes are freshened, not removed.
    shared: bool = False
    #: False when some manifest could not be read: no blob is provably unreferenced.
    blobs_removable: bool = True
    #: Blobs never to remove here (gc quarantines corrupt ones instead).
    keep_blobs: frozenset[str] = frozenset()
    # Progress, for a plan carried out in steps.
    done_orphans: int = 0
    done_manifests: int = 0
    refs_left: Counter[str] | None = None
    freed_so_far: int = 0

    @property
    def finished(self) -> bool:
        return self.done_orphans >= len(self.orphans) and self.done_manifests >= len(self.manifests)

    def expected(self) -> tuple[int, list[str]]:
        """Bytes this plan frees if nothing changes meanwhile, and the blobs that go with their last manifest."""
        snap = self.snapshot
        freed = sum(snap.blobs[d].st_size for d in self.orphans)
        refs = snap.refs.copy()
        last: list[str] = []
        for info in self.manifests:
            freed += info.stat.st_size
            digest = self.last_named(refs, info)
            if digest is not None:
                last.append(digest)
                if not self.shared:
                    freed += snap.blobs[digest].st_size
        return freed, last

    def last_named(self, refs: Counter[str], info: ManifestInfo) -> str | None:
        """The blob that ``info``'s manifest, counted off ``refs`` as it goes, was the last to name, if it may go."""
        if info.manifest is None:
            return None
        digest = info.manifest.digest
        refs[digest] -= 1
        if refs[digest] or not self.blobs_removable or digest not in self.snapshot.blobs or digest in self.keep_blobs:
            return None
        return digest


@dataclass(slots=True)
class RemovalResult:
    manifests_removed: int = 0
    blobs_removed: int = 0
    bytes_freed: int = 0
    #: Planned but kept: changed or gone since the scan.
    kept_changed: int = 0
    #: Shared stores: blobs whose last manifest went, freshened to wait out the grace period.
    blobs_deferred: int = 0
    #: Blobs too young to remove with their last manifest, with their identity at the scan.
    retired: dict[str, FileId] = field(default_factory=dict)
    stored_bytes_after: int = 0
    steps: int = 0

    def add(self, other: RemovalResult) -> None:
        self.manifests_removed += other.manifests_removed
        self.blobs_removed += other.blobs_removed
        self.bytes_freed += other.bytes_freed
        self.kept_changed += other.kept_changed
        self.blobs_deferred += other.blobs_deferred
        self.retired.update(other.retired)
        self.stored_bytes_after = other.stored_bytes_after
        self.steps += other.steps


def removable_orphans(snap: Snapshot, grace_ns: int, retired: dict[str, FileId] | None = None) -> list[str]:
    """Orphans of ``snap`` that may go: past their grace period (a retire mark is 0), or retired and untouched."""
    cutoff = snap.started_ns - grace_ns
    retired = retired or {}
    blobs = snap.blobs
    return [d for d in snap.orphans() if snap.mtime_ns(blobs[d]) < cutoff or retired.get(d) == file_id(blobs[d])]


class Remover:
    """Removes the files of one cache root."""

    def __init__(self, lay: Layout) -> None:
        self.lay = lay

    def file(self, path: str) -> bool:
        """Unlink one file of the root by its path; True if this call did."""
        try:
            with_sharing_retry(lambda: os.unlink(path))
        except FileNotFoundError:
            return False
        except PermissionError as exc:
            if is_sharing_violation(exc):
                return False
            raise
        return True

    def manifest(self, kid: str, st: os.stat_result | None = None) -> bool:
        """Unlink the manifest of ``kid``; with ``st``, only if it is still that file. True if this call removed it.

        The window between the check and the unlink is microseconds: at worst a fresh entry
        is lost and recompiled, never a wrong one returned.
        """
        path = self.lay.manifest_path(kid)
        if st is not None and not same_file(path, file_id(st)):
            return False
        return self.file(path)

    def blob(self, digest: str, *, cutoff_ns: int = 0, seen: FileId | None = None) -> int:
        """Unlink a blob if its mtime is below ``cutoff_ns``, or it is still ``seen``; the bytes freed."""
        path = self.lay.blob_path(digest)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return 0
        # A time more than a day past the scan's clock is no freshen since the scan: a wrong clock's.
        if trusted_mtime_ns(st.st_mtime_ns, cutoff_ns) >= cutoff_ns and (seen is None or file_id(st) != seen):
            return 0
        return st.st_size if self.file(path) else 0

    def retire(self, digest: str) -> None:
        """Mark a blob whose last key may just have gone with mtime 0: an old orphan, if it is one."""
        try:
            os.utime(self.lay.blob_path(digest), ns=(0, 0))
        except OSError:
            pass

    def quarantine(self, digest: str, st: os.stat_result | None = None) -> str | None:
        """Move a bad blob (with ``st``, only if still that file) into ``quarantine/``; where it went."""
        path = self.lay.blob_path(digest)
        if st is not None and not same_file(path, file_id(st)):
            return None
        os.makedirs(self.lay.quarantine, mode=0o700, exist_ok=True)
        dest = os.path.join(self.lay.quarantine, f"{digest}.{time.time_ns()}.{os.getpid()}")
        try:
            with_sharing_retry(lambda: os.replace(path, dest))
        except (FileNotFoundError, PermissionError):
            return None
        return dest

    def temp_file(self, path: str, st: os.stat_result) -> bool:
        """Remove a stale temp file if it is still the one listed."""
        if not same_file(path, file_id(st)):
            return False
        return self.file(path)

    def sweep_temp(self) -> int:
        """Remove the stale temp files of ``tmp/``, best effort; how many went."""
        removed = 0
        for path, st in stale_temp_files(self.lay.tmp):
            try:
                removed += self.temp_file(path, st)
            except OSError:
                continue
        return removed

    def execute(self, plan: RemovalPlan, *, budget: int | None = None, until_freed: int | None = None) -> RemovalResult:
        """Carry a plan out, or its next steps, tolerating files that changed or vanished.

        A step is one orphan, or one manifest with its blob when it was the last to name it;
        orphans go first. Stops after ``budget`` steps or once ``until_freed`` bytes went
        (both None: the whole plan). ``OSError`` for what stops removal altogether.
        """
        snap = plan.snapshot
        result = RemovalResult()
        if plan.refs_left is None:
            plan.refs_left = snap.refs.copy()
        refs = plan.refs_left
        steps = 0

        def more() -> bool:
            if until_freed is not None and result.bytes_freed >= until_freed:
                return False
            return budget is None or steps < budget

        while plan.done_orphans < len(plan.orphans) and more():
            digest = plan.orphans[plan.done_orphans]
            plan.done_orphans += 1
            steps += 1
            freed = self.blob(digest, seen=file_id(snap.blobs[digest]))
            if freed:
                result.blobs_removed += 1
                result.bytes_freed += freed
            else:
                result.kept_changed += 1
        while plan.done_manifests < len(plan.manifests) and more():
            info = plan.manifests[plan.done_manifests]
            plan.done_manifests += 1
            steps += 1
            if not self.manifest(info.key_id, info.stat):
                result.kept_changed += 1
                continue
            result.manifests_removed += 1
            result.bytes_freed += info.stat.st_size
            last = plan.last_named(refs, info)
            if last is None:
                continue
            if plan.shared:
                try:
                    os.utime(self.lay.blob_path(last))
                    result.blobs_deferred += 1
                except OSError:
                    pass
                continue
            freed = self.blob(last, cutoff_ns=snap.cutoff_ns)
            if freed:
                result.blobs_removed += 1
                result.bytes_freed += freed
            elif os.path.lexists(self.lay.blob_path(last)):
                result.retired[last] = file_id(snap.blobs[last])
        plan.freed_so_far += result.bytes_freed
        result.steps = steps
        result.stored_bytes_after = max(0, snap.stored_bytes - plan.freed_so_far)
        return result
