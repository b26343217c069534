"""``cuda-program-cas stats``: what the cache holds, how well it deduplicates, how full it is,
and its lifetime counters (every process's hits, misses, writes... since they were zeroed).

Reads only: works on a read-only cache or mount, takes no lock, touches nothing.
``--zero`` sets the lifetime counters to zero (it writes, under ``counters.lock``).
Files it cannot read (another user's cache, a damaged disk) are listed as
problems, the figures are then lower bounds, and the exit status is 1.

A path where no cache has been created yet (missing, or an empty directory) is
reported as an empty cache, exit 0, and said so (``exists`` false in the JSON):
a job that has not stored anything yet is not bad usage. A file or a directory
holding something else is still bad usage (exit 2).
"""

from __future__ import annotations

import argparse
import os
import stat
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from cuda_program_cas._base.config import ENV_MAX_SIZE
from cuda_program_cas._disk.classify import Condition, classify
from cuda_program_cas._disk.layout import Layout, LayoutState, check_layout, stale_temp_files
from cuda_program_cas._disk.scan import Snapshot, take_snapshot
from cuda_program_cas._disk.settings import Setting, effective_settings
from cuda_program_cas._store.lifetime import NAMES, read_counters, zero_counters
from cuda_program_cas._verbs.common import open_cache
from cuda_program_cas._verbs.packs import pack_stats
from cuda_program_cas.index import is_record

from .main import add_json_arg, add_path_arg, cache_path, fmt_age, fmt_bytes, plural, print_json, size_arg

__all__ = ["gather", "register"]

#: Problems printed one per line; the rest are counted.
_SHOWN = 20
#: Where the cap came from, in the text output.
_CAP_FROM = {
    "argument": "--max-size",
    "environment": f"${ENV_MAX_SIZE}",
    "cache": "stored in the cache: cuda-program-cas config",
    "default": "default",
}


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "stats",
        help="entries, blobs, dedup ratio, use of the cap, files count, lifetime counters",
        description="Show what the cache holds and its lifetime counters (hits, misses, writes... of every "
        "process since they were zeroed). Reads only: works on a read-only cache.",
    )
    add_path_arg(p)
    p.add_argument(
        "--max-size",
        type=size_arg,
        metavar="SIZE",
        help=f"the cap to compare with (default: ${ENV_MAX_SIZE}, else the cap stored in the cache)",
    )
    p.add_argument("--zero", action="store_true", help="set the lifetime counters to zero (nothing else changes)")
    add_json_arg(p)
    p.set_defaults(func=run)


def _iso(ns: int | None) -> str | None:
    if ns is None:
        return None
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="seconds")


