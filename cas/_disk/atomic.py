"""The atomic write: a file appears whole under its name, or not at all.

Each file goes to a unique temp file in the cache's own ``tmp/``, gets its final mode, and
is renamed into place with :func:`os.replace`; the temp file never survives an exception.
:func:`append_line` adds a line to an append-only log of self-checking lines, whose readers
skip a torn one. :func:`staging` is the temp file without the rename, for bytes not yet
known to be good (:class:`~cuda_program_cas._disk.intake.Intake` stages a large blob there while it is verified).
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

from .files import READ_FLAGS, NotRegularFile, is_sharing_violation, with_sharing_retry

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
#: The read flags (no symlink, no FIFO wait), appending.
_APPEND_FLAGS = READ_FLAGS | os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)


class _TempNames:
    """Unique temp file names, ``<pid>-<16 hex>.tmp``: a random half per process, then a counter (no system call)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._prefix = f"{os.getpid()}-{os.urandom(4).hex()}"
        self._count = itertools.count()

    def next(self, tmp_dir: str) -> str:
        return f"{tmp_dir}{os.sep}{self._prefix}{next(self._count) & 0xFFFFFFFF:08x}.tmp"


_TEMP_NAMES = _TempNames()
after_fork_call(_TEMP_NAMES.reset)
_tmp_name = _TEMP_NAMES.next


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
    """Write ``data`` (bytes, or an iterable of chunks) to ``target`` through a temp file and ``os.replace``.

    The file gets ``mode`` less the umask, or exactly ``mode`` with ``exact_mode``. A missing
    parent is made with ``make_dir(path)`` when given, else :func:`os.makedirs`. False only
    when a Windows sharing violation outlasted the retry budget: the write is dropped.
    """
    fd, tmp = _open_temp(tmp_dir)
    try:
        try:
            for chunk in (data,) if isinstance(data, (bytes, memoryview)) else data:
                _write_all(fd, chunk)
            if mode != 0o600 and _HAVE_FCHMOD:
                os.fchmod(fd, mode if exact_mode else mode & ~current_umask())
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            with_sharing_retry(lambda: os.replace(tmp, target))
        except FileNotFoundError:
            # The shard directory is made on first use, not stat-ed on every write.
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
    """A new owner-only temp file in ``tmp_dir`` (made if missing): its descriptor and path."""
    tmp = _tmp_name(tmp_dir)
    try:
        return os.open(tmp, flags, 0o600), tmp
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
        while got < self.size:
            part = os.pread(self.fd, self.size - got, got)
            if not part:
                raise OSError(f"{self.path}: shorter than what was written to it")
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)


@contextmanager
def staging(tmp_dir: str) -> Iterator[Staging]:
    """A temp file in ``tmp_dir``, as :func:`atomic_write`'s, removed on leaving.

    On POSIX its name goes at once, so not even a SIGKILL leaves it behind; elsewhere the
    sweep of ``tmp/`` takes what a killed process left.
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

    Anything else in its place would drop every write for good: it is replaced, with a
    WARNING. Unlinked, never moved: ``unlink`` cannot take the directory another process made.
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
            pass
        else:
            kind = "symlink" if stat.S_ISLNK(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "special file"
            message = "cuda-program-cas: %s was a %s of %d bytes, not a directory; replaced it with a directory"
            _log.warning(message, tmp_dir, kind, st.st_size)
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

    Created owner-only; anything but a regular file raises ``NotRegularFile``. After a torn
    last line the line starts on a new one. ``O_APPEND``: concurrent appenders do not interleave.
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
