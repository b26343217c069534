"""A loopback HTTP/1.1 server of the tests' own whose misbehaviour each test chooses.

It serves a folder's files for GET and HEAD, single Range requests (206, 416) and keep-alive, one
thread a connection. ``set(prefix, fault)`` makes requests whose path starts with ``prefix``
misbehave (the longest prefix wins; ``set_default`` covers the rest). The faults, ``Fault.<name>``:

- ``ok()``: serve the file (404 where none); ``refuse()``: reset the connection, no answer (a port
  where nothing listens is :func:`refused_url`); ``stall()``: answer nothing until ``stop()``;
  ``stall_body()``: the headers, then nothing; ``trickle(ms)``: one body byte every ``ms``;
  ``status(code)``: answer ``code`` with a short body; ``truncate()``: half the body, then close;
  ``wrong_bytes()``: the body's first byte flipped; ``redirect_loop()``, ``redirect_to(url)``: 302;
  ``no_ranges()``: a Range request answered 200 with the whole file.
- How long a client waits and how much it reads: ``trickle_status(ms)`` (``HTTP/1.1 2``, then a
  byte every ``ms``: a reason phrase that never ends; http.client reads 64 KiB a line);
  ``trickle_headers(ms)`` (a header line every ``ms``, never the blank line; http.client takes
  100); ``many_headers(n)``; ``lie_length(by)`` (a ``Content-Length`` ``by`` bytes off, then
  close); ``endless(length)`` (zeros forever, under ``Content-Length: length`` or none).
- ``huge_trailer(count)``: a pack (``.cpk``) whose trailer claims ``count`` entries, the file as
  large as that says (``consistent``: zeros where the real one ends) or its real size.
- ``lie_ranges(how)``: a multi-range request answered falsely: ``boundary`` (another boundary than
  the header's), ``unasked`` (the second part moved by a byte, its ``Content-Range`` saying so),
  ``single`` (a 206 of the first range alone), ``bytes`` (each part's first byte flipped).
- ``FaultServer.trickle_handshake(ms)``: each new connection gets the start of a 16 KiB TLS record,
  then a byte of it every ``ms`` (a handshake that never ends).

``FaultServer(root, writable=True)`` also takes PUT (parents made, the body renamed into place, as
nginx's WebDAV does) and MKCOL (one level; 405 where it exists); ``keep_nothing()`` and
``keep_half()`` answer 201 but keep nothing or the body's first half. ``times=n`` applies a fault
to the next n matching requests only. Every request is recorded (``log``, ``hits(path)``);
``wait_for`` blocks until requests arrived, so a test need not sleep. ``stop()`` releases the
stalls and closes every connection.
"""

from __future__ import annotations

import http.client
import itertools
import os
import socket
import socketserver
import struct
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from testkit.server import free_port

__all__ = ["Fault", "FaultServer", "Request", "refused_url"]

_MAX_HEADER = 65536
_CHUNK = 65536
#: A pack's trailer (cas/_disk/pack.py): checksum, index offset, count, version, magic.
_TRAILER = struct.Struct("<32sQII8s")
_FANOUT_SIZE = 256 * 4
_ENTRY_SIZE = 96


