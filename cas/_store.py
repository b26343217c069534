"""The cache itself, bytes in and bytes out, with no CUDA dependency.

:class:`CacheStore` composes the pieces of one cache root: the reader (the hot
path), the writer (the one write protocol), the remover, the size cap, and the
shared stores looked up (read-only) after the local one.
``ContentAddressedProgramCache`` is a thin ``cuda.core`` adapter over it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Iterable, Sequence

from blake3 import blake3

from cuda_program_cas_index import Manifest, key_id

from ._blobs import BlobStore
from ._cap import EVICT_STEP, ORPHAN_GRACE_S, SizeCap
from ._config import validate_max_size
from ._errors import LayoutError, ReadOnlyCacheError
from ._files import FileId, ShardGuard
from ._layout import Layout, LayoutState, check_layout, create_layout, damaged_layout_error
from ._reader import Reader
from ._remove import RemovalPlan, RemovalResult, Remover, removable_orphans
from ._scan import Snapshot, take_snapshot
from ._shared import SharedStore
from ._stats import CacheStats, Counters
from ._upgrade import upgrade_if_needed
from ._writer import DROP_ERRNOS, Writer, WriteResult

__all__ = ["CacheStore"]

_log = logging.getLogger("cas")
_sha256 = hashlib.sha256
#: The largest manifest a write adds (tag, key id, digest, a size of up to 16 digits, spaces).
_MANIFEST_MAX_BYTES = len(Manifest("0" * 64, 10**16 - 1, "0" * 64).encode())
#: A manifest's bytes less the digits of its size.
_MANIFEST_BASE_BYTES = len(Manifest("0" * 64, 0, "0" * 64).encode()) - 1


class CacheStore:
    """A content-addressed cache directory, optionally layered over shared stores.

    Parameters are those of :class:`cas.ContentAddressedProgramCache`, except that
    this class stores ``bytes`` only and reads no environment variables. One
    instance is safe to share between threads.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_size_bytes: int | None = None,
        read_only: bool = False,
        shared: Iterable[str | os.PathLike[str]] = (),
        copy_shared_hits: bool = True,
    ) -> None:
        self._max = validate_max_size(max_size_bytes)
        root = os.fspath(path)
        if not isinstance(root, str) or root == "":
            raise ValueError(f"cache path must be a non-empty path, got {path!r}")
        if isinstance(shared, (str, bytes, os.PathLike)):
            raise TypeError(f"shared must be a sequence of paths, not a single path: {shared!r}")
        self.root = os.path.abspath(root)
        self.read_only = bool(read_only)
        self._copy_shared = bool(copy_shared_hits)
        self.layout = lay = Layout(self.root)
        self._counters = Counters()
        self._warned: set[tuple[str, int]] = set()
        self._guard = ShardGuard(self._strange_shard)
        if self.read_only:
            state = check_layout(self.root)
            if state is LayoutState.MISSING:
                raise LayoutError(f"read-only cache {self.root!r} does not exist (a read-only cache is never created)")
            if state is LayoutState.DAMAGED:
                raise damaged_layout_error(self.root)
        else:
            create_layout(self.root)
            if not os.access(self.root, os.W_OK):
                raise ReadOnlyCacheError(
                    f"cache directory {self.root!r} is not writable; open it with read_only=True to use it as is"
                )
        self._remover = None if self.read_only else Remover(lay)
        self._writer = None if self.read_only else Writer(lay, guard=self._guard)
        self._reader = Reader(lay, self._counters, self._guard, self._remover, note=self._note)
        self.blobs = BlobStore(lay.blobs)
        self._cap: SizeCap | None = None
        if self._remover is not None and self._writer is not None:
            self._remover.sweep_temp()
            upgrade_if_needed(lay, self._writer)
            # Uncapped stores keep one too, for explicit evictions (evict_to).
            self._cap = SizeCap(self._max, lay, self._remover, self._counters, lambda: self._reader.recent)
        self._clear_lock = threading.Lock()
        self.shared: tuple[SharedStore, ...] = tuple(SharedStore(p) for p in shared)

    def _note(self, what: str, code: int, message: str) -> None:
        """Log a problem of the local cache once per kind, at WARNING."""
        if (what, code) in self._warned:
            return
        self._warned.add((what, code))
        _log.warning("cuda-program-cas: %s (%s): %s", self.root, what, message)

    def _strange_shard(self, shard: str) -> None:
        self._counters.add("corrupt")
        self._note("shard is not a directory", 0, f"{shard} is a symlink or a file; its keys are misses")

    # -- lookups -----------------------------------------------------------------

    def get(self, key: object) -> bytes | None:
        """The bytes stored under ``key`` (here or in a shared store), verified; None on a miss."""
        # bytes keys (what Program.compile uses) hashed inline: this is the hot path.
        kid = _sha256(key, usedforsecurity=False).hexdigest() if type(key) is bytes else key_id(key)
        found = self._reader.lookup(kid)
        if found is not None:
            self._counters.hit()
            return found[0]
        for store in self.shared:
            found = store.lookup(kid)
            if found is not None:
                data, digest = found
                self._counters.add("hits")
                self._counters.add("shared_hits")
                if self._copy_shared and self._writer is not None:
                    self._copy_in(kid, data, digest)
                return data
        self._counters.add("misses")
        return None

    def _copy_in(self, kid: str, data: bytes, digest: str) -> None:
        """Keep a verified shared hit locally, so later reads stay local. Best effort."""
        try:
            self._commit(kid, data, digest)
        except OSError as exc:
            self._counters.add("dropped_writes")
            self._note("copy from shared store failed", exc.errno or 0, str(exc))

    # -- writes ------------------------------------------------------------------

    def _refuse(self, what: str) -> ReadOnlyCacheError:
        return ReadOnlyCacheError(f"cannot {what}: cache {self.root!r} was opened read-only")

    def put(self, key: object, data: bytes) -> WriteResult:
        """Store ``data`` under ``key``; :class:`cas.WriteResult` says how (``DROPPED``: not stored).

        Raises :class:`cas.ReadOnlyCacheError` on a read-only cache, ``TypeError``
        for a key that is not ``str``/``bytes`` or data that is not ``bytes``.
        """
        kid = key_id(key)
        if not isinstance(data, bytes):
            raise TypeError(
                f"CacheStore stores bytes, got {type(data).__name__} (other bytes-like values or ObjectCode "
                "go through ContentAddressedProgramCache)"
            )
        if self._writer is None:
            raise self._refuse("store an entry")
        if self._max is not None and len(data) + _MANIFEST_MAX_BYTES > self._max:
            # It could never fit: storing it would only evict everything else, then itself.
            self._counters.add("dropped_writes")
            self._note("value larger than the cap", 0, f"{len(data)} bytes > max_size_bytes={self._max}")
            return WriteResult.DROPPED
        try:
            result = self._commit(kid, data, blake3(data).hexdigest())
        except OSError as exc:
            if exc.errno not in DROP_ERRNOS:
                raise
            self._counters.add("dropped_writes")
            self._note("write dropped", exc.errno or 0, str(exc))
            return WriteResult.DROPPED
        if not result:
            self._counters.add("dropped_writes")
            return result
        self._counters.add("writes")
        if result is WriteResult.DEDUPLICATED:
            self._counters.add("dedup_writes")
        return result

    def _commit(self, kid: str, data: bytes, digest: str) -> WriteResult:
        """The write protocol for one entry, then the cap's accounting; retires the blob it replaced."""
        assert self._writer is not None and self._remover is not None
        before = self._reader.current_digest(kid)
        result = self._writer.commit(kid, data, digest)
        if not result:
            return result
        if before is not None and before != digest:
            self._remover.retire(before)
        if self._max is not None and self._cap is not None:
            added = _MANIFEST_BASE_BYTES + len(str(len(data))) + (len(data) if result is WriteResult.STORED else 0)
            self._cap.account(added, written=kid)
        return result

    # -- the size cap --------------------------------------------------------------

    def enforce_cap(self, *, budget: int | None = EVICT_STEP) -> RemovalResult | None:
        """Bring the stored bytes under the cap if over it (see :meth:`cas._cap.SizeCap.enforce`)."""
        if self._cap is None or self._max is None:
            return None
        return self._cap.enforce(budget=budget)

    def evict_to(self, snap: Snapshot, target_bytes: int, *, orphan_grace_s: float = ORPHAN_GRACE_S) -> RemovalResult:
        """Reference-aware LRU down to ``target_bytes`` from a snapshot, all at once (the caller holds the lock)."""
        if self._cap is None:
            raise self._refuse("evict")
        return self._cap.evict_to(snap, target_bytes, orphan_grace_s=orphan_grace_s)

    # -- deletion ----------------------------------------------------------------

    def delete(self, key: object) -> None:
        """Remove ``key``; ``KeyError`` if absent. A blob no other key names goes at the next collection."""
        kid = key_id(key)
        if self._remover is None:
            raise self._refuse("delete a key")
        if not self._guard.ok(self.layout.index, kid):
            raise KeyError(key)
        before = self._reader.current_digest(kid)
        if not self._remover.manifest(kid):
            raise KeyError(key)
        if before is not None:
            self._remover.retire(before)

    def clear(self) -> None:
        """Remove every entry and blob, keeping whatever a concurrent writer adds meanwhile."""
        if self._remover is None:
            raise self._refuse("clear")
        with self._clear_lock:
            retired: dict[str, FileId] = {}
            # Two passes of one plan: the second takes the blobs the first retired
            # (too young to remove with their last manifest) if still untouched.
            for _ in range(2):
                snap = take_snapshot(self.layout.index, self.layout.blobs, clock_dir=self.layout.tmp)
                plan = RemovalPlan(
                    snap,
                    manifests=list(snap.manifests),
                    orphans=removable_orphans(snap, int(ORPHAN_GRACE_S * 1e9), retired),
                )
                retired = self._remover.execute(plan).retired
                if not retired:
                    break
            self._remover.sweep_temp()
            self._reader.forget()
            if self._cap is not None:
                self._cap.reset()

    # -- inspection ----------------------------------------------------------------

    def __len__(self) -> int:
        return len(take_snapshot(self.layout.index, self.layout.blobs, read_manifests=False).manifests)

    @property
    def max_size_bytes(self) -> int | None:
        return self._max

    def snapshot(self) -> Snapshot:
        return take_snapshot(
            self.layout.index, self.layout.blobs, clock_dir=None if self.read_only else self.layout.tmp
        )

    def counters(self) -> dict[str, int]:
        """This instance's counters (and its shared stores' errors), without scanning the disk."""
        counts = self._counters.as_dict()
        for store in self.shared:
            theirs = store.counters.as_dict()
            counts["errors"] += theirs["errors"]
            counts["corrupt"] += theirs["corrupt"]
        return counts

    def stats(self) -> CacheStats:
        """What the local cache holds now (a scan) and this instance's counters."""
        snap = take_snapshot(self.layout.index, self.layout.blobs)
        return CacheStats(
            entries=len(snap.manifests),
            blobs=len(snap.blobs),
            logical_bytes=snap.logical_bytes,
            stored_bytes=snap.stored_bytes,
            blob_bytes=snap.blob_bytes,
            max_size_bytes=self._max,
            **self.counters(),
        )

    def shared_paths(self) -> Sequence[str]:
        return tuple(s.root for s in self.shared)
