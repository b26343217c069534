"""``cuda-program-cas publish SRC... DEST``: merge local caches into a shared store."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ._publish import publish

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "publish",
        help="merge local caches into a shared store (created if missing)",
        description=(
            "Merge the cache directories SRC... into the shared store DEST, which nodes open read-only "
            "(shared=[DEST]). Blobs are verified, then written before the manifests naming them, each "
            "atomically: safe while nodes read DEST and while another publish runs; running it again "
            "publishes only what is new. A key DEST already maps to other valid bytes keeps them."
        ),
    )
    parser.add_argument("sources", nargs="+", metavar="SRC", help="a node's local cache directory (only read)")
    parser.add_argument("dest", metavar="DEST", help="the shared store")
    parser.add_argument(
        "--group-shared",
        action="store_true",
        help="make files group-readable and directories group-accessible and setgid (default: follow the umask)",
    )
    parser.add_argument("--dry-run", action="store_true", help="read and verify everything, write nothing")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = publish(args.sources, args.dest, group_shared=args.group_shared, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(report.to_dict(), sort_keys=True))
        return 1 if report.problems else 0
    out = sys.stdout
    for label, items in (
        ("bad blob (skipped)", report.bad_blobs),
        ("missing blob (skipped)", report.missing_blobs),
        ("invalid manifest (skipped)", report.invalid_manifests),
        ("error", report.errors),
    ):
        for item in items:
            print(f"{label}: {item}", file=out)
    verb = "would publish" if report.dry_run else "published"
    new = report.published + report.replaced
    line = (
        f"{verb} {new:,} {_plural(new, 'entry', 'entries')} and {report.blobs_published:,} "
        f"{_plural(report.blobs_published, 'blob', 'blobs')} ({_size(report.bytes_published)}) "
        f"from {len(report.sources)} {_plural(len(report.sources), 'cache', 'caches')} into {report.dest}"
    )
    extras = []
    if report.created:
        extras.append("store " + ("would be created" if report.dry_run else "created"))
    extras.append(f"{report.unchanged:,} already there")
    if report.replaced:
        extras.append(f"{report.replaced:,} broken {_plural(report.replaced, 'entry', 'entries')} replaced")
    if report.conflicts:
        extras.append(f"{report.conflicts:,} {_plural(report.conflicts, 'conflict', 'conflicts')} kept as published")
    if report.problems:
        extras.append(f"{report.problems:,} {_plural(report.problems, 'problem', 'problems')}")
    print(f"{line}; {', '.join(extras)}", file=out)
    return 1 if report.problems else 0


def _plural(n: int, one: str, many: str) -> str:
    return one if n == 1 else many


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
