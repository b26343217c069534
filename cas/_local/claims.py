"""Claims: one process of a node compiles a key, the others wait for its result.

A caller that missed takes the key's claim, an ``flock`` on ``tmp/<key id>.claim`` (released by
the kernel however its holder dies; not ``fcntl`` record locks, which threads would share). The
others wait, bounded by ``$CUDA_PROGRAM_CAS_CLAIM_WAIT``, each try bounded too (NFS: docs/nfs.md),
then look the key up again. Anything that keeps a claim from being taken (read-only cache, no
locks, Windows) means no claim: the caller compiles. A claim can only save work.

The holder removes its file while still holding the lock: a waiter that gets the lock and finds
its file gone from its name takes the claim afresh; one that finds it in place took over from a
dead claimant. Files left behind are swept from ``tmp/`` like temp files.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass

from cuda_program_cas._base.config import say_once
from cuda_program_cas._disk.layout import CLAIM_SUFFIX
from cuda_program_cas.index import is_key_id

from .flocks import FIRST_TRY_S, LAST_TRY_S, open_lock, try_lock
from .flocks import Slow as _Slow
from .flocks import close_lock as _close
from .stats import Counters

try:
    import fcntl
except ImportError:  # Windows: no claims
    fcntl = None  # type: ignore[assignment]

__all__ = ["Claim", "claim"]

_log = logging.getLogger("cuda_program_cas")
_FLAGS = (
    os.O_RDWR
    | os.O_CREAT
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
#: A waiter polls the lock after 1 ms, doubling up to every 50 ms, then every twentieth of the
#: time it has waited, up to every second (over NFS each poll is a round trip to the server).
_FIRST_PAUSE_S = 0.001
_FAST_PAUSE_S = 0.05
_PAUSE_SHARE = 0.05
_LONGEST_PAUSE_S = 1.0
#: Opens of a name whose file was replaced under us before the claim is given up.
_MAX_TRIES = 32


@dataclass(slots=True)
class Claim:
    """What :func:`claim` yields: ``held`` (compile and store), ``waited`` (look the key up again first).

    ``timed_out``: the wait reached its bound with the claim still held. Neither: no claim; compile.
    """

    held: bool = False
    waited: bool = False
    timed_out: bool = False


@contextlib.contextmanager
def claim(tmp_dir: str, kid: str, wait_s: float, counters: Counters | None = None) -> Iterator[Claim]:
    """Hold the claim on key id ``kid`` for the ``with`` block, waiting up to ``wait_s`` for another's.

    Never raises for what it meets on disk; a waited claim counts ``claim_waits``.
    """
    if fcntl is None or not is_key_id(kid):
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
    waited = False
    for _ in range(_MAX_TRIES):
        try:
            fd = _open(path)
        except OSError as exc:
            if exc.errno == errno.ESTALE:
                continue  # NFS: the name still led to a file its server had removed; look again
            _no_claim(path, exc)
            return Claim(waited=waited), None
        try:
            try:
                until = max(deadline, time.monotonic() + (LAST_TRY_S if waited else FIRST_TRY_S))
                busy = not try_lock(fd, until, _close)
            except OSError as exc:
                if exc.errno == errno.ESTALE:
                    raise
                # No locks here (ENOLCK, EOPNOTSUPP): no one holds this file, so it goes now.
                with contextlib.suppress(OSError):
                    if _still_named(path, fd):
                        os.unlink(path)
                raise
            if busy:
                waited = True
                if not _wait(fd, deadline):
                    _close(fd)
                    _log.debug("cuda-program-cas: %s: waited %.1f s for another compile; compiling here", path, wait_s)
                    return Claim(waited=True, timed_out=True), None
            if not _still_named(path, fd):
                raise _Gone
            if os.utime in os.supports_fd:
                with contextlib.suppress(OSError):  # another user's file: held all the same
                    os.utime(fd)  # a file left by a dead claimant: young again, so no sweep takes it
        except _Slow:
            # The try goes on in its thread, which lets go of what it gets and closes fd.
            if waited:
                return Claim(waited=True, timed_out=True), None
            _no_claim(
                path, OSError(errno.ETIMEDOUT, "flock did not return in time (a lock manager that does not answer)")
            )
            return Claim(), None
        except (_Gone, OSError) as exc:
            _close(fd)
            if isinstance(exc, _Gone) or exc.errno == errno.ESTALE:
                # Its holder removed it as it let go: take the claim afresh, so that a caller that
                # still misses compiles holding it and the node's other waiters wait for that.
                continue
            _no_claim(path, exc)
            return Claim(waited=waited), None
        except BaseException:
            _close(fd)  # interrupted while waiting
            raise
        return Claim(held=True, waited=waited), fd
    return Claim(waited=waited), None


def _open(path: str) -> int:
    fd = open_lock(path, _FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        _close(fd)
        raise
    return fd


class _Gone(Exception):
    """The claim file locked is no longer at its name: its holder let go."""


def _next_pause(pause: float, waited_s: float) -> float:
    return min(_LONGEST_PAUSE_S, max(min(2 * pause, _FAST_PAUSE_S), _PAUSE_SHARE * waited_s))


def _wait(fd: int, deadline: float) -> bool:
    """Poll the lock until it is ours (True) or the deadline passes (False)."""
    start = time.monotonic()
    pause = _FIRST_PAUSE_S
    while True:
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = _next_pause(pause, now - start)
        if try_lock(fd, max(deadline, time.monotonic() + LAST_TRY_S), _close):
            return True


def _still_named(path: str, fd: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _release(path: str, fd: int) -> None:
    assert fcntl is not None
    try:
        # Removed while still locked, and only if still ours (a sweep may have taken it).
        if _still_named(path, fd):
            os.unlink(path)
    except OSError as exc:
        _log.debug("cuda-program-cas: claim file %s not removed: %s", path, exc)
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: a copy in a child would keep it held
        _close(fd)


def _no_claim(path: str, exc: OSError) -> None:
    """Say once per directory and reason, at DEBUG, why no claim was taken."""
    where = os.path.dirname(path)
    say_once(
        ("no claims", where, exc.errno or 0),
        "cuda-program-cas: no claims in %s (%s): compiles of this node that miss the same key each compile",
        where,
        exc,
        level=logging.DEBUG,
    )
