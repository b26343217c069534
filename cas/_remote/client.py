"""The one HTTP client of the cache: urllib3's pool, bounded in time, never raising anything but :class:`HttpFailure`.

Why urllib3: the pool under ``requests`` and pip, quick with security fixes; keep-alive
pools that threads share, per-phase timeouts, bodies read in chunks, TLS through ``ssl``
(the system's CAs; ``requests`` brings certifi's, ``httpx`` is larger and slower to
import). Imported at the first request (about 25 ms).

Every request is bounded. One deadline covers connect, TLS, status line, headers and
body: the connect plus the read timeout, plus a second per 4 MiB the cache allows to
arrive (up to the entry ceiling: 64 s more at its default) or sends; a size a server
states earns no time. At the deadline its sockets are shut down (:mod:`.deadline`), so a
trickling server is cut off. At most ``limit`` bytes of body are read: a larger
``Content-Length`` is refused before the body, a longer body cut off.

Nothing is retried: the store that asked decides. Redirects: three at most. At most
:data:`PARALLEL` requests run at once in a process; one waits for its turn within its own
deadline, and one whose turn came because a request to the same server failed as an
outage meanwhile fails at once, so a dead server costs a burst of threads one batch of
requests, not two. The settings (docs/http.md: ``CUDA_PROGRAM_CAS_HTTP_TIMEOUT``,
``CUDA_PROGRAM_CAS_HTTP_TOKEN`` or a ``.netrc`` entry, ``CUDA_PROGRAM_CAS_CA_BUNDLE``) are
read once per process; a token is never logged, nor sent on a redirect to another host.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar
from urllib.parse import urlsplit

from cuda_program_cas._base.config import VAR_CA_BUNDLE, VAR_HTTP_TIMEOUT, VAR_HTTP_TOKEN, env_max_entry_size, say_once
from cuda_program_cas._base.engine import Landing, StoreFailure
from cuda_program_cas._base.errors import without_frames
from cuda_program_cas._base.fork import ForkSafeLock, after_fork_call

from .deadline import current, watch

__all__ = [
    "ENV_CA_BUNDLE",
    "ENV_HTTP_TIMEOUT",
    "ENV_HTTP_TOKEN",
    "PARALLEL",
    "SLOW_LINK_S_PER_BYTE",
    "HttpFailure",
    "Reply",
    "close_connections",
    "deadline_for",
    "request",
    "request_many",
    "sign_below",
    "timeouts",
]

ENV_HTTP_TIMEOUT = VAR_HTTP_TIMEOUT.name
ENV_HTTP_TOKEN = VAR_HTTP_TOKEN.name
ENV_CA_BUNDLE = VAR_CA_BUNDLE.name
#: Connect and read timeouts (s): three cover a SYN retransmit; ten, a cold object store's first byte.
DEFAULT_TIMEOUTS = (3.0, 10.0)
#: Bytes the cache allows to arrive, or sends, earn this much time each (4 MiB/s).
SLOW_LINK_S_PER_BYTE = 1 / (4 << 20)
#: Requests at once in a process, and connections kept per server: a burst of first hits at a 20 ms
#: round trip costs about a round trip per 16, and a node holds few of a server's worker connections.
PARALLEL = 16
_MAX_REDIRECTS = 3
_CHUNK = 1 << 16
_MAX_NETRC = 1 << 20


class HttpFailure(StoreFailure):
    """A request that got no usable answer: ``kind`` says what (``refused``, ``timeout``, ``tls``...).

    ``outage``: the server (or the way to it) may be down, so asking again at once would cost another timeout.
    """


@dataclass(frozen=True)
class Reply:
    """A server's answer: its status, body (empty for HEAD) and headers (names lowercase)."""

    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)


def _parse_timeouts(text: str) -> tuple[float, float]:
    try:
        values = [float(p) for p in text.split(",")]  # float() takes the spaces around a number
    except ValueError:
        values = []
    if not 1 <= len(values) <= 2:
        raise ValueError("expected CONNECT or CONNECT,READ in seconds, e.g. 3,10")
    if any(not 0 < v < float("inf") for v in values):  # NaN fails both
        raise ValueError("timeouts must be positive numbers of seconds")
    return (values[0], values[-1] if len(values) == 2 else DEFAULT_TIMEOUTS[1])


