"""The failure side of the HTTP shared store, against real servers: every fault is a miss, and an outage is cheap.

A published store (real NVRTC compiles, published loose and packed) is served by the tests'
fault server (tests/_http) or a real nginx. Each fault must make a lookup a miss: ``get()``
returns None and ``Program.compile(cache=)`` still compiles and returns the right bytes; never
an exception, never wrong bytes. An outage pauses the store (5 s, doubling to 300 s), so N
lookups cost one request, not N: the tests count the server's requests and connections,
never time them. The pause's clock is a frozen stand-in for the ``time`` module, patched
into the store's module only and moved by hand, so no test sleeps through a pause.

The client reads its settings (timeouts, CA bundle, tokens) once per process, when it makes
its pool. The autouse fixture ``_fresh_client`` sets the timeouts (long; short where a server
stalls) and closes the client's connections before and after each test
(``close_connections()``), so the next request reads each test's settings. Tests that need
a process of their own (the log file, laziness, fork) run a fresh interpreter.
"""

from __future__ import annotations

import logging
import os
import shutil
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _http import Fault, FaultServer, Nginx, nginx_or_skip, refused_url
from conftest import compile_program, run_python
from hypothesis import given, settings
from hypothesis import strategies as st

import cuda_program_cas._store.http as http_store
from cuda_program_cas import ContentAddressedProgramCache, digest_of, publish
from cuda_program_cas._base.config import env_shared
from cuda_program_cas._base.urls import mend_split
from cuda_program_cas._remote import client
from cuda_program_cas._store.http import RETRY_MAX_S, HttpStore
from cuda_program_cas._store.tier import RETRY_S
from cuda_program_cas._store.tier import Tier as SharedStore

#: Kernels compiled once for the module: distinct cubins, stored under the keys "k0", "k1", ...
ARCHES = ("sm_80", "sm_86", "sm_90", "sm_75")
#: Connect and read timeouts (s). Where nothing stalls, long ones: a loaded machine may take a
#: second to answer, and a timeout there would fail a test of something else. Where a server
#: stalls, short ones (``short_timeouts``): each stall costs one.
TIMEOUTS = "2,5"
SHORT_TIMEOUTS = "0.5,1"
TOKEN = "t0k3n-Sekr1t.value"  # noqa: S105 - a test's token, grepped for in logs


@dataclass(frozen=True)
class Published:
    """The module's published stores and what they hold."""

    loose: Path
    packed: Path
    values: dict[str, bytes]  # key -> the compiled bytes stored under it
    saxpy: bytes  # an uncached compile of SAXPY for sm_80, what Program.compile must return


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Published:
    base = tmp_path_factory.mktemp("published")
    saxpy = bytes(compile_program().code)  # uncached: the reference
    values = {}
    with ContentAddressedProgramCache(base / "src", shared=()) as src:
        assert bytes(compile_program(cache=src).code) == saxpy  # its compile key is published too
        for i, arch in enumerate(ARCHES):
            values[f"k{i}"] = bytes(compile_program(arch=arch).code)
            src[f"k{i}"] = values[f"k{i}"]
    assert len(set(values.values())) == len(ARCHES)
    publish([base / "src"], base / "loose")
    publish([base / "src"], base / "packed", pack=True)
    assert not list((base / "packed").glob("index/*/*"))  # the packed store holds packs only
    return Published(base / "loose", base / "packed", values, saxpy)


