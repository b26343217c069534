"""Check every manifest and blob of a cache; with ``repair``, fix what can be fixed.

Problems found: a damaged ``layout.json``; manifests invalid, dangling or of the wrong size
(judged by :func:`cuda_program_cas._disk.classify.classify`, as ``gc`` and ``stats`` judge
them); blobs that fail their hash; stale temp files; unreadable files; stray files. Repair
moves bad blobs to ``quarantine/``, removes bad manifests (only if still the file that was
checked) and stale temp files, and rewrites a damaged ``layout.json``. Stray and unreadable
files are never touched. Without ``repair`` nothing is written.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from dataclasses import dataclass
from typing import ClassVar

from cuda_program_cas._disk.blobs import BlobState
from cuda_program_cas._disk.classify import classify, describe
from cuda_program_cas._disk.files import READ_FLAGS
from cuda_program_cas._disk.layout import LAYOUT_FILE, LayoutState, create_layout, mark_shared_store, stale_temp_files
from cuda_program_cas._disk.scan import take_snapshot
from cuda_program_cas.index import is_hex

from .common import ProgressFn, Report, check_blobs, not_created, open_cache
from .packs import pack_stats, verify_packs

__all__ = ["Problem", "VerifyReport", "verify"]

#: The shared mark as ``layout.json`` spells it, found in what is left of a damaged one.
_SHARED_RE = re.compile(rb'"shared"\s*:\s*(true|false)')


def said_shared(path: str) -> bool | None:
    """What a damaged ``layout.json`` still says of the shared mark: True, False, or None (nothing).

    Its first 4 KiB, read without following a symlink or blocking on a FIFO.
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        raw = b""
    finally:
        os.close(fd)
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        data = None
    if isinstance(data, dict) and isinstance(data.get("shared"), bool):
        return bool(data["shared"])
    found = _SHARED_RE.search(raw)
    return None if found is None else found.group(1) == b"true"


def strays(directory: str) -> list[str]:
    """Entries under a two-level ``<2 hex>/<62 hex>`` tree that are not cache files."""
    found: list[str] = []
    try:
        with os.scandir(directory) as top:
            shards = []
            for entry in top:
                if is_hex(entry.name, 2) and entry.is_dir(follow_symlinks=False):
                    shards.append(entry.path)
                else:
                    found.append(entry.path)
    except (FileNotFoundError, NotADirectoryError):
        return found
    for shard in shards:
        try:
            with os.scandir(shard) as it:
                for entry in it:
                    if not is_hex(entry.name, 62) or not entry.is_file(follow_symlinks=False):
                        found.append(entry.path)
        except OSError:
            continue
    return sorted(found)


@dataclass(slots=True)
class Problem:
    kind: str
    path: str
    detail: str = ""
    fixed: bool = False


@dataclass(slots=True)
class VerifyReport(Report):
    """What a check found (a :class:`Problem` each) and, with ``repair``, fixed."""

    max_listed: ClassVar[int | None] = None

    root: str
    repair: bool
    exists: bool = True
    entries: int = 0
    blobs: int = 0
    blobs_checked: int = 0
    bytes_checked: int = 0
    orphan_blobs: int = 0
    #: The packs whose every blob was hashed too, their entries and bytes.
    packs: int = 0
    packed_entries: int = 0
    pack_bytes: int = 0
    elapsed_s: float = 0.0

    @property
    def unfixed(self) -> int:
        return sum(1 for p in self.problems if not p.fixed)

    def as_dict(self) -> dict[str, object]:
        out = Report.as_dict(self)
        out["problems_found"] = len(self.problems)
        out["problems_fixed"] = len(self.problems) - self.unfixed
        return out


def verify(
    root: str | os.PathLike[str],
    *,
    repair: bool = False,
    progress: ProgressFn | None = None,
    shared: bool | None = None,
) -> VerifyReport:
    """Check the cache at ``root``; with ``repair``, fix what can be fixed. Never raises for a bad file.

    ``shared``: whether a damaged ``layout.json`` is rewritten with the shared mark (None: as
    the damaged file still says; where it says nothing, unmarked, and the problem says so).
    """
    t0 = time.monotonic()
    if not_created(root):  # an empty cache, as stats reports it
        return VerifyReport(os.path.abspath(os.fspath(root)), repair, exists=False)
    cache = open_cache(root, write=repair, allow_damaged=True, purpose="repair")
    lay, blobs, remover = cache.lay, cache.blobs, cache.remover
    report = VerifyReport(lay.root, repair)
    if cache.state is LayoutState.DAMAGED:
        path = os.path.join(lay.root, LAYOUT_FILE)
        problem = Problem("damaged_layout", path, "not a valid layout file")
        if repair:
            said = said_shared(path)  # before it is rewritten
            mark = said if shared is None else shared
            create_layout(lay.root)
            if mark:
                mark_shared_store(lay.root, lay.tmp)
                problem.detail += "; rewritten with its shared mark" + (" (--shared)" if shared else "")
            elif said is None and shared is None:
                problem.detail += (
                    "; rewritten without a shared mark (none is left to read): --shared for a published store"
                )
            problem.fixed = True
        report.problem(problem)
    if progress:
        progress("scanning", 0, 0)
    snap = take_snapshot(lay.index, lay.blobs)
    report.entries = len(snap.manifests)
    report.blobs = len(snap.blobs)
    for path in snap.unreadable:
        report.problem(Problem("unreadable_manifest", path, "cannot be read"))
    for directory in (lay.index, lay.blobs):
        for path in strays(directory):
            report.problem(Problem("stray_file", path, "not a cache file; left alone"))

    checks = check_blobs(snap, blobs, progress)
    bad_blobs = {digest: check for digest, check in checks.items() if check.state is BlobState.CORRUPT}
    for digest, check in checks.items():
        if check.state is BlobState.UNREADABLE:
            report.problem(Problem("unreadable_blob", blobs.path_for(digest), check.detail))
        elif check.stat is not None:
            report.blobs_checked += 1
            report.bytes_checked += check.stat.st_size
    for info in snap.manifests:
        condition = classify(info, snap, bad_blobs)
        if not condition.bad:
            continue
        path = lay.manifest_path(info.key_id)
        problem = Problem(condition.value, path, describe(condition, info, snap))
        if remover is not None:
            problem.fixed = remover.manifest(info.key_id, info.stat) or not os.path.lexists(path)
        report.problem(problem)
    for digest, check in bad_blobs.items():
        problem = Problem("corrupt_blob", blobs.path_for(digest), check.detail)
        if remover is not None and check.stat is not None:
            where = remover.quarantine(digest, check.stat)
            problem.fixed = where is not None or not os.path.lexists(blobs.path_for(digest))
            if where:
                problem.detail += f"; moved to {where}"
        report.problem(problem)
    for path, st in stale_temp_files(lay.tmp):
        problem = Problem("stale_temp_file", path, "left by a crashed writer")
        if remover is not None:
            try:
                remover.temp_file(path, st)
                problem.fixed = not os.path.lexists(path)
            except OSError as exc:
                problem.detail += f"; cannot remove: {exc.strerror}"
        report.problem(problem)
    packs = pack_stats(lay)  # before verify_packs: what it checks, also a pack it moves aside
    report.packs, report.packed_entries = packs["packs"], packs["packed_entries"]
    report.pack_bytes = packs["pack_bytes"]
    for kind, path, detail, fixed in verify_packs(lay, repair=remover is not None):
        report.problem(Problem(kind, path, detail, fixed))
    report.orphan_blobs = len(snap.orphans())
    report.elapsed_s = time.monotonic() - t0
    return report