def _parse_file(text: str) -> str:
    if not os.path.isfile(text):
        raise ValueError("no such file")
    return text


class _Pool:
    """This process's urllib3 pool manager and settings, made at the first request."""

    def __init__(self) -> None:
        self.lock = ForkSafeLock()
        self.timeouts = DEFAULT_TIMEOUTS
        self.reset()

    def reset(self) -> None:
        # A forked child must not share its parent's sockets: it opens its own (and its own threads).
        #: Pool managers for http and for https URLs (the latter alone loads the CAs: ~70 ms).
        self.managers: dict[bool, Any] = {}
        self.tokens: dict[str, str | None] = {}
        #: Turns to make a request (:data:`PARALLEL`), and the threads that run :func:`request_many`'s.
        self.slots = threading.BoundedSemaphore(PARALLEL)
        self.workers: Any = None
        #: Server (host:port) -> when a request to it last failed as an outage, and how.
        self.down: dict[str, tuple[float, str]] = {}


_POOL = _Pool()
after_fork_call(_POOL.reset)

#: ``signer(method, url, headers, body)`` -> the headers to send instead (S3's signature); a file body stays at 0.
Signer = Callable[[str, str, dict[str, str], "bytes | IO[bytes] | None"], dict[str, str]]
#: Signers by the URL below which they sign (an S3 bucket's); read from a copy (threads add).
_SIGNERS: dict[str, Signer] = {}


def sign_below(root: str, signer: Signer) -> None:
    """Sign every request to ``root`` or below it with ``signer`` (and send no bearer token there): S3's SigV4."""
    _SIGNERS[root.rstrip("/")] = signer


def close_connections() -> None:
    """Close this process's connections; the next request opens new ones and reads the settings again."""
    with _POOL.lock:
        managers = list(_POOL.managers.values())
        _POOL.reset()
    for manager in managers:
        manager.clear()


def timeouts() -> tuple[float, float]:
    """The connect and read timeouts this process uses, in seconds."""
    value: tuple[float, float] | None = VAR_HTTP_TIMEOUT.value()
    return value or DEFAULT_TIMEOUTS


def _manager(tls: bool) -> Any:
    manager = _POOL.managers.get(tls)
    if manager is not None:
        return manager
    with _POOL.lock:
        if tls not in _POOL.managers:
            import urllib3

            tls_kw: dict[str, Any] = {}
            if tls:
                import ssl

                context = ssl.create_default_context()  # the system's CAs (or SSL_CERT_FILE's), verified
                bundle = VAR_CA_BUNDLE.value()
                if bundle is not None:
                    context.load_verify_locations(cafile=bundle)
                tls_kw["ssl_context"] = context
            _POOL.timeouts = timeouts()
            # block=False: never wait on urllib3 (its wait has no deadline); the turns bound the connections.
            manager = urllib3.PoolManager(num_pools=16, maxsize=PARALLEL, block=False, **tls_kw)
            manager.pool_classes_by_scheme = _watched_pools()
            _POOL.managers[tls] = manager
        return _POOL.managers[tls]


def _watched_pools() -> dict[str, Any]:
    """urllib3's pools, whose connections' sockets join the request's deadline (:mod:`.deadline`).

    A new socket joins once TCP is connected, before the TLS handshake; a reused one as its
    request is sent. The connect gets the time left, if less than the connect timeout.
    """
    from urllib3.connection import HTTPConnection, HTTPSConnection
    from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

    class Watched:
        timeout: Any
        sock: Any

        def _new_conn(self) -> Any:
            w = current()
            if w is not None and isinstance(self.timeout, (int, float)):
                self.timeout = min(self.timeout, max(w.left(), 0.001))
            sock = super()._new_conn()  # type: ignore[misc]
            if w is not None:
                w.add(sock)
            return sock

        def request(self, *args: Any, **kwargs: Any) -> Any:
            w = current()
            if w is not None and self.sock is not None:
                w.add(self.sock)
            return super().request(*args, **kwargs)  # type: ignore[misc]

    kinds = (("http", HTTPConnectionPool, HTTPConnection), ("https", HTTPSConnectionPool, HTTPSConnection))
    return {scheme: type(pool.__name__, (pool,), {"ConnectionCls": type(conn.__name__, (Watched, conn), {})})
            for scheme, pool, conn in kinds}  # fmt: skip


