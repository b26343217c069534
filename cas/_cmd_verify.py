"""``cuda-program-cas verify [--repair]``: check every manifest and blob, report each problem."""

from __future__ import annotations

import argparse
from typing import Any

from ._cli import add_json_arg, add_path_arg, cache_path, fmt_bytes, plural, print_json
from ._verify import verify

__all__ = ["register"]


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "verify",
        help="check every manifest and blob; --repair fixes what it can",
        description=(
            "Read every manifest and hash every blob; report each problem. Without --repair nothing is "
            "written (a read-only cache can be verified). --repair moves bad blobs to quarantine/, removes "
            "bad manifests and stale temp files, and rewrites a damaged layout.json."
        ),
    )
    add_path_arg(p)
    p.add_argument("--repair", action="store_true", help="fix what can be fixed")
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = verify(cache_path(args.path), repair=args.repair, progress=args.progress)
    args.progress.done()
    if args.json:
        print_json(report.as_dict())
    else:
        for p in report.problems:
            state = " [fixed]" if p.fixed else ""
            print(f"{p.kind}: {p.path}{': ' + p.detail if p.detail else ''}{state}")
        found = len(report.problems)
        head = (
            f"checked {plural(report.entries, 'entry', 'entries')} and {plural(report.blobs_checked, 'blob')} "
            f"({fmt_bytes(report.bytes_checked)}) in {report.elapsed_s:.1f} s: "
        )
        if not found:
            tail = "no problems"
        elif args.repair:
            tail = f"{plural(found, 'problem')}, {found - report.unfixed:,} fixed"
        else:
            tail = f"{plural(found, 'problem')} (fix with --repair)" if found else "no problems"
        if report.orphan_blobs:
            tail += f"; {plural(report.orphan_blobs, 'orphan blob')} for gc"
        print(head + tail)
    return 1 if report.unfixed else 0
