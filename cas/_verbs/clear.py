"""Empty a node's local cache (``ccache -C``), safe while others use it.

It is :meth:`cuda_program_cas.CacheStore.clear`: every manifest, then every blob no
manifest names, each removal re-checked against the file the scan saw; what a
concurrent writer adds meanwhile stays, and a reader meanwhile gets misses,
never wrong bytes. The lifetime counters, settings and ``quarantine/`` are kept.

A shared store (publish marked it) is refused: emptying it empties every node's
second level at once, and its packs are not loose entries; its owner collects
it with ``gc`` or removes it and publishes again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from cuda_program_cas._base.errors import LayoutError
from cuda_program_cas._disk.layout import is_shared_store
from cuda_program_cas._disk.scan import take_snapshot
from cuda_program_cas._store.store import CacheStore

from .common import Report, cache_root, not_created, open_cache

__all__ = ["ClearReport", "clear"]


@dataclass(slots=True)
class ClearReport(Report):
    """What a clear removed (``dry_run``: what it would remove); ``*_after`` is what writers added meanwhile."""

    root: str
    dry_run: bool
    #: False where no cache has been created yet: nothing to remove, nothing created.
    exists: bool = True
    entries_before: int = 0
    blobs_before: int = 0
    bytes_before: int = 0
    entries_after: int = 0
    blobs_after: int = 0
    bytes_after: int = 0
    bytes_freed: int = 0
    elapsed_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    problem_count: int = 0


def clear(path: str | os.PathLike[str] | None = None, *, dry_run: bool = False) -> ClearReport:
    """Remove every entry and blob of the local cache at ``path`` (None: the default directory).

    Raises :class:`cuda_program_cas.LayoutError` for a path that is not a cache,
    or is a shared store; :class:`cuda_program_cas.ReadOnlyCacheError` when it
    cannot be written (not for ``dry_run``).
    """
    t0 = time.monotonic()
    root = cache_root(path)
    if not_created(root):  # an empty cache, as stats reports it
        return ClearReport(root, dry_run, exists=False)
    lay = open_cache(root, write=not dry_run, purpose="clear").lay
    if is_shared_store(lay.root):
        raise LayoutError(
            f"{lay.root!r} is a shared store (publish marked it in its layout.json): clear empties a node's local "
            "cache; collect a shared store with `gc`, or remove it and publish again"
        )
    before = take_snapshot(lay.index, lay.blobs, read_manifests=False)
    if not dry_run:
        CacheStore(lay.root, max_size_bytes=None).clear()
    after = before if dry_run else take_snapshot(lay.index, lay.blobs, read_manifests=False)
    return ClearReport(
        lay.root,
        dry_run,
        entries_before=len(before.manifests),
        blobs_before=len(before.blobs),
        bytes_before=before.stored_bytes,
        entries_after=len(after.manifests),
        blobs_after=len(after.blobs),
        bytes_after=after.stored_bytes,
        bytes_freed=before.stored_bytes if dry_run else max(0, before.stored_bytes - after.stored_bytes),
        elapsed_s=time.monotonic() - t0,
    )
