"""A TCP forwarder of the tests' own, with faults chosen while it runs: delay, trickle, reset, stall.

``Proxy(("127.0.0.1", port))`` listens on 127.0.0.1 and a free port (``port``)
and forwards every connection to the target, each direction by two threads (one receives
and stamps, one sends when due), so a delay is latency, not a slower link. The settings are
attributes, read for every chunk, so a test may change them at any time:

- ``delay_up_ms``, ``delay_down_ms``: latency added client to server, and server to client.
- ``rate_down``: bytes per second server to client (None: as fast as it comes); ``1`` with
  a small value is a trickle, one byte at a time. Each connection's own, unless ``rate_shared``:
  then the connections share it, as requests in parallel share one node's link.
- ``reset_after``: a connection is reset (RST to both sides) once this many bytes went
  server to client on it; None: never.
- ``stall``: nothing is forwarded while True; the connections stay open.

Counters: ``connections`` (accepted), ``bytes_down``, and ``exchanges``: the
client's turns to speak (data from the client after data went to it, or the first on a
connection); a pipelined call is one exchange. ``rounds``: the exchanges in sequence, the
round trips a client waited for one after another: an exchange that begins while no other
connection's awaits its answer starts a round; requests sent in parallel are one round.
``stop()`` closes everything.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from types import TracebackType

__all__ = ["Proxy"]

_CHUNK = 1 << 16
_TICK = 0.01  # the stall's and the rate's step, in seconds


class _Link:
    """One client connection and its connection to the target."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.down = 0  # bytes sent to the client
        self.client_turn = True  # the next data from the client starts an exchange
        self.closed = False

    def close(self, reset: bool = False) -> None:
        self.closed = True
        for s in (self.client, self.server):
            if reset:  # SO_LINGER 0: close() sends RST, not FIN
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class Proxy:
    """Forwards 127.0.0.1:``port`` to ``target`` (see the module docstring)."""

    def __init__(
        self,
        target: tuple[str, int],
        *,
        delay_up_ms: float = 0.0,
        delay_down_ms: float = 0.0,
        rate_down: float | None = None,
        rate_shared: bool = False,
        reset_after: int | None = None,
    ) -> None:
        self.target = target
        self.delay_up_ms = delay_up_ms
        self.delay_down_ms = delay_down_ms
        self.rate_down = rate_down
        self.rate_shared = rate_shared
        self._rate_free = 0.0  # with rate_shared: when the link is free for the next piece
        self.reset_after = reset_after
        self.stall = False
        self.connections = 0
        self.bytes_down = 0
        self.exchanges = 0
        self.rounds = 0
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._stopped = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)

    def start(self) -> Proxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and every connection; idempotent."""
        with self._lock:
            self._stopped = True
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()

    def __enter__(self) -> Proxy:
        return self.start() if not self._thread.is_alive() else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()  # the target is down: so is the proxy's answer
                continue
            server.settimeout(None)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client, server)
            with self._lock:
                stopped = self._stopped
                if not stopped:
                    self.connections += 1
                    self._links.append(link)
            if stopped:  # stop() came while this one was being connected: it would have been missed
                link.close()
                return
            for up in (True, False):
                queue: collections.deque[tuple[float, bytes]] = collections.deque()
                ready = threading.Condition()
                threading.Thread(target=self._receive, args=(link, up, queue, ready), daemon=True).start()
                threading.Thread(target=self._send, args=(link, up, queue, ready), daemon=True).start()

    def _receive(
        self, link: _Link, up: bool, queue: collections.deque[tuple[float, bytes]], ready: threading.Condition
    ) -> None:
        source = link.client if up else link.server
        while True:
            try:
                data = source.recv(_CHUNK)
            except OSError:
                data = b""
            with self._lock:
                if up and data and link.client_turn:
                    self.exchanges += 1
                    if not any(not other.client_turn and not other.closed for other in self._links):
                        self.rounds += 1  # no other exchange under way: this one starts a round
                    link.client_turn = False
            delay = (self.delay_up_ms if up else self.delay_down_ms) / 1000
            with ready:
                queue.append((time.monotonic() + delay, data))  # b"": the end, forwarded in its turn
                ready.notify()
            if not data:
                return

    def _send(
        self, link: _Link, up: bool, queue: collections.deque[tuple[float, bytes]], ready: threading.Condition
    ) -> None:
        sink = link.server if up else link.client
        while True:
            with ready:
                while not queue:
                    ready.wait()
                due, data = queue.popleft()
            time.sleep(max(0.0, due - time.monotonic()))
            if not data:
                try:
                    sink.shutdown(socket.SHUT_WR)  # pass the peer's FIN on
                except OSError:
                    pass
                return
            while data:
                while self.stall and not link.closed:
                    time.sleep(_TICK)
                if link.closed:
                    return
                piece = self._piece(link, up, data)
                if piece == 0:
                    link.close(reset=True)
                    return
                if not up and self.rate_down and self.rate_shared:
                    with self._lock:  # this piece's turn on the shared link
                        start = max(time.monotonic(), self._rate_free)
                        self._rate_free = start + piece / self.rate_down
                    time.sleep(max(0.0, start - time.monotonic()))
                if not up:
                    # The client's turn begins before it can have these bytes: set after sendall, a reply
                    # read by the other thread first was not counted as a turn (a loaded machine did so).
                    with self._lock:
                        link.client_turn = True
                try:
                    sink.sendall(data[:piece])
                except OSError:
                    link.close()
                    return
                if not up:
                    with self._lock:
                        self.bytes_down += piece
                        link.down += piece
                data = data[piece:]
                rate = None if up or self.rate_shared else self.rate_down
                if rate:
                    time.sleep(piece / rate)

    def _piece(self, link: _Link, up: bool, data: bytes) -> int:
        """How many bytes of ``data`` to send now: all, a rate's tick of them, or up to the reset (0: reset now)."""
        n = len(data)
        if up:
            return n
        if self.rate_down:
            n = min(n, max(1, int(self.rate_down * _TICK)))
        if self.reset_after is not None:
            n = min(n, self.reset_after - link.down)
        return max(n, 0)
