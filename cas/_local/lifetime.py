"""Lifetime counters: what every process did with one cache directory since they were last zeroed.

``<root>/counters`` is an append-only file of short self-checking text lines::

    c6 <hits> <misses> <writes> <dedup_writes> <evictions> <corrupt> <shared_hits> <dropped_writes> <errors>
       <switched> <uploads> <uploads_dropped> <untrusted> <saved_us> <listed_misses> <skipped_lookups>
       <eviction_failures> <crc>                                                                    (one line)
    z1 <when the counters were zeroed, ns since the epoch> <crc>

A ``c6`` line holds what one process counted since its previous line (non-negative
decimal integers); the totals are the sums. ``<crc>`` is the CRC-32 of the line up
to its last space, in 8 lowercase hex digits. A line that is torn (no newline),
garbled or fails its check is ignored; one that checks out but has a tag this
version does not know (a later version's) is left out of the sums and kept by
compaction.

How counts get there: an instance counts in memory (:class:`cuda_program_cas._local.stats.Counters`,
an increment and no I/O per operation) and its :class:`Recorder` appends the
difference since its last line: on the first operation a second or more after
the last flush (so at most once a second, and only when there is something new),
at ``close()``, when the instance is garbage collected, and at interpreter exit
(``weakref.finalize``, which holds no reference to the instance). A forked child
starts from what its parent had counted, so nothing is counted twice. A process
that ends without running ``atexit`` (SIGKILL, ``os._exit``, a ``multiprocessing``
child) loses what it counted since its last flush, and nothing else.

Why this design rather than one small file rewritten at each flush:

- A flush is one ``write`` of about 60 bytes under a short blocking lock on
  ``counters.lock``: many processes flushing at once are serialised, so none loses
  a count, and no flush costs a temp file and a rename (no directory churn, on NFS
  no extra round trips, at every process exit of a thousand-process job). The
  lock is ``flock`` itself where there is one (what ``filelock`` takes on POSIX,
  without its 20-70 ms import and 250 us per lock: a flush costs tens of
  microseconds, at every exit too), else ``filelock``.
- A process killed while flushing leaves at most a torn last line; the lock is an
  OS lock, released by the kill. Readers ignore the torn line and the next writer
  starts its own line on a new line. Damage (a flipped bit, a power loss: nothing
  is fsync-ed) costs the lines it touches, not the totals.
- Readers take no lock: a valid line is complete whenever it is seen.
- ``stats --zero`` and compaction (every line folded into one once the file passes
  :data:`COMPACT_BYTES`) rewrite the file through the one write protocol
  (:func:`cuda_program_cas._disk.atomic.atomic_write`) under the same lock, so no append falls
  between their read and their replace. The append is the one write that does not
  go through it: a rename per flush is what this design avoids.

Counts never corrupt the cache: the file sits beside it and nothing else reads it.
Caches opened ``read_only=True`` and shared stores are never written: their counts
stay in the instance (``counters()``). A hit from a shared store is counted in the
local cache's file, as ``hits`` and ``shared_hits``.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import os
import re
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from stat import S_ISREG
from typing import NamedTuple

from cuda_program_cas._base.errors import CacheError
from cuda_program_cas._base.fork import after_fork, after_fork_call
from cuda_program_cas._base.log import LOGGER as _log
from cuda_program_cas._disk.atomic import append_line, atomic_write
from cuda_program_cas._disk.files import READ_FLAGS, NotRegularFile
from cuda_program_cas._disk.layout import Layout

from .flocks import FIRST_TRY_S, LAST_TRY_S, Slow, try_lock
from .stats import COUNTER_NAMES

try:
    import fcntl
except ImportError:  # Windows: filelock
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "COMPACT_BYTES",
    "FLUSH_INTERVAL_S",
    "NAMES",
    "Busy",
    "Lifetime",
    "Recorder",
    "counters_locked",
    "encode_line",
    "locked_append",
    "read_counters",
    "read_log",
    "split_lines",
    "zero_counters",
]


#: The counters of a ``c6`` line, in order: this instance's counters but the two of
#: claims, which say what one process waited for. A new counter needs a new tag (lines
#: of the tags before, which only pre-release versions wrote, are not read).
NAMES = tuple(n for n in COUNTER_NAMES if n not in ("claim_waits", "claim_hits"))
_TAG = "c6"
#: The tags of counter lines this version sums, and how many values each holds.
_COUNTS = {_TAG.encode(): len(NAMES)}
#: An instance flushes at most this often (on its next operation once it has passed).
FLUSH_INTERVAL_S = 1.0
#: A flush that leaves the file larger than this folds it into one line.
COMPACT_BYTES = 4096
#: How long the last flush (close, collection, exit) waits for the lock. One on the way
#: (in a lookup or a write) does not wait: a busy lock only puts it off to the next.
_WAIT_LAST_S = 2.0
_MAX_READ = 1 << 24

_LOCK_FLAGS = (
    os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
)


@functools.cache
def _line_re() -> re.Pattern[bytes]:
    """A counters line's form, compiled when first read (0.15 ms: a process that only hits and flushes appends)."""
    return re.compile(rb"([a-z][a-z0-9]{0,7})((?: [0-9]{1,20})*) ([0-9a-f]{8})")


