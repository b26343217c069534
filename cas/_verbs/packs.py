"""Maintenance of a store's packs, for ``gc``, ``verify`` and ``stats``.

- ``gc``: retired packs (``packs/retired/``, moved there by ``repack``) go once the
  grace period has passed since they were retired; a loose manifest that a live
  pack holds with the same digest goes once the grace period has passed since
  that pack was written (nodes had time to list it); ``--max-age``/``--max-size``
  over packed entries are applied by repacking without the dropped entries, never
  by rewriting a pack. Nothing goes in the run that replaced it.
- ``verify``: each pack's index checksum, and every entry's blob hashed; with
  ``repair``, a bad pack is moved into ``quarantine/`` (its good entries are lost
  from the store until the next publish; a repack first keeps them).
- ``stats``: packs, their entries and bytes (stored, and the raw bytes they stand for).

Repacking (``repack``, and ``gc`` over packed entries, which drops entries by ``keep``) merges a
store's loose entries and packs into one new pack of every entry the store serves (a key's newest
pack entry wins over older packs, a pack entry over a loose one), each blob verified as it is read.
It becomes visible complete; then the packs it replaced are *retired* into ``packs/retired/`` (a node
that has one open keeps reading it). Nothing a node may still be reading is removed here: ``gc``
removes retired packs, and loose entries a pack holds with the same digest, after the grace period.

Repacking needs the store's ``evict.lock``: :mod:`.repack` takes it, ``gc`` holds it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import ClassVar

from cuda_program_cas._base.engine import StoreFailure
from cuda_program_cas._base.errors import CorruptBlobError
from cuda_program_cas._disk.blobs import BlobStore
from cuda_program_cas._disk.classify import Condition, classify
from cuda_program_cas._disk.direngine import DirEngine, DirModes
from cuda_program_cas._disk.files import trusted_mtime_ns
from cuda_program_cas._disk.layout import Layout
from cuda_program_cas._disk.pack import RETIRED, PackEntry, PackError, PackInput, PackReader
from cuda_program_cas._disk.packpublish import StorePacks
from cuda_program_cas._disk.packset import list_packs
from cuda_program_cas._disk.remove import Remover
from cuda_program_cas._disk.scan import ManifestInfo, take_snapshot
from cuda_program_cas._disk.writer import Writer
from cuda_program_cas.index import lru_units

from .common import SHARED_MIN_GRACE_S, Report

__all__ = [
    "RETIRED",
    "PackGcResult",
    "RepackReport",
    "collect_packs",
    "loose_entries",
    "pack_stats",
    "repack_locked",
    "verify_packs",
]

_log = logging.getLogger("cuda_program_cas")


@dataclass(slots=True)
class RepackReport(Report):
    """What a repack wrote and retired; ``problems``: the entries left out because their blob could not be read."""

    #: Every problem is listed.
    max_listed: ClassVar[int | None] = None

    root: str
    #: The pack written (None when there was nothing to pack).
    pack: str | None = None
    entries: int = 0
    blobs: int = 0
    bytes: int = 0
    #: Entries left out on purpose (``keep`` said no).
    dropped: int = 0
    #: Packs moved to ``packs/retired/``.
    retired: list[str] = field(default_factory=list)
    #: Loose entries left in ``index/`` (nodes may be reading them: a repack removes nothing).
    loose_left: int = 0
    #: Of those, the ones the new pack holds with the same blob: ``gc`` removes them, and the
    #: retired packs, once its grace period has passed since this repack.
    loose_packed: int = 0
    #: When that is with ``gc``'s default (and shortest, for a shared store) grace: ISO 8601, UTC.
    gc_removes_after: str | None = None
    elapsed_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        out = Report.as_dict(self)
        out["unreadable"] = list(self.problems)  # what docs/cli.md names them: entries and packs that could not be read
        return out


def loose_entries(lay: Layout) -> list[ManifestInfo]:
    """The loose entries of a store that serve their key (judged by the one classifier), by key id."""
    snap = take_snapshot(lay.index, lay.blobs)
    return sorted((m for m in snap.manifests if classify(m, snap) is Condition.OK), key=lambda m: m.key_id)


def repack_locked(lay: Layout, *, keep: Callable[[str, int], bool] | None = None, fsync: bool = True) -> RepackReport:
    """Repack the store of ``lay``, for a caller that holds its lock (``repack``, ``gc``)."""
    t0 = time.monotonic()
    report = RepackReport(lay.root)
    old = []
    for path in list_packs(os.path.join(lay.root, "packs")):
        try:
            old.append(PackReader(path))
        except (OSError, PackError) as exc:
            report.problem(f"{path}: {exc}")
    blobs = BlobStore(lay.blobs)
    inputs: list[PackInput] = []
    seen: set[str] = set()
    for reader in old:  # newest first
        for entry in reader.entries():
            if entry.key_id in seen:
                continue
            seen.add(entry.key_id)
            if keep is not None and not keep(entry.key_id, entry.time_ns):
                report.dropped += 1
                continue
            load = functools.partial(_from_pack, reader, entry, report)
            inputs.append((entry.key_id, entry.digest, load, entry.time_ns))
    for info in loose_entries(lay):
        assert info.manifest is not None
        kid, digest, size, mtime = info.key_id, info.manifest.digest, info.manifest.size, info.stat.st_mtime_ns
        if kid in seen:
            continue
        seen.add(kid)
        if keep is not None and not keep(kid, mtime):
            report.dropped += 1
            continue
        inputs.append((kid, digest, functools.partial(_from_loose, blobs, digest, size, report), mtime))
    stats: dict[str, int] = {}
    engine = _engine(lay, fsync)
    packs = StorePacks(engine)
    try:
        if inputs or old:
            report.pack = packs.write(inputs, stats, empty=True)
            report.entries, report.blobs, report.bytes = stats["entries"], stats["blobs"], stats["bytes"]
    finally:
        for reader in old:
            reader.close()
    if report.pack is not None:
        report.retired = [retire(lay, reader.path) for reader in old]
        packs.entries()  # the packs listed now: the new one
        packs.finish(True)  # packs/summary for publishers, packs/list for HTTP readers
        held = {kid: packed.entry for kid, packed in packs.written().items()}  # read back by the write
        _left_loose(lay, report, held)
        _place_sets(lay, report.pack, held, engine.writer(fsync=fsync))
    report.elapsed_s = time.monotonic() - t0
    return report


def _engine(lay: Layout, fsync: bool) -> DirEngine:
    """The store's directory engine for the one pack publisher: its files 0644 exactly, a pack fsynced with fsync."""
    return DirEngine(lay.root, modes=dataclasses.replace(DirModes.for_process(False, fsync=fsync), file=0o644))


