"""Recency touches, taken off the hot path.

Eviction orders entries by their manifest's mtime; touching it inside a hit would cost a quarter
of a first hit. A hit queues the path (no system call); one daemon thread per process applies
the queues once a second, as do ``flush()``, ``close()``, collection, exit and
:func:`apply_pending` before an eviction is planned. A process killed outright loses its last
second of reads: those entries look older than they are, never wrong.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections import deque

from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._disk.files import trusted_mtime_ns

__all__ = ["TOUCH_INTERVAL_NS", "Touches", "apply_pending", "ensure_thread"]

#: How often the thread applies the queues.
TOUCH_DELAY_S = 1.0
#: A manifest whose mtime is younger than this is not touched again.
TOUCH_INTERVAL_NS = 1_000_000_000

#: Touch a symlink itself, never what it points to (where the platform can).
_NOFOLLOW = os.utime in os.supports_follow_symlinks


class Touches:
    """The queue of manifest paths to touch for one cache. Thread-safe: ``add`` and ``apply`` may race."""

    __slots__ = ("__weakref__", "_due", "add")

    def __init__(self) -> None:
        self._due: deque[str] = deque()
        #: Queue a touch of a path (the hot path: no system call, no lock).
        self.add = self._due.append
        _FLUSHER.register(self)

    def apply(self) -> int:
        """Touch every queued path whose mtime is a second old or more; how many were touched.

        Processes sharing hot keys then write each key's mtime about once a second between them.
        """
        pop = self._due.popleft
        done = 0
        while True:
            try:
                path = pop()
            except IndexError:
                return done
            try:
                now = time.time_ns()
                if now - trusted_mtime_ns(os.lstat(path).st_mtime_ns, now) < TOUCH_INTERVAL_NS:
                    continue  # touched within the second (or ahead by less than a day)
                if _NOFOLLOW:
                    os.utime(path, follow_symlinks=False)
                else:
                    os.utime(path)
            except OSError:
                continue  # removed or rewritten meanwhile, or a read-only mount: nothing to freshen
            done += 1

    def _forget(self) -> None:
        self._due.clear()


class _Flusher:
    def __init__(self) -> None:
        self._queues: weakref.WeakSet[Touches] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def register(self, touches: Touches) -> None:
        with self._lock:
            self._queues.add(touches)

    def ensure_thread(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cuda-program-cas touches", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        # A pass a second, queued or not: waking this thread from a hit would cost the hit more.
        while True:
            time.sleep(TOUCH_DELAY_S)
            self.apply_all()

    def apply_all(self) -> None:
        for touches in list(self._queues):
            touches.apply()

    def _after_fork_in_child(self) -> None:
        had_thread = self._thread is not None
        self._lock = threading.Lock()
        self._thread = None
        for touches in list(self._queues):
            touches._forget()
        if had_thread:
            self.ensure_thread()  # the parent had one: so does the child


_FLUSHER = _Flusher()
#: Start this process's touch thread if it is not running.
ensure_thread = _FLUSHER.ensure_thread
#: Apply every touch this process has queued, for every cache (before planning an eviction).
apply_pending = _FLUSHER.apply_all


atexit.register(_FLUSHER.apply_all)
after_fork(_FLUSHER)
