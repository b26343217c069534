"""Check every manifest and blob of a cache; with ``repair``, fix what can be fixed.

Problems found: a damaged ``layout.json``, manifests that are not valid (empty,
truncated, garbled), that name a missing blob or a blob of another size, blobs
whose bytes do not hash to their name, stale temp files, files that cannot be
read, and stray files where only cache files belong. Repair moves bad blobs to
``quarantine/``, removes bad manifests (only if still the file that was checked)
and stale temp files, and rewrites a damaged ``layout.json``. Stray and
unreadable files are reported, never touched. Without ``repair`` nothing is
written: a read-only cache or mount can be verified.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from index import Index

from ._blobs import BlobStore
from ._errors import CacheError, CorruptBlobError, LayoutError, ReadOnlyCacheError
from ._layout import Layout, check_layout, create_layout, stale_temp_files
from ._scan import Snapshot, take_snapshot

__all__ = ["Problem", "VerifyReport", "check_blob", "open_cache", "verify"]

#: ``progress(phase, done, total)``: called now and then during long runs.
ProgressFn = Callable[[str, int, int], None]

#: Temp files older than this belong to a crashed writer.
_SHARD_RE = re.compile(r"[0-9a-f]{2}")
_REST_RE = re.compile(r"[0-9a-f]{62}")


def open_cache(
    root: str | os.PathLike[str], *, write: bool, allow_damaged: bool = False, purpose: str = "maintain"
) -> tuple[Layout, Index, BlobStore]:
    """The layout, index and blob store of an existing cache, for maintenance.

    Never creates anything. Raises :class:`LayoutError` for a path that is missing,
    a file, foreign, newer or (unless ``allow_damaged``) has a damaged
    ``layout.json``; :class:`ReadOnlyCacheError` when ``write`` is asked of a cache
    that cannot be written (read-only mount, permissions).
    """
    path = os.path.abspath(os.fspath(root))
    state = check_layout(path)
    if state == "missing":
        if not os.path.isdir(path):
            raise LayoutError(f"no cache at {path!r}: no such directory")
        raise LayoutError(f"no cache at {path!r}: the directory holds no layout.json")
    if state == "damaged" and not allow_damaged:
        raise CacheError(
            f"cache at {path!r} has a damaged layout.json; repair it with `cuda-program-cas verify --repair`"
        )
    lay = Layout(path)
    if write:
        check_writable(lay, purpose)
    tmp = lay.tmp if write else None
    return lay, Index(lay.index, tmp), BlobStore(lay.blobs, tmp, lay.quarantine)


def check_writable(lay: Layout, purpose: str) -> None:
    """Raise :class:`ReadOnlyCacheError` when the cache's directories cannot be written."""
    for directory in (lay.root, lay.index, lay.blobs):
        if os.path.isdir(directory) and not os.access(directory, os.W_OK):
            why = "permission denied"
            try:
                if os.statvfs(directory).f_flag & os.ST_RDONLY:
                    why = "read-only filesystem"
            except (OSError, AttributeError):
                pass
            raise ReadOnlyCacheError(f"cannot {purpose}: cache {lay.root!r} is read-only ({why}: {directory})")


def check_blob(blobs: BlobStore, digest: str) -> tuple[str, os.stat_result | None, str]:
    """Read and hash one blob: ``("ok" | "bad" | "missing" | "error", stat, detail)``."""
    try:
        _, st = blobs.read(digest)
    except FileNotFoundError:
        return "missing", None, ""
    except CorruptBlobError as exc:
        return "bad", exc.stat, f"hashes to {exc.actual}"
    except OSError as exc:
        return "error", None, f"{exc.strerror or exc}"
    return "ok", st, ""


def strays(directory: str) -> list[str]:
    """Entries under a two-level ``<2 hex>/<62 hex>`` tree that are not cache files."""
    found: list[str] = []
    try:
        with os.scandir(directory) as top:
            shards = []
            for entry in top:
                if _SHARD_RE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                    shards.append(entry.path)
                else:
                    found.append(entry.path)
    except (FileNotFoundError, NotADirectoryError):
        return found
    for shard in shards:
        try:
            with os.scandir(shard) as it:
                for entry in it:
                    if _REST_RE.fullmatch(entry.name) is None or not entry.is_file(follow_symlinks=False):
                        found.append(entry.path)
        except OSError:
            continue
    return sorted(found)


@dataclass(slots=True)
class Problem:
    """One thing wrong in the cache."""

    kind: str
    path: str
    detail: str = ""
    fixed: bool = False

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "path": self.path, "detail": self.detail, "fixed": self.fixed}


