"""What ``cache.stats()`` returns: :class:`CacheStats` (imported on first use, not by a hit)."""

from __future__ import annotations

from dataclasses import dataclass

from .stats import Counts

__all__ = ["CacheStats"]


@dataclass(frozen=True, slots=True)
class CacheStats(Counts):
    """A snapshot of a cache: what is on disk, and what this instance did.

    ``entries``, ``blobs``, ``logical_bytes`` and ``stored_bytes`` describe the local
    cache directory now (a scan). The counters count this instance's operations
    since it was opened.
    """

    #: Keys (manifests) in the local cache.
    entries: int
    #: Distinct blobs in the local cache.
    blobs: int
    #: Sum of the sizes of all entries, as if each key had its own copy.
    logical_bytes: int
    #: Unique blob bytes plus manifest bytes: what the size cap counts (it adds the files in ``tmp/``, none at rest).
    stored_bytes: int
    #: Unique blob bytes: each distinct binary once.
    blob_bytes: int
    #: The cap, or None.
    max_size_bytes: int | None
    # The counters follow, as fields with default 0: their names, types and meanings are Counts's.
    __annotations__.update(Counts.__annotations__)

    @property
    def dedup_ratio(self) -> float:
        """``logical_bytes / blob_bytes``: 1.0 when nothing is shared (or the cache is empty)."""
        return self.logical_bytes / self.blob_bytes if self.blob_bytes else 1.0

    @property
    def manifest_bytes(self) -> int:
        """What the manifests take: ``stored_bytes - blob_bytes``."""
        return self.stored_bytes - self.blob_bytes
