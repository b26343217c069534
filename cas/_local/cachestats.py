"""What ``cache.stats()`` returns: :class:`CacheStats` (imported on first use, not by a hit)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .stats import COUNTER_NAMES

__all__ = ["CacheStats"]


@dataclass(frozen=True, slots=True)
class CacheStats:
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
    hits: int = 0
    misses: int = 0
    writes: int = 0
    #: Writes whose content was already stored (the blob was freshened, not rewritten).
    dedup_writes: int = 0
    #: Manifests removed by size-cap eviction.
    evictions: int = 0
    #: Bad blobs or manifests met (moved aside or removed; never returned).
    corrupt: int = 0
    #: Hits served by a shared store.
    shared_hits: int = 0
    #: Writes not stored: the cache is read-only, the disk full, or a file was locked.
    dropped_writes: int = 0
    #: I/O errors met on lookups (a shared store gone, EIO, ESTALE, permission): each a miss.
    errors: int = 0
    #: Lookups that missed, then waited for another process of the node compiling the same key (``claim``).
    claim_waits: int = 0
    #: Of those, the ones that then found its result: a compile saved.
    claim_hits: int = 0
    #: Compiles and links that the switch (``CUDA_PROGRAM_CAS=1``, ``install()``) sent through the cache.
    switched: int = 0
    #: New entries sent to writable shared stores (write-back).
    uploads: int = 0
    #: Uploads not sent: the queue was full, the store down or paused, the process exiting.
    uploads_dropped: int = 0
    #: Shared entries ignored because no trusted key signed them (``$CUDA_PROGRAM_CAS_TRUSTED_KEYS``).
    untrusted: int = 0
    #: Compile time saved by hits, in microseconds: each hit adds its entry's recorded compile time
    #: (added when the counts are flushed; hits of entries whose compile time is unknown add nothing).
    saved_us: int = 0
    #: Shared-store lookups answered as misses by the store's key list, with no request.
    listed_misses: int = 0
    #: Shared-store lookups skipped because their round trips would cost more than the entry's compile.
    skipped_lookups: int = 0
    #: Files eviction could not remove (permission denied, a read-only or failing disk), and passes that failed.
    eviction_failures: int = 0

    @property
    def dedup_ratio(self) -> float:
        """``logical_bytes / blob_bytes``: 1.0 when nothing is shared (or the cache is empty)."""
        return self.logical_bytes / self.blob_bytes if self.blob_bytes else 1.0

    @property
    def manifest_bytes(self) -> int:
        """What the manifests take: ``stored_bytes - blob_bytes``."""
        return self.stored_bytes - self.blob_bytes


if tuple(f.name for f in fields(CacheStats))[6:] != COUNTER_NAMES:  # one list of counters, spelled twice
    raise RuntimeError("cuda_program_cas._local.stats.COUNTER_NAMES does not match CacheStats's counter fields")
