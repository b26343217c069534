"""``cuda-program-cas repack STORE``: merge a shared store's loose entries and packs into one pack."""

from __future__ import annotations

import argparse
import os
from typing import Any

from cuda_program_cas._base.errors import CollectorBusyError
from cuda_program_cas._verbs.repack import RepackReport, check_shared_store, repack

from .bucket import is_bucket
from .bucket import run as bucket_run
from .main import add_json_arg, emit, fmt_bytes, plural, print_json, print_problems

__all__ = ["register"]


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "repack",
        help="merge a shared store's loose entries and packs into one pack",
        description=(
            "Write every entry the shared store STORE serves (loose and packed) into one new pack, then "
            "retire the packs it replaced into packs/retired/. Safe while nodes read STORE: nothing they "
            "may be reading is removed; gc removes what was replaced once the shared grace period has passed. "
            "A node's local cache (a store publish did not mark as shared) is refused. One repack at a time: "
            "while another repack or a gc runs on STORE, it says so, changes nothing and exits 0."
        ),
    )
    p.add_argument("store", metavar="STORE", help="the shared store")
    add_json_arg(p)
    p.set_defaults(func=run)


def _left(report: RepackReport) -> str:
    """What the repack left for gc, and when gc removes it: nodes may be reading it now."""
    others = report.loose_left - report.loose_packed
    kept = f"; {plural(others, 'loose entry', 'loose entries')} not in the pack stay{'s' if others == 1 else ''}"
    if not report.loose_packed and not report.retired:
        return f"left {plural(report.loose_left, 'loose entry', 'loose entries')}" + (kept if others else "")
    what = []
    if report.loose_packed:
        what.append(f"{plural(report.loose_packed, 'loose entry', 'loose entries')} now also in the pack")
    if report.retired:
        what.append(f"{plural(len(report.retired), 'retired pack')}")
    when = (report.gc_removes_after or "").replace("T", " ").replace("+00:00", " UTC")
    return (
        f"left {' and '.join(what)} for nodes that may be reading them: gc removes them once its --grace has "
        f"passed (1h by default: from {when}){kept if others else ''}"
    )


def run(args: argparse.Namespace) -> int:
    if is_bucket(args.store):
        args.path = args.store
        return bucket_run("repack", args)
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
        f"packed {plural(report.entries, 'entry', 'entries')} in {plural(report.blobs, 'blob')} "
        f"({fmt_bytes(report.bytes)}) into {report.pack or 'no pack (the store is empty)'}; "
        f"retired {plural(len(report.retired), 'pack')}"
    )
