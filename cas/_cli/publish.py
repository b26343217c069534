"""``cuda-program-cas publish SRC... STORE``: merge local caches into a shared store (a directory or a URL)."""

from __future__ import annotations

import argparse

from cuda_program_cas._base.signing import env_signer
from cuda_program_cas._verbs.publish import PublishReport, check_sources, publish

from .main import UsageError, emit, fmt_bytes, plural

__all__ = ["DESCRIPTION", "HELP", "arguments", "run"]

HELP = "merge local caches into a shared store (created if missing)"
DESCRIPTION = (
    "Merge the cache directories SRC... into the shared store STORE, which nodes open read-only "
    "(shared=[STORE]). Blobs are verified, then written before the manifests naming them, each "
    "atomically: safe while nodes read STORE and while another publish runs; running it again "
    "publishes only what is new. A key STORE already maps to other valid bytes keeps them. "
    "STORE may be an http(s):// URL of a WebDAV location (PUT, MKCOL; token from "
    "CUDA_PROGRAM_CAS_HTTP_TOKEN or ~/.netrc): the same order, each upload atomic on the server. "
    "STORE may be a redis(s):// URL: the same order, loose entries only (no --pack). "
    "`publish --init STORE` with no SRC creates an empty store of any kind, ready for write-back. "
    "Exit status 2 when a SRC is missing, not a cache, or STORE itself."
)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sources", nargs="*", metavar="SRC", help="a node's local cache directory (only read)")
    parser.add_argument(
        "dest",
        metavar="STORE",
        help="the shared store: a directory (or file://), an http(s):// WebDAV URL or a redis(s):// URL",
    )
    parser.add_argument(
        "--group-shared",
        action="store_true",
        help="make files group-readable and directories group-accessible and setgid (default: follow the umask)",
    )
    parser.add_argument("--dry-run", action="store_true", help="read and verify everything, write nothing")
    parser.add_argument(
        "--init",
        action="store_true",
        help="with no SRC: create STORE empty (layout.json), ready for nodes that name it |write",
    )
    parser.add_argument(
        "--pack",
        action="store_true",
        help="write what is new into one immutable pack file (a handful of files for any number of entries)",
    )
    parser.add_argument(
        "--no-verify-existing",
        dest="verify_existing",
        action="store_false",
        help="trust the store's copies of entries it already holds (no hashing; faster for large sources, "
        "but a copy damaged in place then stays until verify --repair)",
    )


def run(args: argparse.Namespace) -> int:
    if not args.sources and not args.init:
        raise UsageError(
            "publish needs SRC... before STORE, or --init to create an empty store (usage: cuda-program-cas publish "
            "[options] SRC... STORE, or cuda-program-cas publish --init STORE)"
        )
    # A source that is STORE or not a cache, a bad URL: bad usage, nothing written.
    check_sources(args.sources, args.dest, group_shared=args.group_shared, pack=args.pack)
    try:
        env_signer()  # a signing key that cannot be used: bad usage, before anything is written
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    report = publish(
        args.sources,
        args.dest,
        group_shared=args.group_shared,
        dry_run=args.dry_run,
        pack=args.pack,
        verify_existing=args.verify_existing,
        progress=args.progress,
        init=args.init,
    )
    return emit(args, report, lambda: _text(report))


def _text(report: PublishReport) -> None:
    for line in report.problems:
        print(line)
    if not report.sources:  # --init alone
        made = ("would create" if report.dry_run else "created") if report.created else "found"
        print(f"{made} {'an empty' if report.created else 'the'} store at {report.dest}")
        return
    verb = "would publish" if report.dry_run else "published"
    new = report.published + report.replaced
    line = (
        f"{verb} {plural(new, 'entry')} and {plural(report.blobs_published, 'blob')} "
        f"({fmt_bytes(report.bytes_published)}) from {plural(len(report.sources), 'cache')} into {report.dest}"
    )
    extras = []
    if report.created:
        extras.append("store " + ("would be created" if report.dry_run else "created"))
    extras.append(f"{report.unchanged:,} already there")
    if report.replaced:
        extras.append(f"{plural(report.replaced, 'broken entry')} replaced")
    if report.blobs_repaired:
        extras.append(f"{plural(report.blobs_repaired, 'damaged blob')} repaired")
    if report.conflicts:
        extras.append(f"{plural(report.conflicts, 'conflict')} kept as published")
    if report.sets_published:
        extras.append(plural(report.sets_published, "warm set") + (" would be merged" if report.dry_run else " merged"))
    if report.problem_count:
        extras.append(plural(report.problem_count, "problem"))
    for path in report.packs:
        extras.append(f"pack {path}")
    print(f"{line}; {', '.join(extras)}")