def _token(host: str) -> str | None:
    """The bearer token for ``host``: the environment's, else ``.netrc``'s password for it, else None."""
    if host not in _POOL.tokens:
        _POOL.tokens[host] = VAR_HTTP_TOKEN.value() or _netrc_token(host)
    return _POOL.tokens[host]


def _netrc_token(host: str) -> str | None:
    """The password of ``host``'s ``.netrc`` entry (``$NETRC``, else ``~/.netrc``); None, one WARNING where unusable.

    Checked before it is parsed: a FIFO would hang the open. The parser's messages may
    quote the file, so only its name and the line are logged, never a token.
    """
    import netrc

    given = os.environ.get("NETRC") or None
    path = given or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        st = os.stat(path)
    except OSError:
        return None  # none: the usual case
    why = ""
    if not stat.S_ISREG(st.st_mode):
        why = "it is not a regular file"
    elif st.st_size > _MAX_NETRC:
        why = f"it is {st.st_size} bytes, more than a .netrc holds"
    else:
        try:
            entry = netrc.netrc(given).authenticators(host)
        except netrc.NetrcParseError as exc:
            why = f"it cannot be parsed (line {exc.lineno})"
            if "permissive" in exc.msg or "owner" in exc.msg:
                why = "group or others may read it, or another user owns it (chmod 600)"
        except (OSError, ValueError) as exc:  # unreadable, or not text (UnicodeDecodeError)
            why = f"it cannot be read ({type(exc).__name__})"
        else:
            return entry[2] if entry and entry[2] else None
    say_once(("netrc", path), "cuda-program-cas: the .netrc %s is ignored: %s", path, why)
    return None


def deadline_for(limit: int, sent: int = 0) -> float:
    """Seconds a request may take in all: the timeouts, and time for the bytes the cache allows."""
    connect, read = _POOL.timeouts if _POOL.managers else timeouts()  # the pool's, read when it was made
    allowed = min(max(limit, 0), env_max_entry_size())
    return connect + read + (allowed + sent) * SLOW_LINK_S_PER_BYTE


