"""redis-py's connection and RESP2 parser, bounded: what :mod:`.redis` talks to its server through (imports ``redis``).

redis-py reads whatever length a reply announces and gives each ``recv`` the whole timeout
again, so its reading is replaced. ``bound(...)`` sets a call's bounds before it is sent: a
bulk reply over ``limit`` is refused from its header (:class:`TooLarge`); at most ``budget``
bytes, lines of :data:`MAX_LINE`, arrays of ``items`` one deep (EXEC's); one deadline for
the call, connect and TLS included, extended by each value's bytes at ``rate``.
"""

from __future__ import annotations

import os
import select
import time
from typing import Any

from redis import exceptions
from redis._parsers import _RESP2Parser
from redis._parsers.socket import SERVER_CLOSED_CONNECTION_ERROR, SocketBuffer
from redis.connection import Connection, PythonRespSerializer, SSLConnection
from redis.utils import SENTINEL

from cuda_program_cas._base.config import VAR_CA_BUNDLE
from cuda_program_cas._base.engine import Landing

__all__ = ["MAX_LINE", "TooLarge", "connect", "exceptions"]

#: The longest reply line: Redis's are a few hundred bytes.
MAX_LINE = 64 << 10
_MAX_DEPTH = 1
#: A larger value is sent as its own buffer, not copied; smaller commands are joined up to it,
#: so a pipeline goes out in one write (redis-py's 6000 split 100 SETs in two).
_BUFFER_CUTOFF = 64 << 10


class TooLarge(Exception):
    """A reply larger than the call allows, refused before it was read."""


class _Buffer(SocketBuffer):
    """redis-py's socket buffer, with the call's deadline and byte budget checked before every recv."""

    def __init__(self, sock: Any, read_size: int, socket_timeout: Any, parser: _Parser) -> None:
        super().__init__(sock, read_size, socket_timeout)
        self.parser = parser

    def _recv(self, into: memoryview | None = None) -> bytes | int:
        parser = self.parser
        left = parser.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call ran past its deadline (a slow or trickling server)")
        sock = self._sock
        sock.settimeout(min(left, self.socket_timeout or left))
        data = b""
        if into is None:
            data = sock.recv(self.socket_read_size)
            got = len(data)
        else:
            got = sock.recv_into(into)
        if got == 0:
            raise exceptions.ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
        parser.received += got
        if parser.received > parser.budget:
            raise TooLarge(f"the reply is larger than the {parser.budget} bytes this call asked for")
        return data if into is None else got

    def _read_from_socket(
        self, length: int | None = None, timeout: Any = SENTINEL, raise_on_timeout: Any = True
    ) -> bool:
        """One recv onto the buffer's end (``length`` is only base ``read``'s, replaced below)."""
        if timeout is not None and timeout is not SENTINEL:  # a poll (can_read): not the engine's
            return bool(super()._read_from_socket(length, timeout, raise_on_timeout))
        buf = self._buffer
        pos = buf.tell()
        buf.seek(0, os.SEEK_END)
        try:
            buf.write(self._recv())  # type: ignore[arg-type]
        finally:
            buf.seek(pos)
        return True

    def readline(self, timeout: Any = None) -> bytes:
        buf = self._buffer
        data = buf.readline()
        while not data.endswith(b"\r\n"):
            if len(data) > MAX_LINE:
                raise exceptions.InvalidResponse(f"a reply line longer than {MAX_LINE} bytes")
            self._read_from_socket()
            data += buf.readline()
        return bytes(data[:-2])

    def read(self, length: int, timeout: Any = None) -> bytes:
        # Straight into the buffer that becomes the value. Every view is released, a failure's too:
        # one left in a traceback's frames crashed CPython 3.12.1's collector.
        out = Landing(length + 2)
        with out.room() as room:
            got = self._buffer.readinto(room)
            while got < len(room):
                with room[got:] as rest:
                    got += int(self._recv(rest))
            end = bytes(room[length:])
        if end != b"\r\n":
            raise exceptions.InvalidResponse("a bulk reply not ended by CRLF")
        out.filled(length)
        return out.value()