#: Descriptors of ``counters.lock`` open in this process (closed in a forked child).
_LOCK_FDS: set[int] = set()

#: ``source(lock)``: an instance's counts now (``lock=False`` after a fork).
Source = Callable[[bool], Mapping[str, int]]


# A NamedTuple, not a dataclass: every process with a cache imports this module, and a frozen
# dataclass costs it about 0.3 ms to build (a NamedTuple 0.04 ms).
class Lifetime(NamedTuple):
    """The sums of a counters file."""

    #: Name -> total, for every name in :data:`NAMES`.
    counters: dict[str, int]
    #: When ``stats --zero`` last ran (ns since the epoch), or None.
    zeroed_ns: int | None = None
    #: Lines ignored: torn, garbled or failing their check.
    bad_lines: int = 0

    @property
    def hit_rate(self) -> float | None:
        """``hits / (hits + misses)``, or None before the first lookup."""
        looked = self.counters["hits"] + self.counters["misses"]
        return self.counters["hits"] / looked if looked else None


def encode_line(tag: str, values: Sequence[int]) -> bytes:
    """One self-checking line: ``tag``, the non-negative integers ``values``, their CRC-32."""
    body = " ".join([tag, *map(str, values)]).encode()
    return b"%s %08x\n" % (body, zlib.crc32(body))


_encode = encode_line


def split_lines(data: bytes) -> Iterator[tuple[bytes, list[int]] | None]:
    """``(tag, values)`` of each line of ``data`` :func:`encode_line` wrote; None for one torn, garbled or failing
    its check (a last line without its newline is torn)."""
    lines = data.split(b"\n")
    torn = lines.pop()
    for raw in lines:
        if not raw:
            continue
        m = _line_re().fullmatch(raw)
        if m is None or zlib.crc32(raw[: m.start(3) - 1]) != int(m.group(3), 16):
            yield None
            continue
        yield m.group(1), [int(v) for v in m.group(2).split()]
    if torn:
        yield None


def _parse(data: bytes) -> tuple[Lifetime, list[bytes]]:
    """The sums of ``data``, and its well-formed lines of unknown tags (kept by compaction)."""
    totals = dict.fromkeys(NAMES, 0)
    zeroed = None
    bad = 0
    unknown = []
    for line in split_lines(data):
        if line is None:
            bad += 1
            continue
        tag, values = line
        if _COUNTS.get(tag) == len(values):
            for name, value in zip(NAMES, values, strict=False):
                totals[name] += value
        elif tag == b"z1" and len(values) == 1:
            zeroed = values[0]
        elif tag in _COUNTS or tag == b"z1":
            bad += 1
        else:
            unknown.append(encode_line(tag.decode(), values))
    return Lifetime(totals, zeroed, bad), unknown


