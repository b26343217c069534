"""A pack file read by ``pread`` on a descriptor of one process-wide pool (:class:`.pack.PackReader`'s transport).

However many packs a process's shared stores hold, at most :data:`MAX_OPEN_PACKS` of their
descriptors are open; one the pool closed is opened again when it is read.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Callable

from cuda_program_cas._base.fork import after_fork_call

from .files import HASH_CHUNK, READ_FLAGS

__all__ = ["MAX_OPEN_PACKS", "RETIRED", "TRANSIENT", "PackFile", "open_packs"]

#: At most this many pack files are open in one process, whatever the number of packs
#: in its shared stores (1,100 packs open at once made every open past the soft limit
#: of 1024 fail with EMFILE). Reopening an evicted pack costs one ``open``; see docs/nfs.md.
MAX_OPEN_PACKS = 32
#: Errors that say the process is short of descriptors or memory, not that the pack is bad.
TRANSIENT = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOMEM))
#: Where a repack moves the packs it replaced, under ``packs/`` (they wait out the shared grace period).
RETIRED = "retired"


class _DescriptorPool:
    """The open descriptors of every pack file of this process, least recently used first.

    A descriptor in use (pinned by :meth:`pin`) is never closed under its reader: a
    thread reading through it would otherwise read a number the kernel gave to
    another file. Past :data:`MAX_OPEN_PACKS`, unpinned ones close, oldest first.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lru: OrderedDict[PackFile, None] = OrderedDict()

    def add(self, file: PackFile) -> None:
        with self._lock:
            self._lru[file] = None
            self._shrink()

    def pin(self, file: PackFile) -> int:
        """The file's descriptor, opened again if it was closed, kept open until :meth:`unpin`."""
        with self._lock:
            if file.fd >= 0:
                file.pins += 1
                self._lru.move_to_end(file)
                return file.fd
            if file.closed:
                raise FileNotFoundError(errno.ENOENT, "the pack was closed", file.path)
        fd = file.reopen()  # outside the lock: an open on a slow server holds up no other pack
        with self._lock:
            if file.fd >= 0 or file.closed:  # another thread opened (or closed) it meanwhile
                os.close(fd)
                if file.closed:
                    raise FileNotFoundError(errno.ENOENT, "the pack was closed", file.path)
            else:
                file.fd = fd
                self._lru[file] = None
            file.pins += 1
            self._lru.move_to_end(file)
            self._shrink()
            return file.fd

    def unpin(self, file: PackFile) -> None:
        with self._lock:
            file.pins -= 1
            if file.closed and file.pins == 0:
                self._drop(file)

    def close(self, file: PackFile) -> None:
        """Close the file for good (now, or when its last user unpins it)."""
        with self._lock:
            file.closed = True
            if file.pins == 0:
                self._drop(file)

    def _shrink(self) -> None:
        over = len(self._lru) - MAX_OPEN_PACKS
        if over <= 0:
            return
        victims = [file for file in self._lru if file.pins == 0][:over]  # oldest first
        for file in victims:
            self._drop(file)

    def _drop(self, file: PackFile) -> None:
        if file in self._lru:
            del self._lru[file]
            fd, file.fd = file.fd, -1
            os.close(fd)

    def after_fork_in_child(self) -> None:
        # Threads that pinned descriptors do not exist in the child; its lock may have been held.
        self._lock = threading.Lock()
        for file in self._lru:
            file.pins = 0


_POOL = _DescriptorPool()
after_fork_call(_POOL.after_fork_in_child)


def open_packs() -> int:
    """How many pack files this process holds open now (at most :data:`MAX_OPEN_PACKS` plus those in use)."""
    return len(_POOL._lru)  # one read of a dict's size: no lock needed


class PackFile:
    """A pack file read by ``pread`` on a descriptor of the pool; one the pool closed is opened again when needed,
    and must be the same file (device, inode, size), at its path or in ``retired/`` where a repack moved it."""

    rereads = True

    def __init__(self, path: str, fd: int, st: os.stat_result) -> None:
        self.path = path
        self.fd = fd
        self.pins = 0
        self.closed = False
        self._identity = (st.st_dev, st.st_ino, st.st_size)
        _POOL.add(self)

    def reopen(self) -> int:
        head, name = os.path.split(self.path)
        for candidate in (self.path, os.path.join(head, RETIRED, name)):
            try:
                fd = os.open(candidate, READ_FLAGS)
            except FileNotFoundError:
                continue
            try:
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
            if (st.st_dev, st.st_ino, st.st_size) == self._identity:
                return fd
            os.close(fd)
        raise FileNotFoundError(errno.ENOENT, "the pack is gone", self.path)

    def read(self, offset: int, length: int) -> bytes:
        fd = _POOL.pin(self)
        try:
            return os.pread(fd, length, offset)
        finally:
            _POOL.unpin(self)

    def stream(self, offset: int, length: int, sink: Callable[[bytes], object]) -> int:
        at, end = offset, offset + length
        while at < end and (chunk := self.read(at, min(HASH_CHUNK, end - at))):
            sink(chunk)
            at += len(chunk)
        return at - offset

    def close(self) -> None:
        _POOL.close(self)
