"""One deadline per request: a watchdog thread shuts a request's sockets down when its time is up.

A socket timeout bounds each ``recv``, not a request: a byte every half second meets every
one for days (urllib3's ``Timeout(total=)`` too). ``shutdown(SHUT_RDWR)`` from another thread
needs no hook into http.client or ssl: whatever blocks on the socket returns at once. One
thread per process sleeps until the earliest deadline. :meth:`Watch.done` runs under its
lock, so a finished request is never shut down, and one that was knows it (``fired``).
"""

from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time

from cuda_program_cas._base.fork import after_fork_call

__all__ = ["Watch", "current", "watch"]


class Watch:
    """One request's deadline and the sockets it uses."""

    __slots__ = ("deadline", "finished", "fired", "sockets")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.sockets: list[socket.socket] = []
        self.fired = False
        self.finished = False

    def add(self, sock: socket.socket) -> None:
        """Watch ``sock`` too (a connection made or reused for this request); shut at once if late."""
        with _DOG.cond:
            if self.finished:
                return
            self.sockets.append(sock)
            if self.fired or time.monotonic() >= self.deadline:
                self.fired = True
                _shut(sock)

    def left(self) -> float:
        """Seconds until the deadline (0 when it passed)."""
        return max(0.0, self.deadline - time.monotonic())

    def done(self) -> bool:
        """Stop watching; True when the deadline passed first (its sockets were shut down)."""
        with _DOG.cond:
            self.finished = True
            self.sockets = []
            _local.watch = None
            return self.fired


def _shut(sock: socket.socket) -> None:
    try:
        # The plain socket's shutdown, on an SSLSocket too: ssl's own would drop its SSL object
        # under the thread reading through it.
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


class _Watchdog:
    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.heap: list[tuple[float, int, Watch]] = []
        self.seq = itertools.count()
        self.thread: threading.Thread | None = None

    def reset(self) -> None:
        # After fork: the thread did not come along, and its lock may have been held.
        self.cond = threading.Condition(threading.Lock())
        self.heap = []
        self.thread = None

    def add(self, w: Watch) -> None:
        with self.cond:
            if len(self.heap) > 64 and len(self.heap) > 4 * sum(not e[2].finished for e in self.heap):
                self.heap = [e for e in self.heap if not e[2].finished]  # finished ones wait for their time
                heapq.heapify(self.heap)
            first = not self.heap or w.deadline < self.heap[0][0]
            heapq.heappush(self.heap, (w.deadline, next(self.seq), w))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="cuda-program-cas-deadline", daemon=True)
                self.thread.start()
            elif first:
                self.cond.notify()

    def _run(self) -> None:
        with self.cond:
            while True:
                now = time.monotonic()
                while self.heap and self.heap[0][0] <= now:
                    _deadline, _seq, w = heapq.heappop(self.heap)
                    if not w.finished:
                        w.fired = True
                        for sock in w.sockets:
                            _shut(sock)
                self.cond.wait(self.heap[0][0] - now if self.heap else None)


_DOG = _Watchdog()
after_fork_call(_DOG.reset)
_local = threading.local()


def watch(seconds: float) -> Watch:
    """Start this thread's request: its sockets are shut down ``seconds`` from now unless it is done by then."""
    w = Watch(time.monotonic() + seconds)
    _DOG.add(w)
    _local.watch = w
    return w


def current() -> Watch | None:
    """The request this thread is making, if any (what a new or reused connection joins)."""
    w: Watch | None = getattr(_local, "watch", None)
    return w