def _left_loose(lay: Layout, report: RepackReport, held: dict[str, PackEntry]) -> None:
    """Count the loose entries a repack left, and say when ``gc`` removes those its pack (``held``) holds."""
    loose = loose_entries(lay)
    report.loose_left = len(loose)
    packed = {kid: e.digest for kid, e in held.items()}
    report.loose_packed = sum(1 for m in loose if m.manifest is not None and packed.get(m.key_id) == m.manifest.digest)
    if report.loose_packed or report.retired:
        # collect_packs: covered loose entries once the pack is older than the grace; retired packs
        # once they are (retire() set their mtime to now, just after the pack was written).
        when = time.time() + SHARED_MIN_GRACE_S
        report.gc_removes_after = datetime.fromtimestamp(when, tz=timezone.utc).isoformat(timespec="seconds")


def _place_sets(lay: Layout, pack: str, held: dict[str, PackEntry], writer: Writer) -> None:
    """Give each warm set's lines (``sets/*``) the pack and offset the new pack (``held``) holds their entry at.

    A set written against loose entries, or against the packs this repack retired,
    would send a cold node to loose copies that ``gc`` removes and to retired packs
    (one request per entry, then misses); rewritten, it is one multi-range request
    again. A line whose entry the new pack lacks (dropped, unreadable) names no
    pack; a damaged set is left (nodes ignore it). Through the one read-modify-write
    of a set (:func:`cuda_program_cas._shared.warmset.updated`).
    """
    from cuda_program_cas._shared.warmset import MAX_SET_BYTES, stored_sets, updated

    names = stored_sets(lay.root)
    if not names:
        return
    name_of = os.path.basename(pack)

    def where(kid: str, digest: str) -> tuple[str, int, int, int] | None:
        entry = held.get(kid)
        return (name_of, entry.offset, entry.size, entry.at) if entry is not None and entry.digest == digest else None

    engine = DirEngine(lay.root)
    for name in names:
        try:
            data = updated(engine.get(name, limit=MAX_SET_BYTES), [], None, where)
            if data is not None:
                writer.write_file(engine.path(name), [data])
        except (OSError, StoreFailure) as exc:  # a set is a hint: one left as it was costs lookups, not bytes
            _log.debug("cuda-program-cas: the warm set %s was not rewritten: %s", engine.path(name), exc)