@dataclass(slots=True)
class VerifyReport:
    root: str
    repair: bool
    entries: int = 0
    blobs: int = 0
    blobs_checked: int = 0
    bytes_checked: int = 0
    orphan_blobs: int = 0
    elapsed_s: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    @property
    def unfixed(self) -> int:
        return sum(1 for p in self.problems if not p.fixed)

    def as_dict(self) -> dict[str, object]:
        return {
            "root": self.root,
            "repair": self.repair,
            "entries": self.entries,
            "blobs": self.blobs,
            "blobs_checked": self.blobs_checked,
            "bytes_checked": self.bytes_checked,
            "orphan_blobs": self.orphan_blobs,
            "elapsed_s": round(self.elapsed_s, 3),
            "problems_found": len(self.problems),
            "problems_fixed": len(self.problems) - self.unfixed,
            "problems": [p.as_dict() for p in self.problems],
        }


def verify(root: str | os.PathLike[str], *, repair: bool = False, progress: ProgressFn | None = None) -> VerifyReport:
    """Check the cache at ``root``; with ``repair``, fix what can be fixed. Never raises for a bad file."""
    t0 = time.monotonic()
    lay, index, blobs = open_cache(root, write=repair, allow_damaged=True, purpose="repair")
    report = VerifyReport(lay.root, repair)
    if check_layout(lay.root) == "damaged":
        problem = Problem("damaged_layout", os.path.join(lay.root, "layout.json"), "not a valid layout file")
        if repair:
            create_layout(lay.root)
            problem.fixed = True
        report.problems.append(problem)
    if progress:
        progress("scanning", 0, 0)
    snap = take_snapshot(index, blobs)
    report.entries = len(snap.manifests)
    report.blobs = len(snap.blobs)
    for path in snap.unreadable:
        report.problems.append(Problem("unreadable_manifest", path, "cannot be read"))
    for directory in (lay.index, lay.blobs):
        for path in strays(directory):
            report.problems.append(Problem("stray_file", path, "not a cache file; left alone"))

    bad_blobs = _check_blobs(snap, blobs, report, progress)
    for info in snap.manifests:
        path = index.path_for(info.key_id)
        m = info.manifest
        if m is None:
            problem = Problem("invalid_manifest", path, "empty, truncated or garbled")
        elif m.digest in bad_blobs:
            problem = Problem("manifest_of_corrupt_blob", path, f"names corrupt blob {m.digest}")
        elif m.digest not in snap.blobs:
            problem = Problem("dangling_manifest", path, f"blob {m.digest} is missing")
        elif snap.blobs[m.digest].st_size != m.size:
            problem = Problem(
                "size_mismatch", path, f"says {m.size} bytes, blob {m.digest} has {snap.blobs[m.digest].st_size}"
            )
        else:
            continue
        if repair:
            problem.fixed = index.remove_if_unchanged(info.key_id, info.stat) or not os.path.lexists(path)
        report.problems.append(problem)
    for digest, (st, detail) in bad_blobs.items():
        problem = Problem("corrupt_blob", blobs.path_for(digest), detail)
        if repair:
            where = blobs.quarantine(digest, st)
            problem.fixed = where is not None or not os.path.lexists(blobs.path_for(digest))
            if where:
                problem.detail += f"; moved to {where}"
        report.problems.append(problem)
    for path, _st in stale_temp_files(lay.tmp):
        problem = Problem("stale_temp_file", path, "left by a crashed writer")
        if repair:
            try:
                os.unlink(path)
                problem.fixed = True
            except FileNotFoundError:
                problem.fixed = True
            except OSError as exc:
                problem.detail += f"; cannot remove: {exc.strerror}"
        report.problems.append(problem)
    report.orphan_blobs = len(snap.orphans())
    report.elapsed_s = time.monotonic() - t0
    return report


def _check_blobs(
    snap: Snapshot, blobs: BlobStore, report: VerifyReport, progress: ProgressFn | None
) -> dict[str, tuple[os.stat_result, str]]:
    """Hash every blob; returns the bad ones (digest -> (stat, detail)) and records read errors."""
    bad: dict[str, tuple[os.stat_result, str]] = {}
    total = len(snap.blobs)
    for n, digest in enumerate(sorted(snap.blobs)):
        if progress and n % 64 == 0:
            progress("verifying blobs", n, total)
        state, st, detail = check_blob(blobs, digest)
        if state == "missing":
            continue
        if state == "error":
            report.problems.append(Problem("unreadable_blob", blobs.path_for(digest), detail))
            continue
        assert st is not None
        report.blobs_checked += 1
        report.bytes_checked += st.st_size
        if state == "bad":
            bad[digest] = (st, detail)
    if progress:
        progress("verifying blobs", total, total)
    return bad