class _Parser(_RESP2Parser):
    """RESP2, bounded: a bulk reply longer than ``limit`` is refused from its header, before it is read."""

    _buffer: _Buffer
    limit = 0
    budget = 0
    items = 1
    rate = 1.0
    received = 0
    deadline = 0.0

    def on_connect(self, connection: Any) -> None:
        super().on_connect(connection)  # type: ignore[no-untyped-call]
        self._buffer = _Buffer(self._sock, self.socket_read_size, connection.socket_timeout, self)

    def _read_response(self, disable_decoding: bool = False, timeout: Any = None, depth: int = 0) -> Any:
        raw = self._buffer.readline()
        if not raw:
            raise exceptions.ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
        byte, rest = raw[:1], raw[1:]
        if byte == b"-":
            error = self.parse_error(rest.decode("utf-8", errors="replace"))  # type: ignore[no-untyped-call]
            if isinstance(error, exceptions.ConnectionError):
                raise error  # AUTH refused, LOADING, too many clients: no call can succeed
            return error
        if byte == b"+":
            return rest
        if byte == b":":
            return int(rest)
        if byte in (b"$", b"*"):
            n = int(rest)
            if n == -1:
                return None
            if n < 0:
                raise exceptions.InvalidResponse(f"Protocol Error: {raw[:40]!r}")
            if byte == b"$":
                if n > self.limit:
                    raise TooLarge(f"a value of {n} bytes, more than the {self.limit} asked for")
                self.deadline += n / self.rate
                return self._buffer.read(n)
            if depth >= _MAX_DEPTH or n > self.items:
                raise exceptions.InvalidResponse(f"an array of {n} replies, nested {depth} deep: not what was asked")
            return [self._read_response(disable_decoding, timeout, depth + 1) for _ in range(n)]
        raise exceptions.InvalidResponse(f"Protocol Error: {raw[:40]!r}")


class _Bounded:
    """A connection whose every call is bounded by its parser's limit, budget and deadline."""

    _parser: _Parser
    _sock: Any
    encoder: Any
    socket_connect_timeout: Any

    def bound(self, *, limit: int, budget: int, items: int, seconds: float, rate: float) -> None:
        """The bounds of the next call: each value, all bytes, the longest array, the deadline, the slow-link rate."""
        p = self._parser
        p.limit, p.budget, p.items, p.rate, p.received = limit, budget, items, rate, 0
        p.deadline = time.monotonic() + seconds

    def stale(self) -> bool:
        """True when an idle connection has something to read: the server closed it, or sent junk."""
        sock = self._sock
        return sock is not None and bool(select.select([sock], [], [], 0)[0])

    def _left(self, doing: str = "connecting") -> float:
        left = self._parser.deadline - time.monotonic()
        if left <= 0:  # the caller disconnects
            raise exceptions.TimeoutError(f"the call ran past its deadline while {doing}")
        return left

    def _connect(self) -> Any:
        # redis-py gives the connect and then the TLS handshake each the whole timeout.
        self.socket_connect_timeout = self._left()
        return super()._connect()  # type: ignore[misc]

    def _wrap_socket_with_ssl(self, sock: Any) -> Any:
        # redis-py 8.1 wraps with the socket's timeout, 8.2 with socket_connect_timeout: both are what is left.
        left = self._left()
        self.socket_connect_timeout = left
        sock.settimeout(left)
        return super()._wrap_socket_with_ssl(sock)  # type: ignore[misc]

    def _construct_command_packer(self, packer: Any) -> Any:
        # redis-py's own packer sends a large value as it is; hiredis's would copy it.
        return PythonRespSerializer(_BUFFER_CUTOFF, self.encoder.encode)

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        # Python's sendall with a timeout bounds each piece, not the whole: give each what is left.
        if not self._sock:
            self.connect_check_health(check_health=False)  # type: ignore[attr-defined]
        for item in [command] if isinstance(command, (bytes, str)) else command:
            self._sock.settimeout(self._left("sending"))
            super().send_packed_command([item], check_health=False)  # type: ignore[misc]


class _Plain(_Bounded, Connection):
    pass


class _Tls(_Bounded, SSLConnection):
    pass


def connect(a: Any, timeout: float) -> Any:
    """A bounded connection to the address ``a`` (:class:`.redis._Address`), connected at its first call.

    TLS is verified against the system's CAs and ``CUDA_PROGRAM_CAS_CA_BUNDLE``.
    """
    kwargs: dict[str, Any] = {
        "host": a.host, "port": a.port, "db": a.db, "username": a.user, "password": a.password,
        "socket_timeout": timeout, "socket_connect_timeout": timeout, "parser_class": _Parser, "protocol": 2,
        "driver_info": None,  # no CLIENT SETINFO: two round trips per connection saved
    }  # fmt: skip
    if not a.tls:
        return _Plain(**kwargs)  # type: ignore[no-untyped-call]
    return _Tls(ssl_cert_reqs="required", ssl_check_hostname=True, ssl_ca_certs=VAR_CA_BUNDLE.value(), **kwargs)
