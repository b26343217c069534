"""``repack``: merge a shared store's loose entries and packs into one new pack.

The new pack holds every entry the store serves (a key's newest pack entry wins
over older packs, a pack entry over a loose one), each blob verified as it is
read. It becomes visible complete (written in ``tmp/``, synced, renamed into
``packs/``); then the packs it replaced are *retired*: moved into
``packs/retired/`` (out of the listing new readers see; a node that has one open
keeps reading it through its descriptor) with their mtime set to now. Nothing a
node may still be reading is removed here: ``gc`` removes retired packs, and loose
entries that a pack holds with the same digest, once the shared grace period has
passed since the pack that covers them was written.

``keep(key_id, time_ns)`` lets ``gc`` drop entries (``--max-age``/``--max-size``)
by repacking without them.

One repack at a time: it takes the store's ``evict.lock`` without blocking, the
lock ``gc`` holds. Two repacks at once would each retire the packs the other is
reading (one then failed with ENOENT and two full packs stayed); a second one
finds the lock taken and does nothing (:class:`cas.CollectorBusyError`).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ._blobs import BlobStore
from ._classify import Condition, classify
from ._errors import CollectorBusyError, CorruptBlobError
from ._layout import Layout
from ._maint import check_writable, open_cache
from ._pack import PackEntry, PackError, PackInput, PackReader, list_packs, write_pack
from ._packsummary import PackSummary
from ._scan import ManifestInfo, take_snapshot
from ._writer import Writer

__all__ = ["RETIRED", "RepackReport", "loose_entries", "repack", "repack_locked"]

#: Where replaced packs wait out the shared grace period, under ``packs/``.
RETIRED = "retired"


@dataclass(slots=True)
class RepackReport:
    root: str
    #: The pack written (None when there was nothing to pack).
    pack: str | None = None
    entries: int = 0
    blobs: int = 0
    bytes: int = 0
    #: Entries left out on purpose (``keep`` said no).
    dropped: int = 0
    #: Entries left out because their blob could not be read or was corrupt.
    unreadable: list[str] = field(default_factory=list)
    #: Packs moved to ``packs/retired/``.
    retired: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        out = {k: getattr(self, k) for k in self.__slots__}
        out["problems"] = list(self.unreadable)
        out["problem_count"] = len(self.unreadable)
        out["elapsed_s"] = round(self.elapsed_s, 3)
        return out


def loose_entries(lay: Layout) -> list[ManifestInfo]:
    """The loose entries of a store that serve their key (judged by the one classifier), by key id."""
    snap = take_snapshot(lay.index, lay.blobs)
    return sorted((m for m in snap.manifests if classify(m, snap) is Condition.OK), key=lambda m: m.key_id)


def repack(
    root: str | os.PathLike[str],
    *,
    keep: Callable[[str, int], bool] | None = None,
    fsync: bool = True,
) -> RepackReport:
    """Merge the store at ``root`` into one new pack and retire the packs it replaced.

    Raises :class:`cas.CollectorBusyError` when another repack or a ``gc`` holds
    the store's lock (nothing was changed).
    """
    cache = open_cache(root, write=True, purpose="repack")
    lay = cache.lay
    check_writable(lay, "repack")
    import filelock

    lock = filelock.FileLock(lay.lock, timeout=0)
    try:
        lock.acquire(blocking=False)
    except filelock.Timeout:
        raise CollectorBusyError(
            f"store {lay.root!r} is busy: another repack or a gc holds {lay.lock}; nothing was changed"
        ) from None
    try:
        return repack_locked(lay, keep=keep, fsync=fsync)
    finally:
        lock.release()


def repack_locked(lay: Layout, *, keep: Callable[[str, int], bool] | None = None, fsync: bool = True) -> RepackReport:
    """:func:`repack` for a caller that holds the store's lock already (``gc``)."""
    t0 = time.monotonic()
    report = RepackReport(lay.root)
    old = []
    for path in list_packs(os.path.join(lay.root, "packs")):
        try:
            old.append(PackReader(path))
        except (OSError, PackError) as exc:
            report.unreadable.append(f"{path}: {exc}")
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
    try:
        if inputs or old:
            writer = Writer(lay, file_mode=0o644, exact_mode=True, fsync=fsync)
            report.pack = write_pack(lay, inputs, writer.write_file, stats)
            report.entries, report.blobs, report.bytes = stats["entries"], stats["blobs"], stats["bytes"]
    finally:
        for reader in old:
            reader.close()
    if report.pack is not None:
        report.retired = [retire(lay, reader.path) for reader in old]
        PackSummary.load(lay.root).save(writer.write_file)  # publishers read this, not every pack
    report.elapsed_s = time.monotonic() - t0
    return report


def _from_pack(reader: PackReader, entry: PackEntry, report: RepackReport) -> bytes | None:
    data = reader.read(entry)
    if data is None:
        report.unreadable.append(f"{reader.path}: the blob of {entry.key_id} is damaged")
    return data


def _from_loose(blobs: BlobStore, digest: str, size: int, report: RepackReport) -> bytes | None:
    try:
        return blobs.read(digest, size)[0]
    except (OSError, CorruptBlobError) as exc:
        report.unreadable.append(f"{blobs.path_for(digest)}: {exc}")
        return None


def retire(lay: Layout, path: str) -> str:
    """Move a replaced pack out of the listing into ``packs/retired/``, its mtime set to now (its grace starts)."""
    retired_dir = os.path.join(lay.root, "packs", RETIRED)
    os.makedirs(retired_dir, exist_ok=True)
    dest = os.path.join(retired_dir, os.path.basename(path))
    os.replace(path, dest)
    os.utime(dest)
    return dest
