"""The directory engine: a store's objects as files under its root (a local disk, an NFS mount).

It implements :class:`cuda_program_cas._base.engine.Engine` with the same system
calls the cache's own reader makes, so a first hit of a loose entry costs an NFS
server what it always did: an open, a read and a close of the manifest, then of
the blob. Every file is opened with ``O_NOFOLLOW | O_NONBLOCK`` (a planted symlink
is not followed, a FIFO does not block), and a shard directory (``index/ab``)
that is a symlink or a file is refused, as the local cache refuses it
(:class:`cuda_program_cas._disk.files.ShardGuard`). A blob over a MiB is read in chunks
through :func:`~cuda_program_cas._disk.intake.verified_intake`, as HTTP's body is.

Errors: a missing file (ENOENT, ENOTDIR) is "no such object". EIO, ETIMEDOUT,
ENOTCONN and EHOSTDOWN may mean the server is gone (a soft mount's EIO comes after
its whole timeout): they are outages, and its record (not ``remote``) asks the
store above to check the layout once before it pauses, since on a directory one
bad file is not yet an outage. Anything else (ESTALE, EACCES, a symlink, a
file too large) is a bad answer for this object only.

Writes (a store named writable, and publish) go through the one write protocol,
:class:`cuda_program_cas._disk.writer.Writer`: a private temp file in the store's
``tmp/``, then ``os.replace``, with the store's :class:`DirModes` (publish: the
umask's or the group's modes, a ``syncfs`` per phase). Only a directory has mtimes
to freshen (:meth:`DirEngine.freshen`) and a cache of its own to sync
(:meth:`DirEngine.sync`). Removals go through the one remover. Its abilities:
ranged reads (``pread``) and listing (a folder's files). A directory gives no
leases: ``flock`` over NFS is not a lease a dead node gives back within a bound
(see docs/nfs.md), so per-node claims remain.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, TypeVar

from cuda_program_cas._base.engine import Abilities, StoreFailure, limits_of
from cuda_program_cas._base.frame import stored_limit, verified

from .atomic import current_umask
from .files import HASH_CHUNK, READ_FLAGS, ShardGuard, read_rest
from .intake import Take, verified_intake

if TYPE_CHECKING:
    from .writer import Writer

__all__ = ["OUTAGE_ERRNOS", "DirEngine", "DirModes"]

#: Read errors that may mean the whole store is unreachable.
OUTAGE_ERRNOS = frozenset(
    e for e in (errno.EIO, errno.ETIMEDOUT, errno.ENOTCONN, getattr(errno, "EHOSTDOWN", None)) if e is not None
)
_ABSENT = frozenset((errno.ENOENT, errno.ENOTDIR))
#: The top-level folders whose children are shards (``index/ab/...``).
_SHARDED = ("index/", "blobs/")
_CHUNK = 1 << 20
_T = TypeVar("_T")


@dataclass(frozen=True)
class DirModes:
    """How a store directory's files are written (publish's options): ``file``/``dir``: the exact modes of new files
    and directories; ``tmp_dir``: the store's ``tmp/`` (its files stay private); ``group_shared``: new directories
    setgid; ``fsync``: each pack fsynced, and :meth:`DirEngine.sync` one ``syncfs`` per phase."""

    file: int
    dir: int
    tmp_dir: int
    group_shared: bool
    fsync: bool

    @classmethod
    def for_process(cls, group_shared: bool, *, fsync: bool = True) -> DirModes:
        umask = current_umask()
        file_mode = 0o644 & ~umask
        dir_mode = 0o777 & ~umask
        if group_shared:
            # Group members read everything; new files and directories inherit
            # the directory's group (setgid). Group write follows the umask, so a
            # publishing team with umask 002 can publish into one store together.
            file_mode |= 0o640
            dir_mode |= 0o2750
            return cls(file_mode, dir_mode, dir_mode, True, fsync)
        return cls(file_mode, dir_mode, 0o700, False, fsync)


class DirEngine:
    """The objects of the store directory ``root`` (see the module docstring).

    ``modes``: how its files are written (None: the writer's defaults, as write-back writes).
    """

    #: A put is renamed in whole by this process (proven: publish re-checks blobs after their manifests for a
    #: collector); ``put_many`` is one put after another, not a transaction; not remote: one file failing is
    #: not yet an outage.
    can = Abilities(ranges=True, listing=True, puts_proven=True)
    #: What to ask of a directory that did not keep what it was given (for a message).
    lost_hint = "is another writer at work, or the file system not a real one?"

    def __init__(
        self, root: str, *, guard: ShardGuard | None = None, modes: DirModes | None = None, staging: str | None = None
    ) -> None:
        self.root = root
        #: Where a large blob's raw bytes wait while they are verified (the local cache's ``tmp/``; None: in memory).
        self.staging = staging
        self.shown = root
        self.modes = modes
        self._guard = guard if guard is not None else ShardGuard()

    def writer(self, *, fsync: bool = False) -> Writer:
        """The one writer of this store's files, with its modes (``fsync``: each file)."""
        from .layout import Layout
        from .writer import Writer

        m = self.modes
        if m is None:
            return Writer(Layout(self.root), fsync=fsync, guard=self._guard)
        return Writer(
            Layout(self.root),
            file_mode=m.file,
            exact_mode=True,
            dir_mode=m.dir,
            setgid=m.group_shared,
            fsync=fsync,
            guard=self._guard,
        )

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
        fd = _found(path, lambda: os.open(path, READ_FLAGS))
        if fd is None:
            return None
        stored = stored_limit(limit, digest)
        try:
            if digest is not None and limit > HASH_CHUNK:
                return verified_intake(path, digest, limit, self.staging, lambda take: _chunks(fd, path, stored, take))
            data = os.read(fd, stored + 1)
            if len(data) <= stored:
                # A short read ends a regular file only at its end; read on until then (or past the limit).
                data = read_rest(fd, data, stored + 1)
        except OSError as exc:  # a directory (EISDIR), a FIFO (EAGAIN), EIO, ESTALE
            raise _failure(path, exc) from None
        finally:
            os.close(fd)
        if len(data) > stored:
            raise StoreFailure(path, "too large", f"more than {stored} bytes", outage=False)
        return data if digest is None else bytes(verified(path, data, digest, limit))

    def get_many(self, names: Sequence[str], *, limit: int | Sequence[int]) -> list[bytes | None]:
        return [self.get(name, limit=n) for name, n in zip(names, limits_of(names, limit), strict=True)]

    def get_range(
        self, name: str, offset: int, length: int, *, sink: Callable[[bytes], object] | None = None
    ) -> bytes | None:
        got = self._pread(name, lambda size: [(offset, length)], sink)
        return None if got is None else got[0][offset]

    def get_tail(self, name: str, length: int) -> tuple[bytes, int] | None:
        got = self._pread(name, lambda size: [(max(0, size - length), min(length, size))])
        return None if got is None else (next(iter(got[0].values())), got[1])

    def get_ranges(
        self, name: str, spans: Sequence[tuple[int, int]], tail: int = 0
    ) -> tuple[Mapping[int, memoryview], int] | None:
        got = self._pread(name, lambda size: [*spans, *([(max(0, size - tail), min(tail, size))] if tail else [])])
        return None if got is None else ({at: memoryview(data) for at, data in got[0].items()}, got[1])

    def _pread(
        self, name: str, spans: Callable[[int], list[tuple[int, int]]], sink: Callable[[bytes], object] | None = None
    ) -> tuple[dict[int, bytes], int] | None:
        """The bytes of each ``(offset, length)`` of ``spans(its size)`` in ``name`` by offset, and its size; None: no
        file. With ``sink`` the bytes go there in chunks, none held. A span past the end is ``short``."""
        path = self._vetted(name)
        fd = _found(path, lambda: os.open(path, READ_FLAGS))
        if fd is None:
            return None
        got: dict[int, bytes] = {}
        try:
            size = self._read(path, lambda: os.fstat(fd).st_size)
            for offset, length in spans(size):
                if offset + length > size:
                    detail = f"asked {length} bytes from {offset}, the file has {size}"
                    raise StoreFailure(self.path(name), "short", detail, outage=False)
                parts: list[bytes] = []
                for at in range(offset, offset + length, _CHUNK):
                    n = min(offset + length - at, _CHUNK)
                    part = self._read(path, lambda: os.pread(fd, n, at))  # noqa: B023 - called at once
                    if len(part) < n:
                        raise StoreFailure(self.path(name), "short", f"it ended while read at {at}", outage=False)
                    (parts.append if sink is None else sink)(part)  # a sink's own failure reaches the caller
                got[offset] = b"".join(parts)
        finally:
            os.close(fd)
        return got, size

    @staticmethod
    def _read(path: str, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except OSError as exc:
            raise _failure(path, exc) from None

    def names(self, folder: str) -> list[str]:
        path = self._vetted(folder.rstrip("/") + "/")

        def names() -> list[str]:
            with os.scandir(path) as it:
                return sorted(e.name for e in it if e.is_file(follow_symlinks=False) and not e.name.startswith("."))

        return _found(path, names) or []

    def size(self, name: str) -> int | None:
        path = self._vetted(name)
        st = _found(path, lambda: os.lstat(path))
        return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None

    # -- writes (a store named writable) ---------------------------------------------------

    def put(self, name: str, data: bytes | IO[bytes]) -> str:
        path = self._vetted(name)
        body: bytes | Iterator[bytes] = data if isinstance(data, bytes) else iter(lambda: data.read(_CHUNK), b"")
        # A file (a pack) is copied in chunks, and fsynced where the modes say so; bytes (loose files) are made
        # durable once per phase (sync).
        fsync = not isinstance(data, bytes) and self.modes is not None and self.modes.fsync
        try:
            if not self.writer(fsync=fsync).write_file(path, body):
                raise StoreFailure(path, "dropped", "the write was dropped (a shard is not a directory)", outage=False)
        except OSError as exc:
            raise _failure(path, exc) from None
        return "a completed write"

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        for name, data in items:
            self.put(name, data)

    def freshen(self, name: str, size: int) -> bool:
        """Set the mtime of ``name`` to now if it is a file of ``size`` bytes (a collector then sees it young)."""
        return self.writer().freshen(self._vetted(name), size)

    def sync(self) -> None:
        """Make what was written so far durable, with ``modes.fsync``: one ``syncfs``, not an fsync per file."""
        if self.modes is not None and self.modes.fsync:
            self.writer().sync()

    def remove(self, name: str) -> None:
        from .layout import Layout
        from .remove import Remover

        path = self._vetted(name)
        try:
            Remover(Layout(self.root)).file(path)
        except OSError as exc:
            raise _failure(path, exc) from None

    def close(self) -> None:
        return


def _chunks(fd: int, path: str, stored: int, take: Take) -> bool:
    """The file's bytes into ``take`` in chunks of :data:`HASH_CHUNK`: a file that lies about its bytes costs a chunk
    of memory, not its size; more than ``stored`` of them are ``too large``."""
    got = 0
    n = HASH_CHUNK
    while got <= stored and (chunk := DirEngine._read(path, lambda: os.read(fd, n))):  # noqa: B023 - called at once
        got += len(chunk)
        n = min(HASH_CHUNK, stored + 1 - got)
        take(chunk)
    if got > stored:
        raise StoreFailure(path, "too large", f"more than {stored} bytes", outage=False)
    return True


def _found(path: str, call: Callable[[], _T]) -> _T | None:
    """``call()``; None where ``path`` is not there, a :class:`StoreFailure` for another ``OSError``."""
    try:
        return call()
    except OSError as exc:
        if exc.errno in _ABSENT:
            return None
        raise _failure(path, exc) from None


def _failure(path: str, exc: OSError) -> StoreFailure:
    code = exc.errno or 0
    kind = "not a regular file" if code in (errno.ELOOP, errno.EMLINK) else errno.errorcode.get(code, "error")
    if code in (errno.EACCES, errno.EPERM):
        kind = "denied"
    return StoreFailure(path, kind, exc.strerror or str(exc), outage=code in OUTAGE_ERRNOS)


if TYPE_CHECKING:  # mypy checks that the class keeps the interfaces its record declares
    from cuda_program_cas._base.engine import Engine, Listing, Ranged

    def _is_engine(engine: DirEngine) -> tuple[Engine, Ranged, Listing]:
        return engine, engine, engine