def _walk(root: str) -> tuple[int, int, int]:
    """Files, directories and bytes on disk (allocated blocks) under ``root``, itself included."""
    files, dirs, disk = 0, 1, 0
    stack = [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    disk += getattr(st, "st_blocks", 0) * 512 or st.st_size
                    if stat.S_ISDIR(st.st_mode):
                        dirs += 1
                        stack.append(entry.path)
                    else:
                        files += 1
        except OSError:
            continue
    return files, dirs, disk


def _unreadable(root: str, index_dir: str, blobs_dir: str, snap: Snapshot) -> list[str]:
    """What this user cannot read: the scan's unreadable manifests and shards, and blobs and blob shards."""
    found = list(snap.unreadable)
    for directory in (index_dir, blobs_dir):
        if os.path.isdir(directory) and not os.access(directory, os.R_OK | os.X_OK):
            found.append(directory)
    try:
        with os.scandir(blobs_dir) as it:
            shards = [e.path for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except OSError:
        shards = []
    found.extend(sorted(d for d in shards if not os.access(d, os.R_OK | os.X_OK)))
    found.extend(
        p for p in (os.path.join(blobs_dir, d[:2], d[2:]) for d in sorted(snap.blobs)) if not os.access(p, os.R_OK)
    )
    return found


def gather(root: str, cap: int | None, cap_source: str | None = None) -> dict[str, Any]:
    """The statistics of the cache at ``root`` as one JSON-ready dict.

    ``problems`` lists what could not be read (``problem_count`` counts it); the
    other figures then count only what could. No cache at ``root`` yet: an empty
    one, with ``exists`` false.
    """
    path = os.path.abspath(root)
    exists = check_layout(path) is not LayoutState.MISSING
    lay = open_cache(path, write=False, allow_damaged=True).lay if exists else Layout(path)
    snap = take_snapshot(lay.index, lay.blobs)
    unreadable = _unreadable(lay.root, lay.index, lay.blobs, snap)
    problems = [f"{path}: cannot be read" for path in unreadable]
    conditions = [classify(m, snap) for m in snap.manifests]
    uses = [m.stat.st_mtime_ns for m in snap.manifests if m.manifest is not None]
    orphans = snap.orphans()
    files, dirs, disk = _walk(lay.root)
    try:
        quarantined = len(os.listdir(lay.quarantine))
    except OSError:
        quarantined = 0
    stored = snap.stored_bytes
    records = [m.manifest for m in snap.manifests if m.manifest is not None and is_record(m.key_id)]
    record_bytes = sum(snap.blobs[r.digest].st_size for r in records if r.digest in snap.blobs)
    try:
        life = read_counters(lay)
    except OSError as exc:
        life = None
        problems.append(f"{lay.counters}: cannot be read ({exc.strerror or exc}): the lifetime counters are unknown")
    return {
        "path": lay.root,
        "exists": exists,
        "entries": len(snap.manifests),
        "blobs": len(snap.blobs),
        "logical_bytes": snap.logical_bytes,
        "stored_bytes": stored,
        "blob_bytes": snap.blob_bytes,
        "manifest_bytes": snap.manifest_bytes,
        "dedup_ratio": round(snap.logical_bytes / snap.blob_bytes, 3) if snap.blob_bytes else 1.0,
        "max_size_bytes": cap,
        "max_size_source": cap_source if cap else None,
        "cap_used_percent": round(100.0 * stored / cap, 1) if cap else None,
        "oldest_use": _iso(min(uses)) if uses else None,
        "newest_use": _iso(max(uses)) if uses else None,
        "files": files,
        "directories": dirs,
        "inodes": files + dirs,
        "disk_bytes": disk,
        "front_door_records": len(records),
        "front_door_record_bytes": record_bytes,
        "orphan_blobs": len(orphans),
        "orphan_bytes": sum(snap.blobs[d].st_size for d in orphans),
        "invalid_manifests": sum(c in (Condition.INVALID, Condition.MISPLACED) for c in conditions),
        "unreadable_manifests": len(snap.unreadable),
        "dangling_manifests": sum(c is Condition.DANGLING for c in conditions),
        "size_mismatch_manifests": sum(c is Condition.SIZE_MISMATCH for c in conditions),
        "stale_temp_files": len(stale_temp_files(lay.tmp)),
        "quarantined_files": quarantined,
        **pack_stats(lay),
        "counters": None if life is None else life.counters,
        "hit_rate": None if life is None or life.hit_rate is None else round(life.hit_rate, 4),
        "counters_zeroed_at": None if life is None else _iso(life.zeroed_ns),
        "problems": problems,
        "problem_count": len(problems),
    }


def _zero(root: str, as_json: bool) -> int:
    lay = open_cache(root, write=True, purpose="zero the counters").lay
    before = zero_counters(lay)
    if as_json:
        print_json({"path": lay.root, "zeroed": True, "counters_before": before.counters})
        return 0
    was = ", ".join(f"{before.counters[n]:,} {n.replace('_', ' ')}" for n in NAMES)
    print(f"zeroed the lifetime counters of {lay.root} (they were: {was})")
    return 0


def _counter_rows(info: dict[str, Any], when: Callable[[str | None], str]) -> list[tuple[str, str]]:
    c = info["counters"]
    if c is None:
        return [("lookups", "unknown: the counters file cannot be read")]
    rate = "-" if info["hit_rate"] is None else f"{100 * info['hit_rate']:.1f}%"
    since = info["counters_zeroed_at"]
    return [
        (
            "lookups",
            f"{c['hits'] + c['misses']:,}: {c['hits']:,} hits ({c['shared_hits']:,} from shared stores), "
            f"{c['misses']:,} misses; hit rate {rate}",
        ),
        (
            "writes",
            f"{c['writes']:,} ({c['dedup_writes']:,} deduplicated), {c['dropped_writes']:,} dropped; "
            f"{c['evictions']:,} evicted",
        ),
        ("problems", f"{c['corrupt']:,} corrupt, {c['errors']:,} errors"),
        ("counted", f"since {when(since)}" if since else "since the cache was created (never zeroed)"),
    ]


def run(args: argparse.Namespace) -> int:
    if args.zero:
        return _zero(cache_path(args.path), args.json)
    root = cache_path(args.path)
    if args.max_size is not None:
        setting = Setting("max_size_bytes", args.max_size, "argument", "--max-size")
    else:  # the environment, else the cache's own setting: as a cache opened there would
        setting = next(s for s in effective_settings(root) if s.name == "max_size_bytes")
    cap = setting.value if isinstance(setting.value, int) else None
    info = gather(root, cap, setting.source)
    status = 1 if info["problem_count"] else 0
    if args.json:
        print_json(info)
        return status
    now = time.time()

    def when(iso: str | None) -> str:
        if iso is None:
            return "-"
        age = max(0.0, now - datetime.fromisoformat(iso).timestamp())
        return f"{iso.replace('T', ' ').replace('+00:00', ' UTC')} ({fmt_age(age)} ago)"

    if cap:
        cap_text = f"{fmt_bytes(cap)}, {info['cap_used_percent']}% used ({_CAP_FROM[setting.source]})"
    else:
        cap_text = f"none (give --max-size, set {ENV_MAX_SIZE}, or store one with `config PATH max-size 10G`)"
    garbage = [
        plural(info["orphan_blobs"], "orphan blob") + f" ({fmt_bytes(info['orphan_bytes'])})",
        plural(info["invalid_manifests"], "invalid manifest"),
        plural(info["dangling_manifests"], "dangling manifest"),
        plural(info["stale_temp_files"], "stale temp file"),
    ]
    rows = [
        ("cache", info["path"] + ("" if info["exists"] else " (no cache here yet: nothing has been stored)")),
        ("entries", f"{info['entries']:,} ({fmt_bytes(info['logical_bytes'])} if each had its own copy)"),
        (
            "blobs",
            f"{info['blobs']:,} unique ({fmt_bytes(info['blob_bytes'])}) + manifests "
            f"({fmt_bytes(info['manifest_bytes'])}) = {fmt_bytes(info['stored_bytes'])} stored",
        ),
        (
            "dedup ratio",
            f"{info['dedup_ratio']:.2f}x ({fmt_bytes(info['logical_bytes'])} of entries in "
            f"{fmt_bytes(info['blob_bytes'])} of unique blobs; manifests not counted)",
        ),
        ("cap", cap_text),
        ("oldest use", when(info["oldest_use"])),
        ("newest use", when(info["newest_use"])),
        (
            "files",
            f"{info['inodes']:,} inodes ({info['files']:,} files, {info['directories']:,} directories), "
            f"{fmt_bytes(info['disk_bytes'])} on disk",
        ),
        (
            "garbage",
            ", ".join(garbage)
            + (" (orphans may be named by manifests that cannot be read)" if info["unreadable_manifests"] else ""),
        ),
        *_counter_rows(info, when),
    ]
    if info["front_door_records"]:
        rows.append((
            "front door",
            f"{plural(info['front_door_records'], 'record')} of the headers cache.compile() read "
            f"({fmt_bytes(info['front_door_record_bytes'])} of the unique blobs), each evicted with its binaries",
        ))  # fmt: skip
    if info["packs"] or info["retired_packs"]:
        rows.append((
            "packs",
            f"{plural(info['packs'], 'pack')} holding {plural(info['packed_entries'], 'entry', 'entries')} "
            f"({fmt_bytes(info['pack_bytes'])}), {info['retired_packs']:,} retired (gc removes them after --grace)",
        ))  # fmt: skip
    if info["quarantined_files"]:
        rows.append(("quarantine", plural(info["quarantined_files"], "bad blob") + " kept for inspection"))
    if info["problem_count"]:
        rows.append((
            "unreadable",
            f"{plural(info['problem_count'], 'file')} this user cannot read; the figures above count only the rest "
            "(run stats as the cache's owner)",
        ))  # fmt: skip
    for label, value in rows:
        print(f"{label:<12} {value}")
    for text in info["problems"][:_SHOWN]:
        print(f"problem: {text}")
    if info["problem_count"] > _SHOWN:
        print(f"problem: ... and {info['problem_count'] - _SHOWN:,} more")
    print(
        f"{plural(info['entries'], 'entry', 'entries')} in {plural(info['blobs'], 'blob')}, "
        f"{fmt_bytes(info['stored_bytes'])} stored, dedup {info['dedup_ratio']:.2f}x"
        + (f", {info['cap_used_percent']}% of the cap" if cap else "")
        + ("" if info["hit_rate"] is None else f", hit rate {100 * info['hit_rate']:.1f}%")
        + (f"; {plural(info['problem_count'], 'file')} could not be read" if info["problem_count"] else "")
    )
    return status
