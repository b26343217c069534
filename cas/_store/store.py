"""The cache itself, bytes in and bytes out, with no CUDA dependency.

:class:`CacheStore` composes the local cache of one root
(:class:`~cuda_program_cas._local.local.LocalStore`: blobs, manifests, the cap, its counters)
and, when shared stores are named, the cluster layer over it
(:class:`~cuda_program_cas._shared.layer.SharedLayer`: the shared stores looked up after the
local one, write-back, leases, warm sets). A lookup asks the local cache, then each shared
store in order; a write lands locally, then goes to the stores named writable.
``ContentAddressedProgramCache`` is a thin ``cuda.core`` adapter over it.

What is not bad input never raises into the caller: a lookup is a hit or a miss, a write
lands or is dropped and counted. The local cache's listeners hear what it does (its
counters, the usage ledger, the miss journal, and a DEBUG record on the ``cuda_program_cas``
logger, built only when DEBUG is on: :mod:`cuda_program_cas._local.listeners`).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING

from cuda_program_cas._base.config import NOT_GIVEN
from cuda_program_cas._base.log import DEBUG as _DEBUG
from cuda_program_cas._base.log import LOGGER as _log
from cuda_program_cas._disk.files import digest_of
from cuda_program_cas._local.local import LocalStore
from cuda_program_cas.index import key_id

if TYPE_CHECKING:
    from cuda_program_cas._disk.blobs import BlobStore
    from cuda_program_cas._disk.writer import WriteResult
    from cuda_program_cas._local.cachestats import CacheStats
    from cuda_program_cas._local.claims import Claim
    from cuda_program_cas._shared.layer import SharedLayer

# What a hit needs is imported above; the cluster layer is imported when shared stores are named
# (a local cache's hit imports nothing of it), the rest of the local cache when first used.

__all__ = ["CacheStore", "Inner"]

_sha256 = hashlib.sha256
_perf_ns = time.perf_counter_ns
_monotonic = time.monotonic


class CacheStore:
    """A content-addressed cache directory, optionally layered over shared stores.

    Parameters are those of :class:`cuda_program_cas.ContentAddressedProgramCache`, except that
    this class stores ``bytes`` only and reads no environment variables: a
    ``max_size_bytes`` not given is the cap stored in the cache (``cuda-program-cas
    config``), if any. One instance is safe to share between threads.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_size_bytes: int | None = NOT_GIVEN,
        read_only: bool = False,
        shared: Iterable[str | os.PathLike[str]] = (),
        copy_shared_hits: bool = True,
    ) -> None:
        root = os.fspath(path)
        if not isinstance(root, str) or root == "":
            raise ValueError(f"cache path must be a non-empty path, got {path!r}")
        if isinstance(shared, (str, bytes, os.PathLike)):
            raise TypeError(f"shared must be a sequence of paths, not a single path: {shared!r}")
        self._local = local = LocalStore(os.path.abspath(root), max_size_bytes=max_size_bytes, read_only=read_only)
        self.root, self.read_only = local.root, local.read_only
        self._shared: SharedLayer | None = None
        if shared:
            from cuda_program_cas._shared.layer import SharedLayer

            self._shared = SharedLayer(local, shared, copy_hits=copy_shared_hits)
        # The hot path's parts. A local hit does what the hit event's two listeners do (the counters' step and
        # the usage ledger's tally, cas/_local/listeners.py) in place: calling them cost about 770 more
        # instructions per hit (callgrind), 3 % of a repeated 8 KB hit.
        self._lookup, self._counters, self._tally, self._heard = local.lookup, local.counters, local.tally, local.heard
        self._used = None if self._shared is None else self._shared.used

    @property
    def inner(self) -> Inner:
        """What the CUDA layer asks of this store beyond its public API (:class:`Inner`).

        A new object each time, which the store does not keep: a caller that asks on
        every compile keeps the one it got.
        """
        return Inner(self)

    # -- lookups -----------------------------------------------------------------

    def get(self, key: object) -> bytes | None:
        """The bytes stored under ``key`` (here or in a shared store), verified; None on a miss."""
        # bytes keys (what Program.compile uses) hashed inline: this is the hot path.
        kid = _sha256(key).hexdigest() if type(key) is bytes else key_id(key)
        t0 = _perf_ns() if _log.isEnabledFor(_DEBUG) else 0
        found = self._lookup(kid)
        if found is not None:
            self._counters.hit()
            tally = self._tally
            if tally is not None:
                tally[kid] = tally.get(kid, 0) + 1
            if self._used is not None:
                self._used.add(kid, found[1], len(found[0]))
            if t0:
                self._heard.look(kid, "local", t0)
            if _monotonic() >= self._local.flush_at:
                self._local.flush_on_the_way()
            return found[0]
        return self._get_shared(kid, t0)

    def _get_shared(self, kid: str, t0: int) -> bytes | None:
        """After a local miss: the shared stores in order, then the miss (``t0``: a record is due)."""
        local = self._local
        reasons = [("local", local.reader.miss_reason())] if t0 else None
        found = None if self._shared is None else self._shared.find(kid, reasons)
        if found is not None:
            local.note_hit(kid, found[1], t0_ns=t0)
            return found[0]
        local.heard.count("misses")
        if reasons is not None:
            local.heard.look(kid, None, t0, reasons)
        if _monotonic() >= local.flush_at:
            local.flush_on_the_way()
        return None

    def _find(self, kid: str) -> tuple[bytes, str | None] | None:
        """The verified bytes under key id ``kid``, and where: None for local, else a shared store's root.

        Counts neither a hit nor a miss and logs no lookup record. It serves a
        caller that answers one request from several entries (the front door's
        record and result) and reports that request once, with ``note_hit`` or
        ``note_miss`` (:class:`Inner`).
        """
        found = self._lookup(kid)
        if found is not None:
            if self._used is not None:
                self._used.add(kid, found[1], len(found[0]))
            return found[0], None
        return None if self._shared is None else self._shared.find(kid, None)

    def _claim(self, kid: str, *, wait_s: float | None = None) -> AbstractContextManager[Claim]:
        """Single flight for key id ``kid`` on this node: ``with store.inner.claim(kid) as c:`` around a compile.

        The first process (or thread) to claim a key holds it (``c.held``) until its
        block ends; the others wait for that (``c.waited``), then look the key up
        again and compile only if it is still missing. A claim dies with its
        process. The wait is bounded by ``wait_s``, by default
        ``$CUDA_PROGRAM_CAS_CLAIM_WAIT`` or 5 minutes. A read-only or uncached store,
        or one where no lock can be taken, yields a claim neither held nor waited
        for, at once: compile. Where a writable shared store gives leases, the
        cluster's lease follows the node's claim. Never raises for what it meets on
        disk. See :mod:`cuda_program_cas._local.claims` and :mod:`cuda_program_cas._shared.lease`.
        """
        from cuda_program_cas._base.config import env_claim_wait

        bound = env_claim_wait() if wait_s is None else wait_s
        if self._shared is None:
            return self._local.claim(kid, bound)
        return self._shared.claim(kid, bound)

    def _find_or_claim(
        self, kid: str, claims: ExitStack, *, reason: str = "not stored"
    ) -> tuple[bytes, str | None] | None:
        """:meth:`_find`, for a caller that compiles on a miss; one hit or one miss is counted.

        On a miss the node's :meth:`_claim` on ``kid`` is entered into ``claims``, so it
        is held until the caller closes that stack (its compile stored, or failed); when
        another held it, ``kid`` is looked up again, and found then it is a hit (and a
        claim hit). ``reason``: what the miss's record says.
        """
        t0 = _perf_ns()
        local = self._local
        found = self._find(kid)
        if found is None:
            claim = claims.enter_context(self._claim(kid))
            if claim.held or claim.waited:
                found = self._find(kid)  # stored meanwhile, by the claimant waited for
                if found is not None:
                    local.note_hit(kid, found[1], t0_ns=t0, waited=claim.waited)
                    return found
            local.note_miss(kid, reason, t0_ns=t0)
            return None
        local.note_hit(kid, found[1], t0_ns=t0)
        return found

    def compile_seconds(self, kid: str) -> float | None:
        """How long the entry under key id ``kid`` took to compile, as recorded when it was stored; None if unknown.

        What a caller weighs against the cost of asking a remote store. Known for
        entries this cache compiled and stored itself (a plain key's id is
        ``key_id(key)``; a ``cache.compile`` entry's is its record's id), not for
        ones copied from a shared store or imported. One ``stat`` of the ledger
        when it is unchanged since this process last read it.
        """
        return self._local.compile_seconds(kid)

    # -- writes and removals ----------------------------------------------------------

    def put(self, key: object, data: bytes) -> WriteResult:
        """Store ``data`` under ``key``; :class:`cuda_program_cas.WriteResult` says how (``DROPPED``: not stored).

        A write that cannot land is dropped and counted in ``dropped_writes``: on a
        read-only cache, a full disk, a directory this process may not write or
        that went read-only, a ``blobs/`` or ``tmp/`` moved to another disk. Raises
        ``TypeError`` for a key that is not ``str``/``bytes`` or data that is not
        ``bytes``.
        """
        return self._put_id(key_id(key), data)

    def _put_id(self, kid: str, data: bytes) -> WriteResult:
        """:meth:`put` under a key id the caller derived itself (the front door's grouped ids)."""
        if not isinstance(data, bytes):
            raise TypeError(
                f"CacheStore stores bytes, got {type(data).__name__} (other bytes-like values or ObjectCode "
                "go through ContentAddressedProgramCache)"
            )
        local = self._local
        t0 = _perf_ns() if _log.isEnabledFor(_DEBUG) else 0
        digest = "" if local.read_only else digest_of(data)
        result, why = local.store(kid, data, digest)
        if self._shared is not None and not local.read_only:
            self._shared.stored(kid, digest, data, result, why)
        if t0:
            local.heard.write(kid, result.value, len(data), t0, why)
        if _monotonic() >= local.flush_at:
            local.flush_on_the_way()
        return result

    def delete(self, key: object) -> None:
        """Remove ``key``; ``KeyError`` if absent. A blob no other key names goes at the next collection."""
        if not self._local.delete_id(key_id(key)):
            raise KeyError(key)

    def clear(self) -> None:
        """Remove every entry and blob, keeping whatever a concurrent writer adds meanwhile."""
        self._local.clear()

    # -- inspection ----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._local.snapshot(read_manifests=False).manifests)

    @property
    def max_size_bytes(self) -> int | None:
        return self._local.max_size_bytes

    def counters(self) -> dict[str, int]:
        """This instance's counters (and its shared stores' errors), without scanning the disk."""
        return self._local.counts()

    def stats(self) -> CacheStats:
        """What the local cache holds now (a scan) and this instance's counters."""
        return self._local.stats(self.counters())

    def flush(self) -> bool:
        """Apply the recency touches of this instance's hits and record its counts in the lifetime counters now.

        Returns False when the counts could not be recorded (they wait for the next
        flush). A no-op on a read-only cache. Both happen anyway: touches within
        about a second (:mod:`cuda_program_cas._local.touch`), counts at most once a second, and both
        at ``close()``, at garbage collection and at exit.
        """
        return self._local.flush()

    def close(self) -> None:
        """Send queued uploads to writable stores, then apply touches and record counts (see :meth:`flush`).

        The uploads get at most :data:`cuda_program_cas._shared.writeback.EXIT_FLUSH_S`; what is left then
        is dropped and counted. Nothing else is held open; the store stays usable.
        """
        if self._shared is not None:
            self._shared.close()
        self.flush()


