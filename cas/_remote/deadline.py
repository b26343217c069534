"""One deadline per request: a watchdog thread shuts a request's sockets down when its time is up.

Why a watchdog. A socket timeout bounds each ``recv``, not a request: a server
that sends ``HTTP/1.1 2`` and then a byte every half second, or a short header
line every 0.3 s, meets every per-recv timeout while http.client waits for up
to 64 KiB a line and 100 header lines (days). urllib3's ``Timeout(total=)`` is
no better: it shortens the read timeout by the connect time, still per recv.
Shrinking the timeout before each ``recv`` would need a hook into every read of
http.client and of the ssl module. ``shutdown(SHUT_RDWR)`` from another thread
needs none: the kernel ends the socket, so whatever blocks on it (the TLS
handshake, the status line, a header, the body) returns at once with an EOF or
an error, in C or Python code alike. It is a known way to abort a blocking recv.

One thread per process serves every request, sleeping until the earliest
deadline (a timer thread per request would cost a thread start each). A request
registers with :func:`watch`, its sockets join as they are made or reused
(:meth:`Watch.add`), and :func:`Watch.done` takes it off the list: under the
watchdog's lock, so a request that finished is never shut down, and one that
was shut down knows it (``fired``) and closes its connection instead of handing
it back to the pool. A forked child starts its own thread when it needs one.
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
        # under the thread that is reading through it.
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # closed already (EBADF), or never connected (ENOTCONN)


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
