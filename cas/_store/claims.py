"""Claims: one process of a node compiles a key, the others wait for its result.

At a job's cold start every rank of a node misses the same kernels at the same
moment, and without claims each compiles them (8 ranks: 8 compiles of each). A
caller that missed takes the key's *claim* before it compiles: the first to ask
holds it, and the others wait until it lets go, look the key up again and use the
hit. A claim can only save work, never change a result:

- it is an ``flock`` on ``tmp/<key id>.claim``, which the kernel releases when its
  holder dies, however it dies: a waiter whose claimant was killed takes the claim
  over at once and compiles itself;
- a wait is bounded (:data:`cuda_program_cas._base.config.DEFAULT_CLAIM_WAIT_S`,
  or ``$CUDA_PROGRAM_CAS_CLAIM_WAIT``): a waiter whose claimant is still compiling
  when the bound passes compiles too;
- anything that keeps a claim from being taken (a read-only cache, no space, a
  directory where the file belongs, no locks on this file system, no ``fcntl`` on
  Windows) means no claim: the caller compiles as it would without them.

Why ``flock`` on a file of our own rather than ``filelock``: ``filelock`` takes the
same ``flock`` on POSIX, but it leaves its lock files behind, cannot tell that the
file it locked was removed meanwhile, and knows nothing of forks; the lifetime
counters already take their lock this way (:mod:`cuda_program_cas._store.lifetime`).
``flock``, not ``fcntl``'s record locks: those belong to the process, so two threads
of one process would both hold the claim, and closing any descriptor of the file
drops it. An ``flock`` belongs to the open file: threads contend like processes.

Lock files do not pile up. The holder removes its file while it still holds the
lock, then lets go. A waiter that then gets the lock finds the file it locked gone
from its name (the inode check): the claimant is done, and it looks the key up.
One that finds its file still in place took over from a claimant that died, and
compiles. Files of claimants that died and that no one took over are temp files
like any other in ``tmp/``: a holder freshens its file's mtime, and ``gc``,
``verify`` and a writable open remove the ones an hour old.

A forked child gets copies of its parent's descriptors, and with them a share of
its ``flock``: a parent killed while its child lives would leave its claim held. So
a child closes every claim descriptor it inherits (which releases nothing the
parent holds), and a claim left open across a fork does nothing in the child.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass

from cuda_program_cas._base.fork import after_fork_call
from cuda_program_cas._disk.layout import CLAIM_SUFFIX

from .stats import Counters

try:
    import fcntl
except ImportError:  # Windows: no claims
    fcntl = None  # type: ignore[assignment]

__all__ = ["Claim", "claim"]

_log = logging.getLogger("cuda_program_cas")
_KID_RE = re.compile(r"[0-9a-f]{64}")
_FLAGS = (
    os.O_RDWR
    | os.O_CREAT
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
#: A waiter polls the lock: first after 1 ms, doubling up to every 50 ms. Compiles
#: take a tenth of a second and more, so a waiter sees a release within a few percent
#: of the compile it waited for.
_FIRST_PAUSE_S = 0.001
_LONGEST_PAUSE_S = 0.05
#: Opens of a name whose file was replaced under us before the claim is given up.
_MAX_TRIES = 32

#: Claim descriptors open in this process (a forked child closes its copies).
_OPEN: set[int] = set()
#: ``(directory, errno)`` of the failures said (see :func:`_no_claim`).
_SAID: set[tuple[str, int]] = set()


@dataclass(slots=True)
class Claim:
    """What :func:`claim` yields.

    ``held``: this caller holds the key's claim; it compiles and stores, and others
    wait for it. ``waited``: another process (or thread) held it first and this one
    waited for it: look the key up again before compiling. ``timed_out``: the wait
    reached its bound with the claim still held. Neither held nor waited: no claim
    could be taken (see the module docstring); compile.
    """

    held: bool = False
    waited: bool = False
    timed_out: bool = False


@contextlib.contextmanager
def claim(tmp_dir: str, kid: str, wait_s: float, counters: Counters | None = None) -> Iterator[Claim]:
    """Hold the claim on key id ``kid`` for the ``with`` block, waiting up to ``wait_s`` for another's.

    Never raises for what it meets on disk; a waited claim counts ``claim_waits``.
    """
    if fcntl is None or not _KID_RE.fullmatch(kid):
        yield Claim()
        return
    path = os.path.join(tmp_dir, kid + CLAIM_SUFFIX)
    owner = os.getpid()
    result, fd = _take(path, max(0.0, wait_s))
    if result.waited and counters is not None:
        counters.add("claim_waits")
    try:
        yield result
    finally:
        # A child forked inside the block closed its copy: the claim is the parent's to let go.
        if fd is not None and os.getpid() == owner:
            _release(path, fd)


def _take(path: str, wait_s: float) -> tuple[Claim, int | None]:
    """The claim, and the descriptor whose lock holds it (None when not held)."""
    assert fcntl is not None
    deadline = time.monotonic() + wait_s
    for _ in range(_MAX_TRIES):
        try:
            fd = _open(path)
        except OSError as exc:
            _no_claim(path, exc)
            return Claim(), None
        try:
            try:
                busy = not _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                # No locks here (ENOLCK, EOPNOTSUPP): no one holds this file, so it goes now.
                with contextlib.suppress(OSError):
                    if _still_named(path, fd):
                        os.unlink(path)
                raise
            if busy and not _wait(fd, deadline):
                _close(fd)
                _log.debug("cuda-program-cas: %s: waited %.1f s for another compile; compiling here", path, wait_s)
                return Claim(waited=True, timed_out=True), None
            if not _still_named(path, fd):
                # Its holder removed it as it let go: done (or given up); look the key up.
                _close(fd)
                if busy:
                    return Claim(waited=True), None
                continue
            if os.utime in os.supports_fd:
                with contextlib.suppress(OSError):  # another user's file: held all the same
                    os.utime(fd)  # a file left by a dead claimant: young again, so no sweep takes it
        except OSError as exc:
            _close(fd)
            _no_claim(path, exc)
            return Claim(), None
        except BaseException:
            _close(fd)  # interrupted while waiting
            raise
        return Claim(held=True, waited=busy), fd
    return Claim(), None


def _open(path: str) -> int:
    fd = os.open(path, _FLAGS, 0o600)
    _OPEN.add(fd)  # a child forked from now on closes its copy
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        _close(fd)
        raise
    return fd


def _lock(fd: int, how: int) -> bool:
    """True when ``flock`` took the lock; False when another holds it. Other failures raise."""
    assert fcntl is not None
    try:
        fcntl.flock(fd, how)
    except BlockingIOError:
        return False
    return True


def _wait(fd: int, deadline: float) -> bool:
    """Poll the lock until it is ours (True) or the deadline passes (False)."""
    assert fcntl is not None
    pause = _FIRST_PAUSE_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, _LONGEST_PAUSE_S)
        if _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB):
            return True


def _still_named(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _release(path: str, fd: int) -> None:
    """Remove the claim file, then let go of it."""
    assert fcntl is not None
    try:
        # Removed while still locked, and only if it is still ours (a sweep may have
        # taken it, and another claimant made a new one): a waiter that gets the lock
        # then sees the file gone and looks the key up.
        if _still_named(path, fd):
            os.unlink(path)
    except OSError as exc:
        _log.debug("cuda-program-cas: claim file %s not removed: %s", path, exc)
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: a copy in a child would keep it held
        _close(fd)


def _close(fd: int) -> None:
    _OPEN.discard(fd)
    with contextlib.suppress(OSError):
        os.close(fd)


def _no_claim(path: str, exc: OSError) -> None:
    """Say once per directory and reason (at DEBUG: nothing is wrong with a result) why no claim was taken."""
    why = (os.path.dirname(path), exc.errno or 0)
    if why in _SAID:
        return
    _SAID.add(why)
    _log.debug(
        "cuda-program-cas: no claims in %s (%s): compiles of this node that miss the same key each compile",
        why[0],
        exc,
    )


@after_fork_call
def _after_fork_in_child() -> None:
    # The parent's claims stay the parent's: a copy open here would keep one held
    # after the parent died. Closing the copy releases nothing the parent holds.
    for fd in list(_OPEN):
        with contextlib.suppress(OSError):
            os.close(fd)
    _OPEN.clear()
