"""The Redis engine of a shared store: objects are string keys of one Redis database, read through ``redis``.

redis-py is the client Redis's team keeps, pure Python, TLS through ``ssl`` (the system's
CAs); imported at an engine's first call. Only its connection and packer are used, through
:mod:`.resp`, which bounds every reply. An object ``name`` is the key ``cpcas:<name>``, a
lease ``cpcas:lease:<name>``; one database holds one store (``/1``). Each call is one round
trip on one pooled connection; docs/redis.md lists each method's commands and says why.

Every call has one deadline (:data:`DEFAULT_TIMEOUT_S` or ``CUDA_PROGRAM_CAS_REDIS_TIMEOUT``)
covering connect, TLS, AUTH and the whole answer, plus its bytes' time on a slow link, and
receives at most what it asked for. A value over ``max_value`` (at most Redis's 512 MiB) is
refused before a byte is sent. Failures are :class:`StoreFailure` only: an outage when no
call can succeed for now (down, slow, not Redis, TLS or password refused), not when only
this request was (too large, out of memory, a read-only replica, an ACL). The password is
never in ``shown``, a message or a repr. A forked child opens its own connections.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import secrets
import threading
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from cuda_program_cas._base.config import VAR_REDIS_PASSWORD, VAR_REDIS_TIMEOUT, env_max_entry_size, parse_duration
from cuda_program_cas._base.engine import LEASE_MARK, Abilities, StoreFailure, limits_of
from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._base.frame import room, stored_limit, verified
from cuda_program_cas._base.urls import shown

from .client import ENV_CA_BUNDLE, SLOW_LINK_S_PER_BYTE

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENV_REDIS_PASSWORD",
    "ENV_REDIS_TIMEOUT",
    "KEY_PREFIX",
    "RedisEngine",
]

ENV_REDIS_PASSWORD = VAR_REDIS_PASSWORD.name
ENV_REDIS_TIMEOUT = VAR_REDIS_TIMEOUT.name
#: Redis answers in a millisecond; five seconds cover a SYN retransmit (1 s, then 3 s) and a server paused by a fork.
DEFAULT_TIMEOUT_S = 5.0
#: Redis refuses a string longer than 512 MiB (``proto-max-bulk-len``'s default).
MAX_VALUE_BYTES = 512 << 20
KEY_PREFIX = "cpcas:"
LEASE_PREFIX = "lease:"

#: The largest value a call that asks for none may receive (a script's answer, an error line).
_SMALL_REPLY = 1 << 20
#: What each command's reply may take besides its value: a header, +QUEUED, +OK, an integer.
_PER_REPLY = 64
_MAX_IDLE = 16

# KEYS[1] the lease, ARGV[1] the token, ARGV[2] a TTL in ms, ARGV[3] the mark a holder that gave up leaves.
_IF_HELD = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call({}) end return 0"
_RENEW = _IF_HELD.format("'PEXPIRE', KEYS[1], ARGV[2]")
_RELEASE = _IF_HELD.format("'DEL', KEYS[1]")
_MARK = _IF_HELD.format("'SET', KEYS[1], ARGV[3], 'PX', ARGV[2]")
# KEYS[1] the object, ARGV[1] the SHA-1 of the copy in hand ("" for none), ARGV[2] the limit. nil: no such key.
_CHANGED = (
    "local v = redis.call('GETRANGE', KEYS[1], 0, ARGV[2]) "
    "if v == '' and redis.call('EXISTS', KEYS[1]) == 0 then return false end "
    "if ARGV[1] ~= '' and redis.sha1hex(v) == ARGV[1] then return 1 end return v"
)


class _Address:
    """A Redis URL's parts; ``shown`` is the URL without its password."""

    def __init__(self, url: str) -> None:
        if not (isinstance(url, str) and url[:9].lower().startswith(("redis://", "rediss://"))):
            raise ValueError(f"not a Redis URL (redis:// or rediss://): {shown(str(url))[:200]!r}")
        parts = urlsplit(url)
        userinfo, _, hostport = parts.netloc.rpartition("@")
        user, colon, password = userinfo.partition(":")
        self.tls = parts.scheme.lower() == "rediss"
        self.user = unquote(user) or None
        self.password = unquote(password) if colon and password else None
        where = f"{parts.scheme}://{f'{user}@' if user else ''}{hostport}{parts.path}"
        path = parts.path.strip("/")
        if not parts.hostname:
            raise ValueError(f"a Redis URL needs a host: {where!r}")
        try:
            self.port = parts.port or 6379
        except ValueError:
            raise ValueError(f"a Redis URL's port is a number from 1 to 65535: {where!r}") from None
        if path and not (path.isascii() and path.isdigit()):
            raise ValueError(f"a Redis URL's path is a database number (/0, /1...): {where!r}")
        if parts.query or parts.fragment:
            raise ValueError(f"a Redis URL takes no query or fragment: {where!r}")
        self.host, self.db = parts.hostname, int(path or 0)
        host = f"[{self.host}]" if hostport.startswith("[") else self.host
        self.shown = f"{parts.scheme.lower()}://{f'{user}@' if user else ''}{host}:{self.port}/{self.db}"


