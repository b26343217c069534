"""The counters, named once (:class:`Counts`), and this instance's counts of them (:class:`Counters`).

``CacheStats`` is apart, imported by ``stats()``, not a hit: a dataclass of 25 fields costs 1.8 ms to define.
"""

from __future__ import annotations

import itertools
import threading

from cuda_program_cas._base.fork import after_fork

__all__ = ["COUNTER_NAMES", "Counters", "Counts", "merged"]


class Counts:
    """The counters, the one list: their names, types and meanings (the fields of ``CacheStats`` after its six of
    the disk). A plain class, cheap to define on the hit path; ``CacheStats`` is the dataclass built on it.
    """

    __slots__ = ()

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


#: The counters' names, in order (the lifetime counters' lines keep it).
COUNTER_NAMES = tuple(Counts.__annotations__)


class Counters:
    """This instance's operation counts (thread-safe); hits step an ``itertools.count`` (atomic, no lock)."""

    __slots__ = ("__weakref__", "_hits", "_lock", "hit", *(n for n in COUNTER_NAMES if n != "hits"))

    def __init__(self) -> None:
        self._lock = threading.Lock()
        after_fork(self)
        self._hits = itertools.count()
        for name in COUNTER_NAMES:
            if name != "hits":
                setattr(self, name, 0)
        self.hit = self._hits.__next__

    @property
    def hits(self) -> int:
        # repr is "count(N)": N is the next value, the number of hits so far.
        return int(repr(self._hits)[6:-1])

    def counter_of_hits(self) -> itertools.count[int]:
        return self._hits

    def add(self, name: str, n: int = 1) -> None:
        if name == "hits":
            for _ in range(n):
                self.hit()
            return
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def _after_fork_in_child(self) -> None:
        # The counts stay: a child starts from its parent's (its recorder records only what it adds).
        self._lock = threading.Lock()

    def as_dict(self, *, lock: bool = True) -> dict[str, int]:
        """The counts by name; ``lock=False`` reads without the lock (after a fork, where it may be held)."""
        if not lock:
            return {name: getattr(self, name) for name in COUNTER_NAMES}
        with self._lock:
            return {name: getattr(self, name) for name in COUNTER_NAMES}


def merged(local: Counters, theirs: tuple[Counters, ...], lock: bool = True) -> dict[str, int]:
    """An instance's counts: its own, with what the stores it reads through count for it (:data:`_THEIRS`)."""
    counts = local.as_dict(lock=lock)
    for their_counts in theirs:
        found = their_counts.as_dict(lock=lock)
        for name in _THEIRS:
            counts[name] += found[name]
    return counts


#: What the stores an instance reads through count for it.
_THEIRS = ("errors", "corrupt", "untrusted", "listed_misses", "skipped_lookups")
