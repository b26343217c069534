"""One ``flock`` try that cannot hold its caller past a bound: the claims' and the lifetime counters'.

``LOCK_NB`` makes the lock non-blocking, not the call: over NFS a try may block 61 s or never
return (docs/nfs.md). There a try runs in a thread, and one not back by its bound raises
:class:`Slow`; the thread then owns the descriptor and closes it. While a try is out on a file
system, later ones there raise :class:`Slow` at once. On a local file system the try is made in
the caller's thread (a thread costs 1-3 ms).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

from cuda_program_cas._base.fork import after_fork_call

try:
    import fcntl
except ImportError:  # Windows: callers take no flock there
    fcntl = None  # type: ignore[assignment]

__all__ = ["FIRST_TRY_S", "LAST_TRY_S", "OPEN_LOCKS", "Slow", "close_lock", "open_lock", "try_lock"]

#: A first try may take this long even when its caller's bound is shorter: one over NFS not
#: back after a second is taken for one that never will be.
FIRST_TRY_S = 1.0

#: A later try (while waiting) may end this long past its caller's bound.
LAST_TRY_S = 0.05


#: Lock files open in this process (claims, ``counters.lock``): a forked child closes its copies,
#: which would hold a parent's flock for the child's whole life (closing them releases nothing).
OPEN_LOCKS: set[int] = set()


def open_lock(path: str, flags: int) -> int:
    fd = os.open(path, flags, 0o600)
    OPEN_LOCKS.add(fd)
    return fd


def close_lock(fd: int) -> None:
    OPEN_LOCKS.discard(fd)
    with contextlib.suppress(OSError):
        os.close(fd)


class _Stuck:
    """``devs``: ``st_dev`` of the file systems where an abandoned try has not returned yet."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.devs: set[int] = set()


_STUCK = _Stuck()


class Slow(Exception):
    """A try at the lock did not return in time (or one on the same file system is still out)."""


class _Try:
    __slots__ = ("abandoned", "close", "dev", "done", "error", "mutex", "taken")

    def __init__(self, dev: int, close: Callable[[int], None]) -> None:
        self.dev = dev
        self.close = close
        self.done = threading.Event()
        self.mutex = threading.Lock()
        self.taken = self.abandoned = False
        self.error: OSError | None = None

    def run(self, fd: int) -> None:
        assert fcntl is not None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.taken = True
        except BlockingIOError:
            pass
        except OSError as exc:
            self.error = exc
        with self.mutex:
            self.done.set()
            if not self.abandoned:
                return
        # Its caller gave up: the file system answers again; let go of what it got.
        with _STUCK.lock:
            _STUCK.devs.discard(self.dev)
        if self.taken:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
        self.close(fd)


def try_lock(fd: int, until: float, close: Callable[[int], None]) -> bool:
    """One ``LOCK_EX | LOCK_NB`` try on ``fd``: True when taken, False when another holds it.

    A try not back by ``until`` raises :class:`Slow`; its thread then calls ``close(fd)``, not the caller.
    """
    dev = os.fstat(fd).st_dev
    with _STUCK.lock:
        if dev in _STUCK.devs:
            raise Slow
    if _local(fd):
        assert fcntl is not None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
    attempt = _Try(dev, close)
    try:
        threading.Thread(target=attempt.run, args=(fd,), name="cuda-program-cas flock", daemon=True).start()
    except RuntimeError:
        # No new thread (refused at interpreter shutdown, or the thread limit): tried here, unbounded.
        attempt.run(fd)
    if not attempt.done.wait(max(0.0, until - time.monotonic())):
        with attempt.mutex:
            if not attempt.done.is_set():
                attempt.abandoned = True
                with _STUCK.lock:
                    _STUCK.devs.add(dev)
                raise Slow
    if attempt.error is not None:
        raise attempt.error
    return attempt.taken


def _local(fd: int) -> bool:
    """Whether ``fd``'s file is on a local file system (Linux: ``statfs`` through ``/proc/self/fd``)."""
    from cuda_program_cas._disk.fskind import STAT_RELIABLE, fs_type

    return fs_type(f"/proc/self/fd/{fd}") in STAT_RELIABLE


@after_fork_call
def _after_fork_in_child() -> None:
    # The parent's tries stay the parent's; a thread of the parent may have held the lock.
    _STUCK.lock = threading.Lock()
    _STUCK.devs.clear()
    for fd in list(OPEN_LOCKS):
        with contextlib.suppress(OSError):
            os.close(fd)
    OPEN_LOCKS.clear()
