"""The read path: look a key up in one cache root and return verified bytes, or miss.

The hot path, written for few system calls: open, read and close the manifest, then the blob;
``fstat`` only where it saves a hash. A repeated hit proves the manifest unchanged with one
``lstat``; the blob's bytes then come from memory, or from the file once an ``fstat`` proves it
the one verified. The recency touch is queued (:mod:`.touch`). Nothing on disk makes a lookup
raise: a bad or unreadable file is a miss, counted, its reason kept per thread. A writable cache
removes what it proves bad; a read-only one only reads. Thread-safe.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from stat import S_ISREG
from typing import TYPE_CHECKING

from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._base.log import LOGGER as _log
from cuda_program_cas._disk.bootrecord import BootRecord, old_enough
from cuda_program_cas._disk.files import (
    READ_FLAGS,
    FileId,
    NotRegularFile,
    ShardGuard,
    file_id,
    hashes_to,
    is_sharing_violation,
    read_rest,
    shard_path,
    with_sharing_retry,
)
from cuda_program_cas._disk.files import (
    digest_of as _hexdigest,
)
from cuda_program_cas._disk.layout import Layout
from cuda_program_cas.index import MAX_MANIFEST_BYTES, parse_fields

from .stats import Counters
from .touch import TOUCH_INTERVAL_NS, Touches

if TYPE_CHECKING:
    from cuda_program_cas._disk.remove import Remover

__all__ = ["Reader"]


#: Verified blob identities remembered per reader (each a few dozen bytes).
_VERIFIED_MAX = 8192
#: Per-key touch and read times remembered (to skip an fstat on repeated hits).
_TOUCHED_MAX = 65536
#: From this size on, an fstat to prove a blob unchanged is cheaper than hashing it.
_IDENTITY_MIN_BYTES = 16384
#: Below it too, for a process's first this many blobs: the boot record spares loading blake3.
_SMALL_LOOKED_UP = 32
#: A larger size a manifest claims is checked against the file before the read.
_READ_BEFORE_FSTAT_MAX = 16 << 20
#: Verified bytes of repeatedly read blobs kept in memory per reader, and the largest kept.
_HOLD_MAX_BYTES = 32 << 20
_HOLD_MAX_BLOB = 4 << 20
_time_ns = time.time_ns


class Reader:
    """Lookups in one cache root. ``remover`` (made when first called) None: read-only, never writes."""

    def __init__(
        self,
        lay: Layout,
        counters: Counters,
        guard: ShardGuard,
        remover: Callable[[], Remover] | None,
        *,
        note: Callable[[str, int, str], None],
    ) -> None:
        self._lay = lay
        self._counters = counters
        self._guard = guard
        self._index_real = guard.real_names(lay.index)
        self._blobs_real = guard.real_names(lay.blobs)
        self._remover = remover
        self._note = note
        self.touches: Touches | None = None if remover is None else Touches()
        self._verified: dict[str, FileId] = {}
        #: key id -> when this process last queued a touch of it (0 when read-only): seen before.
        self._touched: dict[str, int] = {}
        #: key id -> when this process last read it (recency finer than a touch).
        self.recent: dict[str, int] = {}
        #: key id -> (identity of its manifest file, digest, size, manifest path).
        self._known: dict[str, tuple[FileId, str, int, str]] = {}
        #: digest -> (identity of its blob file, verified bytes), least recently used first.
        self._held: OrderedDict[str, tuple[FileId, bytes]] = OrderedDict()
        self._held_bytes = 0
        self._held_lock = threading.Lock()
        #: digest -> repeated reads of it in this process, halved now and then: which blobs earn memory.
        self._reads: dict[str, int] = {}
        self._holds_since_aging = 0
        self._why = threading.local()
        self._boot = BootRecord(lay.root, lay.blobs, lay.tmp, writable=True) if remover is not None else None
        self._small_looked = 0
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        # What the parent held stays held (its bytes are verified); a thread of the
        # parent may have been between changing ``_held`` and its byte count.
        self._held_lock = threading.Lock()
        self._held_bytes = sum(len(data) for _, data in self._held.values())

    def miss_reason(self) -> str:
        """Why this thread's last lookup here missed."""
        reason: str = getattr(self._why, "reason", "unknown")
        return reason

    def unusable(self, kid: str) -> None:
        """The lookup of a cache that could not be created or laid out: a miss, nothing read."""
        self._why.reason = "cache not usable (it could not be created or laid out)"

    def forget(self) -> None:
        self._verified.clear()
        self._known.clear()
        with self._held_lock:
            self._held.clear()
            self._held_bytes = 0

    def current_digest(self, kid: str) -> str | None:
        """The digest the manifest of ``kid`` names now, unverified; None when there is none (or it is bad)."""
        try:
            fd = os.open(self._lay.manifest_path(kid), READ_FLAGS)
        except OSError:
            return None
        try:
            fields = parse_fields(os.read(fd, MAX_MANIFEST_BYTES + 1))
        except OSError:
            return None
        finally:
            os.close(fd)
        return None if fields is None or fields[0] != kid else fields[1]

    def lookup(self, kid: str) -> tuple[bytes, str] | None:
        """The verified bytes of ``kid`` and their digest, or None on a miss."""
        known = self._known.get(kid)
        if known is not None:
            found = self._lookup_known(kid, known)
            if found is not None:
                return found
        ipath = shard_path(self._lay.index, kid)
        if kid[:2] not in self._index_real and not self._guard.ok(self._lay.index, kid):
            self._why.reason = "index shard is not a directory"
            return None
        try:
            mfd = os.open(ipath, READ_FLAGS)
        except FileNotFoundError:
            self._why.reason = "no entry"
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
            if fields is None or fields[0] != kid:
                # Garbled, or a manifest of another key copied or renamed here.
                self._why.reason = "damaged manifest" if fields is None else "misplaced manifest (another key's)"
                self._counters.add("corrupt")
                self._remove_manifest(kid, mfd)
                return None
            touched = self._touched
            repeat = kid in touched
            digest = fields[1]
            found = self._read_blob(kid, mfd, digest, fields[2], repeat)
            if found is None:
                return None
            if repeat:
                try:
                    mst = os.fstat(mfd)
                except OSError:  # ESTALE on NFS: serve the verified hit, just don't remember it
                    pass
                else:
                    self._known[kid] = (file_id(mst), digest, fields[2], ipath)
            elif len(touched) >= _TOUCHED_MAX:
                touched.clear()
                self._known.clear()
                self.recent.clear()
        finally:
            os.close(mfd)
        touches = self.touches
        if touches is None:
            touched[kid] = 0  # seen: its next hit remembers the manifest
        else:
            self._used(touches, kid, ipath)
        return found

    def _used(self, touches: Touches, kid: str, ipath: str) -> None:
        """This process's clock for the cap, and a queued touch at most once a second per key."""
        now = _time_ns()
        self.recent[kid] = now
        if now - self._touched.get(kid, 0) >= TOUCH_INTERVAL_NS:
            self._touched[kid] = now
            touches.add(ipath)

    def _lookup_known(self, kid: str, known: tuple[FileId, str, int, str]) -> tuple[bytes, str] | None:
        """A repeated hit whose manifest a stat proves unchanged; None (read everything) when anything changed."""
        ipath = known[3]
        try:
            mst = os.lstat(ipath)
        except OSError:
            return None
        if file_id(mst) != known[0]:
            return None
        digest = known[1]
        reads = self._reads
        reads[digest] = reads.get(digest, 0) + 1
        held = self._held.get(digest)
        if held is not None:
            # Verified bytes stay right whatever happens to the blob's file since.
            try:
                self._held.move_to_end(digest)
            except KeyError:
                pass  # another thread dropped it from memory meanwhile; these bytes are still proven
            data = held[1]
        else:
            verified = self._verified.get(digest)
            if verified is None:
                return None
            try:
                bfd = os.open(shard_path(self._lay.blobs, digest), READ_FLAGS)
            except OSError:
                return None
            try:
                size = known[2]
                data = os.read(bfd, size + 1)
                if len(data) != size:
                    return None
                # After the read: unchanged since verified, so these are the verified bytes (see _read_blob).
                identity = file_id(os.fstat(bfd))
                if identity != verified:
                    return None
            except OSError:
                return None
            finally:
                os.close(bfd)
            if size <= _HOLD_MAX_BLOB:
                self._hold(digest, identity, data)
        touches = self.touches
        if touches is not None:
            self._used(touches, kid, ipath)
        return data, digest

    def _read_blob(self, kid: str, mfd: int, digest: str, size: int, repeat: bool) -> tuple[bytes, str] | None:
        """Read and verify a blob; on a repeated hit, keep its bytes in memory."""
        if digest[:2] not in self._blobs_real and not self._guard.ok(self._lay.blobs, digest):
            self._why.reason = "blob shard is not a directory"
            return None
        bpath = shard_path(self._lay.blobs, digest)
        try:
            bfd = os.open(bpath, READ_FLAGS)
        except FileNotFoundError:
            self._why.reason = "blob missing"
            # Dangling: the blob was collected. The manifest goes only if still the one read (a writer may re-point it).
            self._remove_manifest(kid, mfd)
            return None
        except OSError as exc:
            fd = self._open_failed(exc, bpath)
            if fd is None:
                return None
            bfd = fd
        try:
            if size > _READ_BEFORE_FSTAT_MAX:
                # A manifest claiming a petabyte must not be allocated.
                try:
                    st = os.fstat(bfd)
                except OSError as exc:
                    self._read_failed(exc, bpath)
                    return None
                if st.st_size != size or not S_ISREG(st.st_mode):
                    if st.st_size and S_ISREG(st.st_mode):  # a store's framed blob? (its header says)
                        return self._unframed(kid, mfd, digest, size, bfd=bfd, data=b"", held=st.st_size)
                    self._corrupt_blob(kid, mfd, digest, bfd)
                    return None
            try:
                data = os.read(bfd, size + 1)
                if len(data) < size:  # a short read: only at EOF on a regular file
                    data = read_rest(bfd, data, size + 1)
            except OSError as exc:
                self._read_failed(exc, bpath)
                return None
            if len(data) != size:  # truncated or grown: not the blob the manifest names
                if data:  # or a store's framed blob (a store directory opened as a cache)
                    return self._unframed(kid, mfd, digest, size, bfd=bfd, data=data)
                self._corrupt_blob(kid, mfd, digest, bfd)
                return None
            identity = None
            hash_only = not repeat and size < _IDENTITY_MIN_BYTES
            if hash_only and self._boot is not None and self._small_looked < _SMALL_LOOKED_UP:
                self._small_looked += 1  # from threads at once, a count off by a few: no matter
                hash_only = False
            if not hash_only:
                try:
                    st = os.fstat(bfd)
                except OSError as exc:  # ESTALE from an NFS server: a miss, like a failed read
                    self._read_failed(exc, bpath)
                    return None
                if st.st_size != size or not S_ISREG(st.st_mode):
                    self._corrupt_blob(kid, mfd, digest, bfd)
                    return None
                identity = file_id(st)
            # The fstat comes after the read: a file still of a verified identity (this process's, or
            # this boot's record) was not changed since hashed, nor during this read (a change sets the
            # ctime; only root sets it back). Only files already old when hashed are remembered
            # (MIN_AGE_NS): a change even within one tick of the file system's clock sets a later ctime.
            if identity is None or (
                self._verified.get(digest) != identity
                and (self._boot is None or not self._boot.vouches(digest, identity))
            ):
                if _hexdigest(data) != digest:  # or a framed blob as large as its raw bytes
                    return self._unframed(kid, mfd, digest, size, bfd=bfd, data=data)
                if identity is not None:
                    now = _time_ns()
                    if old_enough(identity, now):  # young, it may have changed between the read and the fstat
                        if len(self._verified) >= _VERIFIED_MAX:
                            self._verified.clear()
                        self._verified[digest] = identity
                        if self._boot is not None:
                            self._boot.enter(digest, identity, now)
            if repeat and identity is not None and size <= _HOLD_MAX_BLOB:
                self._reads[digest] = self._reads.get(digest, 0) + 1
                self._hold(digest, identity, data)
            return data, digest
        finally:
            os.close(bfd)

    def _hold(self, digest: str, identity: FileId, data: bytes) -> None:
        """Keep a verified blob's bytes in memory, within the budget.

        When full, a newcomer displaces the least recently used only if read two or more times more
        often: keys read in a loop, more than fit, then mostly stay (plain LRU fails a loop).
        """
        reads = self._reads
        with self._held_lock:
            held = self._held
            self._holds_since_aging += 1
            if self._holds_since_aging > len(held) + 64:
                self._holds_since_aging = 0
                if len(reads) > _VERIFIED_MAX:
                    reads.clear()
                else:
                    for name, n in list(reads.items()):
                        reads[name] = n >> 1
            old = held.pop(digest, None)
            if old is not None:
                self._held_bytes -= len(old[1])
            elif (
                held
                and self._held_bytes + len(data) > _HOLD_MAX_BYTES
                and reads.get(digest, 0) <= reads.get(next(iter(held)), 0) + 1
            ):
                # One read of margin: in a loop the blob next in line has one read fewer than the one just read.
                return
            held[digest] = (identity, data)
            self._held_bytes += len(data)
            while self._held_bytes > _HOLD_MAX_BYTES and held:
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
        """Remove a bad or dangling manifest if it is still the file read (``mfd``)."""
        if self._remover is None:
            return
        try:
            st = os.fstat(mfd)
            self._remover().manifest(kid, st)
        except OSError as exc:
            self._counters.add("errors")
            self._note("cannot remove a bad manifest", exc.errno or 0, f"{self._lay.manifest_path(kid)}: {exc}")

    def _read_failed(self, exc: OSError, path: str) -> None:
        if isinstance(exc, NotRegularFile):
            self._why.reason = "not a regular file"
            self._counters.add("corrupt")
            self._note("not a regular file", 0, path)
            return
        self._why.reason = f"cannot read ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
        self._counters.add("errors")
        self._note("read error", exc.errno or 0, f"{path}: {exc}")

    def _unframed(
        self, kid: str, mfd: int, digest: str, size: int, *, bfd: int, data: bytes, held: int | None = None
    ) -> tuple[bytes, str] | None:
        """The raw bytes of a store directory's framed blob (``data``: its first bytes read), verified, else damage.

        Framed, ``size`` raw bytes take at most ``room(size)``. ``held``: the file's size where known, so
        that ``os.read`` (which allocates what it is asked) is asked no more (a manifest claiming a petabyte).
        """
        from cuda_program_cas._base.engine import StoreFailure
        from cuda_program_cas._base.frame import is_framed, room, verified

        bound = room(size) if held is None else min(room(size), held)
        try:
            data = read_rest(bfd, data, bound + 1)
            if len(data) <= room(size) and is_framed(data):
                return bytes(verified(digest, data, digest, size)), digest
        except (OSError, StoreFailure):
            pass
        self._corrupt_blob(kid, mfd, digest, bfd)
        return None

    def _corrupt_blob(self, kid: str, mfd: int, digest: str, bfd: int) -> None:
        """A blob that is not what its name says: never returned; moved aside, its manifest removed."""
        self._counters.add("corrupt")
        self._verified.pop(digest, None)
        if _hashes_to(bfd, digest):
            # Intact, only the manifest's size is wrong; other keys may share the blob: keep it.
            self._why.reason = "damaged manifest (its size is not its blob's)"
            self._remove_manifest(kid, mfd)
            return
        self._why.reason = "damaged blob"
        if self._remover is None:
            self._note("corrupt blob", 0, self._lay.blob_path(digest))
            return
        try:
            bst = os.fstat(bfd)
            where = self._remover().quarantine(digest, bst)
        except OSError as exc:
            self._set_aside_failed(digest, bfd, exc)
        else:
            done = f"moved to {where}" if where else "left alone (it changed meanwhile)"
            _log.warning("cuda-program-cas: blob %s failed verification; %s", digest, done)
        self._remove_manifest(kid, mfd)

    def _set_aside_failed(self, digest: str, bfd: int, exc: OSError) -> None:
        """A bad blob that ``quarantine/`` cannot take: remove it if still the file read, else it stays (said once)."""
        assert self._remover is not None
        try:
            removed = self._remover().blob(digest, seen=file_id(os.fstat(bfd)))
        except OSError as again:
            self._counters.add("errors")
            self._note(
                "bad blob stays",
                again.errno or 0,
                f"blob {digest} failed verification and can be neither moved to quarantine/ ({exc}) nor removed "
                f"({again}); it stays, and every lookup of it is a miss",
            )
            return
        done = "removed it" if removed else "left alone (it changed meanwhile)"
        _log.warning(
            "cuda-program-cas: blob %s failed verification; quarantine/ cannot take it (%s), so %s", digest, exc, done
        )


def _hashes_to(fd: int, digest: str) -> bool:
    try:
        if not S_ISREG(os.fstat(fd).st_mode):
            return False
        os.lseek(fd, 0, os.SEEK_SET)
        return hashes_to(lambda n: os.read(fd, n), digest)
    except OSError:
        return False