def _positive_duration(text: str) -> float:
    seconds = parse_duration(text)
    if not seconds > 0:
        raise ValueError("the timeout must be more than 0 seconds")
    return seconds


class RedisEngine:
    """One Redis database as a store's engine; a bad URL or argument is a ``ValueError``, nothing connects yet.

    ``url``: ``redis://[[user]:password@]host[:port][/db]``, or ``rediss://`` (TLS, verified against the
    system's CAs and ``CUDA_PROGRAM_CAS_CA_BUNDLE``); without a password, ``CUDA_PROGRAM_CAS_REDIS_PASSWORD``'s.
    ``max_value``: the largest value ``put`` sends (default: a framed blob of the entry ceiling).
    """

    #: Not proven: Redis evicts on its own (under allkeys-random or -lfu a key just set may be the next to go).
    can = Abilities(
        conditional_get=True,
        conditional_create=True,
        leases=True,
        atomic_batch=True,
        remote=True,
        evicts=True,
        layout_optional=True,
    )
    lost_hint = (
        "was it evicted at once? (use maxmemory-policy allkeys-lru and room for what is published: docs/redis.md)"
    )

    def __init__(
        self, url: str, *, timeout: float | None = None, max_value: int | None = None, prefix: str = KEY_PREFIX
    ) -> None:
        address = _Address(url)
        if address.password is None:
            address.password = VAR_REDIS_PASSWORD.value() or None
        if timeout is None:
            timeout = VAR_REDIS_TIMEOUT.value() or DEFAULT_TIMEOUT_S
        elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        if max_value is None:
            max_value = room(env_max_entry_size())
        elif isinstance(max_value, bool) or not isinstance(max_value, int) or max_value < 0:
            raise ValueError(f"max_value must be a non-negative int, not {max_value!r}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
        self._address = address
        #: The store's address as it may be logged: the URL without its password.
        self.shown = address.shown
        self.timeout = float(timeout)
        self.max_value = min(max_value, MAX_VALUE_BYTES)
        self.prefix = prefix
        self._lock = threading.Lock()
        self._idle: list[Any] = []
        self._scripts = True  # False once the server refused a script: conditional reads are plain ones
        after_fork(self)

    def __repr__(self) -> str:
        return f"RedisEngine({self.shown!r})"

    def _after_fork_in_child(self) -> None:
        # The parent's sockets are not ours: forget them (each closes its fd copy when collected,
        # without a shutdown, since redis-py compares the pid) and connect anew.
        self._lock = threading.Lock()
        self._idle = []

    # -- the interface ----------------------------------------------------------------------

    def get(self, name: str, *, limit: int, digest: str | None = None) -> bytes | None:
        data = self.get_many([name], limit=stored_limit(limit, digest))[0]
        return data if data is None or digest is None else bytes(verified(self._where(name), data, digest, limit))

    def get_many(self, names: Sequence[str], *, limit: int | Sequence[int]) -> list[bytes | None]:
        limits = limits_of(names, limit)
        for n in limits:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"limit must be a non-negative int, not {n!r}")
        keys = [self._key(n) for n in names]
        if not keys:
            return []
        commands: list[tuple[Any, ...]] = []
        for key, n in zip(keys, limits, strict=True):
            commands += [("GETRANGE", key, 0, n), ("EXISTS", key)]
        replies = self._call(commands, bulk=max(limits) + 1, values=sum(limits) + len(keys))
        out: list[bytes | None] = []
        for i, (name, n) in enumerate(zip(names, limits, strict=True)):
            value, exists = replies[2 * i], replies[2 * i + 1]
            self._check(value, name)
            self._check(exists, name)
            if not isinstance(value, bytes):
                raise StoreFailure(self._where(name), "protocol", "GETRANGE did not answer a string")
            if len(value) > n:
                raise StoreFailure(self._where(name), "too large", f"more than {n} bytes", outage=False)
            out.append(value if value or exists else None)
        return out

    def get_changed(self, name: str, *, limit: int, tag: str | None) -> tuple[bytes | None, str | None] | None:
        """None when ``name`` still hashes to ``tag`` (SHA-1); else its bytes (None: no such key) and their SHA-1."""
        if self._scripts:
            script = ("EVAL", _CHANGED, 1, self._key(name), tag or "", limit)
            (reply,) = self._call([script], bulk=limit + 1, values=limit + 1)
            if isinstance(reply, Exception):
                failure = self._failure(reply, name)
                if failure.outage:
                    raise failure
                self._scripts = False  # refused (NOPERM, scripts off): plain reads from now on
            elif reply == 1 and tag:
                return None
            elif reply is None or isinstance(reply, bytes):
                if reply is not None and len(reply) > limit:
                    raise StoreFailure(self._where(name), "too large", f"more than {limit} bytes", outage=False)
                return reply, None if reply is None else _sha1(reply)
            else:
                raise StoreFailure(self._where(name), "protocol", "the script did not answer a string or 1")
        data = self.get(name, limit=limit)
        return data, None if data is None else _sha1(data)

    def put(self, name: str, data: bytes | IO[bytes]) -> str:
        self.put_many([(name, self._body(name, data))])
        return "OK to SET"

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        commands: list[tuple[Any, ...]] = []
        sent = 0
        for name, data in items:
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"put_many takes bytes, not {type(data).__name__} (for {name!r})")
            self._fits(name, len(data))
            commands.append(("SET", self._key(name), data))
            sent += len(data)
        if not commands:
            return
        if len(commands) == 1:  # atomic by itself
            self._checked(commands, items[0][0], sent=sent)
            return
        # More go in one MULTI/EXEC, all or none. A command refused while queued (OOM, NOPERM) makes EXEC
        # answer EXECABORT: the first cause is raised.
        replies = self._checked([("MULTI",), *commands, ("EXEC",)], None, sent=sent)[-1]
        if not isinstance(replies, list) or len(replies) != len(commands):
            raise StoreFailure(self.shown, "protocol", "EXEC did not answer one reply per command")
        for reply, (name, _) in zip(replies, items, strict=True):
            self._check(reply, name)

    def create(self, name: str, data: bytes) -> bool:
        self._fits(name, len(data))
        (reply,) = self._checked([("SET", self._key(name), data, "NX")], name, sent=len(data))
        return reply is not None

    def remove(self, name: str) -> None:
        self._checked([("UNLINK", self._key(name))], name)

    def size(self, name: str) -> int | None:
        key = self._key(name)
        length, exists = self._checked([("STRLEN", key), ("EXISTS", key)], name)
        return int(length) if length or exists else None

    def lease(self, name: str, ttl_s: float, *, take: bool = True) -> str | None:
        key, token = self._lease_key(name), secrets.token_hex(16)
        ms = _ms(ttl_s)
        # The holder's value read in the same round trip: a mark left by a holder that gave up says compile now.
        replies = self._checked([("SET", key, token, "NX", "PX", ms), ("GET", key)] if take else [("GET", key)], name)
        if take and replies[0] is not None:
            return token
        held = replies[-1]
        if held == LEASE_MARK.encode():
            return LEASE_MARK
        return "" if held is None and not take else None

    def renew(self, name: str, token: str, ttl_s: float) -> bool:
        return bool(self._script(_RENEW, name, token, _ms(ttl_s)) == 1)

    def release(self, name: str, token: str, *, mark_s: float = 0.0) -> None:
        if mark_s > 0:
            self._script(_MARK, name, token, _ms(mark_s), LEASE_MARK)
        else:
            self._script(_RELEASE, name, token)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()

    # -- keys and values --------------------------------------------------------------------

    def _key(self, name: str) -> bytes:
        if not isinstance(name, str) or not name:
            raise ValueError(f"an object name is a non-empty str, not {name!r}")
        try:
            return (self.prefix + name).encode()
        except UnicodeEncodeError:
            raise ValueError(f"an object name must be encodable as UTF-8: {name!r}") from None

    def _lease_key(self, name: str) -> bytes:
        return self._key(LEASE_PREFIX + name)

    def _where(self, name: str) -> str:
        return f"{self.shown} key {self.prefix}{name}"

    def _fits(self, name: str, size: int) -> None:
        if size > self.max_value:
            raise StoreFailure(
                self._where(name), "too large", f"{size} bytes, at most {self.max_value} are stored", outage=False
            )

    def _body(self, name: str, data: bytes | IO[bytes]) -> bytes:
        """``data``'s bytes: a file is read from its start, at most ``max_value + 1`` bytes of it."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            return bytes(data) if not isinstance(data, bytes) else data
        try:
            if hasattr(data, "fileno"):
                self._fits(name, os.fstat(data.fileno()).st_size)
            data.seek(0)
            body = data.read(self.max_value + 1)
        except OSError as exc:
            raise StoreFailure(self._where(name), "read", f"the file to store: {exc}", outage=False) from None
        self._fits(name, len(body))
        return body

    # -- round trips ------------------------------------------------------------------------

    def _script(self, source: str, name: str, *args: object) -> Any:
        """The lease script ``source`` on ``name``'s lease: EVALSHA, then EVAL where the server lacks it."""
        from_sha = ("EVALSHA", _sha1(source.encode()), 1, self._lease_key(name), *args)
        (reply,) = self._call([from_sha])
        if isinstance(reply, _wire().exceptions.NoScriptError):
            (reply,) = self._call([("EVAL", source, 1, self._lease_key(name), *args)])
        self._check(reply, name)
        return reply

    def _checked(self, commands: list[tuple[Any, ...]], name: str | None, **bounds: int) -> list[Any]:
        """:meth:`_call`, an error reply to any command raised as the failure on ``name``."""
        replies = self._call(commands, **bounds)
        for reply in replies:
            self._check(reply, name)
        return replies

    def _call(
        self, commands: list[tuple[Any, ...]], *, bulk: int = _SMALL_REPLY, values: int = 0, sent: int = 0
    ) -> list[Any]:
        """Send ``commands`` at once and read one reply each (an error reply as its exception, in place).

        ``bulk`` bounds each value; ``values`` (plus a little per reply) all bytes received. The
        deadline is the timeout plus the slow-link time of ``sent`` bytes and of each value met.
        """
        wire = _wire()
        try:
            conn = self._take(wire)
            seconds = self.timeout + sent * SLOW_LINK_S_PER_BYTE
            budget = values + len(commands) * _PER_REPLY + _SMALL_REPLY
            conn.bound(limit=bulk, budget=budget, items=len(commands), seconds=seconds, rate=1 / SLOW_LINK_S_PER_BYTE)
        except Exception as exc:
            raise self._failure(exc) from None
        try:
            conn.send_packed_command(conn.pack_commands(commands), check_health=False)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(conn.read_response(disable_decoding=True))
                except wire.exceptions.ResponseError as exc:  # an error reply: the connection is still in step
                    replies.append(exc)
        except BaseException as exc:  # redis-py's errors, the socket's, the parser's, MemoryError: a StoreFailure
            conn.disconnect()
            if isinstance(exc, Exception):
                raise self._failure(exc) from None
            raise
        with self._lock:
            if len(self._idle) < _MAX_IDLE:
                self._idle.append(conn)
                return replies
        conn.disconnect()
        return replies

    def _take(self, wire: Any) -> Any:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            return wire.connect(self._address, self.timeout)
        if conn.stale():
            conn.disconnect()  # the server closed it (a restart, its idle timeout): connect again
        return conn

    # -- failures ---------------------------------------------------------------------------

    def _check(self, reply: Any, name: str | None) -> None:
        if isinstance(reply, Exception):
            raise self._failure(reply, name)

    def _failure(self, exc: BaseException, name: str | None = None) -> StoreFailure:
        """``exc`` as one :class:`StoreFailure` named by what happened; the password cut out of every text."""
        where = self.shown if name is None else self._where(name)
        text = self._scrub(str(exc) or type(exc).__name__)
        kind, outage, hint = _classify(exc, text.lower())
        return StoreFailure(where, kind, text + hint, outage=outage)

    def _scrub(self, text: str) -> str:
        password = self._address.password
        if password:
            from urllib.parse import quote

            for form in sorted({password, quote(password, safe="")}, key=len, reverse=True):
                text = text.replace(form, "***")  # the longer first: the quoted form may hold the plain one
        return text


