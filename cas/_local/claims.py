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
  when the bound passes compiles too. The bound holds even where a single
  "non-blocking" ``flock`` does not return (NFS: see below);
- anything that keeps a claim from being taken (a read-only cache, no space, a
  directory where the file belongs, no locks on this file system, no ``fcntl`` on
  Windows) means no claim: the caller compiles as it would without them.

Why ``flock`` on a file of our own rather than ``filelock``: ``filelock`` takes the
same ``flock`` on POSIX, but it leaves its lock files behind, cannot tell that the
file it locked was removed meanwhile, and knows nothing of forks; the lifetime
counters already take their lock this way (:mod:`cuda_program_cas._local.lifetime`).
``flock``, not ``fcntl``'s record locks: those belong to the process, so two threads
of one process would both hold the claim, and closing any descriptor of the file
drops it. An ``flock`` belongs to the open file: threads contend like processes.

Lock files do not pile up. The holder removes its file while it still holds the
lock, then lets go. A waiter that then gets the lock finds the file it locked gone
from its name (the inode check): the claimant is done. It takes the claim afresh
(a new file) and looks the key up; should it still miss (the claimant failed, or
an NFS client still caches the entry's absence), its compile is the one of its
node, and the node's other waiters wait for it. One that finds its file still in
place took over from a claimant that died, and compiles. Files of claimants that
died and that no one took over are temp files like any other in ``tmp/``: a
holder freshens its file's mtime, and ``gc``, ``verify`` and a writable open
remove the ones an hour old.

On a cache that sits on NFS (docs/nfs.md has what the NFS harness measured), the
client turns ``flock`` into byte-range locks that the server arbitrates, so the
claim holds across the nodes that mount the cache (with ``nolock`` or
``local_lock=``, across one mount's processes only). A holder that dies lets go
at once while its node lives; a node that dies holds its claims until the
server's lease ends (NFSv4: 90 s by default) or, on NFSv3, until it comes back:
the wait's bound covers both. Each try is a round trip to the server, so a
waiter asks less and less often, and each try is bounded
(:mod:`cuda_program_cas._local.flocks`): one on NFSv3 with no ``rpc.statd`` did
not return for 61 s, one whose server's lock manager is gone never returns. A try
still out at the bound is given up (no claim: compile). A file that the server
removed while a waiter had it open (``ESTALE``) is a claimant that let go.

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
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass

from cuda_program_cas._base.fork import after_fork_call
from cuda_program_cas._disk.layout import CLAIM_SUFFIX
from cuda_program_cas.index import is_key_id

from .flocks import FIRST_TRY_S, LAST_TRY_S, try_lock
from .flocks import Slow as _Slow
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
#: A waiter polls the lock: first after 1 ms, doubling up to every 50 ms, then every
#: twentieth of the time it has waited, up to every second. It sees a release within
#: 50 ms or 5 % of its wait. Over NFS each poll is a round trip to the server: every
#: 50 ms, a waiter sent 17 to 18 LOCK calls a second in the NFS harness; now 25 in its
#: first second, and about one a second past 20 s (300 s: about 370, not 6,000).
_FIRST_PAUSE_S = 0.001
_FAST_PAUSE_S = 0.05
_PAUSE_SHARE = 0.05
_LONGEST_PAUSE_S = 1.0
#: The first try at the lock may take this long even when the wait's bound is shorter.
_FIRST_TRY_S = FIRST_TRY_S
#: A later try may end this long past the bound (a try made as the bound passes).
_LAST_TRY_S = LAST_TRY_S
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
    waited = False  # whether this caller waited for another's claim, on this file or an earlier one
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
                # The first try may take _FIRST_TRY_S even when the bound is shorter.
                busy = not _lock(fd, max(deadline, time.monotonic() + (_LAST_TRY_S if waited else _FIRST_TRY_S)))
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
                # Its holder removed it as it let go (done, or given up; ESTALE: an NFS server
                # removed it while it was open here). Take the claim afresh and look the key
                # up: a caller that still misses (the holder failed, or this NFS client still
                # caches the entry's absence) then compiles holding it, and the node's other
                # waiters wait for that compile rather than each compile.
                continue
            _no_claim(path, exc)
            return Claim(waited=waited), None
        except BaseException:
            _close(fd)  # interrupted while waiting
            raise
        return Claim(held=True, waited=waited), fd
    return Claim(waited=waited), None


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


class _Gone(Exception):
    """The claim file locked is no longer at its name: its holder let go."""


def _lock(fd: int, until: float) -> bool:
    """One non-blocking try (:func:`cuda_program_cas._local.flocks.try_lock`): True when taken,
    False when another holds it; :class:`_Slow` when not back by ``until`` (its thread then closes ``fd``)."""
    return try_lock(fd, until, _close)


def _next_pause(pause: float, waited_s: float) -> float:
    """The pause after ``pause``, ``waited_s`` into a wait: doubling to 50 ms, then a
    twentieth of the time waited, up to 1 s."""
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
        if _lock(fd, max(deadline, time.monotonic() + _LAST_TRY_S)):
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
