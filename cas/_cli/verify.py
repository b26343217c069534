"""``cuda-program-cas verify [--repair]``: check every manifest and blob, report each problem."""

from __future__ import annotations

import argparse

from cuda_program_cas._verbs.common import cache_root
from cuda_program_cas._verbs.verify import VerifyReport, verify

from .main import UsageError, add_path_arg, emit, fmt_bytes, plural

__all__ = ["BUCKET", "DESCRIPTION", "HELP", "arguments", "run"]


HELP = "check every manifest and blob; --repair fixes what it can"
DESCRIPTION = (
    "Read every manifest and hash every blob; report each problem. Without --repair nothing is "
    "written (a read-only cache can be verified). --repair moves bad blobs to quarantine/, removes "
    "bad manifests and stale temp files, and rewrites a damaged layout.json (with the shared mark of a "
    "published store, as far as the damaged file still shows it; --shared or --no-shared says it)."
)
BUCKET = "path"


def arguments(p: argparse.ArgumentParser) -> None:
    add_path_arg(p)
    p.add_argument("--repair", action="store_true", help="fix what can be fixed")
    p.add_argument(
        "--shared",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --repair: rewrite a damaged layout.json marked as a shared store, or not (default: as the "
        "damaged file still says; unmarked where it says nothing)",
    )


#: Problems --repair leaves alone: it cannot make a file readable, and never touches a file that is not the cache's.
_UNREADABLE = frozenset({"unreadable_manifest", "unreadable_blob"})
_STRAY = "stray_file"


def _tail(report: VerifyReport, repair: bool) -> str:
    found = len(report.problems)
    if not found:
        tail = "no problems"
    else:
        unreadable = sum(p.kind in _UNREADABLE for p in report.problems)
        stray = sum(p.kind == _STRAY for p in report.problems)
        fixable = found - unreadable - stray
        notes = []
        if repair:
            notes.append(f"{found - report.unfixed:,} fixed")
        elif fixable:
            notes.append("fix with --repair" if fixable == found else f"fix {fixable:,} with --repair")
        if unreadable:
            notes.append(
                f"{plural(unreadable, 'file')} this user cannot read: run as the cache's owner, "
                "--repair does not change permissions"
            )
        if stray:
            notes.append(f"{plural(stray, 'stray file')} left alone")
        tail = f"{plural(found, 'problem')} ({'; '.join(notes)})"
    if report.orphan_blobs:
        if any(p.kind == "unreadable_manifest" for p in report.problems):
            tail += f"; {plural(report.orphan_blobs, 'blob')} named by no manifest it could read"
        else:
            tail += f"; {plural(report.orphan_blobs, 'orphan blob')} for gc"
    return tail


def run(args: argparse.Namespace) -> int:
    if args.shared is not None and not args.repair:
        raise UsageError("--shared and --no-shared say how --repair rewrites a damaged layout.json: give --repair")
    report = verify(cache_root(args.path), repair=args.repair, progress=args.progress, shared=args.shared)
    status = 1 if report.unfixed else 0
    return emit(args, report, lambda: _text(report, args.repair), status=status, empty="nothing to check")


def _text(report: VerifyReport, repair: bool) -> None:
    for p in report.problems:
        state = " [fixed]" if p.fixed else ""
        print(f"{p.kind}: {p.path}{': ' + p.detail if p.detail else ''}{state}")
    entries = plural(report.entries, "entry")
    packed = ""
    if report.packs:
        entries = plural(report.entries, "loose entry")
        packed = (
            f", and {plural(report.packs, 'pack')} holding {plural(report.packed_entries, 'entry')} "
            f"({fmt_bytes(report.pack_bytes)})"
        )
    print(
        f"checked {entries} and {plural(report.blobs_checked, 'blob')} ({fmt_bytes(report.bytes_checked)})"
        f"{packed} in {report.elapsed_s:.1f} s: {_tail(report, repair)}"
    )