def read_log(path: str) -> bytes:
    """The bytes of a log file of this floor (counters, usage ledger, miss journal); empty when there is none.

    At most 16 MiB are read: a larger file is read up to there (its later lines are lost to the sums).
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except FileNotFoundError:
        return b""
    try:
        if not S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(path)
        chunks = []
        got = 0
        while got < _MAX_READ and (chunk := os.read(fd, 1 << 16)):
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_counters(lay: Layout) -> Lifetime:
    """The lifetime counters of the cache ``lay`` (all zero when it has none). Reads only, takes no lock."""
    return _parse(read_log(lay.counters))[0]


class Busy(Exception):
    """``counters.lock`` stayed held by someone else."""


@contextlib.contextmanager
def counters_locked(path: str, wait_s: float) -> Iterator[None]:
    """Hold ``counters.lock`` (an OS lock: a killed holder's is released); :class:`Busy` after ``wait_s``.

    Never creates the cache directory (``filelock`` would, for a cache removed meanwhile).
    """
    if fcntl is None:
        try:
            import filelock

            file_lock, timeout = filelock.FileLock, filelock.Timeout
        except AttributeError:  # half imported: a collection in its import flushes a dropped instance
            raise Busy from None
        lock = file_lock(path, timeout=wait_s)
        try:
            lock.acquire(blocking=wait_s > 0)
        except timeout:
            raise Busy from None
        try:
            yield
        finally:
            lock.release()
        return
    fd = os.open(path, _LOCK_FLAGS, 0o600)
    _LOCK_FDS.add(fd)  # a child forked meanwhile closes its copy
    owned = True  # False once a try that did not return owns fd (flocks.try_lock closes it)
    try:
        deadline = time.monotonic() + wait_s
        pause = 0.001
        # Each try bounded: over NFS one may never return (docs/nfs.md), and a put flushes here.
        until = max(deadline, time.monotonic() + FIRST_TRY_S)
        while True:
            try:
                if try_lock(fd, until, _close_lock_fd):
                    break
            except Slow:
                owned = False
                raise Busy from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise Busy from None
            time.sleep(min(pause, left))  # holders keep it for microseconds
            pause = min(2 * pause, 0.05)
            until = max(deadline, time.monotonic() + LAST_TRY_S)
        try:
            yield
        finally:
            # Explicitly: closing releases an flock only once every copy of the
            # descriptor is closed, and a child forked meanwhile holds one.
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        if owned:
            _close_lock_fd(fd)


def _close_lock_fd(fd: int) -> None:
    _LOCK_FDS.discard(fd)
    with contextlib.suppress(OSError):
        os.close(fd)


def zero_counters(lay: Layout, *, wait_s: float = 10.0) -> Lifetime:
    """Set the lifetime counters of ``lay`` to zero; returns what they were.

    Counts that running processes have not flushed yet arrive after the zero.
    Raises :class:`cuda_program_cas.CacheError` when another process holds the lock for ``wait_s``.
    """
    try:
        with counters_locked(lay.counters_lock, wait_s):
            before = _parse(read_log(lay.counters))[0]
            atomic_write(lay.counters, _encode("z1", [time.time_ns()]), lay.tmp)
    except Busy:
        raise CacheError(
            f"cannot zero the counters of {lay.root!r}: {lay.counters_lock} is held by another process"
        ) from None
    return before


def locked_append(lay: Layout, path: str, lines: bytes, wait_s: float, then: Callable[[int], None]) -> bool:
    """Append ``lines`` to the log file ``path`` of ``lay`` under ``counters.lock``, then ``then(its size)``
    under the lock still (a compaction, when due). False when the cache was removed; raises
    :class:`Busy` when the lock stayed held for ``wait_s``, ``OSError`` for what the disk said."""
    if not os.path.isdir(lay.index):
        return False
    with counters_locked(lay.counters_lock, wait_s):
        then(append_line(path, lines))
    return True


def _compact(lay: Layout) -> None:
    """Fold every line into one (the caller holds the lock)."""
    life, unknown = _parse(read_log(lay.counters))
    head = b"" if life.zeroed_ns is None else _encode("z1", [life.zeroed_ns])
    atomic_write(lay.counters, head + _encode(_TAG, [life.counters[n] for n in NAMES]) + b"".join(unknown), lay.tmp)


class Recorder:
    """Appends one instance's counts to its cache's counters file (see the module docstring).

    ``source`` must not refer to the instance, so that the instance can be
    collected (and flushed) while the recorder lives on in its finalizer.
    """

    def __init__(self, lay: Layout, source: Source) -> None:
        self._lay = lay
        self._source = source
        self._flushed = dict.fromkeys(NAMES, 0)  # a new instance has counted nothing yet
        self._mutex = threading.Lock()
        self._failed: set[int] = set()
        after_fork(self)

    def attach(self, owner: object) -> None:
        """Flush when ``owner`` is garbage collected, or at interpreter exit if it is still alive."""
        weakref.finalize(owner, self._last_flush)

    def _last_flush(self) -> None:
        # Runs in a finalizer (in whatever thread collects the owner) or at exit: never raises.
        try:
            if not self.flush(last=True) and os.path.isdir(self._lay.index):
                _PENDING.append(self)  # one more try at exit
        except Exception as exc:
            _log.debug("cuda-program-cas: %s: lifetime counters not recorded: %r", self._lay.root, exc)

    def flush(self, *, last: bool = False) -> bool:
        """Append what was counted since the last flush; False when it could not be (it is kept for the next).

        ``last``: wait up to a few seconds for the lock; otherwise do not wait at all.
        """
        wait_s = _WAIT_LAST_S if last else 0.0
        acquired = self._mutex.acquire(timeout=wait_s) if last else self._mutex.acquire(blocking=False)
        if not acquired:
            return False
        try:
            now = self._source(True)
            delta = [now[n] - self._flushed[n] for n in NAMES]
            if not any(delta):
                return True
            if not self._record(_encode(_TAG, delta), wait_s):
                return False
            self._flushed = dict(now)
            return True
        finally:
            self._mutex.release()

    def _record(self, line: bytes, wait_s: float) -> bool:
        lay = self._lay

        def compact_if_due(size: int) -> None:
            if size > COMPACT_BYTES:
                try:
                    _compact(lay)
                except OSError as exc:  # the line is recorded; the next flush compacts
                    self._failed_once(exc)

        try:
            return locked_append(lay, lay.counters, line, wait_s, compact_if_due)
        except Busy:
            return False
        except OSError as exc:
            self._failed_once(exc)
            return False

    def _failed_once(self, exc: OSError) -> None:
        code = exc.errno or 0
        if code in self._failed:
            return
        self._failed.add(code)
        _log.debug(
            "cuda-program-cas: %s: lifetime counters not recorded (%s: %s); kept for the next flush",
            self._lay.root,
            errno.errorcode.get(code, code),
            exc,
        )

    def _after_fork_in_child(self) -> None:
        # The child starts from what the parent counted (the parent records that).
        self._mutex = threading.Lock()
        self._flushed = dict(self._source(False))


#: Recorders whose last flush failed (a busy lock), tried once more at exit.
_PENDING: list[Recorder] = []


def _flush_pending() -> None:
    while _PENDING:
        recorder = _PENDING.pop()
        try:
            recorder.flush(last=True)
        except Exception as exc:
            _log.debug("cuda-program-cas: %s: lifetime counters not recorded: %r", recorder._lay.root, exc)


# Exit hooks run last registered first: this one runs after the finalizers' (which flush the
# instances still alive) unless something created a finalizer before cas was imported.
atexit.register(_flush_pending)


@after_fork_call
def _after_fork_in_child() -> None:
    _PENDING.clear()  # the parent tries those
    # A thread of the parent was inside a flush: its descriptor of counters.lock came
    # along, and while open it would hold the flock for the child's whole life (the
    # parent's close releases only its own copy). Closing it here releases nothing
    # the parent holds.
    for fd in list(_LOCK_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()
