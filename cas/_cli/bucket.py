"""``stats``, ``verify``, ``gc`` and ``repack`` of a store in an S3 bucket (``s3://BUCKET/PREFIX``).

The commands' directory options need a store's files and are refused for a bucket (exit 2).
"""

from __future__ import annotations

import argparse
import sys

from .main import UsageError, emit, fmt_bytes, plural, print_problems

__all__ = ["is_bucket", "run"]

#: Options of the directory commands that a bucket cannot honour, by their argparse names.
_DIRECTORY_ONLY = ("zero", "max_size", "max_age", "verify", "shared", "repair")
_ONE = {"manifests": "manifest", "blobs": "blob", "packs": "pack", "leases": "lease", "other": "other object"}


def is_bucket(path: object) -> bool:
    return isinstance(path, str) and path[:5].lower() == "s3://"


def run(verb: str, args: argparse.Namespace) -> int:
    """``verb`` (stats, verify, gc, repack) on the bucket store ``args.path``: 0 done, 1 problems or no answer."""
    from cuda_program_cas._base.engine import StoreFailure
    from cuda_program_cas._verbs.bucket import bucket_verb
    from cuda_program_cas._verbs.common import SHARED_MIN_GRACE_S

    given = [name for name in _DIRECTORY_ONLY if getattr(args, name, None) not in (None, False)]
    if given:
        options = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"{options}: not for a bucket (a directory store's); see docs/s3.md")
    try:
        if verb == "gc" and args.grace < SHARED_MIN_GRACE_S:
            raise UsageError("a bucket is a shared store: --grace must be at least 1h (write-back under way)")
        gc = {"grace_s": args.grace, "dry_run": args.dry_run} if verb == "gc" else {}
        report = bucket_verb(verb, args.path, **gc)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except StoreFailure as exc:
        print(f"cuda-program-cas {verb}: {exc}", file=sys.stderr)
        return 1

    def text() -> None:
        counts = [(kind, n) for kind, n in report.objects.items() if n]
        kinds = ", ".join(f"{plural(n, _ONE[kind], kind)} ({fmt_bytes(report.bytes[kind])})" for kind, n in counts)
        print(f"{report.store}: {kinds or 'no objects'}")
        print_problems(report, lambda item: f"{item['object']}: {item['problem']}")
        if verb in ("verify", "gc"):
            print(f"{plural(report.problem_count, 'problem')}; {plural(report.orphan_blobs, 'orphan blob')}")
        if verb == "repack":
            print(f"one new pack; retired or removed {plural(len(report.removed), 'object')}")
        if verb == "gc":
            did = "would remove" if args.dry_run else "removed"
            print(f"{did} {plural(len(report.removed), 'object')} ({fmt_bytes(report.bytes_removed)})")

    return emit(args, report, text, status=None if verb == "verify" else 0)