def request(
    method: str,
    url: str,
    *,
    body: bytes | IO[bytes] | None = None,
    headers: Mapping[str, str] | None = None,
    limit: int = 1 << 20,
    sink: Callable[[bytes], object] | None = None,
    error_limit: int = 0,
) -> Reply:
    """``method`` on ``url``; the reply whatever its status, or :class:`HttpFailure`.

    A body over ``limit`` bytes is a failure, not an outage. With ``sink``, a 2xx body is given
    to it chunk by chunk (64 KiB at most) and the reply's ``body`` is empty; an exception from
    ``sink`` reaches the caller. ``body`` is bytes, or a binary file sent from its start with
    its ``Content-Length`` (never held in memory). ``error_limit``: a body of another status
    than 2xx is kept up to this, whatever ``limit`` (an S3 error's XML names it).
    """
    import urllib3
    from urllib3.exceptions import HTTPError as _Urllib3Error

    parts = urlsplit(url)
    manager = _manager(parts.scheme == "https")
    connect, read = _POOL.timeouts
    sent = dict(headers or {})
    below = (s for root, s in list(_SIGNERS.items()) if url == root or url.startswith((root + "/", root + "?")))
    signer = next(below, None)
    token = None if signer is not None else _token(parts.hostname or "")
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    size = 0
    if isinstance(body, bytes):
        size = len(body)
    elif body is not None:
        size = os.fstat(body.fileno()).st_size
        body.seek(0)
        sent["Content-Length"] = str(size)  # not chunked: object stores want the length
    if signer is not None:
        sent = signer(method, url, sent, body)  # a file body it hashes is left at its start
    total = deadline_for(limit, size)
    retries = urllib3.Retry(
        total=_MAX_REDIRECTS, connect=0, read=0, redirect=_MAX_REDIRECTS, status=0, other=0,
        raise_on_redirect=True, raise_on_status=False, respect_retry_after_header=False,
    )  # fmt: skip
    w = watch(total)
    slots = _POOL.slots
    server = parts.netloc
    waited_from = time.monotonic()
    if not slots.acquire(timeout=w.left()):  # behind PARALLEL others until this one's deadline
        w.done()
        raise _late(url, total)
    try:
        down = _POOL.down.get(server)
        if down is not None and down[0] >= waited_from:
            # Its turn came because others to this server failed meanwhile: one outage, not a second batch of it.
            raise HttpFailure(url, down[1], f"another request to this server failed meanwhile ({down[1]})")
        try:
            resp = manager.request(
                method,
                url,
                body=body,
                headers=sent,
                timeout=urllib3.Timeout(connect=min(connect, total), read=min(read, total)),
                retries=retries,
                preload_content=False,
            )
        except (_Urllib3Error, OSError, ValueError) as exc:  # OSError, ValueError: unwrapped, a malformed URL
            # without_frames: its traceback would keep the callers' frames (Program's) alive (errors.py).
            raise _late(url, total) if w.done() else _failure(url, without_frames(exc)) from None
        try:
            reply = _read(resp, url, method, limit, sink, errors=error_limit)
        except HttpFailure as exc:
            raise _late(url, total) if w.done() else exc from None
        if w.done():  # shut down meanwhile: a body that ended at the shutdown may look whole
            resp.close()
            raise _late(url, total)
        resp.release_conn()
        return reply
    except HttpFailure as exc:
        if exc.outage:
            _POOL.down[server] = (time.monotonic(), exc.kind)  # before the turn is given back (see above)
        raise
    finally:
        w.done()
        slots.release()


_T = TypeVar("_T")


def request_many(calls: Sequence[Callable[[], _T]]) -> list[_T]:
    """Each of ``calls`` (each makes a request or a few), :data:`PARALLEL` at once, their results in order.

    An outage cancels the calls not yet started; it (else the first exception) is raised once
    the started ones are done, each within its own deadline.
    """
    if len(calls) <= 1:
        return [call() for call in calls]
    from concurrent.futures import ThreadPoolExecutor

    with _POOL.lock:
        if _POOL.workers is None:
            _POOL.workers = ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="cuda-program-cas-http")
        workers = _POOL.workers
    futures = [workers.submit(call) for call in calls]
    failure: BaseException | None = None
    results: list[Any] = []
    for future in futures:
        try:
            results.append(future.result())
        except BaseException as exc:  # raised below, once every started call is done (a cancelled one: the outage)
            results.append(None)
            if failure is None or (_is_outage(exc) and not _is_outage(failure)):
                failure = exc
            if _is_outage(exc):
                for rest in futures:
                    rest.cancel()  # a dead server: no more requests to it
    if failure is not None:
        raise failure
    return results


def _is_outage(exc: BaseException) -> bool:
    return isinstance(exc, HttpFailure) and exc.outage


def _late(url: str, total: float) -> HttpFailure:
    return HttpFailure(
        url, "timeout", f"the answer did not arrive in time: not whole within {total:.3g} s (connect, status line, "
        "headers and body), a stalled or trickling server",
    )  # fmt: skip


