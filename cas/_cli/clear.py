"""``cuda-program-cas clear [PATH]``: empty a node's local cache (``ccache -C``), safe while others use it.

It is :meth:`cuda_program_cas.CacheStore.clear`: every manifest, then every blob no manifest
names, each removal re-checked against the file the scan saw; what a concurrent
writer adds meanwhile stays, and a reader meanwhile gets misses, never wrong
bytes. The lifetime counters, settings and quarantine/ are kept (``stats --zero``
zeroes the counters).

A shared store (publish marked it) is refused as bad usage: emptying it empties
every node's second level at once, and its packs are not loose entries; its
owner collects it with ``gc`` or removes it and publishes again.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from cuda_program_cas._disk.layout import is_shared_store
from cuda_program_cas._disk.scan import take_snapshot
from cuda_program_cas._store.store import CacheStore
from cuda_program_cas._verbs.common import open_cache

from .main import UsageError, add_json_arg, add_path_arg, cache_path, fmt_bytes, plural, print_json

__all__ = ["register"]


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "clear",
        help="empty a local cache (every entry and blob), safe while others use it",
        description=(
            "Remove every entry and blob of the local cache at PATH, as ccache -C does. Safe while other "
            "processes use it: what they write meanwhile stays, and their lookups meanwhile are misses. "
            "The lifetime counters and the stored settings are kept. A shared store is refused."
        ),
    )
    add_path_arg(p)
    p.add_argument("--dry-run", action="store_true", help="say what would be removed; change nothing")
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    root = cache_path(args.path)
    lay = open_cache(root, write=not args.dry_run, purpose="clear").lay
    if is_shared_store(lay.root):
        raise UsageError(
            f"{lay.root!r} is a shared store (publish marked it in its layout.json): clear empties a node's local "
            "cache; collect a shared store with `gc`, or remove it and publish again"
        )
    before = take_snapshot(lay.index, lay.blobs, read_manifests=False)
    if not args.dry_run:
        CacheStore(lay.root, max_size_bytes=None).clear()
    after = before if args.dry_run else take_snapshot(lay.index, lay.blobs, read_manifests=False)
    freed = max(0, before.stored_bytes - after.stored_bytes)
    report = {
        "root": lay.root,
        "dry_run": bool(args.dry_run),
        "entries_before": len(before.manifests),
        "blobs_before": len(before.blobs),
        "bytes_before": before.stored_bytes,
        "entries_after": len(after.manifests),
        "blobs_after": len(after.blobs),
        "bytes_after": after.stored_bytes,
        "bytes_freed": before.stored_bytes if args.dry_run else freed,
        "elapsed_s": round(time.monotonic() - t0, 3),
        "problems": [],
        "problem_count": 0,
    }
    if args.json:
        print_json(report)
        return 0
    what = f"{plural(len(before.manifests), 'entry', 'entries')} and {plural(len(before.blobs), 'blob')}"
    if args.dry_run:
        print(f"would remove {what}, freeing {fmt_bytes(before.stored_bytes)} of {lay.root} (dry run: nothing changed)")
        return 0
    kept = ""
    if after.manifests or after.blobs:
        kept = (
            f"; kept {plural(len(after.manifests), 'entry', 'entries')} and {plural(len(after.blobs), 'blob')} "
            "written meanwhile"
        )
    print(f"cleared {lay.root}: removed {what}, freed {fmt_bytes(freed)} of {fmt_bytes(before.stored_bytes)}{kept}")
    return 0