def _from_pack(reader: PackReader, entry: PackEntry, report: RepackReport) -> bytes | None:
    """The entry's bytes as its pack holds them, verified: the new pack takes a framed one as it is."""
    try:
        return reader.read_stored(entry)
    except (OSError, PackError) as exc:
        report.problem(f"{exc}: left out" if isinstance(exc, PackError) else f"{reader.path}: {exc}")
        return None


def _from_loose(blobs: BlobStore, digest: str, size: int, report: RepackReport) -> bytes | None:
    try:
        return blobs.read(digest, size)[0]
    except (OSError, CorruptBlobError) as exc:
        report.problem(f"{blobs.path_for(digest)}: {exc}")
        return None


def retire(lay: Layout, path: str) -> str:
    """Move a replaced pack out of the listing into ``packs/retired/``, its mtime set to now (its grace starts)."""
    retired_dir = os.path.join(lay.root, "packs", RETIRED)
    os.makedirs(retired_dir, exist_ok=True)
    dest = os.path.join(retired_dir, os.path.basename(path))
    os.replace(path, dest)
    os.utime(dest)
    return dest


@dataclass(slots=True)
class PackGcResult:
    retired_removed: int = 0
    retired_bytes: int = 0
    loose_removed: int = 0
    #: Entries dropped by repacking for ``max_age_s``/``max_size``.
    entries_dropped: int = 0
    repacked_into: str | None = None
    problems: list[str] = field(default_factory=list)


def _packs_dir(lay: Layout) -> str:
    return os.path.join(lay.root, "packs")


def _each_pack(lay: Layout) -> Iterator[tuple[str, PackReader | OSError | PackError]]:
    """Each pack of the store, newest first, with its reader (closed after its turn) or why it cannot be opened."""
    for path in list_packs(_packs_dir(lay)):
        try:
            reader = PackReader(path)
        except (OSError, PackError) as exc:
            yield path, exc
            continue
        try:
            yield path, reader
        finally:
            reader.close()


def _retired(lay: Layout) -> list[tuple[str, os.stat_result]]:
    directory = os.path.join(_packs_dir(lay), RETIRED)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    out = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            out.append((path, os.lstat(path)))
        except OSError:
            continue
    return out


def collect_packs(
    lay: Layout,
    remover: Remover | None,
    *,
    grace_s: float,
    max_age_s: float | None = None,
    max_size: int | None = None,
) -> PackGcResult:
    """Collect what repacks replaced and apply ages and sizes to packed entries (``remover`` None: plan only)."""
    result = PackGcResult()
    now = time.time()
    now_ns = time.time_ns()
    for path, st in _retired(lay):
        if trusted_mtime_ns(st.st_mtime_ns, now_ns) < now_ns - int(grace_s * 1e9):
            result.retired_removed += 1
            result.retired_bytes += st.st_size
            if remover is not None:
                try:
                    os.unlink(path)
                except OSError as exc:
                    result.problems.append(f"retired pack {path} cannot be removed: {exc.strerror}")
    covered: dict[str, tuple[str, float]] = {}
    entries = []
    for path, reader in _each_pack(lay):
        if isinstance(reader, Exception):
            result.problems.append(f"pack {path} cannot be read: {reader}")
            continue
        packed_at = trusted_mtime_ns(int(reader.mtime * 1e9), now_ns) / 1e9
        for entry in reader.entries():
            covered.setdefault(entry.key_id, (entry.digest, packed_at))
            entries.append(entry)
    # Loose manifests a pack holds with the same digest, once the pack is older than the grace period.
    for info in loose_entries(lay):
        held = covered.get(info.key_id)
        manifest = info.manifest
        if held is None or held[1] >= now - grace_s or manifest is None or manifest.digest != held[0]:
            continue
        result.loose_removed += 1
        if remover is not None and remover.manifest(info.key_id, info.stat):
            try:
                os.utime(lay.blob_path(manifest.digest))  # an orphan now: it waits out the grace period
            except OSError:
                pass
    # Ages and sizes: repack without what goes.
    # A front-door record and its results are one unit, as new as its newest member (cuda_program_cas.index).
    units = lru_units(entries, lambda e: trusted_mtime_ns(e.time_ns, now_ns))
    drop: set[str] = set()
    if max_age_s is not None:
        cutoff = now_ns - int(max_age_s * 1e9)
        for unit in units:
            if max(trusted_mtime_ns(e.time_ns, now_ns) for e in unit) < cutoff:
                drop.update(e.key_id for e in unit)
    if max_size is not None:
        total = 0
        for unit in reversed(units):  # newest kept first
            if unit[0].key_id in drop:
                continue
            total += sum(e.size for e in unit)
            if total > max_size:
                drop.update(e.key_id for e in unit)
    if drop:
        result.entries_dropped = len(drop)
        if remover is not None:
            report = repack_locked(lay, keep=lambda kid, _t: kid not in drop)  # gc holds the lock
            result.repacked_into = report.pack
            result.problems.extend(report.problems)
    return result


