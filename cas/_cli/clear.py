"""``cuda-program-cas clear [PATH]``: empty a node's local cache (``ccache -C``), safe while others use it."""

from __future__ import annotations

import argparse

from cuda_program_cas._verbs.clear import ClearReport, clear

from .main import add_path_arg, emit, fmt_bytes, plural

__all__ = ["DESCRIPTION", "HELP", "arguments", "run"]

HELP = "empty a local cache (every entry and blob), safe while others use it"
DESCRIPTION = (
    "Remove every entry and blob of the local cache at PATH, as ccache -C does. Safe while other "
    "processes use it: what they write meanwhile stays, and their lookups meanwhile are misses. "
    "The lifetime counters and the stored settings are kept. A shared store is refused, unless it is "
    "of an older layout, which is emptied whole (every other command refuses such a cache)."
)


def arguments(p: argparse.ArgumentParser) -> None:
    add_path_arg(p)
    p.add_argument("--dry-run", action="store_true", help="say what would be removed; change nothing")


def run(args: argparse.Namespace) -> int:
    report = clear(args.path, dry_run=args.dry_run)  # a shared store: LayoutError, bad usage
    return emit(args, report, lambda: _text(report), empty="nothing to clear")


def _text(report: ClearReport) -> None:
    what = f"{plural(report.entries_before, 'entry')} and {plural(report.blobs_before, 'blob')}"
    if report.dry_run:
        print(
            f"would remove {what}, freeing {fmt_bytes(report.bytes_before)} of {report.root} (dry run: nothing changed)"
        )
        return
    kept = ""
    if report.entries_after or report.blobs_after:
        kept = (
            f"; kept {plural(report.entries_after, 'entry')} and {plural(report.blobs_after, 'blob')} written meanwhile"
        )
    print(
        f"cleared {report.root}: removed {what}, freed {fmt_bytes(report.bytes_freed)} of "
        f"{fmt_bytes(report.bytes_before)}{kept}"
    )
