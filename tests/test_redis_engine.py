"""The Redis engine against a real redis-server: every Engine method, its bounds, its failures, its leases.

Servers are started by the tests on loopback (tools/testkit/redis_server.py) and stopped after: one plain
server for the module, and servers of their own where a test needs a password, TLS, a memory
limit or to kill one. Faults between the engine and the server come from tools/testkit/proxy.py (delay,
trickle, reset, stall); answers no Redis gives come from a small server of the tests' own
(``_Liar``). Each test gets engines under a prefix of its own, so tests share the server
without seeing each other's keys. Round trips are counted by the server's own figures (INFO
commandstats: which commands, how many) and by the proxy (the client's turns to speak).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.proxy import Proxy
from testkit.redis_server import RedisServer, redis_or_skip

from cuda_program_cas._base import frame
from cuda_program_cas._base.engine import LEASE_MARK, StoreFailure
from cuda_program_cas._remote.redis import ENV_REDIS_PASSWORD, KEY_PREFIX, RedisEngine

PASSWORD = "Pw-7f3a9c.sekr1t"  # noqa: S105 - a test's password, grepped for in every output
MB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = redis_or_skip(tmp_path_factory.mktemp("redis"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = redis_or_skip(tmp_path_factory.mktemp("redis-auth"), password=PASSWORD)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = redis_or_skip(tmp_path_factory.mktemp("redis-tls"), tls=True, password=PASSWORD)
    yield s
    s.stop()


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    return f"t-{request.node.name[:60]}:"


@pytest.fixture
def engines(prefix: str) -> Iterator[list[RedisEngine]]:
    """Engines a test makes (``engines.append``), closed after it."""
    made: list[RedisEngine] = []
    yield made
    for e in made:
        e.close()


@pytest.fixture
def make(engines: list[RedisEngine], prefix: str) -> Any:
    def _make(url: str, **kw: Any) -> RedisEngine:
        kw.setdefault("timeout", 2.0)
        kw.setdefault("prefix", prefix)
        e = RedisEngine(url, **kw)
        engines.append(e)
        return e

    return _make


def failure_of(call: Any, *args: Any, **kw: Any) -> tuple[StoreFailure, float]:
    """The StoreFailure ``call`` raises, and how long it took."""
    t0 = time.monotonic()
    with pytest.raises(StoreFailure) as info:
        call(*args, **kw)
    return info.value, time.monotonic() - t0


# -- every method ------------------------------------------------------------------------------


def test_every_method_over_a_real_server(server: RedisServer, make: Any, prefix: str, tmp_path: Path) -> None:
    e = make(server.url)
    assert e.can.leases is True
    assert e.get("index/ab/cd", limit=100) is None
    assert e.size("index/ab/cd") is None
    e.put("index/ab/cd", b"manifest\r\n$-1\r\n")  # RESP's own bytes in a value are just bytes
    assert e.get("index/ab/cd", limit=100) == b"manifest\r\n$-1\r\n"
    assert e.size("index/ab/cd") == 15
    e.put("empty", b"")
    assert e.get("empty", limit=0) == b""  # empty is not missing
    assert e.size("empty") == 0
    body = tmp_path / "blob"
    body.write_bytes(os.urandom(300_000))
    with open(body, "rb") as f:
        f.read(10)  # read from its start, wherever it stands
        e.put("blobs/ef/01", f)
    assert e.get("blobs/ef/01", limit=300_000) == body.read_bytes()
    e.put_many([("blobs/1", b"one"), ("index/1", b"names one")])
    assert e.get_many(["index/1", "nothing", "blobs/1", "empty"], limit=100) == [b"names one", None, b"one", b""]
    assert e.get_many([], limit=10) == []
    e.put("index/1", b"replaced")
    assert e.get("index/1", limit=100) == b"replaced"
    e.remove("index/1")
    e.remove("index/1")  # nothing there: nothing happens
    assert e.get("index/1", limit=100) is None
    # The server holds plain string keys under the prefix.
    assert server.client().get(f"{prefix}blobs/1") == b"one"
    e.close()
    assert e.get("blobs/1", limit=10) == b"one"  # the next call connects again


def test_the_default_prefix_is_documented() -> None:
    assert KEY_PREFIX == "cpcas:"
    assert "cpcas:" in (Path(__file__).parent.parent / "docs" / "redis.md").read_text()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=300), st.integers(0, 200_000).map(lambda n: random.Random(n).randbytes(n))))
def test_any_value_round_trips_at_its_exact_limit(server: RedisServer, data: bytes) -> None:
    e = RedisEngine(server.url, timeout=5, prefix="prop:")
    try:
        e.put("v", data)
        assert e.get("v", limit=len(data)) == data
        assert e.size("v") == len(data)
        if data:
            f, _ = failure_of(e.get, "v", limit=len(data) - 1)
            assert (f.kind, f.outage) == ("too large", False)
        assert e.get("v", limit=len(data) + 1) == data  # the failure left the engine usable
    finally:
        e.close()


def test_threads_share_one_engine(server: RedisServer, make: Any) -> None:
    e = make(server.url)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(50):
                e.put(f"t{n}/{i}", f"{n}:{i}".encode())
                assert e.get(f"t{n}/{i}", limit=100) == f"{n}:{i}".encode()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert e.get_many([f"t{n}/49" for n in range(8)], limit=10) == [f"{n}:49".encode() for n in range(8)]


def test_bad_arguments_are_value_errors_naming_them(server: RedisServer, make: Any) -> None:
    e = make(server.url)
    with pytest.raises(ValueError, match="limit"):
        e.get("a", limit=-1)
    with pytest.raises(ValueError, match="name"):
        e.get("", limit=1)
    with pytest.raises(ValueError, match="ttl_s"):
        e.lease("a", 0)
    with pytest.raises(ValueError, match="ttl_s"):
        e.lease("a", float("nan"))
    with pytest.raises(TypeError, match="bytes"):
        e.put_many([("a", "text")])
    for url in ("http://h/", "redis://", "redis://h:99999", "redis://h/x", "redis://h/0?db=1", "redis://h/0#f"):
        with pytest.raises(ValueError) as info:
            RedisEngine(url)
        assert url.split("//")[0] in str(info.value)
    with pytest.raises(ValueError) as info:
        RedisEngine(f"redis://u:{PASSWORD}@h:bad/0")
    assert PASSWORD not in str(info.value) and "u@h:bad" in str(info.value)
    with pytest.raises(ValueError, match="timeout"):
        RedisEngine(server.url, timeout=0)


@settings(max_examples=200, deadline=None)
@given(
    user=st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=8),
    password=st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=16),
    host=st.sampled_from(["h", "redis.example", "10.1.2.3", "[::1]"]),
    port=st.one_of(st.none(), st.integers(1, 65535)),
    db=st.one_of(st.none(), st.integers(0, 15)),
    tls=st.booleans(),
)
def test_a_url_is_parsed_and_shown_without_its_password(  # noqa: PLR0917 - hypothesis's arguments
    user: str, password: str, host: str, port: int | None, db: int | None, tls: bool
) -> None:
    from urllib.parse import quote

    url = f"{'rediss' if tls else 'redis'}://{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    url += f":{port}" if port else ""
    url += f"/{db}" if db is not None else ""
    e = RedisEngine(url)
    a = e._address
    assert (a.user or "", a.password, a.port, a.db, a.tls) == (user, password, port or 6379, db or 0, tls)
    assert a.host == host.strip("[]")
    shown_user = quote(user, safe="") + "@" if user else ""
    assert e.shown == f"{'rediss' if tls else 'redis'}://{shown_user}{host}:{port or 6379}/{db or 0}"
    assert repr(e) == f"RedisEngine({e.shown!r})"
    if "*" not in password and "\n" not in password:  # the mask's own character, and the separator
        assert e._scrub(f"{password}\n{quote(password, safe='')}") == "***\n***"


# -- round trips -------------------------------------------------------------------------------


def _ours(stats: dict[str, int]) -> dict[str, int]:
    """The commands of the engine in a commandstats (the test's own INFO and CONFIG left out)."""
    return {k: v for k, v in stats.items() if k not in ("info", "config|resetstat")}


def test_get_many_of_200_names_is_one_round_trip(server: RedisServer, make: Any) -> None:
    """The server counts one transaction and no GET; the proxy, 60 ms of latency a round trip, one turn."""
    with Proxy(("127.0.0.1", server.port), delay_up_ms=30, delay_down_ms=30) as proxy:
        e = make(f"redis://127.0.0.1:{proxy.port}/0")
        names = [f"index/{i:03d}" for i in range(200)]
        e.put_many([(n, n.encode() * 3) for n in names[::2]])  # half present, half missing
        server.reset_stats()
        turns = proxy.exchanges
        t0 = time.monotonic()
        got = e.get_many(names, limit=1000)
        elapsed = time.monotonic() - t0
        assert proxy.exchanges - turns == 1
    assert got == [n.encode() * 3 if i % 2 == 0 else None for i, n in enumerate(names)]
    assert _ours(server.commandstats()) == {"exists": 200, "getrange": 200}
    assert elapsed < 1.0, elapsed  # one round trip is 0.06 s; one per name would be 12 s


def test_put_many_is_one_round_trip_and_a_reader_never_sees_a_later_item_first(server: RedisServer, make: Any) -> None:
    writer, reader = make(server.url), make(server.url)
    seen_out_of_order: list[int] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            for i in range(0, 300, 7):
                if reader.get(f"index/{i}", limit=100) is not None and reader.get(f"blobs/{i}", limit=100) is None:
                    seen_out_of_order.append(i)

    t = threading.Thread(target=read)
    t.start()
    server.reset_stats()
    for i in range(300):
        writer.put_many([(f"blobs/{i}", b"blob"), (f"index/{i}", b"manifest")])
    stop.set()
    t.join(30)
    assert seen_out_of_order == []
    assert server.commandstats()["exec"] >= 300
    with Proxy(("127.0.0.1", server.port)) as proxy:
        e = make(f"redis://127.0.0.1:{proxy.port}/0")
        e.put_many([(f"x/{i}", b"v") for i in range(100)])
        assert proxy.exchanges == 1


def test_a_batch_of_100_000_small_items_is_not_too_large(server: RedisServer, make: Any) -> None:
    """The replies' bound grows with the commands: 100,000 QUEUEDs and OKs are 1.4 MB of answers, no value."""
    e = make(server.url, timeout=30)
    items = [(f"index/{i}", b"v") for i in range(100_000)]
    e.put_many(items)
    assert e.get_many([n for n, _ in items], limit=1) == [b"v"] * len(items)
    assert server.client().get(f"{e.prefix}index/99999") == b"v"


# -- bounds -----------------------------------------------------------------------------------

_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    from cuda_program_cas._base.engine import StoreFailure
    from cuda_program_cas._remote.redis import RedisEngine

    def peak_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    out = {}
    for label, url, how in json.loads(sys.argv[1]):
        e = RedisEngine(url, timeout=5, prefix="big:")
        e.get("warm-up", limit=10)  # imports redis, connects: not what is measured
        before = peak_mb()
        try:
            if how == "get":
                e.get("value", limit=1 << 20)
            else:  # the parser alone: a plain GET, whose reply only the parser bounds
                e._call([("GET", b"big:value")], bulk=1 << 20)
            out[label] = ["no failure"]
        except StoreFailure as f:
            out[label] = [f.kind, peak_mb() - before]
        e.close()
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_a_value_over_the_limit_is_refused_before_it_is_read(server: RedisServer, tmp_path: Path) -> None:
    """A 200 MB value read with a 1 MB limit: refused, and the reader's peak memory grows by a few MB at most.

    Twice: through ``get`` (GETRANGE: the server sends at most 1 MB + 1), and through a plain GET,
    whose 200 MB reply the parser refuses from its length, before reading it.
    """
    import json

    server.client().setrange("big:value", 200 * MB - 1, b"x")  # 200 MB, made by the server itself
    try:
        sent = server.stats()["total_net_output_bytes"]
        done = run_python(_PEAK_SCRIPT, json.dumps([["get", server.url, "get"], ["parser", server.url, "parser"]]))
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        for label in ("get", "parser"):
            kind, grown = result[label]
            assert kind == "too large", result
            assert grown < 16, f"{label}: peak RSS grew by {grown:.1f} MB"
        # The server sent the GETRANGE's 1 MB and what the socket buffers took of the GET: far from 400 MB.
        assert server.stats()["total_net_output_bytes"] - sent < 40 * MB
    finally:
        server.client().delete("big:value")


class _Liar:
    """A server on loopback that answers whatever it is sent with ``answer``, then holds the connection open.

    ``then`` is sent again and again after it (until the client goes), for endless answers.
    """

    def __init__(self, answer: bytes, then: bytes = b"") -> None:
        self.answer, self.then = answer, then
        self.sent = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.recv(1 << 16)
            conn.sendall(self.answer)
            self.sent += len(self.answer)
            while self.then:
                conn.sendall(self.then)
                self.sent += len(self.then)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.close()
        for c in self._conns:
            c.close()


@pytest.mark.parametrize(
    ("answer", "then", "kind"),
    [
        # GETRANGE's answer: a value of 200 MB that never comes.
        (b"$209715200\r\n", b"", "too large"),
        (b"$1002\r\n", b"", "too large"),  # over limit + 1 by one
        (b"+" + b"a" * 1000, b"a" * 65536, "protocol"),  # a line that never ends
        (b"*1\r\n" * 100_000, b"", "protocol"),  # nested without end
        (b"$-5\r\n", b"", "protocol"),
        (b"$x\r\n", b"", "protocol"),
        (b"*999999999\r\n", b":1\r\n" * 16384, "protocol"),  # an endless array
        (b"*3\r\n:1\r\n:1\r\n:1\r\n", b"", "protocol"),  # an array where a value was asked for
        (b"$1001\r\n", b"y" * 65536, "protocol"),  # a bulk not ended by CRLF
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", b"", "protocol"),
        (b"$3\r\nabc\r\n", b"", "timeout"),  # then no EXISTS: the deadline
    ],
    ids=[
        "huge-bulk",
        "bulk-over-by-one",
        "endless-line",
        "deep",
        "negative",
        "garbled",
        "endless-array",
        "array",
        "no-crlf",
        "http",
        "stall",
    ],  # fmt: skip
)
def test_an_answer_no_redis_gives_is_a_failure_within_the_deadline(
    make: Any, answer: bytes, then: bytes, kind: str
) -> None:
    liar = _Liar(answer, then)
    try:
        e = make(f"redis://127.0.0.1:{liar.port}/0", timeout=1.0)
        f, elapsed = failure_of(e.get, "k", limit=1000)
    finally:
        liar.close()
    assert f.kind == kind, f
    assert f.outage is (kind != "too large"), f
    assert elapsed < (1.5 if kind == "timeout" else 0.5), elapsed  # refused as soon as seen, not after reading
    assert liar.sent < 8 * MB + len(answer)  # the client stopped taking bytes (what socket buffers hold)


def test_a_value_over_max_value_is_refused_on_put_before_it_is_sent(
    server: RedisServer, make: Any, tmp_path: Path
) -> None:
    e = make(server.url, max_value=1000)
    server.reset_stats()
    f, _ = failure_of(e.put, "big", b"x" * 1001)
    assert (f.kind, f.outage) == ("too large", False) and "1001 bytes, at most 1000" in str(f)
    body = tmp_path / "body"
    body.write_bytes(b"y" * 5000)
    with open(body, "rb") as file:
        f, _ = failure_of(e.put, "big", file)
    assert f.kind == "too large"
    f, _ = failure_of(e.put_many, [("small", b"s"), ("big", b"x" * 1001)])
    assert f.kind == "too large"
    assert _ours(server.commandstats()) == {}  # nothing sent
    e.put("ok", b"x" * 1000)
    assert e.get("ok", limit=1000) == b"x" * 1000
    assert e.get("small", limit=10) is None  # the refused batch wrote none of its items
    assert RedisEngine(server.url, max_value=1 << 40).max_value == 512 * MB  # Redis's own ceiling


def test_the_max_entry_size_setting_bounds_put(server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE", "2k")
    assert RedisEngine(server.url).max_value == frame.room(2048)  # a blob of 2 KiB may take that much framed


def test_the_timeout_setting_is_each_calls_deadline(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from cuda_program_cas._remote.redis import DEFAULT_TIMEOUT_S, ENV_REDIS_TIMEOUT

    monkeypatch.setenv(ENV_REDIS_TIMEOUT, "0.4")
    e = RedisEngine(server.url, prefix="timeout:")
    try:
        assert e.timeout == 0.4
        with Proxy(("127.0.0.1", server.port)) as proxy:
            slow = RedisEngine(f"redis://127.0.0.1:{proxy.port}/0", prefix="timeout:")
            assert slow.get("k", limit=1) is None
            proxy.stall = True
            f, elapsed = failure_of(slow.get, "k", limit=1)
            slow.close()
        assert f.kind == "timeout" and 0.35 < elapsed < 0.8, (f, elapsed)
        assert RedisEngine(server.url, timeout=3).timeout == 3.0  # the argument wins
        for bad in ("soon", "0", "-1"):
            monkeypatch.setenv(ENV_REDIS_TIMEOUT, bad)
            with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
                assert RedisEngine(server.url).timeout == DEFAULT_TIMEOUT_S
            assert f"{ENV_REDIS_TIMEOUT}={bad!r}" in caplog.text, caplog.text
    finally:
        e.close()


def test_a_trickling_server_is_cut_off_at_the_deadline(server: RedisServer, make: Any) -> None:
    """20 bytes a second, a byte at a time: each recv gets one within its timeout, the call's deadline ends it."""
    writer = make(server.url)
    writer.put("slow", os.urandom(5000))  # 4 minutes at this rate
    with Proxy(("127.0.0.1", server.port)) as proxy:
        e = make(f"redis://127.0.0.1:{proxy.port}/0", timeout=1.0)
        assert e.get("other", limit=10) is None  # connected
        proxy.rate_down = 20
        f, elapsed = failure_of(e.get, "slow", limit=10_000)
    assert (f.kind, f.outage) == ("timeout", True), f
    assert 0.9 < elapsed < 1.6, elapsed


def test_a_slow_server_is_a_timeout_within_the_deadline(server: RedisServer, make: Any) -> None:
    e = make(server.url, timeout=0.3)
    e.put("k", b"v")
    assert e.get("k", limit=10) == b"v"  # connected
    with socket.create_connection(("127.0.0.1", server.port)) as sleeper:
        sleeper.sendall(b"PING\r\n")
        assert sleeper.recv(100) == b"+PONG\r\n"  # accepted and served: Redis reads it like any client
        # Sent before the engine's request: Redis serves ready sockets in the order they became ready.
        sleeper.sendall(b"DEBUG SLEEP 1\r\n")
        f, elapsed = failure_of(e.get, "k", limit=10)
        sleeper.settimeout(5)
        assert sleeper.recv(100) == b"+OK\r\n"
    assert (f.kind, f.outage) == ("timeout", True)
    assert elapsed < 0.6, elapsed
    assert e.get("k", limit=10) == b"v"  # the server is back: so is the engine, on a new connection
    with Proxy(("127.0.0.1", server.port), delay_down_ms=1000) as proxy:
        slow = make(f"redis://127.0.0.1:{proxy.port}/0", timeout=0.3)
        f, elapsed = failure_of(slow.get, "k", limit=10)
    assert f.kind == "timeout" and elapsed < 0.6, (f, elapsed)


def test_one_deadline_covers_a_slow_connect_and_a_trickling_tls_handshake() -> None:
    """A SYN dropped once (the accept queue full: Linux retransmits it after 1 s), then a TLS record that trickles.

    Each step alone fits its socket timeout; the call's deadline (1.6 s) must bound both together.
    """
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # room for one connection not yet accepted
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port))  # the queue is full: the engine's first SYN is dropped
    started = threading.Event()
    accepted_after: list[float] = []

    def serve() -> None:
        started.wait()
        time.sleep(0.3)  # the engine's SYN has been dropped by now; its retransmit comes at 1 s
        filler_end, _ = listener.accept()
        conn, _ = listener.accept()
        accepted_after.append(time.monotonic() - t0)
        try:
            conn.sendall(b"\x16\x03\x03\x40\x00")  # a TLS handshake record of 16 KiB...
            while True:
                conn.sendall(b"\x00")  # ...that comes 5 bytes a second
                time.sleep(0.2)
        except OSError:
            pass
        finally:
            conn.close()
            filler_end.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    e = RedisEngine(f"rediss://127.0.0.1:{port}/0", timeout=1.6)
    try:
        t0 = time.monotonic()
        started.set()
        f, elapsed = failure_of(e.get, "k", limit=1)
    finally:
        e.close()
        filler.close()
        listener.close()
    assert accepted_after and accepted_after[0] > 0.9, accepted_after  # the connect was slow, as meant
    assert (f.kind, f.outage) == ("timeout", True), f
    assert elapsed < 1.6 + 0.5, elapsed  # 2.8 s when the handshake got a whole timeout of its own


def test_a_stalled_connection_is_a_timeout_then_the_engine_recovers(server: RedisServer, make: Any) -> None:
    with Proxy(("127.0.0.1", server.port)) as proxy:
        e = make(f"redis://127.0.0.1:{proxy.port}/0", timeout=1.0)
        e.put("k", b"v" * 100_000)
        proxy.stall = True
        for call in (lambda: e.get("k", limit=MB), lambda: e.put("k2", b"w" * 100_000), lambda: e.lease("l", 5)):
            f, elapsed = failure_of(call)
            assert f.kind == "timeout" and 0.9 < elapsed < 1.6, (f, elapsed)
        proxy.stall = False
        assert e.get("k", limit=MB) == b"v" * 100_000


# -- failures ---------------------------------------------------------------------------------


def test_nothing_listening_is_a_refused_outage(make: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        e = make(f"redis://127.0.0.1:{port}/0")
        for call in (lambda: e.get("k", limit=1), lambda: e.put("k", b"v"), lambda: e.lease("k", 1)):
            f, elapsed = failure_of(call)
            assert (f.kind, f.outage) == ("refused", True) and elapsed < 0.5
            assert f.where == f"redis://127.0.0.1:{port}/0"


def test_a_killed_server_is_an_outage_and_its_return_is_noticed(tmp_path: Path, make: Any) -> None:
    s = redis_or_skip(tmp_path / "r")
    try:
        e = make(s.url)
        e.put("k", b"v")
        s.kill()
        f, elapsed = failure_of(e.get, "k", limit=10)
        assert f.outage and f.kind in ("refused", "connection"), f
        assert elapsed < 0.5
        s.start(port=s.port)  # back, empty (no persistence)
        assert e.get("k", limit=10) is None
        e.put("k", b"again")
        assert e.get("k", limit=10) == b"again"
    finally:
        s.stop()


def test_a_connection_reset_mid_value_is_an_outage_and_the_next_call_reconnects(server: RedisServer, make: Any) -> None:
    value = os.urandom(MB)
    make(server.url).put("big", value)
    with Proxy(("127.0.0.1", server.port)) as proxy:
        e = make(f"redis://127.0.0.1:{proxy.port}/0")
        proxy.reset_after = 200_000
        f, elapsed = failure_of(e.get, "big", limit=MB)
        assert (f.kind, f.outage) == ("connection", True), f
        assert elapsed < 1.0
        assert proxy.bytes_down == 200_000
        proxy.reset_after = None
        assert e.get("big", limit=MB) == value
        assert proxy.connections == 2


def test_out_of_memory_refuses_writes_whole_and_reads_go_on(tmp_path: Path, make: Any) -> None:
    s = redis_or_skip(tmp_path / "r", maxmemory="6mb", policy="noeviction")
    try:
        e = make(s.url)
        token = e.lease("held", 30)
        assert token is not None
        for i in range(10):  # Redis checks memory before a command, so one value goes past the limit
            try:
                e.put(f"v{i}", os.urandom(MB))
            except StoreFailure as f:
                failure = f
                break
        else:
            pytest.fail("never out of memory")
        assert (failure.kind, failure.outage) == ("out of memory", False), failure
        assert "allkeys-lru" in str(failure)
        assert e.get("v0", limit=MB) is not None  # reads go on
        # A refused value's buffer, freed, may tip the server back under its limit: hold it well over.
        s.client().config_set("maxmemory", "1mb")
        f, _ = failure_of(e.put_many, [("a", b"1"), ("b", b"2")])
        assert f.kind == "out of memory"
        assert e.get_many(["a", "b"], limit=10) == [None, None]  # none of the batch
        f, _ = failure_of(e.lease, "other", 30)
        assert f.kind == "out of memory" and not f.outage
        s.client().script_flush()  # EVAL too, not only EVALSHA
        assert e.renew("held", token, 30) is True  # a holder keeps its lease: PEXPIRE needs no memory
        e.release("held", token)
        assert s.client().exists(f"{e.prefix}lease:held") == 0
        for i in range(10):
            e.remove(f"v{i}")  # UNLINK needs no memory
        s.client().config_set("maxmemory", "6mb")
        e.put("after", b"room again")
        assert e.get("after", limit=100) == b"room again"
    finally:
        s.stop()


def test_an_lru_server_never_fills_up(tmp_path: Path, make: Any) -> None:
    """The documented setting: maxmemory with allkeys-lru evicts the least recently used, writes go on."""
    s = redis_or_skip(tmp_path / "r", maxmemory="3mb", policy="allkeys-lru")
    try:
        e = make(s.url)
        for i in range(20):
            e.put(f"v{i}", os.urandom(MB // 2))
        assert e.get("v19", limit=MB) is not None
        assert e.get("v0", limit=MB) is None  # evicted
        assert s.stats()["evicted_keys"] > 0
    finally:
        s.stop()


def test_a_wrong_or_missing_password_is_denied(
    auth_server: RedisServer, make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_REDIS_PASSWORD, raising=False)
    for url in (auth_server.url, auth_server.url_with_password("wrong")):
        f, elapsed = failure_of(make(url).get, "k", limit=10)
        assert (f.kind, f.outage) == ("denied", True), f
        assert ENV_REDIS_PASSWORD in str(f) and elapsed < 0.5
    right = make(auth_server.url_with_password())
    right.put("k", b"v")
    assert right.get("k", limit=10) == b"v"
    monkeypatch.setenv(ENV_REDIS_PASSWORD, PASSWORD)
    assert make(auth_server.url).get("k", limit=10) == b"v"  # the environment's, where the URL has none
    f, _ = failure_of(make(auth_server.url_with_password("wrong")).get, "k", limit=10)
    assert f.kind == "denied"  # the URL's wins
    user = make(auth_server.url.replace("://", f"://default:{PASSWORD}@"))  # user and password
    assert user.get("k", limit=10) == b"v"


def test_a_read_only_acl_user_reads_and_its_writes_are_denied_without_an_outage(
    auth_server: RedisServer, make: Any
) -> None:
    """The user docs/redis.md gives read-only nodes: reads work, writes and leases are refused, the store stays up."""
    client = auth_server.client()
    client.execute_command("ACL", "SETUSER", "reader", "on", ">reader-pw", "~cpcas:*", "+@read", "+@connection")
    try:
        make(auth_server.url_with_password(), prefix=KEY_PREFIX).put("index/ro", b"written by a writer")
        reader = make(auth_server.url.replace("://", "://reader:reader-pw@"), prefix=KEY_PREFIX)
        assert reader.get_many(["index/ro", "index/none"], limit=100) == [b"written by a writer", None]
        for call in (
            lambda: reader.put("index/ro", b"x"),
            lambda: reader.lease("ro", 5),
            lambda: reader.remove("index/ro"),
        ):
            f, _ = failure_of(call)
            assert (f.kind, f.outage) == ("denied", False), f
        assert reader.get("index/ro", limit=100) == b"written by a writer"
    finally:
        client.execute_command("ACL", "DELUSER", "reader")
        client.delete(f"{KEY_PREFIX}index/ro")


def test_a_server_that_is_not_redis_is_a_protocol_outage(tmp_path: Path, make: Any) -> None:
    from testkit.nginx import nginx_or_skip

    with nginx_or_skip(tmp_path / "nginx") as nginx:
        e = make(f"redis://127.0.0.1:{nginx.port}/0")
        for call in (lambda: e.get("k", limit=10), lambda: e.put("k", b"v"), lambda: e.renew("k", "t", 1)):
            f, elapsed = failure_of(call)
            assert (f.kind, f.outage) == ("protocol", True), f
            assert elapsed < 1.0


def test_tls_is_verified_against_the_ca_bundle(
    tls_server: RedisServer, make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_PROGRAM_CAS_CA_BUNDLE", raising=False)
    url = tls_server.url_with_password()
    assert url.startswith("rediss://")
    f, _ = failure_of(make(url).get, "k", limit=10)
    assert (f.kind, f.outage) == ("tls", True), f  # a self-signed CA the system does not trust
    assert "CERTIFICATE_VERIFY_FAILED" in str(f) and "CUDA_PROGRAM_CAS_CA_BUNDLE" in str(f), f  # and what to do
    monkeypatch.setenv("CUDA_PROGRAM_CAS_CA_BUNDLE", str(tls_server.cert))
    e = make(url)
    e.put("k", b"over tls")
    assert e.get("k", limit=100) == b"over tls"
    assert make(url.replace("127.0.0.1", "localhost")).get("k", limit=100) == b"over tls"  # its other name
    f, _ = failure_of(make(url.replace("127.0.0.1", "[::ffff:127.0.0.1]")).get, "k", limit=10)  # a name it lacks
    assert f.kind == "tls" and "does not name this host" in str(f), f
    f, _ = failure_of(make(tls_server.url).get, "k", limit=10)  # TLS, no password
    assert f.kind == "denied"
    plain = tls_server.url_with_password().replace("rediss://", "redis://")
    f, elapsed = failure_of(make(plain, timeout=0.5).get, "k", limit=10)  # plain text to a TLS port
    assert f.outage and elapsed < 1.0, f


_SECRET_SCRIPT = textwrap.dedent(
    """
    import logging, sys, traceback
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)  # every logger, every level
    from cuda_program_cas._base.engine import StoreFailure
    from cuda_program_cas._remote.redis import RedisEngine

    for url in sys.argv[1:]:
        e = RedisEngine(url, timeout=0.5)
        print(e.shown, repr(e), e)
        for call in (lambda: e.get("k", limit=10), lambda: e.put("k", b"v"), lambda: e.lease("l", 1),
                     lambda: e.renew("l", "t", 1), lambda: e.get("big", limit=1)):
            try:
                print("ok", call())
            except StoreFailure as f:
                print(str(f), repr(f), f.args, f.__context__, f.__cause__)
                traceback.print_exc()
        e.close()
    """
)


def test_the_password_is_never_shown_logged_or_raised(
    auth_server: RedisServer, tls_server: RedisServer, tmp_path: Path
) -> None:
    """Right and wrong passwords, over TCP and TLS (with and without the CA), a dead port: not one trace of either.

    The child logs every logger at DEBUG to stderr, and prints each failure, its repr, its args,
    its context and traceback, and the engine's shown form and repr.
    """
    wrong = "Wr0ng-9d2e1b.sekr1t"
    for s in (auth_server, tls_server):
        s.client().set("cpcas:big", b"x" * 100)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://:{PASSWORD}@127.0.0.1:{s.getsockname()[1]}/0"
        urls = [
            auth_server.url_with_password(),
            auth_server.url_with_password(wrong),
            tls_server.url_with_password(),
            tls_server.url_with_password(wrong),
            dead,
            auth_server.url_with_password().replace(":" + PASSWORD, f"user:{PASSWORD}"),
        ]
        first = run_python(_SECRET_SCRIPT, *urls, env={"CUDA_PROGRAM_CAS_CA_BUNDLE": ""})
        second = run_python(_SECRET_SCRIPT, *urls[2:4], env={"CUDA_PROGRAM_CAS_CA_BUNDLE": str(tls_server.cert)})
    for done in (first, second):
        assert done.returncode == 0, done.stderr
        output = done.stdout + done.stderr
        assert "denied" in output and "too large" in output and "ok None" in output
        assert PASSWORD not in output and wrong not in output
    assert "refused" in first.stdout and ": tls:" in first.stdout


# -- leases -----------------------------------------------------------------------------------


def _fork(work: Any) -> int:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: other tests' idle daemon threads
        pid = os.fork()
    if pid == 0:
        try:
            code = work()
        except BaseException:
            code = 99
        os._exit(code)
    return pid


def _exit_code(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_processes_contending_for_a_lease_exactly_one_holds_it(server: RedisServer, prefix: str) -> None:
    """Eight processes released together by one pipe's end: one token, seven None (exit 0 and 1)."""
    gate_r, gate_w = os.pipe()
    url = server.url

    def contend() -> int:
        e = RedisEngine(url, timeout=5, prefix=prefix)
        e.get("warm-up", limit=1)  # connected before the gate opens
        os.close(gate_w)
        os.read(gate_r, 1)  # blocks until the parent closes its end
        return 0 if e.lease("compile/abc", 30) is not None else 1

    pids = [_fork(contend) for _ in range(8)]
    os.close(gate_r)
    os.close(gate_w)
    codes = sorted(_exit_code(p) for p in pids)
    assert codes == [0] + [1] * 7, codes


def test_a_killed_holders_lease_is_free_after_its_ttl_and_not_before(server: RedisServer, prefix: str) -> None:
    ttl = 1.0
    report_r, report_w = os.pipe()
    url = server.url

    def hold() -> int:
        e = RedisEngine(url, timeout=5, prefix=prefix)
        e.get("warm-up", limit=1)
        before = time.monotonic()
        token = e.lease("compile/k", ttl)
        os.write(report_w, f"{before} {time.monotonic()} {token is not None}\n".encode())
        signal.pause()  # until SIGKILLed: it never releases
        return 0

    pid = _fork(hold)
    os.close(report_w)
    with os.fdopen(report_r) as report:
        before, after, held = report.readline().split()
    assert held == "True"
    os.kill(pid, signal.SIGKILL)
    assert _exit_code(pid) == -signal.SIGKILL
    e = RedisEngine(url, timeout=5, prefix=prefix)
    try:
        while (token := e.lease("compile/k", 30)) is None:
            time.sleep(0.005)  # polling the server's clock: what a waiting node does
        freed = time.monotonic()
        assert token is not None
        assert freed >= float(before) + ttl - 0.01, freed - float(before)  # not before (Redis expires to the ms)
        assert freed <= float(after) + ttl + 0.5, freed - float(after)  # and soon after
    finally:
        e.close()


def test_renew_keeps_a_lease_and_only_its_holder_renews_or_releases(
    server: RedisServer, make: Any, prefix: str
) -> None:
    holder, other = make(server.url), make(server.url)
    client = server.client()
    key = f"{prefix}lease:compile/r"
    token = holder.lease("compile/r", 0.4)
    assert token is not None
    end = time.monotonic() + 1.2  # three TTLs
    while time.monotonic() < end:
        assert holder.renew("compile/r", token, 0.4) is True
        assert other.lease("compile/r", 0.4) is None
        time.sleep(0.1)
    assert other.renew("compile/r", "not-the-token", 60) is False
    assert client.pttl(key) <= 400  # the wrong token extended nothing
    other.release("compile/r", "not-the-token")
    assert client.get(key) == token.encode()  # nor released it
    assert other.lease("compile/r", 0.4) is None
    holder.release("compile/r", token)
    assert client.exists(key) == 0
    assert holder.renew("compile/r", token, 0.4) is False  # gone: lost
    theirs = other.lease("compile/r", 5)
    assert theirs is not None
    holder.release("compile/r", token)  # a late release of the old token leaves the new holder alone
    assert client.get(key) == theirs.encode()


def test_a_holder_that_gives_up_leaves_the_mark_for_its_ttl_and_a_look_takes_nothing(
    server: RedisServer, make: Any, prefix: str
) -> None:
    holder, other = make(server.url), make(server.url)
    client = server.client()
    key = f"{prefix}lease:compile/m"
    assert other.lease("compile/m", 5, take=False) == ""  # free, and only looked at
    assert client.exists(key) == 0
    token = holder.lease("compile/m", 5)
    assert token is not None and other.lease("compile/m", 5, take=False) is None
    other.release("compile/m", "not-the-token", mark_s=5)  # only the holder marks
    assert client.get(key) == token.encode()
    holder.release("compile/m", token, mark_s=0.3)
    assert client.get(key) == LEASE_MARK.encode()
    assert other.lease("compile/m", 5) == LEASE_MARK and other.lease("compile/m", 5, take=False) == LEASE_MARK
    while client.exists(key):  # the mark ends with its own TTL
        time.sleep(0.01)
    assert other.lease("compile/m", 5) not in (None, "", LEASE_MARK)  # free: taken


_LEASE_OPS = st.lists(
    st.tuples(st.sampled_from(["take", "look", "release", "mark"]), st.integers(min_value=0, max_value=2)),
    max_size=12,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_LEASE_OPS)
def test_lease_take_look_release_and_mark_follow_the_model(
    server: RedisServer, make: Any, prefix: str, ops: list[tuple[str, int]]
) -> None:
    """Three holders take, look at, release and mark one lease in any order: each answer is the model's
    (free: a take wins, a look says ""; held: None; marked: the mark, for takes and looks alike; only the
    token that holds it releases or marks)."""
    engines = [make(server.url) for _ in range(3)]
    name = f"prop/{uuid.uuid4().hex}"  # not random: hypothesis seeds it alike for each example
    state: object = None  # None: free; an int: that engine holds it; LEASE_MARK: marked
    tokens: list[str | None] = [None, None, None]
    for op, i in ops:
        e = engines[i]
        if op in ("take", "look"):
            got = e.lease(name, 60, take=op == "take")
            if state is None:
                if op == "take":
                    assert got not in (None, "", LEASE_MARK)
                    state, tokens[i] = i, got
                else:
                    assert got == ""
            else:
                assert got == (LEASE_MARK if state == LEASE_MARK else None)
        else:
            token = tokens[i]
            if token is None:
                continue
            e.release(name, token, mark_s=60 if op == "mark" else 0.0)
            if state == i:
                state = LEASE_MARK if op == "mark" else None
            tokens[i] = None
    holds = server.client().get(f"{prefix}lease:{name}")
    want = None if state is None else LEASE_MARK.encode() if state == LEASE_MARK else tokens[state].encode()  # type: ignore[index]
    assert holds == want


def test_lease_scripts_are_sent_by_sha_and_again_in_full_where_the_server_lacks_them(
    server: RedisServer, make: Any
) -> None:
    e = make(server.url)
    token = e.lease("s", 5)
    assert token is not None
    server.client().script_flush()
    server.reset_stats()
    assert e.renew("s", token, 5) is True  # NOSCRIPT, then EVAL (which caches it)
    assert e.renew("s", token, 5) is True  # EVALSHA alone
    stats = _ours(server.commandstats())
    assert (stats["evalsha"], stats["eval"], stats["pexpire"]) == (2, 1, 2), stats


# -- processes --------------------------------------------------------------------------------


def test_a_forked_child_opens_its_own_connection(server: RedisServer, make: Any) -> None:
    e = make(server.url)
    e.put("k", b"parent")
    connections = server.stats()["total_connections_received"]

    def child() -> int:
        ok = e.get("k", limit=10) == b"parent"
        e.put("k2", b"child")
        return 0 if ok else 3

    assert _exit_code(_fork(child)) == 0
    assert e.get("k2", limit=10) == b"child"  # the parent's connection is in step: the child did not use it
    # The child: one connection of its own; the parent: none new. (The test's own client is counted before.)
    assert server.stats()["total_connections_received"] - connections == 1


def test_redis_is_imported_only_when_a_redis_engine_talks(server: RedisServer) -> None:
    code = textwrap.dedent(
        """
        import sys
        import cuda_program_cas
        from cuda_program_cas._remote.redis import RedisEngine
        assert "redis" not in sys.modules
        e = RedisEngine(sys.argv[1])
        assert "redis" not in sys.modules, "opening it asks nothing yet"
        assert e.get("k", limit=1) is None
        assert "redis" in sys.modules
        print("ok")
        """
    )
    done = run_python(code, server.url)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
    importtime = run_python("import cuda_program_cas", env={"PYTHONPROFILEIMPORTTIME": "1"})
    imported = [line.rsplit("|", 1)[-1].strip() for line in importtime.stderr.splitlines() if "|" in line]
    assert "cuda_program_cas" in imported
    assert [m for m in imported if m == "redis" or m.startswith("redis.")] == []
