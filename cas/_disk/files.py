"""Portable file primitives: reading cache files, naming them, proving them unchanged.

One path builder (:func:`shard_path`) names every blob and manifest; one file identity
(:func:`file_id`) proves a file unchanged between two looks. On Windows, a file held open
elsewhere makes ``os.replace``, ``open`` and ``unlink`` fail for a moment (winerror 5/32/33,
or a bare ``EACCES``): those are retried within a bounded budget; any other
``PermissionError`` propagates.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from cuda_program_cas.index import is_hex

if TYPE_CHECKING:
    from blake3 import blake3 as Blake3

__all__ = [
    "FUTURE_MTIME_NS",
    "HASH_CHUNK",
    "IS_WINDOWS",
    "READ_FLAGS",
    "FileId",
    "NotRegularFile",
    "ShardGuard",
    "SizeMismatch",
    "blake3_hasher",
    "digest_of",
    "file_id",
    "fs_now",
    "hashes_to",
    "is_sharing_violation",
    "read_regular",
    "read_rest",
    "read_small",
    "same_file",
    "scan_sharded",
    "shard_path",
    "trusted_mtime_ns",
    "with_sharing_retry",
]

_T = TypeVar("_T")

#: Module-level so tests can simulate Windows without touching ``os.name``.
IS_WINDOWS = os.name == "nt"

_SHARING_WINERRORS = frozenset((5, 32, 33))  # ACCESS_DENIED, SHARING_VIOLATION, LOCK_VIOLATION
_RETRY_DELAYS = (0.0, 0.005, 0.010, 0.020, 0.050, 0.100)  # about 185 ms in all

_O_BINARY = getattr(os, "O_BINARY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
#: Opening for read: never follow a final symlink, never block on a FIFO.
READ_FLAGS = os.O_RDONLY | _O_BINARY | _O_NOFOLLOW | _O_NONBLOCK

#: Device, inode, size, mtime, ctime: ctime cannot be set back without root, so an equal
#: identity means untouched since.
FileId = tuple[int, int, int, int, int]


def file_id(st: os.stat_result) -> FileId:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


#: How far ahead of the file system's clock a file time is still believed. Clocks differ by
#: seconds; a time further ahead comes from a wrong clock and would keep a file young until then.
FUTURE_MTIME_NS = 86_400 * 10**9


def trusted_mtime_ns(mtime_ns: int, now_ns: int) -> int:
    """``mtime_ns`` as every age in the cache is computed from it; ``now_ns``: the file system's clock.

    A time more than :data:`FUTURE_MTIME_NS` ahead counts as 0, the oldest there is.
    """
    return 0 if mtime_ns > now_ns + FUTURE_MTIME_NS else mtime_ns


def same_file(path: str, before: FileId) -> bool:
    """True when ``path`` (not followed if a symlink) is still the file ``before`` describes."""
    try:
        return file_id(os.lstat(path)) == before
    except OSError:
        return False


def shard_path(directory: str, name: str) -> str:
    """``<directory>/<name[:2]>/<name[2:]>`` for a validated digest or key id."""
    return f"{directory}{os.sep}{name[:2]}{os.sep}{name[2:]}"


def is_sharing_violation(exc: BaseException) -> bool:
    """True for a transient Windows sharing or lock violation (or a pending delete's bare ``EACCES``)."""
    if not IS_WINDOWS or not isinstance(exc, PermissionError):
        return False
    winerror = getattr(exc, "winerror", None)
    if winerror in _SHARING_WINERRORS:
        return True
    return winerror is None and exc.errno == errno.EACCES


def with_sharing_retry(op: Callable[[], _T]) -> _T:
    """Run ``op``, retrying Windows sharing violations; re-raise the last after the budget."""
    last: PermissionError | None = None
    for delay in _RETRY_DELAYS:
        if delay:
            time.sleep(delay)
        try:
            return op()
        except PermissionError as exc:
            if not is_sharing_violation(exc):
                raise
            last = exc
    assert last is not None
    raise last


def read_regular(path: str, expected_size: int | None = None) -> tuple[bytes, os.stat_result]:
    """Read a whole regular file without following a final symlink.

    Raises ``FileNotFoundError`` when it is absent (also after an exhausted Windows sharing
    retry), :class:`NotRegularFile` for anything else, and :class:`SizeMismatch` without
    reading when ``expected_size`` is given and the file has another.
    """
    try:
        fd = with_sharing_retry(lambda: os.open(path, READ_FLAGS))
    except PermissionError as exc:
        if is_sharing_violation(exc):
            raise FileNotFoundError(errno.ENOENT, "busy", path) from exc
        raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise NotRegularFile(path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(path)
        size = st.st_size
        if expected_size is not None and size != expected_size:
            raise SizeMismatch(path, expected_size, size)
        limit = size + 1 if expected_size is None else size
        data = os.read(fd, limit)
        if len(data) < size:
            data = read_rest(fd, data, limit)
        return data, st
    finally:
        os.close(fd)


def read_small(path: str, limit: int) -> bytes:
    """Up to ``limit`` bytes of the regular file ``path``, in one read (a small file: ``layout.json``, settings).

    ``OSError`` as ``open`` raises it (``ELOOP`` for a symlink); :class:`NotRegularFile` for anything else.
    """
    fd = os.open(path, READ_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(path)
        return os.read(fd, limit)
    finally:
        os.close(fd)


class NotRegularFile(OSError):
    """The path names a symlink, directory, FIFO or device, not a cache file."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.EINVAL, "not a regular file", path)


class SizeMismatch(OSError):
    """The file does not have the size its manifest records."""

    def __init__(self, path: str, expected: int, actual: int) -> None:
        super().__init__(errno.EIO, f"expected {expected} bytes, found {actual}", path)
        self.expected = expected
        self.actual = actual


def scan_sharded(directory: str, unreadable: list[str] | None = None) -> Iterator[tuple[str, str, os.stat_result]]:
    """``(name, path, stat)`` of every regular file ``<directory>/<2 hex>/<62 hex>``; anything else is skipped.

    A shard that cannot be listed is appended to ``unreadable``: what it holds is unknown, not absent.
    """
    try:
        with os.scandir(directory) as top:
            shards = sorted(e.name for e in top if is_hex(e.name, 2) and e.is_dir(follow_symlinks=False))
    except OSError:
        return
    for shard in shards:
        shard_path = os.path.join(directory, shard)
        try:
            with os.scandir(shard_path) as it:
                for entry in it:
                    if not is_hex(entry.name, 62):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        yield shard + entry.name, entry.path, st
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            if unreadable is not None:
                unreadable.append(shard_path)


def fs_now(directory: str) -> int | None:
    """The file system's own clock now, in ns (its mtime after a touch; None when it cannot be touched).

    File times come from the kernel's coarse clock or an NFS server's, which can lag
    ``time.time_ns()``: compare file times against this.
    """
    try:
        os.utime(directory)
        return os.stat(directory).st_mtime_ns
    except OSError:
        return None


_LSTATS_BEFORE_LISTING = 32


class ShardGuard:
    """Vouches that shard directories are real directories, not symlinks or files.

    A symlinked shard would lead reads and writes outside the cache root. Each shard is
    checked once per guard (a missing one is fine); ``on_strange(path)`` hears of each bad
    one. The first shards get an ``lstat`` each; past :data:`_LSTATS_BEFORE_LISTING` the
    directory is listed once (about 0.2 ms), which vouches for every shard there.
    """

    def __init__(self, on_strange: Callable[[str], None] | None = None) -> None:
        self._real: dict[str, set[str]] = {}
        #: directory -> shards checked there one by one (None once it is listed).
        self._checked: dict[str, int | None] = {}
        self._on_strange = on_strange

    def real_names(self, directory: str) -> set[str]:
        """The shard names under ``directory`` vouched for so far: a live set, for a hot path to test first."""
        return self._real.setdefault(directory, set())

    def ok(self, directory: str, name: str) -> bool:
        """True unless the shard of ``name`` under ``directory`` is a symlink or not a directory."""
        head = name[:2]
        names = self._real.get(directory)
        if names is not None and head in names:
            return True
        if names is None:
            names = self.real_names(directory)
        checked = self._checked.get(directory, 0)
        if checked is not None:
            if checked < _LSTATS_BEFORE_LISTING:
                self._checked[directory] = checked + 1
            else:
                self._checked[directory] = None
                try:
                    with os.scandir(directory) as it:
                        names.update(e.name for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False))
                except OSError:
                    pass
                if head in names:
                    return True
        shard = f"{directory}{os.sep}{head}"
        try:
            st = os.lstat(shard)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            if self._on_strange is not None:
                self._on_strange(shard)
            return False
        names.add(head)
        return True


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: From this size on, data is hashed on several cores where the process may use at least
#: _MT_MIN_CORES; on smaller machines waking the pool costs more (docs/benchmarks.md).
_MT_MIN_BYTES = 2 << 20
_MT_MIN_CORES = 8
_MT = _usable_cores() >= _MT_MIN_CORES
_AUTO = -1  # blake3.AUTO: as many threads as the pool has


@functools.cache
def blake3_hasher() -> type[Blake3]:
    """blake3's hasher type, imported on first use: about 0.5 ms that a hit of a blob verified this boot skips."""
    from blake3 import blake3

    return blake3


def digest_of(data: bytes | bytearray | memoryview) -> str:
    """The digest that names ``data``: lowercase hex blake3."""
    blake3 = blake3_hasher()
    if _MT and len(data) >= _MT_MIN_BYTES:
        return blake3(data, max_threads=_AUTO).hexdigest()
    return blake3(data).hexdigest()


HASH_CHUNK = 1 << 20


def hashes_to(read: Callable[[int], bytes], digest: str, size: int | None = None) -> bool:
    """Whether the bytes ``read(n)`` gives, in chunks, hash to ``digest``: the first ``size`` (fewer: False), or all."""
    hasher = blake3_hasher()()
    got = 0
    while size is None or got < size:
        chunk = read(HASH_CHUNK if size is None else min(HASH_CHUNK, size - got))
        if not chunk:
            if size is not None:
                return False
            break
        hasher.update(chunk)
        got += len(chunk)
    return hasher.hexdigest() == digest


def read_rest(fd: int, head: bytes, limit: int) -> bytes:
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
