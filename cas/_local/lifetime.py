"""Lifetime counters: what every process did with one cache directory since they were last zeroed.

``<root>/counters`` is an append-only file of short self-checking text lines::

    c6 <each counter of NAMES, in order> <crc>
    z1 <when the counters were zeroed, ns since the epoch> <crc>

A ``c6`` line holds what one process counted since its previous line; the totals are the sums.
``<crc>``: the CRC-32 of the line up to its last space, 8 lowercase hex digits. A torn, garbled
or failing line is ignored; a valid one of an unknown tag is kept by compaction, not summed.

A :class:`Recorder` appends an instance's counts at most once a second, at ``close()``, at
garbage collection and at exit; a forked child starts from what its parent counted. An append
under ``counters.lock`` (``flock``, else ``filelock``), not a rewrite: no temp file and rename at
every exit of a thousand-process job, and a killed writer leaves at most a torn line. Readers
take no lock. ``stats --zero`` and compaction rewrite the file atomically under the lock.
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
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from stat import S_ISREG
from typing import NamedTuple

from cuda_program_cas._base.config import say_once
from cuda_program_cas._base.errors import CacheError
from cuda_program_cas._base.fork import after_fork, after_fork_call
from cuda_program_cas._base.log import DEBUG
from cuda_program_cas._base.log import LOGGER as _log
from cuda_program_cas._disk.atomic import append_line, atomic_write
from cuda_program_cas._disk.files import READ_FLAGS, NotRegularFile
from cuda_program_cas._disk.layout import Layout

from .flocks import FIRST_TRY_S, LAST_TRY_S, Slow, close_lock, open_lock, try_lock
from .stats import COUNTER_NAMES

try:
    import fcntl
except ImportError:  # Windows: filelock
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "COMPACT_BYTES",
    "FLUSH_INTERVAL_S",
    "Busy",
    "Recorder",
    "encode_line",
    "locked_append",
    "read_counters",
    "read_log",
    "split_lines",
    "zero_counters",
]


#: The counters of a ``c6`` line, in order: all but the claims'. A new counter needs a new tag.
NAMES = tuple(n for n in COUNTER_NAMES if n not in ("claim_waits", "claim_hits"))
_TAG = "c6"
_COUNTS = {_TAG.encode(): len(NAMES)}
#: An instance flushes at most this often (on its next operation once it has passed).
FLUSH_INTERVAL_S = 1.0
#: A flush that leaves the file larger than this folds it into one line.
COMPACT_BYTES = 4096
#: How long the last flush (close, collection, exit) waits for the lock; one on the way does not wait.
_WAIT_LAST_S = 2.0
_MAX_READ = 1 << 24

_LOCK_FLAGS = (
    os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
)


@functools.cache
def _line_re() -> re.Pattern[bytes]:
    """A counters line's form, compiled when first read (a process that only hits and flushes appends)."""
    return re.compile(rb"([a-z][a-z0-9]{0,7})((?: [0-9]{1,20})*) ([0-9a-f]{8})")


#: ``source(lock)``: an instance's counts now (``lock=False`` after a fork).
Source = Callable[[bool], Mapping[str, int]]


# A NamedTuple: every process with a cache imports this module, and a frozen dataclass costs 0.3 ms.
class Lifetime(NamedTuple):
    """The sums of a counters file."""

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


def split_lines(data: bytes) -> Iterator[tuple[bytes, list[int]] | None]:
    """``(tag, values)`` of each line of ``data``; None for one torn, garbled or failing its check."""
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
    """The bytes of a log file (counters, usage ledger, miss journal), at most 16 MiB; empty when there is none."""
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
    """The lifetime counters of the cache ``lay`` (all zero when it has none); takes no lock."""
    return _parse(read_log(lay.counters))[0]


class Busy(Exception):
    """``counters.lock`` stayed held by someone else."""


@contextlib.contextmanager
def counters_locked(path: str, wait_s: float) -> Iterator[None]:
    """Hold ``counters.lock`` (an OS lock: a killed holder's is released); :class:`Busy` after ``wait_s``."""
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
    fd = open_lock(path, _LOCK_FLAGS)
    owned = True  # False once a try that did not return owns fd (flocks.try_lock closes it)
    try:
        deadline = time.monotonic() + wait_s
        pause = 0.001
        # Each try bounded: over NFS one may never return (docs/nfs.md), and a put flushes here.
        until = max(deadline, time.monotonic() + FIRST_TRY_S)
        while True:
            try:
                if try_lock(fd, until, close_lock):
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
            close_lock(fd)


def zero_counters(lay: Layout, *, wait_s: float = 10.0) -> Lifetime:
    """Set the lifetime counters of ``lay`` to zero; returns what they were. ``CacheError`` if the lock stays held."""
    try:
        with counters_locked(lay.counters_lock, wait_s):
            before = _parse(read_log(lay.counters))[0]
            atomic_write(lay.counters, encode_line("z1", [time.time_ns()]), lay.tmp)
    except Busy:
        raise CacheError(
            f"cannot zero the counters of {lay.root!r}: {lay.counters_lock} is held by another process"
        ) from None
    return before


def locked_append(lay: Layout, path: str, lines: bytes, wait_s: float, then: Callable[[int], None]) -> bool:
    """Append ``lines`` to ``path`` under ``counters.lock``, then ``then(its size)`` still under it.

    False when the cache was removed; :class:`Busy` when the lock stayed held for ``wait_s``.
    """
    if not os.path.isdir(lay.index):
        return False
    with counters_locked(lay.counters_lock, wait_s):
        then(append_line(path, lines))
    return True


def _compact(lay: Layout) -> None:
    """Fold every line into one (the caller holds the lock)."""
    life, unknown = _parse(read_log(lay.counters))
    head = b"" if life.zeroed_ns is None else encode_line("z1", [life.zeroed_ns])
    atomic_write(lay.counters, head + encode_line(_TAG, [life.counters[n] for n in NAMES]) + b"".join(unknown), lay.tmp)


class Recorder:
    """Appends one instance's counts to its counters file; ``source`` must not refer to the instance."""

    def __init__(self, lay: Layout, source: Source) -> None:
        self._lay = lay
        self._source = source
        self._flushed = dict.fromkeys(NAMES, 0)  # a new instance has counted nothing yet
        self._mutex = threading.Lock()
        self._failed: set[Hashable] = set()  # errnos said
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
        """Append what was counted since the last flush; False when it could not be (kept for the next).

        ``last``: wait up to a few seconds for the lock; otherwise do not wait.
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
            if not self._record(encode_line(_TAG, delta), wait_s):
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
        say_once(
            code,
            "cuda-program-cas: %s: lifetime counters not recorded (%s: %s); kept for the next flush",
            self._lay.root,
            errno.errorcode.get(code, code),
            exc,
            level=DEBUG,
            seen=self._failed,
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


# Exit hooks run last registered first: this one runs after the finalizers' flushes.
atexit.register(_flush_pending)


@after_fork_call
def _after_fork_in_child() -> None:
    _PENDING.clear()  # the parent tries those