class Inner:
    """What the CUDA layer asks of a :class:`CacheStore` beyond its public API: ``store.inner`` makes one.

    Lookups that count their own hit or miss
    (the front door's record and result, a link), claims around a compile, writes and
    removals by key id, what a compile recorded, the cap's eviction, and the store's
    parts (its layout, its shared stores, its warm set, its blobs), which tests and tools
    inspect. The public API is what docs/python-api.md lists; nothing here is part of it.

    Its methods are the store's own or its local cache's, bound when it is made: a call through it is the
    call it names, with nothing in between (the front door's hit makes three). The store
    keeps no reference to it, so that dropping the store's last reference still frees it
    at once (and that flushes its counters); a caller that asks on every compile keeps
    the one it got.
    """

    __slots__ = (
        "claim",
        "delete_id",
        "enforce_cap",
        "evict_to",
        "find",
        "find_or_claim",
        "layout",
        "note_compiled",
        "note_dropped",
        "note_hit",
        "note_miss",
        "note_switched",
        "put_id",
        "shared",
        "shared_paths",
        "snapshot",
        "store",
        "warm",
    )

    def __init__(self, store: CacheStore) -> None:
        local, shared = store._local, store._shared
        #: The store itself, for its public API (``read_only``, ``root``...).
        self.store = store
        self.layout = local.layout
        #: The shared stores, in the order looked up (:class:`cuda_program_cas._shared.tier.Tier`).
        self.shared = () if shared is None else shared.tiers
        #: The job's warm set fetch (:mod:`cuda_program_cas._shared.warmset`), or None.
        self.warm = None if shared is None else shared.warm
        self.find = store._find
        self.note_hit = local.note_hit
        self.note_miss = local.note_miss
        self.claim = store._claim
        self.find_or_claim = store._find_or_claim
        self.note_compiled = local.note_compiled
        self.note_switched = local.note_switched
        self.note_dropped = local.note_dropped
        self.put_id = store._put_id
        self.delete_id = local.delete_id
        self.enforce_cap = local.enforce_cap
        self.evict_to = local.evict_to
        self.snapshot = local.snapshot
        self.shared_paths = _no_paths if shared is None else shared.paths

    @property
    def blobs(self) -> BlobStore:
        """The blob store of the local cache (made on first use)."""
        return self.store._local.blobs


def _no_paths() -> tuple[str, ...]:
    return ()
