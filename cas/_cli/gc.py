"""``cuda-program-cas gc`` (and ``python tools/gc.py``): collect garbage, evict by size or age."""

from __future__ import annotations

import argparse
from functools import partial

from cuda_program_cas._verbs.common import cache_root
from cuda_program_cas._verbs.gc import CATEGORIES, SHARED_MIN_GRACE_S, GcReport, collect, collected_as_shared

from .main import UsageError, add_path_arg, duration_arg, emit, fmt_age, fmt_bytes, plural, print_problems, size_arg

__all__ = ["BUCKET", "DESCRIPTION", "HELP", "arguments", "run"]

HELP = "remove garbage; evict by size or age"
BUCKET = "path"

DESCRIPTION = """\
Plan, then remove: stale temp files (older than 1h), invalid and dangling
manifests, orphan blobs older than --grace, blobs whose last entry this run
removes, and with --max-age/--max-size entries unused for too long or least
recently used. --verify hashes every blob and moves bad ones to quarantine/.
Safe while other processes use the cache; one collector at a time (the cache's
evict.lock, shared with size-cap eviction: when it is busy, gc changes nothing
and exits 1, unless --wait gives it time)."""


def arguments(p: argparse.ArgumentParser) -> None:
    add_path_arg(p)
    p.add_argument(
        "--grace",
        type=partial(duration_arg, zero_ok=True),  # 0s: every orphan now
        default=3600.0,
        metavar="AGE",
        help="keep orphan blobs younger than AGE, e.g. 30m or 1d (default: 1h; a shared store needs at least 1h)",
    )
    p.add_argument(
        "--max-size",
        type=size_arg,
        metavar="SIZE",
        help="evict LRU entries down to SIZE, e.g. 500M or 10G (default: no limit)",
    )
    p.add_argument(
        "--max-age",
        type=partial(duration_arg, zero_ok=False),
        metavar="AGE",
        help="drop entries unused for longer than AGE, e.g. 12h, 7d or 2w (default: no limit)",
    )
    p.add_argument("--verify", action="store_true", help="hash every blob; quarantine bad ones")
    p.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    p.add_argument(
        "--wait",
        type=partial(duration_arg, zero_ok=True, require_unit=False, what="a wait"),  # 30 or 2m
        default=0.0,
        metavar="SECONDS",
        help="wait this long for a busy lock, e.g. 30 or 2m (default: 0, do not wait)",
    )
    p.add_argument(
        "--shared",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="collect as a shared store (default: if publish marked it so): grace >= 1h, blobs of removed "
        "entries wait a grace period",
    )


def _check_grace(root: str, shared: bool | None, grace_s: float) -> None:
    """A shared store is collected with at least an hour of grace: say so as bad usage, naming why it is shared."""
    if grace_s >= SHARED_MIN_GRACE_S or shared is False:
        return
    if not collected_as_shared(root, shared):  # a path that is not a cache is reported as such first
        return
    why = "--shared was given" if shared else f"{root!r} is a shared store (publish marked it in its layout.json)"
    raise UsageError(
        f"--grace {fmt_age(grace_s)} is too short: {why}, and a shared store is collected with a grace period of "
        f"at least {fmt_age(SHARED_MIN_GRACE_S)} (nodes may be reading what goes); give --grace 1h or more"
        + ("" if shared else ", or --no-shared if no node reads it")
    )


def run(args: argparse.Namespace) -> int:
    _check_grace(cache_root(args.path), args.shared, args.grace)
    report = collect(
        cache_root(args.path),
        grace_s=args.grace,
        max_size=args.max_size,
        max_age_s=args.max_age,
        verify=args.verify,
        dry_run=args.dry_run,
        progress=args.progress,
        wait_s=args.wait,
        shared=args.shared,
    )
    return emit(args, report, lambda: print_report(report, args), empty="nothing to collect")


def _labels(args: argparse.Namespace) -> dict[str, str]:
    return {
        "invalid_manifests": "invalid manifests (empty, truncated, garbled)",
        "dangling_manifests": "dangling manifests (blob missing)",
        "size_mismatch_manifests": "manifests whose size disagrees with their blob",
        "corrupt_blob_manifests": "manifests of corrupt blobs",
        "partner_entries": "front-door records or results whose partner goes",
        "expired_entries": f"entries unused for over {fmt_age(args.max_age or 0)}",
        "evicted_entries": f"least recently used entries (down to {fmt_bytes(args.max_size or 0)})",
        "unreferenced_blobs": "blobs whose last entry goes",
        "orphan_blobs": f"orphan blobs older than {fmt_age(args.grace)}",
        "corrupt_blobs": "corrupt blobs (moved to quarantine/)",
        "temp_files": "stale temp files (older than 1h)",
    }


def summary_line(report: GcReport) -> str:
    parts = [plural(report.entries_removed, "entry"), plural(report.blobs_removed, "blob")]
    if report.temp_files_removed:
        parts.append(plural(report.temp_files_removed, "stale temp file"))
    what = ", ".join(parts[:-1]) + " and " + parts[-1]
    freed, total = fmt_bytes(report.bytes_freed), fmt_bytes(report.bytes_before)
    if report.dry_run:
        return f"would remove {what}, freeing {freed} of {total} (dry run: nothing changed)"
    return f"removed {what}, freed {freed} of {total}"


def print_report(report: GcReport, args: argparse.Namespace) -> None:
    print(
        f"{'plan for ' if report.dry_run else ''}{report.root}: {plural(report.entries_before, 'entry')}, "
        f"{plural(report.blobs_before, 'blob')}, {fmt_bytes(report.bytes_before)} stored"
    )
    labels = _labels(args)
    for name in CATEGORIES:
        item = report.plan[name]
        if item["count"]:
            print(f"  {labels[name]:<48} {item['count']:>9,} {fmt_bytes(item['bytes']):>11}")
    if report.blobs_deferred:
        label = "shared store: blobs of removed entries, kept"
        print(f"  {label:<48} {report.blobs_deferred:>9,}  (collected after --grace)")
    if report.kept_changed:
        print(f"  {'kept: changed or used since the scan':<48} {report.kept_changed:>9,}")
    print_problems(report)
    print(summary_line(report))