@pytest.fixture(autouse=True)
def _fresh_client(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Long timeouts, no token, no CA bundle, no .netrc; a pool made anew for this test and closed after it."""
    monkeypatch.setenv(client.ENV_HTTP_TIMEOUT, TIMEOUTS)
    monkeypatch.delenv(client.ENV_HTTP_TOKEN, raising=False)
    monkeypatch.delenv(client.ENV_CA_BUNDLE, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    _drop_pool()
    yield
    _drop_pool()


@pytest.fixture
def short_timeouts(_fresh_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Short timeouts for a test whose server stalls (read when the test's first request makes the pool)."""
    monkeypatch.setenv(client.ENV_HTTP_TIMEOUT, SHORT_TIMEOUTS)


def _drop_pool() -> None:
    client.close_connections()  # the next request reads the settings (timeouts, CA bundle, tokens) again


class FrozenClock:
    """A stand-in for the ``time`` module of the store's module: ``monotonic()`` moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FrozenClock:
    frozen = FrozenClock()
    monkeypatch.setattr(http_store, "time", frozen)
    return frozen


class Site:
    """A store served by a :class:`FaultServer` under a path of this test's own (``/<test dir>/``).

    The path keeps each test's store URL apart from every other's: the store's WARNING is once
    per URL per process, and a port may come round again.
    """

    def __init__(self, tmp_path: Path, store: Path) -> None:
        www = tmp_path / "www"
        www.mkdir()
        self.name = tmp_path.name
        shutil.copytree(store, www / self.name)
        self.store = www / self.name
        self.server = FaultServer(www)

    def __enter__(self) -> Site:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    @property
    def url(self) -> str:
        return self.server.url(self.name)

    def set(self, sub: str, fault: Fault) -> None:
        """Requests for files of the store whose path starts with ``sub`` ("" for all) get ``fault``."""
        self.server.set(f"/{self.name}/{sub}", fault)

    @property
    def hits(self) -> int:
        return self.server.hits()


def node(tmp_path: Path, *shared: str | os.PathLike[str], name: str = "node") -> ContentAddressedProgramCache:
    return ContentAddressedProgramCache(tmp_path / name, shared=list(shared))


def warnings_about(caplog: pytest.LogCaptureFixture, url: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "cuda_program_cas" and r.levelno >= logging.WARNING and url in r.getMessage()
    ]


def http_of(cache: ContentAddressedProgramCache) -> HttpStore:
    (store,) = (s for s in cache.store.shared if isinstance(s, HttpStore))
    return store


def compiles_right(cache: ContentAddressedProgramCache, published: Published) -> None:
    """Program.compile(cache=) returns the right bytes, and the process goes on (the local cache works)."""
    assert bytes(compile_program(cache=cache).code) == published.saxpy
    cache["after"] = b"the local cache still works"
    assert cache.get("after") == b"the local cache still works"


# -- the store works: what the faults below take away ------------------------------------------------


@pytest.mark.parametrize("layout", ["loose", "packed"])
def test_a_published_store_is_read_through_the_fault_server(tmp_path: Path, published: Published, layout: str) -> None:
    with Site(tmp_path, getattr(published, layout)) as site, node(tmp_path, site.url) as cache:
        for key, value in published.values.items():
            assert cache.get(key) == value
        assert bytes(compile_program(cache=cache).code) == published.saxpy
        counts = cache.counters()
        assert counts["shared_hits"] == len(published.values) + 1
        assert (counts["errors"], counts["corrupt"]) == (0, 0)
        assert site.server.connections == 1  # keep-alive


# -- each fault is a miss ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["refused", "dns"])
def test_an_unreachable_server_is_a_miss_with_one_warning(
    tmp_path: Path, published: Published, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """Nothing listens on the port, or the name does not resolve (.invalid never does)."""
    store_url = refused_url(tmp_path.name) if how == "refused" else f"http://cas-no-such-host.invalid/{tmp_path.name}"
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    with node(tmp_path, store_url) as cache:
        for key in published.values:
            assert cache.get(key) is None
        compiles_right(cache, published)
        assert cache.counters()["errors"] == 1  # one try, then the pause
    (warning,) = warnings_about(caplog, store_url)
    assert f"{how}:" in warning


#: (id, layout, the file prefix the fault hits, the fault, what the WARNING says). Every one is an
#: outage: a miss, then a pause.
OUTAGES = [
    ("stall-layout", "loose", "layout.json", Fault.stall(), "timeout"),
    ("stall-manifest", "loose", "index/", Fault.stall(), "timeout"),
    ("stall-body", "loose", "blobs/", Fault.stall_body(), "timeout"),
    ("trickle", "loose", "blobs/", Fault.trickle(ms=5), "timeout"),  # each byte in time, the whole body not
    ("500-layout", "loose", "layout.json", Fault.status(500), "server error: status 500"),
    ("503-manifest", "loose", "index/", Fault.status(503), "server error: status 503"),
    ("500-blob", "loose", "blobs/", Fault.status(500), "server error: status 500"),
    ("truncated-blob", "loose", "blobs/", Fault.truncate(), "truncated"),
    ("truncated-manifest", "loose", "index/", Fault.truncate(), "truncated"),
    ("redirect-loop", "loose", "index/", Fault.redirect_loop(), "redirects: more than 3"),
    ("401", "loose", "", Fault.status(401), "denied: status 401"),
    ("403-blob", "loose", "blobs/", Fault.status(403), "denied: status 403"),
    ("reset-midway", "loose", "blobs/", Fault.refuse(), "protocol"),
    ("503-listing", "packed", "packs/list", Fault.status(503), "server error: status 503"),
    ("stall-pack", "packed", "packs/pack", Fault.stall(), "timeout"),
    ("truncated-pack", "packed", "packs/pack", Fault.truncate(), "truncated"),
]


@pytest.fixture
def outage(
    _fresh_client: None, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, str, Fault, str]:
    """One row of :data:`OUTAGES` (without its id), with short timeouts where the server stalls."""
    row: tuple[str, str, Fault, str] = request.param
    if row[2].kind in ("stall", "stall_body", "trickle"):
        monkeypatch.setenv(client.ENV_HTTP_TIMEOUT, SHORT_TIMEOUTS)
    return row


#: The stalls wait out a timeout each (about a second), the same on every Python: the slow
#: mark leaves them to the full run (CI's 3.11), the other Pythons run the rest.
@pytest.mark.parametrize(
    "outage",
    [pytest.param(o[1:], id=o[0], marks=[pytest.mark.slow] if o[4] == "timeout" else []) for o in OUTAGES],
    indirect=True,
)
def test_an_outage_is_a_miss_then_a_pause(
    tmp_path: Path,
    published: Published,
    caplog: pytest.LogCaptureFixture,
    clock: FrozenClock,
    outage: tuple[str, str, Fault, str],
) -> None:
    layout, where, fault, what = outage
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    with Site(tmp_path, getattr(published, layout)) as site, node(tmp_path, site.url) as cache:
        site.set(where, fault)
        assert cache.get("k0") is None
        made = http_of(cache).requests
        assert site.server.wait_for(made)  # a request the client gave up on may be logged after
        asked = site.hits
        for key in published.values:  # paused: no request at all
            assert cache.get(key) is None
        compiles_right(cache, published)
        assert (http_of(cache).requests, site.hits) == (made, asked)
        counts = cache.counters()
        assert (counts["errors"], counts["corrupt"], counts["shared_hits"]) == (1, 0, 0)
        (warning,) = warnings_about(caplog, site.url)
        assert "unusable" in warning
        assert what in warning, warning
        if fault.kind == "stall":  # the short timeouts were in force (urllib3 names the read timeout)
            assert "read timeout=1.0" in warning, warning
        # Nothing wrong was kept: the local cache has none of the store's keys.
        with node(tmp_path) as alone:
            assert all(alone.get(key) is None for key in published.values)
        # The server mends; the pause ends; the store is asked again and hits.
        site.server.clear()
        clock.advance(RETRY_S)
        assert cache.get("k1") == published.values["k1"], http_of(cache).miss_reason()
        assert site.hits > asked


@pytest.mark.usefixtures("short_timeouts")
@pytest.mark.slow
def test_a_trickling_server_is_cut_off_at_the_deadline(tmp_path: Path, published: Published) -> None:
    """A byte every 0.1 s, well within the read timeout: a 3 KB blob would take minutes; the client gives up.

    The lookup runs in a thread joined with a bound twenty times what it needs (about 1.5 s: the
    short timeouts), so a client that waits for the whole body fails here, not hangs.
    """
    with Site(tmp_path, published.loose) as site, node(tmp_path, site.url) as cache:
        assert len(published.values["k0"]) > 2000
        site.set("blobs/", Fault.trickle(ms=100))
        got: list[tuple[bytes | None, str]] = []
        worker = threading.Thread(target=lambda: got.append((cache.get("k0"), http_of(cache).miss_reason())))
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "the trickle was not cut off"
        ((data, why),) = got
        assert data is None
        assert "did not arrive in time" in why
        assert cache.counters()["errors"] == 1


@pytest.mark.parametrize(("layout", "where"), [("loose", "blobs/"), ("packed", "packs/pack")])
def test_wrong_bytes_are_a_miss_counted_in_corrupt_and_never_kept(
    tmp_path: Path, published: Published, caplog: pytest.LogCaptureFixture, layout: str, where: str
) -> None:
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    with Site(tmp_path, getattr(published, layout)) as site, node(tmp_path, site.url) as cache:
        cache.get("k3")  # opens the store, and for packs fetches their index, before the fault is set
        site.set(where, Fault.wrong_bytes(times=1))
        assert cache.get("k0") is None
        counts = cache.counters()
        assert (counts["corrupt"], counts["errors"]) == (1, 0)
        # Not an outage: no pause, the next lookup is asked and hits.
        assert cache.get("k1") == published.values["k1"]
        compiles_right(cache, published)
        assert not warnings_about(caplog, site.url)
    with node(tmp_path) as alone:  # the hits were copied in; the wrong bytes were not
        assert alone.get("k0") is None
        assert alone.get("k1") == published.values["k1"]


def test_a_blob_gone_after_its_manifest_is_a_plain_miss(tmp_path: Path, published: Published) -> None:
    """A store partially collected: the manifest is there, its blob 404s. A miss, and no pause."""
    with Site(tmp_path, published.loose) as site, node(tmp_path, site.url) as cache:
        digest = digest_of(published.values["k0"])
        (site.store / "blobs" / digest[:2] / digest[2:]).unlink()
        assert cache.get("k0") is None
        assert http_of(cache).miss_reason() == "blob missing"
        assert cache.get("k1") == published.values["k1"]  # asked at once: not paused
        compiles_right(cache, published)
        counts = cache.counters()
        assert (counts["errors"], counts["corrupt"]) == (0, 0)


# -- the pause ---------------------------------------------------------------------------------------


@pytest.mark.usefixtures("short_timeouts")
def test_an_outage_costs_one_connection_not_one_per_lookup(tmp_path: Path, published: Published) -> None:
    """A stalled server (accepts, never answers): twenty lookups and three compiles open one connection."""
    with Site(tmp_path, published.loose) as site, node(tmp_path, site.url) as cache:
        site.set("", Fault.stall())
        for _ in range(5):
            for key in published.values:
                assert cache.get(key) is None
        for _ in range(3):
            assert bytes(compile_program(cache=cache).code) == published.saxpy
        assert http_of(cache).requests == 1
        assert site.server.wait_for(1)  # the request the client gave up on may be logged after
        assert (site.server.connections, site.hits) == (1, 1)
        assert cache.counters()["errors"] == 1


def test_the_pause_doubles_up_to_its_cap_and_each_end_asks_again(
    tmp_path: Path, published: Published, clock: FrozenClock
) -> None:
    with Site(tmp_path, published.loose) as site, node(tmp_path, site.url) as cache:
        site.set("", Fault.status(503))
        assert cache.get("k0") is None
        assert site.hits == 1
        pauses = [min(RETRY_MAX_S, RETRY_S * 2**n) for n in range(10)]
        assert pauses[-1] == RETRY_MAX_S == 300
        for failures, pause in enumerate(pauses, start=1):
            clock.advance(pause - 0.001)
            assert cache.get("k1") is None
            assert site.hits == failures, f"asked during pause {failures} ({pause} s)"
            clock.advance(0.001)
            assert cache.get("k1") is None
            assert site.hits == failures + 1, f"not asked when pause {failures} ({pause} s) ended"
        assert cache.counters()["errors"] == len(pauses) + 1


def test_a_success_resets_the_pause(tmp_path: Path, published: Published, clock: FrozenClock) -> None:
    with Site(tmp_path, published.loose) as site, node(tmp_path, site.url) as cache:
        site.set("layout.json", Fault.status(503, times=2))
        assert cache.get("k0") is None  # failure 1: 5 s
        clock.advance(RETRY_S)
        assert cache.get("k0") is None  # failure 2: 10 s
        clock.advance(2 * RETRY_S)
        assert cache.get("k0") == published.values["k0"]  # an answer: the count of failures starts again
        site.set("index/", Fault.status(503, times=1))
        assert cache.get("k1") is None  # one failure after a success: 5 s, not 20
        before = site.hits
        clock.advance(RETRY_S)
        assert cache.get("k1") == published.values["k1"]
        assert site.hits > before


@pytest.mark.usefixtures("short_timeouts")
def test_one_warning_per_process_however_many_failures_and_caches(
    tmp_path: Path, published: Published, caplog: pytest.LogCaptureFixture, clock: FrozenClock
) -> None:
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    with Site(tmp_path, published.loose) as site:
        site.set("", Fault.status(503))
        with node(tmp_path, site.url) as first, node(tmp_path, site.url, name="other") as second:
            for _ in range(4):
                for cache in (first, second):
                    assert cache.get("k0") is None
                clock.advance(RETRY_MAX_S)
            site.set("", Fault.stall(times=1))  # another kind of failure: still no second WARNING
            assert first.get("k0") is None
            assert first.counters()["errors"] + second.counters()["errors"] == 9
        (warning,) = warnings_about(caplog, site.url)
        assert "503" in warning
        debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "paused for" in r.getMessage()]
        assert len(debug) == 8
        assert any("timeout" in r.getMessage() for r in debug)


@pytest.mark.usefixtures("short_timeouts")
def test_threads_meeting_one_outage_pay_once_each_and_count_as_one_failure(
    tmp_path: Path, published: Published, clock: FrozenClock
) -> None:
    """Eight threads look up at once while the server stalls: each waits once at most, then all are paused.

    Their failures are one outage, not eight in a row: the pause is the first one, not the cap.
    """
    with Site(tmp_path, published.loose) as site, node(tmp_path, site.url) as cache:
        site.set("", Fault.stall())
        errors: list[BaseException] = []
        start = threading.Barrier(8)

        def worker() -> None:
            try:
                start.wait(30)
                for _ in range(10):
                    for key in published.values:
                        assert cache.get(key) is None
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        assert not any(t.is_alive() for t in threads)
        # Each thread asked once at most (the server may see fewer: its listen backlog is 5, and
        # a connection still waiting in it when the connect timeout passes never arrives).
        assert 1 <= http_of(cache).requests <= len(threads)
        assert site.hits <= site.server.connections <= len(threads)
        asked = site.hits
        site.server.clear()
        clock.advance(RETRY_S)
        assert cache.get("k0") == published.values["k0"]
        assert site.hits > asked


# -- TLS and tokens, against nginx -------------------------------------------------------------------


def _nginx_store(tmp_path: Path, published: Published, *, token: str | None = None, tls: bool = False) -> Nginx:
    """A started nginx serving a copy of the loose store under /store/ (skips where nginx cannot run)."""
    server = nginx_or_skip(tmp_path / "nginx", token=token, tls=tls)
    shutil.copytree(published.loose, server.root, dirs_exist_ok=True)
    return server


def test_tls_without_the_ca_is_a_miss_with_one_warning(
    tmp_path: Path, published: Published, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    with _nginx_store(tmp_path, published, tls=True) as server, node(tmp_path, server.read_url()) as cache:
        url = http_of(cache).root
        assert cache.get("k0") is None
        assert cache.get("k1") is None
        compiles_right(cache, published)
        assert cache.counters()["errors"] == 1
        (warning,) = warnings_about(caplog, url)
        assert "tls" in warning and "certificate" in warning.lower()
        assert server.requests() == []  # the handshake failed: no request was made


def test_tls_with_the_ca_bundle_reads(tmp_path: Path, published: Published, monkeypatch: pytest.MonkeyPatch) -> None:
    with _nginx_store(tmp_path, published, tls=True) as server:
        monkeypatch.setenv(client.ENV_CA_BUNDLE, str(server.cert))
        with node(tmp_path, server.read_url()) as cache:
            assert cache.get("k0") == published.values["k0"]
            assert cache.counters()["errors"] == 0


@pytest.mark.parametrize("source", ["env", "netrc"])
def test_a_token_from_the_environment_or_netrc_reads(
    tmp_path: Path, published: Published, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    if source == "env":
        monkeypatch.setenv(client.ENV_HTTP_TOKEN, TOKEN)
    else:
        netrc = tmp_path / "netrc"
        netrc.write_text(f"machine 127.0.0.1\n  login cas\n  password {TOKEN}\n")
        netrc.chmod(0o600)
        monkeypatch.setenv("NETRC", str(netrc))
    with _nginx_store(tmp_path, published, token=TOKEN) as server, node(tmp_path, server.read_url()) as cache:
        assert cache.get("k0") == published.values["k0"]
        assert cache.counters()["errors"] == 0
        assert {e.status for e in server.requests()} <= {200, 404}


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_no_token_or_a_wrong_one_is_a_miss_with_one_warning(
    tmp_path: Path,
    published: Published,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    token: str | None,
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger: urllib3's too
    if token is not None:
        monkeypatch.setenv(client.ENV_HTTP_TOKEN, token)
    with _nginx_store(tmp_path, published, token=TOKEN) as server, node(tmp_path, server.read_url()) as cache:
        url = http_of(cache).root
        assert cache.get("k0") is None
        assert cache.get("k1") is None
        compiles_right(cache, published)
        (warning,) = warnings_about(caplog, url)
        assert "denied" in warning and "401" in warning
        assert [e.status for e in server.requests(wait_for=1)] == [401]
    for record in caplog.records:
        text = record.getMessage() + (logging.Formatter().formatException(record.exc_info) if record.exc_info else "")
        assert TOKEN not in text
        assert token is None or token not in text


def test_a_token_is_never_logged_at_any_level(tmp_path: Path, published: Published) -> None:
    """Neither token, the one that reads nor the one denied, is in a log record, file or output at DEBUG.

    The process logs everything (DEBUG to stderr, and CUDA_PROGRAM_CAS_LOG to a file) and prints its
    miss reasons; its .netrc gives 127.0.0.1 the right token and localhost a wrong one.
    """
    right, wrong = TOKEN, "wr0ng-Sekr1t.value"
    with _nginx_store(tmp_path, published, token=right) as server:
        netrc = tmp_path / "netrc"
        netrc.write_text(f"machine 127.0.0.1 login a password {right}\nmachine localhost login b password {wrong}\n")
        netrc.chmod(0o600)
        log = tmp_path / "cas.log"
        code = textwrap.dedent(
            """
            import logging, sys
            logging.basicConfig(level=logging.DEBUG)
            from cuda_program_cas import CacheStore
            good, bad = sys.argv[1], sys.argv[1].replace("127.0.0.1", "localhost")
            store = CacheStore(sys.argv[2], shared=[good, bad])
            assert store.get("k0") is not None, "the right token reads"
            assert store.get("k1") is not None
            assert store.get("missing") is None
            for shared in store.shared:
                print("reason", shared.miss_reason())
            print(store.counters())
            """
        )
        done = run_python(
            code,
            server.read_url(),
            str(tmp_path / "node"),
            env={"NETRC": str(netrc), "CUDA_PROGRAM_CAS_LOG": str(log), "CUDA_PROGRAM_CAS_HTTP_TIMEOUT": TIMEOUTS},
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        # The right token: layout.json, packs/list (404), two manifests and blobs, a missing manifest
        # (404); the wrong one: layout.json, denied. Nothing more: the denied store is paused.
        statuses = sorted(e.status for e in server.requests(wait_for=8))
    assert statuses == [200] * 5 + [401] + [404] * 2, statuses
    text = log.read_text()
    assert "denied" in text and "401" in text and "DEBUG" in text
    for output in (text, done.stdout, done.stderr):
        assert right not in output
        assert wrong not in output


def test_a_redirect_to_another_server_does_not_carry_the_token(
    tmp_path: Path, published: Published, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(client.ENV_HTTP_TOKEN, TOKEN)
    with Site(tmp_path, published.loose) as site, FaultServer(site.store.parent) as other:
        _redirect_each_blob(site, other)
        with node(tmp_path, site.url) as cache:
            assert cache.get("k0") == published.values["k0"]
        assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in site.server.log)
        assert other.hits() == 1
        assert "authorization" not in other.log[0].headers


def _redirect_each_blob(site: Site, other: FaultServer) -> None:
    """Each blob of the store redirects to the same file on ``other`` (a fault per file: Location is fixed)."""
    for blob in (site.store / "blobs").rglob("*"):
        if blob.is_file():
            rel = blob.relative_to(site.store).as_posix()
            site.set(rel, Fault.redirect_to(other.url(f"{site.name}/{rel}")))


# -- CUDA_PROGRAM_CAS_SHARED with URLs ---------------------------------------------------------------


def test_the_environment_keeps_a_url_whole_between_directories(
    tmp_path: Path, published: Published, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(published.loose, a)
    shutil.copytree(published.loose, b)
    with Site(tmp_path, published.loose) as site:
        url = site.url
        assert url.startswith("http://127.0.0.1:")
        monkeypatch.setenv("CUDA_PROGRAM_CAS_SHARED", os.pathsep.join([str(a), url, str(b)]))
        assert env_shared() == [str(a), url, str(b)]
        with ContentAddressedProgramCache(tmp_path / "node", copy_shared_hits=False) as cache:
            stores = cache.store.shared
            assert [type(s) for s in stores] == [SharedStore, HttpStore, SharedStore]
            assert [s.root for s in stores] == [str(a), url, str(b)]
            shutil.rmtree(a)  # the first store gone: the URL answers next
            assert cache.get("k0") == published.values["k0"]
        assert site.hits >= 1


def test_a_url_with_credentials_or_a_query_is_left_out_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cuda_program_cas")
    host = f"{tmp_path.name.replace('_', '-')}.example"
    secret = "hunter2-pw"
    bad = [f"http://user:{secret}@{host}:8443/store", f"https://{host}/store?sig=abc", f"https://{host}/store#frag"]
    good = [str(tmp_path / "d"), f"https://{host}:8443/store"]
    monkeypatch.setenv("CUDA_PROGRAM_CAS_SHARED", os.pathsep.join([good[0], *bad, good[1]]))
    assert env_shared() == good
    assert env_shared() == good  # read again: no second WARNING
    messages = [r.getMessage() for r in caplog.records if r.name == "cuda_program_cas"]
    assert len(messages) == len(bad)
    assert all("left out" in m for m in messages)
    assert all(secret not in m for m in messages)
    assert any("credentials" in m for m in messages) and sum("query or fragment" in m for m in messages) == 2


_SEGMENT = st.text(st.characters(blacklist_characters=":\x00/", blacklist_categories=("Cs",)), min_size=1, max_size=8)
_DIRS = st.lists(_SEGMENT, min_size=1, max_size=4).map(lambda s: "/" + "/".join(s))
_LABEL = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=10)
_HOSTS = st.one_of(
    st.lists(_LABEL, min_size=1, max_size=3).map(".".join),
    st.tuples(*[st.integers(0, 255)] * 4).map(lambda t: ".".join(map(str, t))),
)
_PATHS = st.lists(st.text("abcdefghijklmnopqrstuvwxyz0123456789-._~", min_size=1, max_size=8), max_size=3).map(
    lambda s: "".join("/" + p for p in s)
)
_USERS = st.none() | st.tuples(_LABEL, st.none() | _LABEL).map(lambda u: f"{u[0]}:{u[1]}@" if u[1] else f"{u[0]}@")
_URLS = st.builds(
    lambda scheme, user, host, port, path: f"{scheme}://{user or ''}{host}{'' if port is None else f':{port}'}{path}",
    st.sampled_from(["http", "https", "HTTP", "Https"]),
    _USERS,
    _HOSTS,
    st.none() | st.integers(1, 65535),
    _PATHS,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(_DIRS, _URLS), min_size=1, max_size=6))
def test_mend_split_gives_back_what_was_joined(entries: list[str]) -> None:
    """Absolute directories without ':' and URLs (with or without user, password, port) survive the split."""
    assert mend_split(":".join(entries).split(":")) == entries


# -- laziness and fork, each in a fresh interpreter --------------------------------------------------


def test_urllib3_and_ssl_are_imported_only_when_a_url_store_is_used(tmp_path: Path, published: Published) -> None:
    code = textwrap.dedent(
        """
        import sys
        import cuda_program_cas
        from cuda_program_cas import ContentAddressedProgramCache

        def loaded():
            return sorted(m for m in ("urllib3", "ssl") if m in sys.modules)

        assert loaded() == [], loaded()
        local, shared, url, key = sys.argv[1:]
        with ContentAddressedProgramCache(local, shared=[shared]) as cache:
            assert cache.get(key) is not None  # a hit in the directory store
            assert cache.get("missing") is None
        assert loaded() == [], loaded()
        with ContentAddressedProgramCache(local + "-2", shared=[url]) as cache:
            assert loaded() == [], loaded()  # opening it asks nothing yet
            assert cache.get(key) is not None
        assert loaded() == ["ssl", "urllib3"], loaded()
        print("ok")
        """
    )
    with Site(tmp_path, published.loose) as site:
        done = run_python(
            code, str(tmp_path / "node"), str(published.loose), site.url, "k0", env={"CUDA_PROGRAM_CAS_LOG": ""}
        )
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
        assert site.hits >= 2


def test_a_forked_child_reads_over_its_own_connection(tmp_path: Path, published: Published) -> None:
    code = textwrap.dedent(
        """
        import os, sys
        from cuda_program_cas import CacheStore

        store = CacheStore(sys.argv[1], shared=[sys.argv[2]], copy_shared_hits=False)
        assert store.get("k0") is not None
        pid = os.fork()
        if pid == 0:  # the child: reports through its exit status
            ok = store.get("k1") is not None and store.get("k2") is not None and store.get("k0") is not None
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert store.get("k3") is not None  # the parent goes on
        print("ok")
        """
    )
    with Site(tmp_path, published.loose) as site:
        done = run_python(code, str(tmp_path / "node"), site.url, timeout=60)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
        log = site.server.log
    # The parent: layout.json, packs/list, k0's manifest and blob; the child: three of each on a
    # connection of its own; the parent again, on its first connection (the child left it alone).
    assert [r.connection for r in log] == [1] * 4 + [2] * 6 + [1] * 2, log
