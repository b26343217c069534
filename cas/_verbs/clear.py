"""Empty a node's local cache (``ccache -C``), safe while others use it.

It is :meth:`cuda_program_cas.CacheStore.clear`: every manifest, then every blob no manifest
names, each removal re-checked; what a writer adds meanwhile stays. The counters, settings
and ``quarantine/`` are kept. A shared store is refused. A cache or store of an older layout
is emptied whole, shared or not, settings kept, and a current ``layout.json`` written.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

from cuda_program_cas._base.errors import LayoutError
from cuda_program_cas._disk.layout import (
    BLOBS,
    INDEX,
    LAYOUT_VERSION,
    Layout,
    is_shared_store,
    layout_version,
    write_layout,
)
from cuda_program_cas._disk.scan import take_snapshot
from cuda_program_cas._store.store import CacheStore

from .common import Report, cache_root, check_writable, not_created, open_cache

__all__ = ["ClearReport", "clear"]


@dataclass(slots=True)
class ClearReport(Report):
    """What a clear removed (``dry_run``: what it would remove); ``*_after`` is what writers added meanwhile."""

    root: str
    dry_run: bool
    exists: bool = True
    entries_before: int = 0
    blobs_before: int = 0
    bytes_before: int = 0
    entries_after: int = 0
    blobs_after: int = 0
    bytes_after: int = 0
    bytes_freed: int = 0
    elapsed_s: float = 0.0


def clear(path: str | os.PathLike[str] | None = None, *, dry_run: bool = False) -> ClearReport:
    """Remove every entry and blob of the local cache at ``path`` (None: the default directory).

    Raises :class:`cuda_program_cas.LayoutError` for a path that is not a cache, or is a shared store.
    """
    t0 = time.monotonic()
    root = cache_root(path)
    version = layout_version(root)
    older = version is not None and version < LAYOUT_VERSION
    if not older and not_created(root):  # an empty cache, as stats reports it
        return ClearReport(root, dry_run, exists=False)
    lay = Layout(root) if older else open_cache(root, write=not dry_run, purpose="clear").lay
    if older and not dry_run:
        check_writable(lay, "clear")
    if not older and is_shared_store(lay.root):
        raise LayoutError(
            f"{lay.root!r} is a shared store (publish marked it in its layout.json): clear empties a node's local "
            "cache; collect a shared store with `gc`, or remove it and publish again"
        )
    before = take_snapshot(lay.index, lay.blobs, read_manifests=False)
    after = None if older else before
    if not dry_run and older:
        _clear_older(lay)
    elif not dry_run:
        CacheStore(lay.root, max_size_bytes=None).clear()
        after = take_snapshot(lay.index, lay.blobs, read_manifests=False)
    left = (0, 0, 0) if after is None else (len(after.manifests), len(after.blobs), after.stored_bytes)
    return ClearReport(
        lay.root,
        dry_run,
        entries_before=len(before.manifests),
        blobs_before=len(before.blobs),
        bytes_before=before.stored_bytes,
        entries_after=left[0],
        blobs_after=left[1],
        bytes_after=left[2],
        bytes_freed=before.stored_bytes if dry_run else max(0, before.stored_bytes - left[2]),
        elapsed_s=time.monotonic() - t0,
    )


#: What an older layout's root holds that a clear of it keeps.
_KEPT = frozenset({"CACHEDIR.TAG", "layout.json", "settings.json", "tmp", "quarantine"})


def _clear_older(lay: Layout) -> None:
    with os.scandir(lay.root) as it:
        names = sorted(e.name for e in it if e.name not in _KEPT)
    for name in names:
        path = os.path.join(lay.root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    for sub in (BLOBS, INDEX):
        os.makedirs(os.path.join(lay.root, sub), exist_ok=True)
    write_layout(lay.root, lay.tmp, version=LAYOUT_VERSION)