def verify_packs(lay: Layout, *, repair: bool) -> list[tuple[str, str, str, bool]]:
    """Problems of the store's packs: ``(kind, path, detail, fixed)``; ``repair`` moves a bad pack aside."""
    problems = []
    for path, reader in _each_pack(lay):
        detail = ""
        if isinstance(reader, Exception):
            detail = str(reader)
        elif not reader.index_ok():
            detail = "its index does not match its checksum"
        elif bad := [why for e in reader.entries() if (why := _damage(reader, e)) is not None]:
            detail = f"{len(bad)} of {reader.count} blobs fail their hash (the first: {bad[0]})"
        if not detail:
            continue
        fixed = False
        if repair:
            os.makedirs(lay.quarantine, mode=0o700, exist_ok=True)
            dest = os.path.join(lay.quarantine, f"{os.path.basename(path)}.{time.time_ns()}")
            try:
                os.replace(path, dest)
                fixed = True
                detail += f"; moved to {dest}"
            except OSError as exc:
                detail += f"; cannot be moved aside: {exc.strerror}"
        problems.append(("bad_pack", path, detail, fixed))
    if any(fixed for *_, fixed in problems):
        StorePacks(_engine(lay, False)).finish(True)  # packs/list: what HTTP readers list
    return problems


def _damage(reader: PackReader, entry: PackEntry) -> str | None:
    """What is wrong with ``entry``'s blob in its pack (cut short, a bad frame, the wrong bytes); None: it is good."""
    try:
        reader.read(entry)
    except PackError as exc:
        return str(exc).removeprefix(f"{reader.path}: ")
    return None


def pack_stats(lay: Layout, keys: dict[str, str] | None = None) -> dict[str, int]:
    """Packs, packed entries and their bytes (the packs' files), the raw bytes their blobs stand for, retired packs.

    ``pack_raw_bytes``: each distinct blob's raw size as its object states it (a
    frame's header, a raw one's own size; one small read each, not verified), so
    ``pack_bytes / pack_raw_bytes`` is what compression saves. ``keys``: filled with
    each packed key id and the digest the store serves for it (the newest pack's),
    so ``stats`` counts a key loose and packed once.
    """
    packs = entries = size = raw = 0
    for _path, reader in _each_pack(lay):  # newest first
        if isinstance(reader, Exception):
            continue
        packs += 1
        entries += reader.count
        size += reader.size
        blobs: dict[int, int] = {}
        for entry in reader.entries():
            if entry.offset not in blobs:
                blobs[entry.offset] = reader.raw_size(entry)
            if keys is not None:
                keys.setdefault(entry.key_id, entry.digest)
        raw += sum(blobs.values())
    retired = len(_retired(lay))
    return {
        "packs": packs,
        "packed_entries": entries,
        "pack_bytes": size,
        "pack_raw_bytes": raw,
        "retired_packs": retired,
    }
