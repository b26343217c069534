"""What a cache holds, how well it deduplicates, how full it is, and its lifetime counters.

:func:`stats` reads only (no lock, nothing touched). Files it cannot read are its
``problems``, and the figures then count only the rest. A path where no cache has been
created yet is an empty cache (``exists`` false).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import ClassVar

from cuda_program_cas._disk.classify import Condition, classify
from cuda_program_cas._disk.layout import Layout, stale_temp_files
from cuda_program_cas._disk.scan import Snapshot, take_snapshot
from cuda_program_cas._disk.settings import MAX_SIZE, effective_settings
from cuda_program_cas._local.lifetime import read_counters
from cuda_program_cas._local.lifetime import zero_counters as _zero_counters
from cuda_program_cas._local.usage import read_usage
from cuda_program_cas.index import is_record

from .common import Report, cache_root, iso_utc, not_created, open_cache
from .packs import pack_stats

__all__ = ["StatsReport", "stats", "zero_counters"]


@dataclass(slots=True)
class StatsReport(Report):
    """The statistics of one cache directory. Bytes are as the size cap counts them (``stored_bytes``:
    unique blobs plus manifests) unless named otherwise; times are ISO 8601 in UTC."""

    max_listed: ClassVar[int | None] = None

    path: str
    exists: bool = True
    #: Keys the store holds, loose or packed, each once (a key both loose and packed counts once).
    entries: int = 0
    #: Of ``entries``, those a manifest in ``index/`` holds (the byte figures are theirs).
    loose_entries: int = 0
    #: Loose manifests that a live pack holds too, with the same blob: what a repack left for ``gc``.
    loose_also_packed: int = 0
    blobs: int = 0
    #: Sum of the sizes of the loose entries, as if each key had its own copy.
    logical_bytes: int = 0
    stored_bytes: int = 0
    blob_bytes: int = 0
    manifest_bytes: int = 0
    #: ``logical_bytes / blob_bytes``, rounded to three places (1.0 for an empty cache).
    dedup_ratio: float = 1.0
    max_size_bytes: int | None = None
    #: Where the cap came from: ``argument``, ``environment``, ``cache`` or ``default`` (None without a cap).
    max_size_source: str | None = None
    cap_used_percent: float | None = None
    oldest_use: str | None = None
    newest_use: str | None = None
    #: Files, directories and bytes on disk (allocated blocks) under the cache, itself included.
    files: int = 0
    directories: int = 0
    inodes: int = 0
    disk_bytes: int = 0
    #: Front-door header records (``cache.compile``) and their blobs' bytes.
    front_door_records: int = 0
    front_door_record_bytes: int = 0
    orphan_blobs: int = 0
    orphan_bytes: int = 0
    invalid_manifests: int = 0
    unreadable_manifests: int = 0
    dangling_manifests: int = 0
    size_mismatch_manifests: int = 0
    stale_temp_files: int = 0
    quarantined_files: int = 0
    packs: int = 0
    #: Keys the live packs hold, each once.
    packed_entries: int = 0
    pack_bytes: int = 0
    #: The raw bytes the packs' distinct blobs stand for (their blobs are stored compressed).
    pack_raw_bytes: int = 0
    retired_packs: int = 0
    #: The lifetime counters of every process, or None when they cannot be read.
    counters: dict[str, int] | None = None
    hit_rate: float | None = None
    counters_zeroed_at: str | None = None
    #: Compile time the hits of every process saved since the counters were zeroed.
    time_saved_s: float | None = None
    #: The (at most 5) entries whose hits saved the most: ``key`` (16 hex), ``hits``, ``saved_s``, ``compile_s``.
    busiest: list[dict[str, object]] = field(default_factory=list)


def stats(path: str | os.PathLike[str] | None = None, *, max_size: int | None = None) -> StatsReport:
    """The statistics of the cache at ``path`` (None: the default directory); reads only.

    ``max_size``: the cap to compare the stored bytes with; None takes the cap a cache opened
    there gets. Raises :class:`cuda_program_cas.LayoutError` for a file or a foreign directory.
    """
    root = cache_root(path)
    cap: int | None = max_size
    source = "argument"
    if max_size is None:  # the environment, else the cache's own setting
        setting = next(s for s in effective_settings(root) if s.name == MAX_SIZE)
        cap = setting.value if isinstance(setting.value, int) else None
        source = setting.source
    return _gather(root, cap, source)


def zero_counters(path: str | os.PathLike[str] | None = None) -> tuple[str, dict[str, int]]:
    """Set the lifetime counters of the cache at ``path`` to zero: its root, and the counters as they were."""
    lay = open_cache(cache_root(path), write=True, purpose="zero the counters").lay
    return lay.root, _zero_counters(lay).counters


def _walk(root: str) -> tuple[int, int, int]:
    """Files, directories and bytes on disk (allocated blocks) under ``root``, itself included."""
    files, dirs, disk = 0, 1, 0
    for top, subdirs, names in os.walk(root):  # into no symlink; a folder it cannot list is skipped
        for name in subdirs + names:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            disk += getattr(st, "st_blocks", 0) * 512 or st.st_size
            dirs += stat.S_ISDIR(st.st_mode)
            files += not stat.S_ISDIR(st.st_mode)
    return files, dirs, disk


def _unreadable(index_dir: str, blobs_dir: str, snap: Snapshot) -> list[str]:
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


def _gather(root: str, cap: int | None, cap_source: str | None) -> StatsReport:
    path = os.path.abspath(root)
    exists = not not_created(path)
    lay = open_cache(path, write=False, allow_damaged=True).lay if exists else Layout(path)
    snap = take_snapshot(lay.index, lay.blobs)
    report = StatsReport(lay.root, exists)
    for unreadable in _unreadable(lay.index, lay.blobs, snap):
        report.problem(f"{unreadable}: cannot be read")
    conditions = [classify(m, snap) for m in snap.manifests]
    uses = [m.stat.st_mtime_ns for m in snap.manifests if m.manifest is not None]
    orphans = snap.orphans()
    files, dirs, disk = _walk(lay.root)
    try:
        quarantined = len(os.listdir(lay.quarantine))
    except OSError:
        quarantined = 0
    records = [m.manifest for m in snap.manifests if m.manifest is not None and is_record(m.key_id)]
    try:
        life = read_counters(lay)
    except OSError as exc:
        life = None
        report.problem(f"{lay.counters}: cannot be read ({exc.strerror or exc}): the lifetime counters are unknown")
    packed: dict[str, str] = {}
    packs = pack_stats(lay, packed)
    loose = {m.key_id: m for m in snap.manifests}
    report.entries = len(loose.keys() | packed.keys())
    report.loose_entries = len(loose)
    report.loose_also_packed = sum(
        1 for kid, m in loose.items() if m.manifest is not None and packed.get(kid) == m.manifest.digest
    )
    report.blobs = len(snap.blobs)
    report.logical_bytes = snap.logical_bytes
    report.stored_bytes = stored = snap.stored_bytes
    report.blob_bytes = snap.blob_bytes
    report.manifest_bytes = snap.manifest_bytes
    report.dedup_ratio = round(snap.logical_bytes / snap.blob_bytes, 3) if snap.blob_bytes else 1.0
    report.max_size_bytes = cap
    report.max_size_source = cap_source if cap else None
    report.cap_used_percent = round(100.0 * stored / cap, 1) if cap else None
    report.oldest_use = iso_utc(min(uses) / 1e9) if uses else None
    report.newest_use = iso_utc(max(uses) / 1e9) if uses else None
    report.files, report.directories, report.inodes, report.disk_bytes = files, dirs, files + dirs, disk
    report.front_door_records = len(records)
    report.front_door_record_bytes = sum(snap.blobs[r.digest].st_size for r in records if r.digest in snap.blobs)
    report.orphan_blobs = len(orphans)
    report.orphan_bytes = sum(snap.blobs[d].st_size for d in orphans)
    report.invalid_manifests = sum(c in (Condition.INVALID, Condition.MISPLACED) for c in conditions)
    report.unreadable_manifests = len(snap.unreadable)
    report.dangling_manifests = sum(c is Condition.DANGLING for c in conditions)
    report.size_mismatch_manifests = sum(c is Condition.SIZE_MISMATCH for c in conditions)
    report.stale_temp_files = len(stale_temp_files(lay.tmp))
    report.quarantined_files = quarantined
    report.packs, report.packed_entries = packs["packs"], len(packed)
    report.pack_bytes, report.retired_packs = packs["pack_bytes"], packs["retired_packs"]
    report.pack_raw_bytes = packs["pack_raw_bytes"]
    try:
        usage = read_usage(lay)
    except OSError as exc:
        report.problem(f"{lay.usage}: cannot be read ({exc.strerror or exc}): the time saved per entry is unknown")
    else:
        top = sorted(usage.saved.items(), key=lambda item: item[1][1], reverse=True)[:5]
        report.busiest = [
            {
                "key": f"{n:016x}",
                "hits": hits,
                "saved_s": round(us / 1e6, 3),
                "compile_s": round(usage.compile_us.get(n, 0) / 1e6, 3),
            }
            for n, (hits, us) in top
        ]
    if life is not None:
        report.time_saved_s = round(life.counters["saved_us"] / 1e6, 3)
        report.counters = life.counters
        report.hit_rate = None if life.hit_rate is None else round(life.hit_rate, 4)
        report.counters_zeroed_at = None if life.zeroed_ns is None else iso_utc(life.zeroed_ns / 1e9)
    return report
