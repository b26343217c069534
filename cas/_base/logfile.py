"""``CUDA_PROGRAM_CAS_LOG``'s file: opened so that it never hangs a job, never floods it, never follows a plant.

The path is often in a shared folder such as ``/tmp``. It is opened ``O_NONBLOCK`` (a FIFO
would block forever), ``O_NOFOLLOW``, ``O_APPEND | O_CREAT``, mode 0o600, and refused unless
it is a regular file. On POSIX it is refused too when the way to it passes, inside a folder
every user can write, through an entry neither this user's nor root's (a planted symlink or
folder could redirect the log; a planted file would receive it), or through such a folder
that is not sticky. Symlinks on the way are followed as the kernel follows them, each
checked the same way; only an entry's owner can replace it in a sticky folder, so what is
checked cannot change before the open. Group-writable folders are trusted.

Each refusal is one WARNING and no log. Each record is one ``os.write`` (``O_APPEND``: lines
of processes do not interleave). The first write that fails drops the handler, one WARNING.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat

__all__ = ["open_log"]

_FLAGS = (
    os.O_WRONLY
    | os.O_APPEND
    | os.O_CREAT
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
#: Symlinks followed on the way before the path is refused (Linux's own limit).
_MAX_LINKS = 40


class LogFile(logging.Handler):
    """Appends each record, formatted, to an open file."""

    def __init__(self, fd: int, path: str, name: str, logger: logging.Logger) -> None:
        super().__init__()
        self._fd: int | None = fd
        self._path = path
        self._name = name
        self._logger = logger
        #: The logger's own level before this handler lowered it (None: it did not).
        self.level_before: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self._fd is None:
            return
        try:
            data = (self.format(record) + "\n").encode("utf-8", "backslashreplace")
        except Exception:  # the caller's error, not the file's
            self.handleError(record)
            return
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self._drop(exc)

    def _drop(self, exc: OSError) -> None:
        self._close_fd()
        # removeHandler runs while the logger iterates its handlers for this record: a handler
        # after this one may miss that one record. Later records reach it as before.
        self._logger.removeHandler(self)
        if self.level_before is not None and self._logger.level == logging.DEBUG:
            self._logger.setLevel(self.level_before)  # lookups stop paying for records nobody writes
        self._logger.warning(
            "cuda-program-cas: %s=%s: a write failed (%s); nothing more is logged there",
            self._name,
            self._path,
            exc.strerror or exc,
        )

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        self._close_fd()
        super().close()


def open_log(path: str, name: str, logger: logging.Logger) -> LogFile | str:
    """A handler appending to ``path``, or why ``path`` is refused."""
    planted, shared = _walk(path)
    if planted is not None:
        return planted
    try:
        fd = os.open(path, _FLAGS, 0o600)
    except OSError as exc:
        return _describe(path) or f"it cannot be opened: {exc.strerror or exc}"
    why: str | None = "interrupted"
    try:
        st = os.fstat(fd)
        why = _not_regular(st.st_mode)
        # Judged on the open file, not before: one planted between a look and the open is caught too.
        if why is None and shared and st.st_uid not in (os.geteuid(), 0):
            why = f"it belongs to uid {st.st_uid}, in a folder that every user can write"
        if why is None:
            _blocking(fd)
    except OSError as exc:
        why = f"it cannot be used: {exc.strerror or exc}"
    finally:
        if why is not None:
            os.close(fd)
    return LogFile(fd, path, name, logger) if why is None else why


def _not_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "it is a symlink, and a symlink there is never followed"
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return f"it is {kind}, not a regular file"
    return "it is not a regular file"


def _describe(path: str) -> str | None:
    """Why an open failed, when what is there says more than ELOOP or ENXIO."""
    try:
        return _not_regular(os.lstat(path).st_mode)
    except OSError:
        return None


def _blocking(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # Windows: no FIFOs to wait on, no flag to clear
        return
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & os.O_NONBLOCK:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)


def _open_to_all(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_IWOTH)


def _walk(path: str) -> tuple[str | None, bool]:
    """Why the way to ``path`` cannot be trusted (or None), and whether the file's folder is every user's.

    Walks the path as the kernel resolves it (``..`` from where the walk is, a symlink's
    target in its place). An error ends the walk: the open reports it.
    """
    if not hasattr(os, "geteuid"):
        return None, False  # Windows: no such folders, no owners to compare
    me = os.geteuid()
    start = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    todo = [p for p in reversed(start.split(os.sep)) if p]
    here, links = os.sep, 0
    try:
        folder = os.stat(here)
        while todo:
            part = todo.pop()
            if part == ".":
                continue
            if part == "..":
                here = os.path.dirname(here)
                folder = os.stat(here)
                continue
            shared = _open_to_all(folder)
            if shared and not folder.st_mode & stat.S_ISVTX:
                return f"the way to it passes through {here}, which every user can write and is not sticky", shared
            if not todo:
                return None, shared  # the file itself
            entry = os.path.join(here, part)
            st = os.lstat(entry)
            if shared and st.st_uid not in (me, 0):
                return f"{entry} belongs to uid {st.st_uid}, in {here}, which every user can write", shared
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > _MAX_LINKS:
                    break  # the open fails with ELOOP and says so
                target = os.readlink(entry)
                todo.extend(p for p in reversed(target.split(os.sep)) if p)
                if os.path.isabs(target):
                    here, folder = os.sep, os.stat(os.sep)
                continue
            here, folder = entry, st
    except OSError:
        pass
    return None, False
