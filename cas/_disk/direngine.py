"""The directory engine: a store's objects as files under its root (a local disk, an NFS mount).

It implements :class:`cuda_program_cas._base.engine.Engine` with the same system
calls the cache's own reader makes, so a first hit of a loose entry costs an NFS
server what it always did: an open, a read and a close of the manifest, then of
the blob. Every file is opened with ``O_NOFOLLOW | O_NONBLOCK`` (a planted symlink
is not followed, a FIFO does not block), and a shard directory (``index/ab``)
that is a symlink or a file is refused, as the local cache refuses it
(:class:`cuda_program_cas._disk.files.ShardGuard`).

Errors: a missing file (ENOENT, ENOTDIR) is "no such object". EIO, ETIMEDOUT,
ENOTCONN and EHOSTDOWN may mean the server is gone (a soft mount's EIO comes after
its whole timeout): they are outages, and :attr:`DirEngine.recheck_on_outage` asks
the store above to check the layout once before it pauses, since on a directory
one bad file is not yet an outage. Anything else (ESTALE, EACCES, a symlink, a
file too large) is a bad answer for this object only.

Writes (a store named writable) go through the one write protocol,
:class:`cuda_program_cas._disk.writer.Writer`: a private temp file in the store's
``tmp/``, then ``os.replace``. Removals go through the one remover. A directory
gives no leases: ``flock`` over NFS is not a lease a dead node gives back within a
bound (see docs/nfs.md), so per-node claims remain.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from typing import IO

from cuda_program_cas._base.engine import StoreFailure, check_digest

from .files import HASH_CHUNK, READ_FLAGS, ShardGuard, hashes_to, read_rest

__all__ = ["OUTAGE_ERRNOS", "DirEngine"]

#: Read errors that may mean the whole store is unreachable.
OUTAGE_ERRNOS = frozenset(
    e for e in (errno.EIO, errno.ETIMEDOUT, errno.ENOTCONN, getattr(errno, "EHOSTDOWN", None)) if e is not None
)
_ABSENT = frozenset((errno.ENOENT, errno.ENOTDIR))
#: The top-level folders whose children are shards (``index/ab/...``).
_SHARDED = ("index/", "blobs/")
_CHUNK = 1 << 20


class DirEngine:
    """The objects of the store directory ``root`` (see the module docstring)."""

    can_lease = False
    #: One file failing is not yet an outage here: the store checks its layout before it pauses.
    recheck_on_outage = True

    def __init__(self, root: str, *, guard: ShardGuard | None = None) -> None:
        self.root = root
        self.shown = root
        self._guard = guard if guard is not None else ShardGuard()

    def path(self, name: str) -> str:
        """The file of object ``name`` (``/``-separated, relative to the root)."""
        return os.path.join(self.root, *name.split("/"))

    def _vetted(self, name: str) -> str:
        if name.startswith(_SHARDED):
            top, _, rest = name.partition("/")
            if not self._guard.ok(os.path.join(self.root, top), rest):
                raise StoreFailure(self.path(name), "not a directory", "its shard is a symlink or a file", outage=False)
        return self.path(name)

    # -- reads -------------------------------------------------------------------------

    def get(self, name: str, *, limit: int, digest: str | None = None) -> bytes | None:
        path = self._vetted(name)
        try:
            fd = os.open(path, READ_FLAGS)
        except OSError as exc:
            if exc.errno in _ABSENT:
                return None
            raise _failure(path, exc) from None
        try:
            if digest is not None and limit > HASH_CHUNK and not _hashes_to(fd, digest, limit):
                # Hashed in chunks first: a file that lies about its bytes costs a chunk of memory, not its size.
                raise StoreFailure(path, "damaged", f"its bytes do not hash to {digest}", outage=False)
            data = os.read(fd, limit + 1)
            if len(data) <= limit:
                # A short read ends a regular file only at its end; read on until then (or past the limit).
                data = read_rest(fd, data, limit + 1)
        except OSError as exc:  # a directory (EISDIR), a FIFO (EAGAIN), EIO, ESTALE
            raise _failure(path, exc) from None
        finally:
            os.close(fd)
        if len(data) > limit:
            raise StoreFailure(path, "too large", f"more than {limit} bytes", outage=False)
        return check_digest(path, data, digest)

    def get_many(self, names: Sequence[str], *, limit: int) -> list[bytes | None]:
        return [self.get(name, limit=limit) for name in names]

    def size(self, name: str) -> int | None:
        path = self._vetted(name)
        try:
            st = os.lstat(path)
        except OSError as exc:
            if exc.errno in _ABSENT:
                return None
            raise _failure(path, exc) from None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    # -- writes (a store named writable) ---------------------------------------------------

    def put(self, name: str, data: bytes | IO[bytes]) -> None:
        from .layout import Layout
        from .writer import Writer

        path = self._vetted(name)
        body: bytes | list[bytes] = data if isinstance(data, bytes) else list(iter(lambda: data.read(_CHUNK), b""))
        try:
            if not Writer(Layout(self.root), guard=self._guard).write_file(path, body):
                raise StoreFailure(path, "dropped", "the write was dropped (a shard is not a directory)", outage=False)
        except OSError as exc:
            raise _failure(path, exc) from None

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        for name, data in items:
            self.put(name, data)

    def remove(self, name: str) -> None:
        from .layout import Layout
        from .remove import Remover

        path = self._vetted(name)
        try:
            Remover(Layout(self.root)).file(path)
        except OSError as exc:
            raise _failure(path, exc) from None

    # -- leases: none here ----------------------------------------------------------------

    def lease(self, name: str, ttl_s: float) -> str | None:
        raise StoreFailure(self.root, "no leases", "a directory store gives no leases", outage=False)

    def renew(self, name: str, token: str, ttl_s: float) -> bool:
        return False

    def release(self, name: str, token: str) -> None:
        return

    def close(self) -> None:
        return


def _hashes_to(fd: int, digest: str, limit: int) -> bool:
    """Whether the file holds ``limit`` bytes, no more, that hash to ``digest`` (read in chunks); at its start again."""
    whole = hashes_to(lambda n: os.read(fd, n), digest, limit) and not os.read(fd, 1)
    os.lseek(fd, 0, os.SEEK_SET)
    return whole


def _failure(path: str, exc: OSError) -> StoreFailure:
    code = exc.errno or 0
    kind = "not a regular file" if code in (errno.ELOOP, errno.EMLINK) else errno.errorcode.get(code, "error")
    if code in (errno.EACCES, errno.EPERM):
        kind = "denied"
    return StoreFailure(path, kind, exc.strerror or str(exc), outage=code in OUTAGE_ERRNOS)
