"""``cuda-program-cas repack STORE``: merge a shared store's loose entries and packs into one pack."""

from __future__ import annotations

import argparse
import os

from cuda_program_cas._base.errors import CollectorBusyError
from cuda_program_cas._verbs.repack import RepackReport, check_shared_store, repack

from .main import emit, fmt_bytes, plural, print_json, print_problems

__all__ = ["BUCKET", "DESCRIPTION", "HELP", "arguments", "run"]

HELP = "merge a shared store's loose entries and packs into one pack"
DESCRIPTION = (
    "Write every entry the shared store STORE serves (loose and packed) into one new pack, then "
    "retire the packs it replaced into packs/retired/. Safe while nodes read STORE: nothing they "
    "may be reading is removed; gc removes what was replaced once the shared grace period has passed. "
    "A node's local cache (a store publish did not mark as shared) is refused. One repack at a time: "
    "while another repack or a gc runs on STORE, it says so, changes nothing and exits 0."
)
BUCKET = "store"


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", metavar="STORE", help="the shared store")


def _left(report: RepackReport) -> str:
    """What the repack left for gc, and when gc removes it: nodes may be reading it now."""
    others = report.loose_left - report.loose_packed
    kept = f"; {plural(others, 'loose entry')} not in the pack stay{'s' if others == 1 else ''}"
    if not report.loose_packed and not report.retired:
        return f"left {plural(report.loose_left, 'loose entry')}" + (kept if others else "")
    what = []
    if report.loose_packed:
        what.append(f"{plural(report.loose_packed, 'loose entry')} now also in the pack")
    if report.retired:
        what.append(f"{plural(len(report.retired), 'retired pack')}")
    when = (report.gc_removes_after or "").replace("T", " ").replace("+00:00", " UTC")
    return (
        f"left {' and '.join(what)} for nodes that may be reading them: gc removes them once its --grace has "
        f"passed (1h by default: from {when}){kept if others else ''}"
    )


def run(args: argparse.Namespace) -> int:
    check_shared_store(args.store)  # a store URL, a node's local cache: bad usage
    root = os.path.abspath(args.store)
    try:
        report = repack(root)
    except CollectorBusyError as exc:
        # Not a failure: the running one does the work this one was asked to do.
        if args.json:
            print_json({"root": root, "busy": True, "message": str(exc)})
        else:
            print(exc)
        return 0
    return emit(args, report, lambda: _text(report))


def _text(report: RepackReport) -> None:
    print_problems(report)
    if report.pack:
        print(_left(report))
    print(
        f"packed {plural(report.entries, 'entry')} in {plural(report.blobs, 'blob')} "
        f"({fmt_bytes(report.bytes)}) into {report.pack or 'no pack (the store is empty)'}; "
        f"retired {plural(len(report.retired), 'pack')}"
    )
