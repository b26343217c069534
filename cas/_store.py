"""The cache itself, bytes in and bytes out, with no CUDA dependency.

:class:`CacheStore` composes the blob store and the index under one root, keeps
the size cap, and looks up shared stores (read-only) after the local one.
``ContentAddressedProgramCache`` is a thin ``cuda.core`` adapter over it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from stat import S_ISDIR, S_ISREG

from blake3 import blake3

from index import Index, Manifest, key_id
from index._files import READ_FLAGS, NotRegularFile, is_sharing_violation, with_sharing_retry
from index._index import MAX_MANIFEST_BYTES
from index._manifest import parse_fields

from ._blobs import BlobStore
from ._cap import EVICT_STEP, ORPHAN_GRACE_S, SizeCap
from ._config import validate_max_size
from ._errors import LayoutError, ReadOnlyCacheError
from ._evict import EvictionResult
from ._layout import Layout, check_layout, create_layout, sweep_stale_temp_files
from ._scan import Snapshot, take_snapshot
from ._stats import CacheStats, Counters

__all__ = ["CacheStore"]

_log = logging.getLogger("cas")

#: A hit touches its manifest only when the mtime is at least this old.
TOUCH_INTERVAL_NS = 1_000_000_000
#: Verified blob identities remembered per store (each a few dozen bytes).
_VERIFIED_MAX = 8192
#: Per-key touch times remembered (to skip an fstat on repeated hits).
_TOUCHED_MAX = 65536
#: From this size on, an fstat to prove a blob unchanged is cheaper than hashing it.
_IDENTITY_MIN_BYTES = 16384
#: Verified bytes of repeatedly read blobs kept in memory per store, and the largest kept.
_HOLD_MAX_BYTES = 32 << 20
_HOLD_MAX_BLOB = 4 << 20
_SEP = os.sep
_sha256 = hashlib.sha256
#: The largest manifest a write adds (tag, digest, a size of up to 16 digits, spaces).
_MANIFEST_MAX_BYTES = len(Manifest("0" * 64, 10**16 - 1).encode())
_UTIME_FD = os.utime in os.supports_fd
#: A shared store that could not be opened is tried again after this long.
_SHARED_RETRY_S = 5.0
#: Read errors of a shared store that may mean the whole store is unreachable.
_OUTAGE_ERRNOS = frozenset(
    e for e in (errno.EIO, errno.ETIMEDOUT, errno.ENOTCONN, getattr(errno, "EHOSTDOWN", None)) if e is not None
)
#: Write failures that drop the write instead of failing the caller: the disk is
#: full, or something that is not ours is in the way of a file (a directory where
#: a blob or manifest belongs). Permission and read-only errors are configuration
#: problems and propagate, as they do from FileStreamProgramCache.
_DROP_ERRNOS = frozenset(
    e
    for e in (
        errno.ENOSPC,
        getattr(errno, "EDQUOT", None),
        errno.EFBIG,
        errno.EISDIR,
        errno.ENOTDIR,
        errno.ELOOP,
        errno.ENOTEMPTY,
        errno.EEXIST,
    )
    if e is not None
)


class CacheStore:
    """A content-addressed cache directory, optionally layered over shared stores.

    Parameters are those of :class:`cas.ContentAddressedProgramCache` except the
    value types: this class stores ``bytes`` only.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_size_bytes: int | None = None,
        read_only: bool = False,
        shared: Iterable[str | os.PathLike[str]] = (),
        copy_shared_hits: bool = True,
        _is_shared: bool = False,
    ) -> None:
        self._max = validate_max_size(max_size_bytes)
        root = os.fspath(path)
        if not isinstance(root, str) or root == "":
            raise ValueError(f"cache path must be a non-empty path, got {path!r}")
        self.root = os.path.abspath(root)
        self.read_only = bool(read_only or _is_shared)
        self._is_shared = _is_shared
        self._copy_shared = bool(copy_shared_hits)
        self._lay = Layout(self.root)
        self._counters = Counters()
        self._verified: dict[str, tuple[int, int, int, int, int]] = {}
        self._touched: dict[str, int] = {}
        #: kid -> (identity of its manifest file, digest): lets a repeated hit stat instead of read.
        self._known: dict[str, tuple[tuple[int, int, int, int, int], str]] = {}
        #: digest -> (identity of its blob file, verified bytes), least recently used first.
        self._held: OrderedDict[str, tuple[tuple[int, int, int, int, int], bytes]] = OrderedDict()
        self._held_bytes = 0
        self._index_dir = self._lay.index + _SEP
        self._blob_dir = self._lay.blobs + _SEP
        #: Shard directories this instance found to be real directories (see _strange_shard).
        self._real_shards: set[str] = set()
        self._listed_dirs: set[str] = set()
        self._warned: set[tuple[str, int]] = set()
        self._usable_at = 0.0  # shared stores: when to try opening again; 0 = usable
        if _is_shared:
            self._open_shared()
        elif self.read_only:
            state = check_layout(self.root)
            if state == "missing":
                raise LayoutError(f"read-only cache {self.root!r} does not exist (a read-only cache is never created)")
            if state == "damaged":
                raise LayoutError(
                    f"read-only cache {self.root!r} has a damaged layout.json; repair it with "
                    "`cuda-program-cas verify --repair` from an account that can write there"
                )
        else:
            create_layout(self.root)
            if not os.access(self.root, os.W_OK):
                raise ReadOnlyCacheError(
                    f"cache directory {self.root!r} is not writable; open it with read_only=True to use it as is"
                )
            sweep_stale_temp_files(self._lay.tmp)
        tmp = None if self.read_only else self._lay.tmp
        self.index = Index(self._lay.index, tmp)
        self.blobs = BlobStore(self._lay.blobs, tmp, self._lay.quarantine)
        # Uncapped stores keep one too, for explicit evictions (evict_to) and their retired blobs.
        self._cap = None if self.read_only else SizeCap(self._max, self._lay, self.index, self.blobs, self._counters)
        self.shared: tuple[CacheStore, ...] = tuple(CacheStore(p, _is_shared=True) for p in shared)

    # -- shared stores -----------------------------------------------------------

    def _open_shared(self) -> bool:
        """Check a shared store's layout (reading only); False while it is unusable."""
        try:
            state = check_layout(self.root)
        except (OSError, LayoutError) as exc:
            self._unusable(f"{exc}")
            return False
        if state != "ok":
            self._unusable(f"shared store {self.root!r} is {state}")
            return False
        self._usable_at = 0.0
        return True

    def _unusable(self, why: str) -> None:
        self._usable_at = time.monotonic() + _SHARED_RETRY_S
        self._counters.add("errors")
        self._note("unusable", 0, why)

    def _note(self, what: str, code: int, message: str) -> None:
        """Log an I/O problem once per kind: debug for shared stores, warning for the local cache."""
        if (what, code) in self._warned:
            return
        self._warned.add((what, code))
        level = logging.DEBUG if self._is_shared else logging.WARNING
        _log.log(level, "cuda-program-cas: %s (%s): %s", self.root, what, message)

    # -- lookups -----------------------------------------------------------------

    def get(self, key: object) -> bytes | None:
        """The bytes stored under ``key`` (here or in a shared store), verified; None on a miss."""
        # bytes keys (what Program.compile uses) hashed inline: this is the hot path.
        kid = _sha256(key, usedforsecurity=False).hexdigest() if type(key) is bytes else key_id(key)
        found = self._lookup(kid)
        if found is not None:
            self._counters.hit()
            return found[0]
        for store in self.shared:
            found = store._lookup(kid)
            if found is not None:
                data, digest = found
                self._counters.add("hits")
                self._counters.add("shared_hits")
                if self._copy_shared and not self.read_only:
                    self._copy_in(kid, data, digest)
                return data
        self._counters.add("misses")
        return None

    def _lookup(self, kid: str) -> tuple[bytes, str] | None:
        """Read and verify one key here. Never raises for what is on disk: a problem is a miss.

        This is the hot path, written for few system calls: open, read and close
        the manifest, then the blob; ``fstat`` only where it saves a hash (large
        blobs met before) or decides a touch (first sight of a key).
        """
        if self._usable_at and (time.monotonic() < self._usable_at or not self._open_shared()):
            return None
        ipath = f"{self._index_dir}{kid[:2]}{_SEP}{kid[2:]}"
        if kid in self._known:
            found = self._lookup_known(kid, ipath)
            if found is not None:
                return found
        if self._index_dir + kid[:2] not in self._real_shards and self._strange_shard(self._index_dir, kid):
            return None
        try:
            mfd = os.open(ipath, READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            fd = self._open_failed(exc, ipath)
            if fd is None:
                return None
            mfd = fd
        try:
            try:
                fields = parse_fields(os.read(mfd, MAX_MANIFEST_BYTES + 1))
            except OSError as exc:  # a directory, a FIFO, EIO, ESTALE
                self._read_failed(exc, ipath)
                return None
            if fields is None:
                self._counters.add("corrupt")
                self._remove_manifest(kid, mfd)
                return None
            seen = self._touched.get(kid)
            found = self._read_blob(kid, mfd, fields[0], fields[1], seen is not None)
            if found is None:
                return None
            mst = None
            try:
                if self.read_only:
                    seen = 0
                    if kid in self._touched:
                        mst = os.fstat(mfd)
                else:
                    # Recency: touch the manifest, unless its mtime (or our own last
                    # touch) is under a second old, so a hot key costs no write per read.
                    if seen is None:
                        mst = os.fstat(mfd)
                        seen = mst.st_mtime_ns
                    now = time.time_ns()
                    if now - seen >= TOUCH_INTERVAL_NS:
                        try:
                            os.utime(mfd if _UTIME_FD else ipath)
                        except OSError:
                            pass
                        seen = now
                        mst = None  # the touch changed its identity; the next hit records it
                    elif mst is None:
                        mst = os.fstat(mfd)
            except OSError:  # ESTALE on NFS: serve the verified hit, just don't remember it
                mst = None
                seen = seen or 0
            if len(self._touched) >= _TOUCHED_MAX:
                self._touched.clear()
                self._known.clear()
            self._touched[kid] = seen
            if mst is not None:
                self._known[kid] = ((mst.st_dev, mst.st_ino, mst.st_size, mst.st_mtime_ns, mst.st_ctime_ns), found[1])
            return found
        finally:
            os.close(mfd)

    def _lookup_known(self, kid: str, ipath: str) -> tuple[bytes, str] | None:
        """A repeated hit: two stats prove the manifest and the blob unchanged since verified.

        Returns None (the caller then reads everything) when either changed, or the
        blob's bytes are not held in memory.
        """
        known = self._known[kid]
        try:
            mst = os.stat(ipath, follow_symlinks=False)
        except OSError:
            return None
        if (mst.st_dev, mst.st_ino, mst.st_size, mst.st_mtime_ns, mst.st_ctime_ns) != known[0]:
            return None
        digest = known[1]
        held = self._held.get(digest)
        if held is None:
            return None
        try:
            bst = os.stat(f"{self._blob_dir}{digest[:2]}{_SEP}{digest[2:]}", follow_symlinks=False)
        except OSError:
            return None
        if (bst.st_dev, bst.st_ino, bst.st_size, bst.st_mtime_ns, bst.st_ctime_ns) != held[0]:
            return None
        self._held.move_to_end(digest)
        if not self.read_only and time.time_ns() - self._touched.get(kid, 0) >= TOUCH_INTERVAL_NS:
            return None  # due for a touch: the full path does it
        return held[1], digest

    def _strange_shard(self, directory: str, name: str) -> bool:
        """True when the shard directory of ``name`` is a symlink or not a directory.

        Such a shard would lead reads and writes outside the cache root: its keys
        are misses and writes to it are dropped. Checked once per shard and
        instance (a missing shard is fine: a write creates it). The first check in a
        directory lists it once, which vouches for every shard there without a
        system call per shard.
        """
        shard = directory + name[:2]
        if shard in self._real_shards:
            return False
        if directory not in self._listed_dirs:
            self._listed_dirs.add(directory)
            try:
                with os.scandir(directory) as it:
                    self._real_shards.update(
                        directory + e.name for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)
                    )
            except OSError:
                pass
            if shard in self._real_shards:
                return False
        try:
            st = os.lstat(shard)
        except FileNotFoundError:
            return False
        except OSError:
            return True
        if not S_ISDIR(st.st_mode):
            self._counters.add("corrupt")
            self._note("shard is not a directory", 0, f"{shard} is a symlink or a file; its keys are misses")
            return True
        self._real_shards.add(shard)
        return False

    def _read_blob(self, kid: str, mfd: int, digest: str, size: int, repeat: bool) -> tuple[bytes, str] | None:
        """Read and verify a blob. On a repeated hit (``repeat``), keep its bytes in memory.

        A blob held in memory is returned by later hits once two stats prove the
        manifest and the blob unchanged (see :meth:`_lookup_known`).
        """
        if self._blob_dir + digest[:2] not in self._real_shards and self._strange_shard(self._blob_dir, digest):
            return None
        bpath = f"{self._blob_dir}{digest[:2]}{_SEP}{digest[2:]}"
        try:
            bfd = os.open(bpath, READ_FLAGS)
        except FileNotFoundError:
            # Dangling: the blob was collected. Remove the manifest only if it is
            # still the one we read; a writer may have just re-pointed it.
            self._remove_manifest(kid, mfd)
            return None
        except OSError as exc:
            fd = self._open_failed(exc, bpath)
            if fd is None:
                return None
            bfd = fd
        try:
            identity = None
            if repeat or size >= _IDENTITY_MIN_BYTES:
                # Hashing costs more than an fstat here: remember what was verified.
                try:
                    st = os.fstat(bfd)
                except OSError as exc:  # ESTALE from an NFS server: a miss, like a failed read
                    self._read_failed(exc, bpath)
                    return None
                if st.st_size != size or not S_ISREG(st.st_mode):
                    self._corrupt_blob(kid, mfd, digest, bfd)
                    return None
                identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            try:
                data = os.read(bfd, size + 1)
                if len(data) < size:  # a short read: only at EOF on a regular file
                    data = _read_rest(bfd, data, size + 1)
            except OSError as exc:
                self._read_failed(exc, bpath)
                return None
            if len(data) != size:  # truncated or grown: not the blob the manifest names
                self._corrupt_blob(kid, mfd, digest, bfd)
                return None
            # A blob already verified and provably unchanged (ctime cannot be set
            # back without root) need not be hashed again.
            if identity is None or self._verified.get(digest) != identity:
                if blake3(data).hexdigest() != digest:
                    self._corrupt_blob(kid, mfd, digest, bfd)
                    return None
                if identity is not None:
                    if len(self._verified) >= _VERIFIED_MAX:
                        self._verified.clear()
                    self._verified[digest] = identity
            if repeat and identity is not None and size <= _HOLD_MAX_BLOB:
                self._hold(digest, identity, data)
            return data, digest
        finally:
            os.close(bfd)

    def _hold(self, digest: str, identity: tuple[int, int, int, int, int], data: bytes) -> None:
        """Keep a verified blob's bytes in memory (least recently used go past the budget)."""
        held = self._held
        old = held.pop(digest, None)
        if old is not None:
            self._held_bytes -= len(old[1])
        held[digest] = (identity, data)
        self._held_bytes += len(data)
        while self._held_bytes > _HOLD_MAX_BYTES:
            _, (_, dropped) = held.popitem(last=False)
            self._held_bytes -= len(dropped)

    def _open_failed(self, exc: OSError, path: str) -> int | None:
        """The slow path of an open: retry a Windows sharing violation, else report a miss."""
        if is_sharing_violation(exc):
            try:
                return with_sharing_retry(lambda: os.open(path, READ_FLAGS))
            except OSError as again:
                exc = again
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            exc = NotRegularFile(path)  # O_NOFOLLOW met a symlink
        self._read_failed(exc, path)
        return None

    def _remove_manifest(self, kid: str, mfd: int) -> None:
        """Remove a bad or dangling manifest if it is still the file we read (``mfd``)."""
        if self.read_only:
            return
        try:
            st = os.fstat(mfd)
        except OSError:
            return
        self.index.remove_if_unchanged(kid, st)

    def _read_failed(self, exc: OSError, path: str) -> None:
        if isinstance(exc, NotRegularFile):
            self._counters.add("corrupt")
            self._note("not a regular file", 0, path)
            return
        self._counters.add("errors")
        self._note("read error", exc.errno or 0, f"{path}: {exc}")
        if self._is_shared and exc.errno in _OUTAGE_ERRNOS:
            # The server may be gone (a soft mount's EIO comes after its whole
            # timeout): check the layout once; if that fails too, the store is
            # skipped for _SHARED_RETRY_S instead of costing a timeout per lookup.
            self._open_shared()
        return

    def _corrupt_blob(self, kid: str, mfd: int, digest: str, bfd: int) -> None:
        """A blob that is not what its name says: never returned; moved aside, its manifest removed."""
        self._counters.add("corrupt")
        self._verified.pop(digest, None)
        if _hashes_to(bfd, digest):
            # The blob is intact; only the manifest's size is wrong. Other keys may
            # share this blob: drop the lying manifest, keep the blob.
            self._remove_manifest(kid, mfd)
            return
        if self.read_only:
            self._note("corrupt blob", 0, self.blobs.path_for(digest))
            return
        try:
            bst: os.stat_result | None = os.fstat(bfd)
        except OSError:
            bst = None
        where = self.blobs.quarantine(digest, bst) if bst is not None else None
        _log.warning("cuda-program-cas: blob %s failed verification; moved to %s", digest, where)
        self._remove_manifest(kid, mfd)

    def _copy_in(self, kid: str, data: bytes, digest: str) -> None:
        """Keep a verified shared hit locally, so later reads stay local. Best effort."""
        try:
            self._commit(kid, data, digest)
        except OSError as exc:
            self._counters.add("dropped_writes")
            self._note("copy from shared store failed", exc.errno or 0, str(exc))

    # -- writes ------------------------------------------------------------------

    def put(self, key: object, data: bytes) -> bool:
        """Store ``data`` under ``key``. False when the write was dropped (read-only, disk full)."""
        kid = key_id(key)
        if not isinstance(data, bytes):
            raise TypeError(f"CacheStore stores bytes, got {type(data).__name__}")
        if self.read_only:
            self._counters.add("dropped_writes")
            return False
        if self._max is not None and len(data) + _MANIFEST_MAX_BYTES > self._max:
            # It could never fit: storing it would only evict everything else, then itself.
            self._counters.add("dropped_writes")
            self._note("value larger than the cap", 0, f"{len(data)} bytes > max_size_bytes={self._max}")
            return False
        digest = blake3(data).hexdigest()
        try:
            existed = self._commit(kid, data, digest)
        except OSError as exc:
            if exc.errno not in _DROP_ERRNOS:
                raise
            self._counters.add("dropped_writes")
            self._note("write dropped", exc.errno or 0, str(exc))
            return False
        if existed is None:
            self._counters.add("dropped_writes")
            return False
        self._counters.add("writes")
        if existed:
            self._counters.add("dedup_writes")
        return True

    def _commit(self, kid: str, data: bytes, digest: str) -> bool | None:
        """Blob first, then manifest, then re-check the blob. True if the blob existed; None if dropped."""
        if self._strange_shard(self._blob_dir, digest) or self._strange_shard(self._index_dir, kid):
            return None
        existed = self.blobs.put(data, digest)
        if existed is None:
            return None  # the blob was not stored: a manifest must not name it
        manifest = Manifest(digest, len(data))
        try:
            committed = self.index.write(kid, manifest)
        except OSError:
            if not existed:
                self._discard_blob(digest)
            raise
        if not committed:
            return None
        # A collector may have removed the blob between our write (or freshen) and
        # the manifest commit: store it again so the manifest never dangles.
        if not self.blobs.exists(digest):
            self.blobs.put(data, digest)
        if self._max is not None and self._cap is not None:
            self._cap.account(len(manifest.encode()) + (0 if existed else len(data)))
        return existed

    def _discard_blob(self, digest: str) -> None:
        try:
            os.unlink(self.blobs.path_for(digest))
        except OSError:
            pass

    # -- the size cap --------------------------------------------------------------

    def enforce_cap(self, *, budget: int | None = EVICT_STEP) -> EvictionResult | None:
        """Bring the stored bytes under the cap if over it (see :meth:`cas._cap.SizeCap.enforce`)."""
        if self._cap is None or self._max is None:
            return None
        return self._cap.enforce(budget=budget)

    def evict_to(self, snap: Snapshot, target_bytes: int, *, orphan_grace_s: float = ORPHAN_GRACE_S) -> EvictionResult:
        """Reference-aware LRU down to ``target_bytes`` from a snapshot, all at once (the caller holds the lock)."""
        if self._cap is None:
            raise self._refuse("evict")
        return self._cap.evict_to(snap, target_bytes, orphan_grace_s=orphan_grace_s)

    # -- deletion ----------------------------------------------------------------

    def _refuse(self, what: str) -> ReadOnlyCacheError:
        return ReadOnlyCacheError(f"cannot {what}: cache {self.root!r} was opened read-only")

    def delete(self, key: object) -> None:
        """Remove ``key``; ``KeyError`` if absent. Its blob goes at the next collection if unshared."""
        kid = key_id(key)
        if self.read_only:
            raise self._refuse("delete a key")
        if self._strange_shard(self._index_dir, kid) or not self.index.remove(kid):
            raise KeyError(key)

    def clear(self) -> None:
        """Remove every entry and blob, keeping whatever a concurrent writer adds meanwhile."""
        if self.read_only:
            raise self._refuse("clear")
        # The blobs are listed before the manifests: a writer that freshens a blob
        # after this listing changes its identity, so it is kept below, and one that
        # freshened it before has almost surely committed its manifest by the time
        # the manifest scan reaches it (its re-check covers the rest).
        seen = {entry.digest: entry.stat for entry in self.blobs.scan()}
        snap = take_snapshot(self.index, self.blobs, clock_dir=self._lay.tmp)
        refs = snap.refs.copy()
        for info in snap.manifests:
            if self.index.remove_if_unchanged(info.key_id, info.stat) and info.manifest is not None:
                refs[info.manifest.digest] -= 1
        orphan_cutoff = snap.started_ns - int(ORPHAN_GRACE_S * 1e9)
        for digest, st in seen.items():
            if refs[digest] > 0 or digest not in snap.blobs:
                continue  # a manifest kept above (touched, rewritten or held open) still names it
            if snap.refs[digest]:
                # Named by a manifest removed above: goes if untouched since it was listed.
                self.blobs.remove_if_older(digest, snap.cutoff_ns, st)
            else:
                # An orphan may be a writer's, between its blob and its manifest.
                self.blobs.remove_if_older(digest, orphan_cutoff)
        sweep_stale_temp_files(self._lay.tmp)
        self._forget()
        if self._cap is not None:
            self._cap.reset()

    def _forget(self) -> None:
        """Drop what this instance remembers of files (after it removed many)."""
        self._verified.clear()
        self._known.clear()
        self._held.clear()
        self._held_bytes = 0

    # -- inspection ----------------------------------------------------------------

    def __len__(self) -> int:
        return self.index.count()

    @property
    def max_size_bytes(self) -> int | None:
        return self._max

    def snapshot(self) -> Snapshot:
        return take_snapshot(self.index, self.blobs, clock_dir=None if self.read_only else self._lay.tmp)

    def stats(self) -> CacheStats:
        snap = take_snapshot(self.index, self.blobs)
        counts = self._counters.as_dict()
        for store in self.shared:
            counts["errors"] += store._counters.as_dict()["errors"]
            counts["corrupt"] += store._counters.as_dict()["corrupt"]
        return CacheStats(
            entries=len(snap.manifests),
            blobs=len(snap.blobs),
            logical_bytes=snap.logical_bytes,
            stored_bytes=snap.stored_bytes,
            max_size_bytes=self._max,
            **counts,
        )

    def shared_paths(self) -> Sequence[str]:
        return tuple(s.root for s in self.shared)


def _hashes_to(fd: int, digest: str) -> bool:
    """True when the whole regular file open as ``fd`` has blake3 ``digest`` (a rare path)."""
    try:
        if not S_ISREG(os.fstat(fd).st_mode):
            return False
        os.lseek(fd, 0, os.SEEK_SET)
        hasher = blake3()
        while chunk := os.read(fd, 1 << 20):
            hasher.update(chunk)
    except OSError:
        return False
    return hasher.hexdigest() == digest


def _read_rest(fd: int, head: bytes, limit: int) -> bytes:
    """Keep reading after a short read, up to ``limit`` bytes or end of file."""
    chunks = [head]
    got = len(head)
    while got < limit:
        more = os.read(fd, limit - got)
        if not more:
            break
        chunks.append(more)
        got += len(more)
    return b"".join(chunks)
