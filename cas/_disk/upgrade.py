"""Upgrading a layout-1 cache in place: manifests rewritten to name their key, then ``layout.json``.

Safe while other processes of this version use the cache: they read both manifest
formats, each manifest is replaced atomically and only if it is still the
layout-1 file that was read (keeping its mtime, the entry's recency), and
``layout.json`` says version 2 only at the end. An upgrade that is interrupted,
or that finds another collector busy, leaves a cache that still reads; the next
writable open finishes it. Processes of an older version that still run may
treat the new manifests as damaged (a miss, never wrong bytes); once
``layout.json`` says 2, older versions refuse to open the cache.
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
    """Upgrade the cache at ``lay`` to the current layout if it is older; True when it was upgraded."""
    version = layout_version(lay.root)
    if version is None or version >= LAYOUT_VERSION:
        return False
    import filelock

    lock = filelock.FileLock(lay.lock, timeout=0)
    try:
        lock.acquire(blocking=False)
    except filelock.Timeout:
        return False  # another process is collecting or upgrading: the next open finishes it
    try:
        snap = take_snapshot(lay.index, lay.blobs)
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
            if writer.write_manifest(Manifest(m.digest, m.size, info.key_id), used_ns=info.stat.st_mtime_ns):
                rewritten += 1
        write_layout(lay.root, lay.tmp, version=LAYOUT_VERSION)
    finally:
        lock.release()
    _log.info(
        "cuda-program-cas: upgraded %s to layout %d (%d manifests rewritten)", lay.root, LAYOUT_VERSION, rewritten
    )
    return True
