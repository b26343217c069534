"""The cache itself, bytes in and bytes out, with no CUDA dependency.

:class:`CacheStore` composes the local cache (:mod:`cuda_program_cas._local.local`) and, when
shared stores are named, the shared layer (:mod:`cuda_program_cas._shared.layer`): a lookup asks
local, then each shared store in order; a write lands locally, then goes to the writable stores.
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

__all__ = ["CacheStore", "Inner"]

_sha256 = hashlib.sha256
_perf_ns = time.perf_counter_ns
_monotonic = time.monotonic


class CacheStore:
    """A content-addressed cache directory, optionally layered over shared stores; safe to share between threads.

    Parameters are those of :class:`cuda_program_cas.ContentAddressedProgramCache`, but it stores
    ``bytes`` only and reads no environment variables. What is not bad input never raises.
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
        # A local hit does what the hit listeners do in place: calling them cost 3 % of a repeated 8 KB hit.
        self._lookup, self._counters, self._tally, self._heard = local.lookup, local.counters, local.tally, local.heard
        self._used = None if self._shared is None else self._shared.used

    @property
    def inner(self) -> Inner:
        """What the CUDA layer asks of this store beyond its public API: a new :class:`Inner` each time."""
        return Inner(self)

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
        local = self._local
        reasons = [("local", local.reader.miss_reason())] if t0 else None
        found = None if self._shared is None else self._shared.find(kid, reasons)
        if found is not None:
            local.note_hit(kid, found[1], t0_ns=t0)
            return found[0]
        local.note_miss(kid, reasons or [], t0_ns=t0)
        return None

    def _find(self, kid: str) -> tuple[bytes, str | None] | None:
        """The verified bytes under key id ``kid`` and where (None: local, else a shared store's root), uncounted."""
        found = self._lookup(kid)
        if found is not None:
            if self._used is not None:
                self._used.add(kid, found[1], len(found[0]))
            return found[0], None
        return None if self._shared is None else self._shared.find(kid, None)

    def _claim(self, kid: str, *, wait_s: float | None = None) -> AbstractContextManager[Claim]:
        """Single flight for ``kid``: the node's claim, then the cluster's lease (``wait_s`` None: the env's bound)."""
        from cuda_program_cas._base.config import env_claim_wait

        bound = env_claim_wait() if wait_s is None else wait_s
        if self._shared is None:
            return self._local.claim(kid, bound)
        return self._shared.claim(kid, bound)

    def _find_or_claim(
        self, kid: str, claims: ExitStack, *, reason: str = "not stored"
    ) -> tuple[bytes, str | None] | None:
        """:meth:`_find`, counted; on a miss :meth:`_claim` is entered into ``claims`` and ``kid`` looked up again."""
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
        """How long the entry under key id ``kid`` took to compile here, as recorded when stored; None if unknown."""
        from cuda_program_cas._local.usage import compile_seconds_of

        return compile_seconds_of(self._local.layout, kid)

    def put(self, key: object, data: bytes) -> WriteResult:
        """Store ``data`` under ``key``; :class:`cuda_program_cas.WriteResult` says how (``DROPPED``: not stored).

        A write that cannot land (read-only cache, full disk, no permission) is dropped and counted in
        ``dropped_writes``. ``TypeError`` for a key not ``str``/``bytes`` or data not ``bytes``.
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
        """Apply this instance's recency touches and record its counts now; False when they wait for the next flush.

        Both happen anyway within about a second, at ``close()``, at garbage collection and at exit.
        """
        return self._local.flush()

    def close(self) -> None:
        """Send queued uploads to writable stores, then apply touches and record counts (see :meth:`flush`).

        The uploads get at most ``EXIT_FLUSH_S``; what is left is dropped and counted. The store stays usable.
        """
        if self._shared is not None:
            self._shared.close()
        self.flush()


class Inner:
    """What the CUDA layer asks of a :class:`CacheStore` beyond its public API: ``store.inner`` makes one.

    Its methods are the store's or its local cache's, bound (nothing in between); the store keeps no
    reference to it, so dropping the store's last reference still frees it at once.
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
        self.store = store
        self.layout = local.layout
        self.shared = () if shared is None else shared.tiers
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
        self.shared_paths = tuple if shared is None else shared.paths

    @property
    def blobs(self) -> BlobStore:
        """The blob store of the local cache (made on first use)."""
        return self.store._local.blobs
