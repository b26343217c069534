"""This instance's operation counts (:class:`Counters`); ``CacheStats`` is apart, imported by ``stats()``, not a hit."""

from __future__ import annotations

import itertools
import threading

from cuda_program_cas._base.fork import after_fork

__all__ = ["COUNTER_NAMES", "Counters", "merged"]

#: The counters: the one list (``CacheStats``'s fields after its six of the disk, checked at its import).
COUNTER_NAMES = (
    "hits",
    "misses",
    "writes",
    "dedup_writes",
    "evictions",
    "corrupt",
    "shared_hits",
    "dropped_writes",
    "errors",
    "claim_waits",
    "claim_hits",
    "switched",
    "uploads",
    "uploads_dropped",
    "untrusted",
    "saved_us",
    "listed_misses",
    "skipped_lookups",
    "eviction_failures",
)


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
