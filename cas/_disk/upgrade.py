"""Upgrading a layout-1 cache in place: manifests rewritten to name their key, then ``layout.json``.

Why it is sound. A layout-1 line names no key, so it is believed only while
``layout.json`` says 1 (:func:`cuda_program_cas.index.fits_key`; readers ask
:class:`cuda_program_cas._disk.layout.LayoutVersion` after reading the line).
``layout.json`` is replaced, atomically, only after every layout-1 line the
scan found was rewritten; from that moment no reader of this version believes a
layout-1 line, whatever is left or put there later. So every case ends in a
hit of the key's own bytes or a miss, never another key's:

- A crash, or a full disk, part-way: ``layout.json`` still says 1, the lines not
  yet rewritten still read, and the next writable open finishes the job. A
  write that fails (ENOSPC, EROFS) stops the upgrade there, with a WARNING.
- Two processes opening it at once: one upgrades (it holds ``evict.lock``,
  taken without blocking); the other goes on reading layout-1 lines until its
  reader sees the new ``layout.json``. An upgrade that finds the lock taken (a
  collector busy) leaves the cache as it is; the next writable open does it.
- A process of an older version that still runs and writes a layout-1 line
  during or after the upgrade: that line is refused once ``layout.json`` says 2
  (a miss, and removed as any damaged manifest is), never believed on the path
  it was put at. Such processes may treat the new manifests as damaged too (a
  miss); older versions refuse to open a layout-2 cache.

Each manifest is replaced only if it is still the layout-1 file that was read,
keeping its mtime (the entry's recency).
"""

from __future__ import annotations

import logging

from cuda_program_cas.index import Manifest

from .files import file_id, same_file
from .layout import LAYOUT_VERSION, Layout, layout_version, write_layout
from .scan import take_snapshot
from .writer import Writer

__all__ = ["upgrade_if_needed"]

_log = logging.getLogger("cuda_program_cas")


def upgrade_if_needed(lay: Layout, writer: Writer) -> bool:
    """Upgrade the cache at ``lay`` to the current layout if it is older; True when it was upgraded.

    Never raises for what is on disk: an upgrade that cannot finish leaves the
    cache at its layout (it still reads) and says why once.
    """
    version = layout_version(lay.root)
    if version is None or version >= LAYOUT_VERSION:
        return False
    with lay.collector_lock(busy_on_error=True) as held:
        if not held:
            return False  # another process is collecting or upgrading: the next open finishes it
        try:
            if layout_version(lay.root) != version:
                return False  # another process upgraded it before this one had the lock
            rewritten = _rewrite_manifests(lay, writer)
            write_layout(lay.root, lay.tmp, version=LAYOUT_VERSION)
        except OSError as exc:
            _log.warning("cuda-program-cas: cannot upgrade %s to layout %d yet: %s", lay.root, LAYOUT_VERSION, exc)
            return False
    _log.info(
        "cuda-program-cas: upgraded %s to layout %d (%d manifests rewritten)", lay.root, LAYOUT_VERSION, rewritten
    )
    return True


def _rewrite_manifests(lay: Layout, writer: Writer) -> int:
    """Rewrite every layout-1 manifest to name its key; how many were.

    An ``OSError`` (a full disk, a read-only remount) stops it, and with it the upgrade.
    """
    snap = take_snapshot(lay.index, lay.blobs)  # the layout still says 1: layout-1 lines are read
    rewritten = 0
    for info in snap.manifests:
        m = info.manifest
        if m is None or m.key_id is not None:
            continue
        path = lay.manifest_path(info.key_id)
        # Only the layout-1 file that was read is replaced (a writer may have
        # committed a new manifest since: it names its key already).
        if not same_file(path, file_id(info.stat)):
            continue
        # A rewrite dropped (a shard that is not a directory, which no lookup
        # reads through; a file kept locked on Windows) leaves a line that is
        # refused once layout.json says 2: that entry is a miss, and is compiled again.
        if writer.write_manifest(Manifest(m.digest, m.size, info.key_id), used_ns=info.stat.st_mtime_ns):
            rewritten += 1
    return rewritten
