"""Portable file primitives: reading cache files, naming them, proving them unchanged.

One path builder (:func:`shard_path`) names every blob and manifest; one file
identity (:func:`file_id`) proves a file unchanged between two looks. Writing
is :mod:`cuda_program_cas._disk.writer`'s and removing :mod:`cuda_program_cas._disk.remove`'s.

Windows: another process holding a file open without share-delete rights makes
``os.replace``, ``open`` and ``unlink`` fail for a moment with winerror 5/32/33 (or
a bare ``EACCES``). Those are retried within a bounded budget; every other
``PermissionError`` is a real configuration problem and propagates.
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

#: What proves a file is still the one looked at before: device, inode, size, mtime
#: and ctime. A rewrite changes the inode, a touch the mtime and ctime; ctime cannot
#: be set back without root, so an equal identity means untouched since.
FileId = tuple[int, int, int, int, int]


def file_id(st: os.stat_result) -> FileId:
    """The identity of the file ``st`` describes (see :data:`FileId`)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


#: How far ahead of the file system's clock a file time is still believed (a day).
#: Clocks of nodes and NFS servers differ by seconds, rarely minutes; a time further
#: ahead comes from a wrong clock (a restored backup, a node years ahead, a clock set
#: back), and believing it would keep the file "young" or "recent" until that date.
FUTURE_MTIME_NS = 86_400 * 10**9


def trusted_mtime_ns(mtime_ns: int, now_ns: int) -> int:
    """``mtime_ns`` as every age in the cache is computed from it; ``now_ns``: the file system's clock.

    A time more than :data:`FUTURE_MTIME_NS` ahead of ``now_ns`` counts as 0, the
    oldest there is: an orphan is past its grace period, a temp file stale, an entry
    least recently used and expired. One within the day is taken as it is (it is
    young for at most a day longer than it should be). A hit's touch, or a writer's
    freshen, sets the time back to now.
    """
    return 0 if mtime_ns > now_ns + FUTURE_MTIME_NS else mtime_ns


def same_file(path: str, before: FileId) -> bool:
    """True when ``path`` (not followed if a symlink) is still the file ``before`` describes."""
    try:
        return file_id(os.lstat(path)) == before
    except OSError:
        return False


def shard_path(directory: str, name: str) -> str:
    """``<directory>/<name[:2]>/<name[2:]>``: where every blob and manifest lives.

    ``name`` must already be validated (a 64-character lowercase hex digest or key id).
    """
    return f"{directory}{os.sep}{name[:2]}{os.sep}{name[2:]}"


def is_sharing_violation(exc: BaseException) -> bool:
    """True for a transient Windows sharing or lock violation, never off Windows.

    A bare ``EACCES`` without ``winerror`` counts (that is how ``open`` reports a
    pending delete); a ``winerror`` outside the sharing set does not.
    """
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

    Raises ``FileNotFoundError`` when it is absent (also after an exhausted Windows
    sharing retry), ``IsADirectoryError``/``OSError`` for something that is not a
    regular file, and :class:`SizeMismatch` when ``expected_size`` is given and the
    file has another size (truncated or extended), without reading it.
    """
    try:
        fd = with_sharing_retry(lambda: os.open(path, READ_FLAGS))
    except PermissionError as exc:
        if is_sharing_violation(exc):
            raise FileNotFoundError(errno.ENOENT, "busy", path) from exc
        raise
    except OSError as exc:
        # O_NOFOLLOW on a symlink gives ELOOP (EMLINK on some BSDs): not a cache file.
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
        data = os.read(fd, size + 1 if expected_size is None else size)
        if len(data) < size:  # a short read: keep going (large files, odd filesystems)
            chunks = [data]
            got = len(data)
            while True:
                more = os.read(fd, max(size - got, 65536))
                if not more:
                    break
                chunks.append(more)
                got += len(more)
            data = b"".join(chunks)
        return data, st
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
    """``(name, path, stat)`` of every regular file ``<directory>/<2 hex>/<62 hex>``.

    ``name`` is the 64 hex characters of shard and file name. Anything else (other
    names, symlinks, a shard that is not a real directory) is skipped. A shard that
    cannot be listed (EACCES, EIO) is skipped too and, when ``unreadable`` is given,
    appended to it: what it holds is unknown, not absent.
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
    """The file system's own clock now, in ns: touch ``directory`` and read its mtime back.

    File times come from the kernel's coarse clock (or an NFS server's clock), which
    can lag ``time.time_ns()`` by a tick or more. Anything written or touched after
    this call carries an mtime at least this value; compare file times against it,
    not against the process clock. None when the directory cannot be touched.
    """
    try:
        os.utime(directory)
        return os.stat(directory).st_mtime_ns
    except OSError:
        return None


#: Shards of one directory a :class:`ShardGuard` checks one ``lstat`` each before it lists the directory.
_LSTATS_BEFORE_LISTING = 32


class ShardGuard:
    """Vouches that shard directories are real directories, not symlinks or files.

    A symlinked shard would lead reads and writes outside the cache root: its keys
    are misses and writes to it are dropped. Each shard is checked once per guard
    (a missing one is fine: a write creates it). ``on_strange(path)`` is called
    for each bad shard met.

    The first shards checked in a directory get an ``lstat`` each; past
    :data:`_LSTATS_BEFORE_LISTING` of them the directory is listed once, which
    vouches for every shard there without a system call per shard. (A listing of
    256 shards costs about 0.2 ms: a job that looks up a few kernels would pay it
    for two or three shards, a process reading hundreds of keys saves it.)
    """

    def __init__(self, on_strange: Callable[[str], None] | None = None) -> None:
        #: directory -> the shard names (two hex characters) vouched for there.
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
                # Many shards met here: list the directory once, which vouches for every shard in it.
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


#: From this size on, data is hashed on several cores (blake3's shared thread pool),
#: where the process may use at least _MT_MIN_CORES; never on smaller machines, where
#: waking the pool costs more than one core hashing (measured: docs/benchmarks.md).
_MT_MIN_BYTES = 2 << 20
_MT_MIN_CORES = 8
_MT = _usable_cores() >= _MT_MIN_CORES
_AUTO = -1  # blake3.AUTO: as many threads as the pool has


@functools.cache
def blake3_hasher() -> type[Blake3]:
    """blake3's hasher type, imported on first use: loading its extension costs a fresh process about
    half a millisecond (on the 2-core VM), and a hit of a blob verified this boot hashes nothing.
    Every module that hashes on a hit's path takes it here."""
    from blake3 import blake3

    return blake3


def digest_of(data: bytes | bytearray | memoryview) -> str:
    """The digest that names ``data``: lowercase hex blake3 (every blob is named and verified with it)."""
    blake3 = blake3_hasher()
    if _MT and len(data) >= _MT_MIN_BYTES:
        return blake3(data, max_threads=_AUTO).hexdigest()
    return blake3(data).hexdigest()


#: Bytes hashed without being kept are read this many at a time.
HASH_CHUNK = 1 << 20


def hashes_to(read: Callable[[int], bytes], digest: str, size: int | None = None) -> bool:
    """Whether the bytes ``read(n)`` gives, call after call, hash to blake3 ``digest``; read in chunks, kept by none.

    With ``size``: the first ``size`` of them (False when there are fewer); without: all, to the end.
    """
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