def _read(
    resp: Any, url: str, method: str, limit: int, sink: Callable[[bytes], object] | None, *, errors: int
) -> Reply:
    """The reply of ``resp`` with its body (or given to ``sink``); the response is closed on any failure."""
    from urllib3.exceptions import HTTPError as _Urllib3Error

    head = {k.lower(): v for k, v in resp.headers.items()}
    if method == "HEAD":
        return Reply(resp.status, b"", head)
    absent = resp.status in (404, 410, 416)  # no such object, or no such range of it
    if not 200 <= resp.status < 300 and (errors or absent or sink):
        # An error's body kept to be read (request's docstring); any other read to reuse the connection and
        # dropped: "no such object" whatever the limit, up to a page.
        limit, sink = (max(limit, errors), None) if errors else (max(limit, _ABSENT_PAGE) if absent else limit, _drop)
    length = head.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > limit:
        resp.close()  # not read: the connection cannot be reused
        if absent:
            return Reply(resp.status, b"", head)
        raise HttpFailure(url, "too large", f"{length.strip()} bytes, at most {limit} expected", outage=False)
    chunks: list[bytes] = []
    keep = chunks.append if sink is None else sink
    landing = None
    plain = head.get("content-encoding", "identity").strip().lower() in ("", "identity")
    if sink is None and plain and length is not None and length.strip().isdigit():
        # Its length said beforehand (and not decoded to another): taken in once, not gathered then joined.
        landing, said = Landing(int(length)), int(length)

        def keep(chunk: bytes) -> None:
            assert landing is not None
            if landing.size + len(chunk) > said:
                raise HttpFailure(url, "too large", f"more than the {said} bytes its Content-Length said", outage=False)
            landing.take(chunk)

    got = 0
    # read1: what one recv gives (urllib3 >= 2.3); read(n) waits for n bytes, past the deadline for a trickle.
    read1 = getattr(resp, "read1", None) or resp.read

    def read(n: int) -> bytes:  # a failure of the connection is an HttpFailure (a sink's own failure is not one)
        try:
            return bytes(read1(n))
        except (_Urllib3Error, OSError) as exc:
            raise _failure(url, without_frames(exc)) from None

    try:
        while True:
            chunk = read(min(_CHUNK, limit + 1 - got))
            if not chunk:
                break
            got += len(chunk)
            if got > limit:
                if absent:
                    resp.close()
                    return Reply(resp.status, b"", head)
                raise HttpFailure(url, "too large", f"more than {limit} bytes", outage=False)
            keep(chunk)
    except BaseException:  # no answer, too large, the sink's own failure, MemoryError: the connection is mid-body
        resp.close()
        raise
    return Reply(resp.status, landing.value() if landing is not None else b"".join(chunks), head)


#: The most of a 404's, 410's or 416's page read (to reuse the connection); a longer one closes it.
_ABSENT_PAGE = 4096


def _drop(chunk: bytes) -> None:
    pass


def _failure(url: str, exc: BaseException) -> HttpFailure:
    """An urllib3 error as one :class:`HttpFailure`, named by what happened."""
    import socket

    from urllib3.exceptions import (
        MaxRetryError,
        NameResolutionError,
        NewConnectionError,
        ProtocolError,
        ProxyError,
        ResponseError,
        SSLError,
        TimeoutError,
    )

    reason = exc.reason if isinstance(exc, MaxRetryError) and exc.reason is not None else exc
    # urllib3 2 gives the redirects it ran out of as ResponseError("too many redirects").
    redirects = isinstance(reason, ResponseError) and "redirect" in str(reason)
    if redirects or (isinstance(exc, MaxRetryError) and exc.reason is None):
        return HttpFailure(url, "redirects", f"more than {_MAX_REDIRECTS} redirects")
    text = str(reason)
    if isinstance(reason, SSLError):
        return HttpFailure(url, "tls", text)
    if isinstance(reason, NameResolutionError):
        return HttpFailure(url, "dns", text)
    if isinstance(reason, NewConnectionError):  # before TimeoutError: urllib3 makes it one
        kind = "refused" if "refused" in text.lower() else "connect"
        return HttpFailure(url, kind, text)
    if isinstance(reason, TimeoutError):
        return HttpFailure(url, "timeout", text)
    if isinstance(reason, ProtocolError):
        cause = reason.args[1] if len(reason.args) > 1 else None
        if isinstance(cause, (socket.timeout, TimeoutError)):
            return HttpFailure(url, "timeout", text)
        return HttpFailure(url, "truncated" if "IncompleteRead" in text else "protocol", text)
    if isinstance(reason, ProxyError):
        return HttpFailure(url, "proxy", text)
    return HttpFailure(url, "error", f"{type(reason).__name__}: {text}")
