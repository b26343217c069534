"""``cuda-program-cas publish SRC... DEST``: merge local caches into a shared store."""

from __future__ import annotations

import argparse
from typing import Any

from ._cli import add_json_arg, fmt_bytes, plural, print_json
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
    parser.add_argument(
        "--pack",
        action="store_true",
        help="write what is new into one immutable pack file (a handful of files for any number of entries)",
    )
    add_json_arg(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = publish(
        args.sources,
        args.dest,
        group_shared=args.group_shared,
        dry_run=args.dry_run,
        pack=args.pack,
        progress=getattr(args, "progress", None),
    )
    if args.json:
        print_json(report.to_dict())
        return 1 if report.problems else 0
    for label, items in (
        ("bad blob (skipped)", report.bad_blobs),
        ("missing blob (skipped)", report.missing_blobs),
        ("invalid manifest (skipped)", report.invalid_manifests),
        ("error", report.errors),
    ):
        for item in items:
            print(f"{label}: {item}")
    verb = "would publish" if report.dry_run else "published"
    new = report.published + report.replaced
    line = (
        f"{verb} {plural(new, 'entry', 'entries')} and {plural(report.blobs_published, 'blob')} "
        f"({fmt_bytes(report.bytes_published)}) from {plural(len(report.sources), 'cache')} into {report.dest}"
    )
    extras = []
    if report.created:
        extras.append("store " + ("would be created" if report.dry_run else "created"))
    extras.append(f"{report.unchanged:,} already there")
    if report.replaced:
        extras.append(f"{plural(report.replaced, 'broken entry', 'broken entries')} replaced")
    if report.conflicts:
        extras.append(f"{plural(report.conflicts, 'conflict')} kept as published")
    if report.problems:
        extras.append(plural(report.problems, "problem"))
    for path in report.packs:
        extras.append(f"pack {path}")
    print(f"{line}; {', '.join(extras)}")
    return 1 if report.problems else 0
