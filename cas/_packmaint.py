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
- ``stats``: packs, their entries and bytes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ._files import trusted_mtime_ns
from ._groups import lru_units
from ._layout import Layout
from ._pack import PackError, PackReader, list_packs
from ._remove import Remover
from ._repack import RETIRED, loose_entries, repack_locked

__all__ = ["PackGcResult", "collect_packs", "pack_stats", "verify_packs"]


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
    readers = []
    for path in list_packs(_packs_dir(lay)):
        try:
            readers.append(PackReader(path))
        except (OSError, PackError) as exc:
            result.problems.append(f"pack {path} cannot be read: {exc}")
    try:
        covered: dict[str, tuple[str, float]] = {}
        entries = []
        for reader in readers:
            packed_at = trusted_mtime_ns(int(reader.mtime * 1e9), now_ns) / 1e9
            for entry in reader.entries():
                covered.setdefault(entry.key_id, (entry.digest, packed_at))
                entries.append(entry)
    finally:
        for reader in readers:
            reader.close()
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
    # A front-door record and its results are one unit, as new as its newest member (cas._groups).
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
            result.problems.extend(report.unreadable)
    return result


def verify_packs(lay: Layout, *, repair: bool) -> list[tuple[str, str, str, bool]]:
    """Problems of the store's packs: ``(kind, path, detail, fixed)``; ``repair`` moves a bad pack aside."""
    problems = []
    for path in list_packs(_packs_dir(lay)):
        detail = ""
        try:
            reader = PackReader(path)
        except (OSError, PackError) as exc:
            detail = str(exc)
        else:
            try:
                if not reader.index_ok():
                    detail = "its index does not match its checksum"
                else:
                    bad = [e.key_id for e in reader.entries() if reader.read(e) is None]
                    if bad:
                        detail = f"{len(bad)} of {reader.count} blobs fail their hash"
            finally:
                reader.close()
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
    return problems


def pack_stats(lay: Layout) -> dict[str, int]:
    """Packs, packed entries and their bytes, and retired packs."""
    packs = entries = size = 0
    for path in list_packs(_packs_dir(lay)):
        try:
            reader = PackReader(path)
        except (OSError, PackError):
            continue
        packs += 1
        entries += reader.count
        size += reader.size
        reader.close()
    return {"packs": packs, "packed_entries": entries, "pack_bytes": size, "retired_packs": len(_retired(lay))}
