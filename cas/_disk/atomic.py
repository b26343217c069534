"""The atomic write: a file appears whole under its name, or not at all.

Each file goes to a unique temp file in the cache's own ``tmp/``, gets its final
mode, and is renamed into place with :func:`os.replace`. A reader never sees a
partial file, and the temp file never survives an exception. The layout, the
settings, the lifetime counters and :class:`~cuda_program_cas._disk.writer.Writer`
all write through :func:`atomic_write`.

:func:`append_line` is the one write that is not atomic by rename: a line added
to an append-only log of self-checking lines (the lifetime counters, the usage
ledger, the miss journal), whose readers skip a torn or garbled line.

:func:`staging` is the same temp file without the rename: bytes that are not
yet known to be good (a blob arriving from a server) go there, hashed as they
come, instead of into memory; the file is removed when the caller is done.
"""

from __future__ import annotations

import itertools
import os
import stat
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from cuda_program_cas._base.fork import after_fork_call
from cuda_program_cas._base.log import LOGGER as _log

from .files import NotRegularFile, is_sharing_violation, with_sharing_retry

__all__ = [
    "Staging",
    "append_line",
    "atomic_write",
    "current_umask",
    "discard",
    "make_tmp_dir",
    "staging",
    "sync_filesystem",
]

_O_BINARY = getattr(os, "O_BINARY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY | _O_NOFOLLOW
_STAGING_FLAGS = (_WRITE_FLAGS & ~os.O_WRONLY) | os.O_RDWR
_HAVE_FCHMOD = hasattr(os, "fchmod")
_APPEND_FLAGS = (
    os.O_RDWR
    | os.O_APPEND
    | os.O_CREAT
    | _O_BINARY
    | _O_NOFOLLOW
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


class _TempNames:
    """Unique temp file names, ``<pid>-<16 hex>.tmp``: a random half per process, then a counter.

    Drawing them costs no system call (a fresh random name per write cost a
    ``getpid`` and a ``getrandom``); a child after ``fork`` draws a new half.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._prefix = f"{os.getpid()}-{os.urandom(4).hex()}"
        self._count = itertools.count()

    def next(self, tmp_dir: str) -> str:
        return f"{tmp_dir}{os.sep}{self._prefix}{next(self._count) & 0xFFFFFFFF:08x}.tmp"


_TEMP_NAMES = _TempNames()
after_fork_call(_TEMP_NAMES.reset)


def _tmp_name(tmp_dir: str) -> str:
    return _TEMP_NAMES.next(tmp_dir)


def atomic_write(
    target: str,
    data: bytes | memoryview | Iterable[bytes],
    tmp_dir: str,
    *,
    mode: int = 0o600,
    exact_mode: bool = False,
    fsync: bool = False,
    make_dir: object = None,
) -> bool:
    """Write ``data`` to ``target`` through a unique temp file in ``tmp_dir`` and ``os.replace``.

    ``data`` may be an iterable of chunks (a pack, written as it is produced).
    The file gets ``mode`` less the umask, or exactly ``mode`` with ``exact_mode``.
    Creates ``tmp_dir`` and the target's parent directory when they are missing
    (``make_dir(path)`` when given, else :func:`os.makedirs`). Returns False only
    when a Windows sharing violation outlasted the retry budget: the write is
    dropped. The temp file never survives an exception.
    """
    fd, tmp = _open_temp(tmp_dir)
    try:
        try:
            for chunk in (data,) if isinstance(data, (bytes, memoryview)) else data:
                _write_all(fd, chunk)
            if mode != 0o600 and _HAVE_FCHMOD:
                # The final mode, set once the bytes are all written, just before the rename.
                os.fchmod(fd, mode if exact_mode else mode & ~current_umask())
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            with_sharing_retry(lambda: os.replace(tmp, target))
        except FileNotFoundError:
            # The shard directory is created on first use rather than stat-ed on
            # every write (or a collector pruned it meanwhile).
            parent = os.path.dirname(target)
            if callable(make_dir):
                make_dir(parent)
            else:
                os.makedirs(parent, exist_ok=True)
            with_sharing_retry(lambda: os.replace(tmp, target))
    except PermissionError as exc:
        discard(tmp)
        if is_sharing_violation(exc):
            return False
        raise
    except BaseException:
        discard(tmp)
        raise
    return True


def _open_temp(tmp_dir: str, flags: int = _WRITE_FLAGS) -> tuple[int, str]:
    """A new temp file in ``tmp_dir`` (made if missing), owner-only: its descriptor and path."""
    tmp = _tmp_name(tmp_dir)
    try:
        return os.open(tmp, flags, 0o600), tmp  # private while incomplete, whatever its final mode
    except (FileNotFoundError, NotADirectoryError):
        make_tmp_dir(tmp_dir)
        return os.open(tmp, flags, 0o600), tmp
    except FileExistsError:  # a name left by a process long gone with the same pid and draw
        tmp = os.path.join(tmp_dir, f"{os.getpid()}-{os.urandom(8).hex()}.tmp")
        return os.open(tmp, flags, 0o600), tmp


def _write_all(fd: int, chunk: bytes | memoryview) -> None:
    view = memoryview(chunk)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class Staging:
    """A temp file of :func:`staging`: bytes appended with :meth:`write`, read back whole with :meth:`read`."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self.size = 0

    def write(self, chunk: bytes | memoryview) -> None:
        _write_all(self.fd, chunk)
        self.size += len(chunk)

    def read(self) -> bytes:
        """Everything written, as one ``bytes`` (one allocation of its size)."""
        parts = []
        got = 0
        while got < self.size:  # one pread for any size Linux reads at once (up to 2 GiB)
            part = os.pread(self.fd, self.size - got, got)
            if not part:
                raise OSError(f"{self.path}: shorter than what was written to it")
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)


@contextmanager
def staging(tmp_dir: str) -> Iterator[Staging]:
    """A temp file in ``tmp_dir``, named and opened as :func:`atomic_write`'s are, removed on leaving.

    It never becomes a file of the cache: what the caller keeps, it reads back
    (and stores through the write protocol). On POSIX its name goes at once, so
    not even a SIGKILL leaves it behind; elsewhere a process killed meanwhile
    leaves an ordinary temp file, which the sweep of ``tmp/`` removes as any other.
    """
    fd, path = _open_temp(tmp_dir, _STAGING_FLAGS)
    try:
        if os.name == "posix":
            discard(path)
        yield Staging(fd, path)
    finally:
        os.close(fd)
        discard(path)


def make_tmp_dir(tmp_dir: str) -> None:
    """Create the staging directory ``tmp_dir`` (and its parent) unless it is one already.

    Anything else in its place (a file, a FIFO, a symlink to nothing) would drop
    every write of every process for good: it is replaced by a directory, once,
    with a WARNING. It is unlinked, never moved: ``unlink`` cannot take a directory,
    so a process that races here cannot remove the one another just made.
    """
    try:
        os.mkdir(tmp_dir, 0o700)
        return
    except FileNotFoundError:
        os.makedirs(os.path.dirname(tmp_dir), exist_ok=True)
    except FileExistsError:
        if os.path.isdir(tmp_dir):  # also through a symlink: an operator's choice
            return
        try:
            st = os.lstat(tmp_dir)
            os.unlink(tmp_dir)
        except FileNotFoundError:
            pass  # another process replaced it meanwhile
        else:
            kind = "symlink" if stat.S_ISLNK(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "special file"
            _log.warning(
                "cuda-program-cas: %s was a %s of %d bytes, not a directory; replaced it with a directory",
                tmp_dir,
                kind,
                st.st_size,
            )
    try:
        os.mkdir(tmp_dir, 0o700)
    except FileExistsError:
        if not os.path.isdir(tmp_dir):
            raise


def current_umask() -> int:
    """The process umask, read without changing it where the system allows."""
    try:
        with open("/proc/self/status", "rb") as fh:  # bytes: no codec needed (a restricted child may lack one)
            for line in fh:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def append_line(path: str, line: bytes) -> int:
    """Append ``line`` (ending in a newline) to the log file at ``path``; the file's size after it.

    Created owner-only if missing; a symlink or anything but a regular file raises
    :class:`~cuda_program_cas._disk.files.NotRegularFile`. When the file does not
    end in a newline (a writer killed mid-line), the line is started on a new
    one, so that it stays whole. With ``O_APPEND`` a line goes in one ``write``
    on a local file system: concurrent appenders do not interleave within it.
    """
    fd = os.open(path, _APPEND_FLAGS, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(path)
        if st.st_size:
            os.lseek(fd, st.st_size - 1, os.SEEK_SET)
            if os.read(fd, 1) != b"\n":
                line = b"\n" + line
        _write_all(fd, line)
        return st.st_size + len(line)
    finally:
        os.close(fd)


def discard(path: str) -> None:
    """Remove ``path`` if it is there; a failure is ignored (it is a temp file or a blob no manifest names)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def sync_filesystem(path: str) -> None:
    """``syncfs`` on the file system of ``path`` where Linux offers it, else a whole-system ``sync``."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            fd = os.open(path, os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).syncfs(fd) == 0:
                    return
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            pass
    if hasattr(os, "sync"):
        os.sync()