class _Kind:
    """``Fault.<name>(times=None)``: a fault of the kind the attribute names, which takes nothing else."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.kind = name

    def __get__(self, obj: object, owner: type[Fault]) -> Callable[..., Fault]:
        def make(*, times: int | None = None) -> Fault:
            return owner(self.kind, times=times)

        return make


@dataclass(frozen=True)
class Fault:
    """How to answer a request; build one with the class attributes the module's docstring lists."""

    kind: str = "ok"
    code: int = 200
    url: str = ""
    interval: float = 0.0  # seconds between bytes, for trickle
    times: int | None = None  # apply to this many requests, then serve normally; None: always
    number: int | None = None  # header lines, bytes off, Content-Length, entries: what the kind says
    consistent: bool = True  # huge_trailer: the file's size fits the trailer's claim
    how: str = ""  # lie_ranges: which lie

    ok = _Kind()
    refuse = _Kind()
    stall = _Kind()
    stall_body = _Kind()
    truncate = _Kind()
    wrong_bytes = _Kind()
    redirect_loop = _Kind()
    no_ranges = _Kind()
    keep_nothing = _Kind()
    keep_half = _Kind()

    @classmethod
    def trickle(cls, ms: float = 50, times: int | None = None) -> Fault:
        return cls("trickle", interval=ms / 1000, times=times)

    @classmethod
    def status(cls, code: int, times: int | None = None) -> Fault:
        return cls("status", code=code, times=times)

    @classmethod
    def redirect_to(cls, url: str, times: int | None = None) -> Fault:
        return cls("redirect_to", url=url, times=times)

    @classmethod
    def trickle_status(cls, ms: float = 200, times: int | None = None) -> Fault:
        return cls("trickle_status", interval=ms / 1000, times=times)

    @classmethod
    def trickle_headers(cls, ms: float = 200, times: int | None = None) -> Fault:
        return cls("trickle_headers", interval=ms / 1000, times=times)

    @classmethod
    def many_headers(cls, n: int, times: int | None = None) -> Fault:
        return cls("many_headers", number=n, times=times)

    @classmethod
    def lie_length(cls, by: int, times: int | None = None) -> Fault:
        return cls("lie_length", number=by, times=times)

    @classmethod
    def endless(cls, length: int | None = None, times: int | None = None) -> Fault:
        return cls("endless", number=length, times=times)

    @classmethod
    def lie_ranges(cls, how: str, times: int | None = None) -> Fault:
        if how not in ("boundary", "unasked", "single", "bytes"):
            raise ValueError(f"lie_ranges: boundary, unasked, single or bytes, not {how!r}")
        return cls("lie_ranges", how=how, times=times)

    @classmethod
    def huge_trailer(cls, count: int = 2**32 - 1, *, consistent: bool = True, times: int | None = None) -> Fault:
        return cls("huge_trailer", number=count, consistent=consistent, times=times)


@dataclass(frozen=True)
class Request:
    """One request as the server received it."""

    method: str
    path: str  # without the query string
    headers: dict[str, str]  # names lowercased
    connection: int  # serial number of the connection, from 1
    seq: int  # the request's number on its connection, from 1
    fault: str  # the fault kind it got


def refused_url(path: str = "/") -> str:
    """A URL on 127.0.0.1 where nothing listens: connecting is refused (ECONNREFUSED).

    The port was free a moment ago; nothing of this suite listens on ports it did not bind itself.
    """
    return f"http://127.0.0.1:{free_port()}/{path.lstrip('/')}"


@dataclass
class _State:
    root: Path
    writable: bool = False
    faults: dict[str, Fault] = field(default_factory=dict)
    remaining: dict[str, int] = field(default_factory=dict)  # prefix -> requests left for a times= fault
    log: list[Request] = field(default_factory=list)
    per_connection: Counter[int] = field(default_factory=Counter)
    connections: int = 0
    lock: threading.Condition = field(default_factory=threading.Condition)
    stopping: threading.Event = field(default_factory=threading.Event)
    sockets: set[socket.socket] = field(default_factory=set)
    arrived: threading.Event = field(default_factory=threading.Event)  # set at each request
    handshake_interval: float = 0.0  # > 0: every new connection gets a TLS handshake trickled