def _classify(exc: BaseException, lowered: str) -> tuple[str, bool, str]:
    """``(kind, outage, hint)`` of a failure whose text is ``lowered``."""
    x = _wire().exceptions
    if isinstance(exc, _wire().TooLarge):
        return "too large", False, ""
    if isinstance(exc, x.AuthenticationError):
        return "denied", True, f" (is the password right? the URL's, or ${ENV_REDIS_PASSWORD})"
    if isinstance(exc, x.NoPermissionError):
        return "denied", False, " (the server's ACL refuses this command to this user)"
    if isinstance(exc, x.OutOfMemoryError):
        return "out of memory", False, " (maxmemory reached: a cache wants maxmemory-policy allkeys-lru)"
    if isinstance(exc, x.ReadOnlyError):
        return "read only", False, " (a replica: name the primary)"
    if isinstance(exc, x.BusyLoadingError):
        return "loading", True, ""
    if isinstance(exc, (x.TimeoutError, TimeoutError)):
        return "timeout", True, ""
    if isinstance(exc, x.ConnectionError):
        if "refused" in lowered:
            return "refused", True, ""
        if "mismatch" in lowered:
            return "tls", True, " (the server's certificate does not name this host: use a name it has)"
        if "certificate" in lowered:
            return "tls", True, f" (is the server's CA among the system's, or in ${ENV_CA_BUNDLE}?)"
        if "ssl" in lowered:
            return "tls", True, ""
        return "connection", True, ""
    if isinstance(exc, (x.InvalidResponse, ValueError)):
        return "protocol", True, " (is it a Redis server?)"
    if isinstance(exc, x.ResponseError):
        return "error", False, ""
    if isinstance(exc, MemoryError):
        return "memory", False, ""
    if isinstance(exc, OSError):
        return "connection", True, ""
    return "error", True, f" ({type(exc).__name__})"


def _ms(ttl_s: float) -> int:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s < 1e9:
        raise ValueError(f"a lease's ttl_s is a positive number of seconds, not {ttl_s!r}")
    return max(1, round(ttl_s * 1000))


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data, usedforsecurity=False).hexdigest()


def _wire() -> Any:
    """:mod:`.resp`, which imports redis (at any engine's first call)."""
    return importlib.import_module(".resp", __package__)


if TYPE_CHECKING:  # mypy checks that the class keeps the interfaces its record declares
    from cuda_program_cas._base.engine import ConditionalGet, Creates, Engine, Leases

    def _is_engine(engine: RedisEngine) -> tuple[Engine, ConditionalGet, Creates, Leases]:
        return engine, engine, engine, engine
