"""``cuda-program-cas stats``: :func:`cuda_program_cas.stats`'s report, or ``--zero`` of the lifetime counters.

Files it cannot read are problems, and the exit status is 1; where no cache has
been created yet, an empty cache is reported, exit 0.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from cuda_program_cas._base.config import ENV_MAX_SIZE
from cuda_program_cas._verbs.stats import StatsReport, stats, zero_counters

from .main import add_path_arg, emit, fmt_age, fmt_bytes, plural, print_json, print_problems, size_arg

__all__ = ["BUCKET", "DESCRIPTION", "HELP", "arguments", "run"]

#: Problems printed one per line; the rest are counted.
_SHOWN = 20
#: Where the cap came from, in the text output.
_CAP_FROM = {
    "argument": "--max-size",
    "environment": f"${ENV_MAX_SIZE}",
    "cache": "stored in the cache: cuda-program-cas config",
    "default": "default",
}

HELP = "entries, blobs, dedup ratio, use of the cap, files count, lifetime counters"
DESCRIPTION = (
    "Show what the cache holds and its lifetime counters (hits, misses, writes... of every "
    "process since they were zeroed). Reads only: works on a read-only cache."
)
BUCKET = "path"


def arguments(p: argparse.ArgumentParser) -> None:
    add_path_arg(p)
    p.add_argument(
        "--max-size",
        type=size_arg,
        metavar="SIZE",
        help=f"the cap to compare with (default: ${ENV_MAX_SIZE}, else the cap stored in the cache)",
    )
    p.add_argument("--zero", action="store_true", help="set the lifetime counters to zero (nothing else changes)")


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
            f"{c['evictions']:,} evicted, {c.get('eviction_failures', 0):,} failed evictions",
        ),
        ("problems", f"{c['corrupt']:,} corrupt, {c['errors']:,} errors, {c.get('untrusted', 0):,} untrusted"),
        ("switch", f"{c.get('switched', 0):,} compiles and links sent here by CUDA_PROGRAM_CAS / install()"),
        (
            "write-back",
            f"{c.get('uploads', 0):,} entries sent to writable shared stores, {c.get('uploads_dropped', 0):,} dropped",
        ),
        (
            "shared stores",
            f"{c.get('listed_misses', 0):,} misses answered by a store's key list (no request), "
            f"{c.get('skipped_lookups', 0):,} lookups skipped as slower than compiling",
        ),
        ("time saved", _saved(info)),
        ("counted", f"since {when(since)}" if since else "since the cache was created (never zeroed)"),
    ]


def _saved(info: dict[str, Any]) -> str:
    """Compile time the hits saved, and the entries that saved the most."""
    text = f"{info['time_saved_s'] or 0:,.2f} s of compiling"
    top = ", ".join(
        f"{b['key']} {b['saved_s']:,.2f} s ({b['hits']:,} hits of {b['compile_s']:.2f} s)" for b in info["busiest"]
    )
    return f"{text}; most by {top}" if top else text


def _entries(info: dict[str, Any]) -> str:
    """The entries row: on a packed store, loose and packed, and what a repack left loose for gc."""
    if not info["packs"]:
        return f"{info['entries']:,} ({fmt_bytes(info['logical_bytes'])} if each had its own copy)"
    text = (
        f"{info['entries']:,}: {info['packed_entries']:,} packed, {info['loose_entries']:,} loose "
        f"({fmt_bytes(info['logical_bytes'])} if each loose one had its own copy)"
    )
    if info["loose_also_packed"]:
        text += (
            f"; {info['loose_also_packed']:,} of the loose ones are packed too (left by a repack: gc removes them "
            "once --grace has passed since their pack was written)"
        )
    return text


def run(args: argparse.Namespace) -> int:
    if args.zero:
        root, before = zero_counters(args.path)
        if args.json:
            print_json({"path": root, "zeroed": True, "counters_before": before})
        else:
            was = ", ".join(f"{n:,} {name.replace('_', ' ')}" for name, n in before.items())
            print(f"zeroed the lifetime counters of {root} (they were: {was})")
        return 0
    report = stats(args.path, max_size=args.max_size)
    return emit(args, report, lambda: _text(report))


def _text(report: StatsReport) -> None:
    info: dict[str, Any] = report.as_dict()
    cap = info["max_size_bytes"]
    now = time.time()

    def when(iso: str | None) -> str:
        if iso is None:
            return "-"
        age = max(0.0, now - datetime.fromisoformat(iso).timestamp())
        return f"{iso.replace('T', ' ').replace('+00:00', ' UTC')} ({fmt_age(age)} ago)"

    if cap:
        cap_text = f"{fmt_bytes(cap)}, {info['cap_used_percent']}% used ({_CAP_FROM[info['max_size_source']]})"
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
        ("entries", _entries(info)),
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
            f"{plural(info['packs'], 'pack')} holding {plural(info['packed_entries'], 'entry')} "
            f"({fmt_bytes(info['pack_bytes'])}, their blobs {fmt_bytes(info['pack_raw_bytes'])} raw), "
            f"{info['retired_packs']:,} retired (gc removes them after --grace)",
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
    print_problems(report, most=_SHOWN)
    packed, where = "", plural(info["blobs"], "blob")
    if info["packs"]:
        packed = f" ({info['packed_entries']:,} packed)"
        where = f"{plural(info['blobs'], 'loose blob')} and {plural(info['packs'], 'pack')}"
    stored = info["stored_bytes"] + info["pack_bytes"]
    print(
        f"{plural(info['entries'], 'entry')}{packed} in {where}, "
        f"{fmt_bytes(stored)} stored, dedup {info['dedup_ratio']:.2f}x"
        + (f", {info['cap_used_percent']}% of the cap" if cap else "")
        + ("" if info["hit_rate"] is None else f", hit rate {100 * info['hit_rate']:.1f}%")
        + (f"; {plural(info['problem_count'], 'file')} could not be read" if info["problem_count"] else "")
    )