class _Stop(Exception):
    """The server is stopping or the client went away: end this connection."""


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def setup(self) -> None:
        self.state = self.server.state
        self.sock: socket.socket = self.request
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        with self.state.lock:
            self.state.connections += 1
            self.conn_id = self.state.connections
            self.state.sockets.add(self.sock)

    def finish(self) -> None:
        with self.state.lock:
            self.state.sockets.discard(self.sock)

    def handle(self) -> None:
        try:
            if self.state.handshake_interval > 0:
                self._trickle(b"\x16\x03\x03\x40\x00", itertools.repeat(b"\x00"), self.state.handshake_interval)
                return
            while not self.state.stopping.is_set():
                head = self._read_head()
                if head is None:
                    return
                if not self._answer(head):
                    return
        except (_Stop, OSError):
            return

    # -- Reading ----------------------------------------------------------------------------
    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise _Stop
        return data

    def _read_head(self) -> tuple[str, str, dict[str, str], bytes] | None:
        while b"\r\n\r\n" not in self.buf:
            if len(self.buf) > _MAX_HEADER:
                raise _Stop
            try:
                self.buf += self._recv()
            except _Stop:
                return None
        raw, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = raw.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0") or 0)
        while len(self.buf) < length:  # a body is read whole, to keep the connection in step
            self.buf += self._recv()
        body, self.buf = self.buf[:length], self.buf[length:]
        return method, target, headers, body

    # -- Answering --------------------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _trickle(self, first: bytes, then: Iterator[bytes], interval: float) -> None:
        """Send ``first``, then each piece of ``then`` after ``interval`` s, until it ends or ``stop()``."""
        self._send(first)
        for piece in then:
            if self.state.stopping.wait(interval):
                return
            self._send(piece)

    def _stream(self, chunks: Iterator[bytes]) -> None:
        """Send ``chunks`` as fast as the client takes them, until they end, the client goes, or ``stop()``."""
        for chunk in chunks:
            if self.state.stopping.is_set():
                return
            self._send(chunk)

    def _head(self, code: int, reason: str, headers: dict[str, str]) -> bytes:
        lines = [f"HTTP/1.1 {code} {reason}"] + [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _fault_for(self, path: str) -> Fault:
        state = self.state
        with state.lock:
            best = max((p for p in state.faults if path.startswith(p)), key=len, default=None)
            if best is None:
                return Fault.ok()
            fault = state.faults[best]
            if fault.times is not None:
                left = state.remaining.get(best, 0)
                if left <= 0:
                    return Fault.ok()
                state.remaining[best] = left - 1
            return fault

    def _answer(self, head: tuple[str, str, dict[str, str], bytes]) -> bool:
        """Answer one request; False where the connection must end."""
        method, target, headers, body = head
        path = target.split("?", 1)[0]
        if "://" in path:  # absolute-form target
            path = "/" + path.split("://", 1)[1].partition("/")[2]
        fault = self._fault_for(path)
        state = self.state
        with state.lock:
            state.per_connection[self.conn_id] += 1
            state.log.append(
                Request(method, path, headers, self.conn_id, state.per_connection[self.conn_id], fault.kind)
            )
            state.lock.notify_all()
        state.arrived.set()
        keep = headers.get("connection", "").lower() != "close"
        kind = fault.kind
        if kind == "refuse":
            # SO_LINGER 0: close() sends a reset, as a server that dropped the connection at once.
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            self.sock.close()  # here, before socketserver's shutdown(SHUT_WR) could send a FIN first
            return False
        if kind == "stall":
            state.stopping.wait()
            return False
        if kind == "status":
            return self._simple(fault.code, f"fault: status {fault.code}\n".encode(), {}, keep, method)
        if kind in ("redirect_loop", "redirect_to"):
            host = headers.get("host", f"127.0.0.1:{self.server.server_address[1]}")
            location = fault.url if kind == "redirect_to" else f"http://{host}{target}"
            return self._simple(302, b"redirect\n", {"Location": location}, keep, method)
        if kind == "trickle_status":
            reason = itertools.chain(iter([b"0", b"0", b" "]), itertools.repeat(b"x"))
            self._trickle(b"HTTP/1.1 2", reason, fault.interval)
            return False
        if kind == "trickle_headers":
            lines = (f"X-Trickle-{n}: {n}\r\n".encode() for n in itertools.count())
            self._trickle(b"HTTP/1.1 200 OK\r\n", lines, fault.interval)
            return False
        if kind == "endless":
            hdrs = {"Content-Type": "application/octet-stream", "Connection": "close"}
            if fault.number is not None:
                hdrs["Content-Length"] = str(fault.number)
            self._send(self._head(200, "OK", hdrs))
            self._stream(itertools.repeat(bytes(_CHUNK)))
            return False
        if method in ("PUT", "MKCOL") and state.writable:
            return self._write(method, path, body, kind, keep)
        if method not in ("GET", "HEAD"):
            return self._simple(405, b"method not allowed\n", {"Allow": "GET, HEAD"}, keep, method)
        file = self._file(path)
        if file is None:
            return self._simple(404, b"not found\n", {}, keep, method)
        if kind == "huge_trailer":
            return self._huge_trailer(file.read_bytes(), fault, headers, keep, method)
        data = file.read_bytes()
        rng = headers.get("range")
        if kind == "lie_ranges" and rng and "," in rng:
            return self._lie_ranges(data, rng, fault.how, keep, method)
        answer = _ranged(rng if kind != "no_ranges" else None, len(data))
        if answer is None:
            return self._simple(416, b"", {"Content-Range": f"bytes */{len(data)}"}, keep, method)
        code, reason, (start, end), hdrs = answer
        data = data[start : end + 1]
        if not keep:
            hdrs["Connection"] = "close"
        if kind == "many_headers":
            hdrs.update({f"X-Many-{n}": str(n) for n in range(fault.number or 0)})
        if kind == "lie_length":
            hdrs["Content-Length"] = str(max(0, len(data) + (fault.number or 0)))
            hdrs["Connection"] = "close"
            self._send(self._head(code, reason, hdrs) + (b"" if method == "HEAD" else data))
            return False
        self._send(self._head(code, reason, hdrs))
        if method == "HEAD":
            return keep
        if kind == "stall_body":
            state.stopping.wait()
            return False
        if kind == "trickle":
            for i in range(len(data)):
                if i and state.stopping.wait(fault.interval):
                    return False
                self._send(data[i : i + 1])
            return keep
        if kind == "truncate":
            self._send(data[: len(data) // 2])
            return False
        if kind == "wrong_bytes" and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        self._send(data)
        return keep

    def _huge_trailer(self, real: bytes, fault: Fault, headers: dict[str, str], keep: bool, method: str) -> bool:
        """Serve the pack ``real`` with its trailer claiming ``fault.number`` entries (see the module docstring)."""
        checksum, index_offset, _count, version, magic = _TRAILER.unpack(real[-_TRAILER.size :])
        count = fault.number or 0
        trailer = _TRAILER.pack(checksum, index_offset, count, version, magic)
        size = index_offset + _FANOUT_SIZE + count * _ENTRY_SIZE + _TRAILER.size if fault.consistent else len(real)
        answer = _ranged(headers.get("range"), size)
        if answer is None:
            return self._simple(416, b"", {"Content-Range": f"bytes */{size}"}, keep, method)
        code, reason, (first, last), hdrs = answer
        self._send(self._head(code, reason, hdrs))
        if method == "HEAD":
            return keep
        self._stream(_virtual_pack(real[: -_TRAILER.size], trailer, size, first, last))
        return keep

    def _lie_ranges(self, data: bytes, value: str, how: str, keep: bool, method: str) -> bool:
        asked = [_parse_range(f"bytes={part.strip()}", len(data)) for part in value.partition("=")[2].split(",")]
        spans = [span for span in asked if span is not None]
        size = len(data)
        if len(spans) != len(asked):
            return self._simple(416, b"", {"Content-Range": f"bytes */{size}"}, keep, method)
        if how == "single":
            first, last = spans[0]
            return self._simple(206, data[first : last + 1], {"Content-Range": f"bytes {first}-{last}/{size}"},
                                keep, method)  # fmt: skip
        boundary = "0000000000000042"
        framed = "0000000000000043" if how == "boundary" else boundary
        body = b""
        for i, (first, last) in enumerate(spans):
            shift = 1 if how == "unasked" and i == 1 else 0
            chunk = data[first + shift : last + shift + 1]
            if how == "bytes":
                chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
            part = f"--{framed}\r\nContent-Type: application/octet-stream\r\nContent-Range: bytes"
            body += f"\r\n{part} {first + shift}-{last + shift}/{size}\r\n\r\n".encode() + chunk
        body += f"\r\n--{framed}--\r\n".encode()
        return self._simple(206, body, {"Content-Type": f"multipart/byteranges; boundary={boundary}"}, keep, method)

    def _write(self, method: str, path: str, body: bytes, kind: str, keep: bool) -> bool:
        target = self._target(path)
        if target is None:
            return self._simple(403, b"", {}, keep, method)
        if method == "MKCOL":
            try:
                target.mkdir()
            except FileExistsError:
                return self._simple(405, b"", {}, keep, method)
            return self._simple(201, b"", {}, keep, method)
        if kind != "keep_nothing":
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.state.root, prefix=".put-")
            with os.fdopen(fd, "wb") as f:
                f.write(body[: len(body) // 2] if kind == "keep_half" else body)
            os.replace(tmp, target)
        return self._simple(201, b"created\n", {}, keep, method)

    def _simple(self, code: int, body: bytes, extra: dict[str, str], keep: bool, method: str) -> bool:
        reason = http.client.responses.get(code, "Status")
        hdrs = {"Content-Length": str(len(body)), **extra}
        if not keep:
            hdrs["Connection"] = "close"
        self._send(self._head(code, reason, hdrs) + (b"" if method == "HEAD" else body))
        return keep

    def _target(self, path: str) -> Path | None:
        """The file or folder under the root that ``path`` names; None for the root or a path that leaves it."""
        from urllib.parse import unquote

        rel = unquote(path).strip("/")
        if not rel or any(part in ("", ".", "..") for part in rel.split("/")):
            return None
        return self.state.root / rel

    def _file(self, path: str) -> Path | None:
        file = self._target(path)
        return file if file is not None and file.is_file() else None


def _virtual_pack(head: bytes, trailer: bytes, size: int, first: int, last: int) -> Iterator[bytes]:
    """Bytes ``first..last`` of a file of ``size``: ``head``, zeros, and ``trailer`` at its end; made as sent."""
    tail = size - len(trailer)
    pos = first
    while pos <= last:
        end = min(last + 1, pos + _CHUNK)
        if pos >= tail:
            piece = trailer[pos - tail : end - tail]
        elif pos < len(head):
            piece = head[pos : min(end, len(head), tail)]
        else:
            piece = bytes(min(end, tail) - pos)
        yield piece
        pos += len(piece)


def _ranged(value: str | None, size: int) -> tuple[int, str, tuple[int, int], dict[str, str]] | None:
    """Status, reason, span (inclusive) and headers of a file of ``size`` asked for ``value``; None: 416."""
    hdrs = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
    if not value:
        return 200, "OK", (0, size - 1), {**hdrs, "Content-Length": str(size)}
    span = _parse_range(value, size)
    if span is None:
        return None
    first, last = span
    hdrs.update({"Content-Length": str(last - first + 1), "Content-Range": f"bytes {first}-{last}/{size}"})
    return 206, "Partial Content", span, hdrs


def _parse_range(value: str, size: int) -> tuple[int, int] | None:
    """One ``bytes=`` range as (first, last) inclusive; None where unsatisfiable or not understood."""
    unit, _, spec = value.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    first, _, last = spec.strip().partition("-")
    try:
        if first == "":
            n = int(last)
            return (max(size - n, 0), size - 1) if n > 0 and size > 0 else None
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError:
        return None
    if start >= size or end < start:
        return None
    return start, min(end, size - 1)


class _TCPServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = False  # server_close() joins them: stop() leaves no thread behind
    block_on_close = True

    def __init__(self, state: _State) -> None:
        self.state = state
        super().__init__(("127.0.0.1", 0), _Handler)


class FaultServer:
    """The server: ``with FaultServer(root) as s:``; ``s.url("blobs/ab/cd")``."""

    def __init__(self, root: str | os.PathLike[str], *, writable: bool = False) -> None:
        self.root = Path(root)
        if writable:
            self.root.mkdir(parents=True, exist_ok=True)
        self._state = _State(self.root, writable)
        self._server: _TCPServer | None = None
        self._thread: threading.Thread | None = None

    # -- Life cycle -------------------------------------------------------------------------
    def start(self) -> FaultServer:
        self._server = _TCPServer(self._state)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.start()
        return self

    def stop(self) -> None:
        """Release every stall, close every connection, join every thread; idempotent."""
        if self._server is None:
            return
        self._state.stopping.set()
        self._server.shutdown()
        with self._state.lock:
            for sock in list(self._state.sockets):
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a handler blocked in recv()
                except OSError:
                    pass
        self._server.server_close()
        assert self._thread is not None
        self._thread.join()
        self._server = None

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- URLs -------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        port: int = self._server.server_address[1]
        return port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, sub: str = "") -> str:
        return f"{self.base_url}/{sub.lstrip('/')}"

    # -- Faults -----------------------------------------------------------------------------
    def set(self, prefix: str, fault: Fault) -> None:
        """Requests whose path starts with ``prefix`` (e.g. "/blobs/") get ``fault``."""
        if not prefix.startswith("/"):
            prefix = "/" + prefix
        with self._state.lock:
            self._state.faults[prefix] = fault
            if fault.times is not None:
                self._state.remaining[prefix] = fault.times

    def trickle_handshake(self, ms: float = 200) -> None:
        """Every connection accepted from now on gets a TLS handshake trickled (see the module docstring); 0: off."""
        with self._state.lock:
            self._state.handshake_interval = ms / 1000

    def set_default(self, fault: Fault) -> None:
        """Every request that no longer prefix matches gets ``fault``."""
        self.set("/", fault)

    def clear(self) -> None:
        """Every request is served normally again."""
        with self._state.lock:
            self._state.faults.clear()
            self._state.remaining.clear()

    # -- What arrived -----------------------------------------------------------------------
    @property
    def log(self) -> list[Request]:
        with self._state.lock:
            return list(self._state.log)

    def hits(self, path: str | None = None) -> int:
        """Requests received for ``path`` (exactly), or in all."""
        with self._state.lock:
            return sum(1 for r in self._state.log if path is None or r.path == path)

    def hits_by_path(self) -> Counter[str]:
        with self._state.lock:
            return Counter(r.path for r in self._state.log)

    @property
    def connections(self) -> int:
        """Connections accepted so far."""
        with self._state.lock:
            return self._state.connections

    def requests_per_connection(self) -> dict[int, int]:
        """Connection serial number -> requests it carried (more than 1: keep-alive)."""
        with self._state.lock:
            return dict(self._state.per_connection)

    def wait_for(self, n: int = 1, path: str | None = None, timeout: float = 5.0) -> bool:
        """Block until ``n`` requests (for ``path``, if given) have arrived; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._state.lock:
            while True:
                count = sum(1 for r in self._state.log if path is None or r.path == path)
                left = deadline - time.monotonic()
                if count >= n or left <= 0:
                    return count >= n
                self._state.lock.wait(left)

    @property
    def arrived(self) -> threading.Event:
        """Set when a request arrives; ``reset()`` clears it. ``wait_for`` counts, this only signals."""
        return self._state.arrived

    def reset(self) -> None:
        """Forget the requests recorded so far (faults and connection counts stay); clear ``arrived``."""
        with self._state.lock:
            self._state.log.clear()
            self._state.arrived.clear()
