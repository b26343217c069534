"""The failure side of the HTTP shared store, against real servers: every fault is a miss, and an outage is cheap.

A published store (real NVRTC compiles, published loose and packed) is served by the tests'
fault server (tools/testkit/faults.py) or a real nginx. Each fault must make a lookup a miss: ``get()``
returns None and ``Program.compile(cache=)`` still compiles and returns the right bytes; never
an exception, never wrong bytes. An outage pauses the store (5 s, doubling to 300 s), so N
lookups cost one request, not N: the tests count the server's requests and connections,
never time them. The pause's clock is a frozen stand-in for the ``time`` module, patched
into the store's module and its packs' only and moved by hand, so no test sleeps through a pause.

The client reads its settings (timeouts, CA bundle, tokens) once per process, when it makes
its pool. The autouse fixture ``_fresh_client`` sets the timeouts (long; short where a server
stalls) and closes the client's connections before and after each test
(``close_connections()``), so the next request reads each test's settings. Tests that need
a process of their own (the log file, laziness, fork) run a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import compile_program, run_python
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.faults import Fault, FaultServer, refused_url
from testkit.nginx import Nginx, nginx_or_skip

import cuda_program_cas._remote.httppacks as http_store
import cuda_program_cas._shared.tier as tier_module
from cuda_program_cas import ContentAddressedProgramCache, digest_of, publish
from cuda_program_cas._base.config import ENV_MAX_ENTRY_SIZE, env_max_entry_size, env_shared
from cuda_program_cas._base.urls import split_store_list
from cuda_program_cas._disk.direngine import DirEngine
from cuda_program_cas._remote import client
from cuda_program_cas._remote.http import HttpEngine
from cuda_program_cas._shared.tier import RETRY_MAX_S, RETRY_S
from cuda_program_cas._shared.tier import Tier as SharedStore
from cuda_program_cas.index import LONGEST_MANIFEST, MAX_MANIFEST_BYTES

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
    monkeypatch.setattr(tier_module, "time", frozen)
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


def http_of(cache: ContentAddressedProgramCache) -> SharedStore:
    (store,) = (s for s in cache.store.inner.shared if isinstance(s.engine, HttpEngine))
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
    ("trickle-status", "loose", "index/", Fault.trickle_status(ms=200), "timeout"),
    ("trickle-headers", "loose", "blobs/", Fault.trickle_headers(ms=200), "timeout"),
    ("trickle-status-layout", "loose", "layout.json", Fault.trickle_status(ms=200), "timeout"),
    ("many-headers", "loose", "index/", Fault.many_headers(1000), "protocol"),
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
    ("trickle-headers-pack", "packed", "packs/pack", Fault.trickle_headers(ms=200), "timeout"),
]
#: The faults that wait for a timeout or the deadline: the short timeouts are in force for them.
SLOW_FAULTS = ("stall", "stall_body", "trickle", "trickle_status", "trickle_headers")


@pytest.fixture
def outage(
    _fresh_client: None, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, str, Fault, str]:
    """One row of :data:`OUTAGES` (without its id), with short timeouts where the server stalls."""
    row: tuple[str, str, Fault, str] = request.param
    if row[2].kind in SLOW_FAULTS:
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
        made = http_of(cache).engine.requests
        assert site.server.wait_for(made)  # a request the client gave up on may be logged after
        asked = site.hits
        for key in published.values:  # paused: no request at all
            assert cache.get(key) is None
        compiles_right(cache, published)
        assert (http_of(cache).engine.requests, site.hits) == (made, asked)
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


#: (layout, the file prefix, the fault) of each wrong answer: a flipped byte, or a Content-Length 100
#: bytes short of the blob (the body as long as it says).
WRONG = {
    f"{layout}-{name}": (layout, where, fault)
    for layout, where in (("loose", "blobs/"), ("packed", "packs/pack"))
    for name, fault in (("flipped", Fault.wrong_bytes(times=1)), ("short", Fault.lie_length(-100, times=1)))
}


@pytest.mark.parametrize("wrong", WRONG.values(), ids=WRONG.keys())
def test_wrong_bytes_are_a_miss_counted_in_corrupt_and_never_kept(
    tmp_path: Path, published: Published, caplog: pytest.LogCaptureFixture, wrong: tuple[str, str, Fault]
) -> None:
    layout, where, fault = wrong
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    with Site(tmp_path, getattr(published, layout)) as site, node(tmp_path, site.url) as cache:
        cache.get("k3")  # opens the store, and for packs fetches their index, before the fault is set
        site.set(where, fault)
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
        assert http_of(cache).engine.requests == 1
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


def test_a_store_that_answers_manifests_and_fails_blobs_is_paused_for_the_first_pause_each_time(
    tmp_path: Path, published: Published, clock: FrozenClock
) -> None:
    """Each manifest is an answer, so the count of failures starts again: 5 s, 5 s, 5 s, never 10 s."""

    def blobs_asked() -> int:
        return sum(n for path, n in site.server.hits_by_path().items() if "/blobs/" in path)

    with Site(tmp_path, published.loose) as site, node(tmp_path, site.url) as cache:
        site.set("blobs/", Fault.status(503))
        for failures in range(1, 5):
            assert cache.get("k0") is None
            assert blobs_asked() == failures, f"not asked {RETRY_S} s after failure {failures - 1}"
            assert cache.get("k1") is None  # paused: not asked
            assert blobs_asked() == failures
            clock.advance(RETRY_S)
        assert cache.counters()["errors"] == 4


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
        assert 1 <= http_of(cache).engine.requests <= len(threads)
        assert site.hits <= site.server.connections <= len(threads)
        asked = site.hits
        site.server.clear()
        clock.advance(RETRY_S)
        assert cache.get("k0") == published.values["k0"]
        assert site.hits > asked


# -- one deadline per request: a server decides nothing about how long a lookup waits ------------------

#: (id, layout, the file prefix, the fault). Each holds part of its answer back, a piece within every
#: per-recv timeout (0.2 s < 1 s). With only those timeouts each held a lookup for as long as the
#: server liked: http.client reads 64 KiB a line and 100 header lines (days at these rates).
HOLDS = [
    ("status-line", "loose", "index/", Fault.trickle_status(ms=200)),
    ("headers", "loose", "index/", Fault.trickle_headers(ms=200)),
    ("body", "loose", "blobs/", Fault.trickle(ms=200)),
    ("stalled-after-headers", "loose", "blobs/", Fault.stall_body()),
    ("pack-range-status-line", "packed", "packs/pack", Fault.trickle_status(ms=200)),
    ("pack-range-headers", "packed", "packs/pack", Fault.trickle_headers(ms=200)),
]
#: Slack over the deadline for a loaded machine (2 cores shared): the bound is still seconds, not days.
SLACK_S = 3.0


def timed_get(cache: ContentAddressedProgramCache, key: str) -> tuple[bytes | None, float]:
    """``cache.get(key)`` in a thread joined with a bound, so a lookup that hangs fails here; its time."""
    got: list[bytes | None] = []
    start = time.monotonic()
    worker = threading.Thread(target=lambda: got.append(cache.get(key)), daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), f"the lookup of {key} was still waiting after 30 s"
    return got[0], time.monotonic() - start


@pytest.mark.slow
@pytest.mark.usefixtures("short_timeouts")
@pytest.mark.parametrize("hold", [pytest.param(h[1:], id=h[0]) for h in HOLDS])
def test_a_server_holding_back_any_part_of_its_answer_is_cut_off_at_the_deadline(
    tmp_path: Path, published: Published, caplog: pytest.LogCaptureFixture, hold: tuple[str, str, Fault]
) -> None:
    layout, where, fault = hold
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    with Site(tmp_path, getattr(published, layout)) as site, node(tmp_path, site.url) as cache:
        site.set(where, fault)
        data, took = timed_get(cache, "k0")
        assert data is None
        # No request of this lookup may take in bytes more than a manifest's bound or k0's blob.
        bound = client.deadline_for(max(MAX_MANIFEST_BYTES, len(published.values["k0"])))
        assert took < bound + SLACK_S, (took, bound)
        (warning,) = warnings_about(caplog, site.url)
        assert "timeout" in warning, warning
        made = http_of(cache).engine.requests
        for key in published.values:  # paused: no request
            assert cache.get(key) is None
        compiles_right(cache, published)
        assert http_of(cache).engine.requests == made


@pytest.mark.slow
@pytest.mark.usefixtures("short_timeouts")
def test_a_tls_handshake_trickled_a_byte_at_a_time_is_cut_off(
    tmp_path: Path, published: Published, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that starts a 16 KiB handshake record and sends a byte of it every 0.2 s: a miss, a pause."""
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    with Site(tmp_path, published.loose) as site:
        site.server.trickle_handshake(ms=200)
        url = site.url.replace("http://", "https://", 1)
        with node(tmp_path, url) as cache:
            data, took = timed_get(cache, "k0")
            assert data is None
            assert took < client.deadline_for(4096) + SLACK_S, took  # layout.json: 4 KiB at most
            assert cache.get("k1") is None
            assert http_of(cache).engine.requests == 1
            (warning,) = warnings_about(caplog, http_of(cache).root)
            assert "timeout" in warning, warning


def test_the_time_a_request_earns_stops_at_the_ceiling_whatever_size_a_server_claims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A manifest of 10**15 bytes once earned 2.4e8 s; the bytes that earn time are those the cache allows."""
    client.close_connections()
    ceiling = env_max_entry_size()
    connect, read = client.timeouts()
    assert client.deadline_for(10**15) == client.deadline_for(ceiling)
    assert client.deadline_for(ceiling) == pytest.approx(connect + read + ceiling / (4 << 20))
    monkeypatch.setenv(ENV_MAX_ENTRY_SIZE, "8M")
    assert client.deadline_for(10**15) == pytest.approx(connect + read + 2)


# -- bounds: a server decides nothing about how much a node reads -------------------------------------


def write_manifest(store: Path, key: str, digest: str, size: int) -> None:
    """Put a manifest for ``key`` into ``store`` that names ``digest`` and claims ``size`` bytes (listed too)."""
    import conftest

    conftest.write_manifest(store, key, digest, size)


def blob_url_path(site: Site, digest: str) -> str:
    return f"/{site.name}/blobs/{digest[:2]}/{digest[2:]}"


@pytest.mark.parametrize("how", ["claims-10**15", "over-the-ceiling", "over-the-cap"])
def test_an_entry_larger_than_the_node_reads_is_a_miss_with_no_request_for_its_blob(
    tmp_path: Path,
    published: Published,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """The size is checked before the blob is asked for: a manifest's claim, the ceiling, the local cap."""
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    big = max(published.values, key=lambda k: len(published.values[k]))
    small = min(published.values, key=lambda k: len(published.values[k]))
    size, digest = len(published.values[big]), digest_of(published.values[big])
    cap = None
    with Site(tmp_path, published.loose) as site:
        if how == "claims-10**15":
            write_manifest(site.store, big, digest, 10**15)
        elif how == "over-the-ceiling":
            monkeypatch.setenv(ENV_MAX_ENTRY_SIZE, str(size - 1))
        else:
            cap = size + LONGEST_MANIFEST - 1  # the entry could never be kept under it
        with ContentAddressedProgramCache(tmp_path / "node", shared=[site.url], max_size_bytes=cap) as cache:
            assert cache.get(big) is None
            assert http_of(cache).miss_reason().startswith("too large"), http_of(cache).miss_reason()
            assert site.server.hits(blob_url_path(site, digest)) == 0
            assert cache.get(small) == published.values[small]  # no pause, nothing counted as wrong
            counts = cache.counters()
            assert (counts["errors"], counts["corrupt"]) == (0, 0)
        (warning,) = warnings_about(caplog, site.url)
        assert "not fetched" in warning


def test_a_packed_entry_over_the_ceiling_is_a_miss_its_request_cut_at_the_frame_header(
    tmp_path: Path, published: Published, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    big = max(published.values, key=lambda k: len(published.values[k]))
    monkeypatch.setenv(ENV_MAX_ENTRY_SIZE, str(len(published.values[big]) - 1))
    with Site(tmp_path, published.packed) as site, node(tmp_path, site.url) as cache:
        (pack,) = (site.store / "packs").glob("*.cpk")
        assert cache.get(big) is None
        # Its trailer and index, then its blob's first bytes: the frame states its raw size (the index, the stored).
        assert site.server.hits(f"/{site.name}/packs/{pack.name}") == 3
        assert cache.counters()["corrupt"] == 0  # over this node's ceiling is a miss, not damage
        (warning,) = warnings_about(caplog, site.url)
        assert f"{len(published.values[big])} bytes" in warning and "not fetched" in warning


@pytest.mark.parametrize(
    "fault",
    [Fault.endless(), Fault.endless(10 * 10**9), Fault.lie_length(1 << 20)],  # over the raw size: blobs are compressed
    ids=["endless", "content-length-10GB", "content-length-over"],
)
def test_a_body_longer_than_asked_is_cut_off_and_a_miss_not_a_pause(
    tmp_path: Path, published: Published, fault: Fault
) -> None:
    with Site(tmp_path, published.loose) as site, node(tmp_path, site.url) as cache:
        site.set("blobs/", fault)
        assert cache.get("k0") is None
        assert http_of(cache).miss_reason() == "bad answer: too large"
        site.server.clear()
        assert cache.get("k1") == published.values["k1"]  # asked at once: a bad answer is no outage
        assert cache.counters()["errors"] == 1
        assert list((tmp_path / "node" / "tmp").iterdir()) == []


def test_a_server_that_ignores_range_makes_packed_entries_misses_with_one_warning(
    tmp_path: Path, published: Published, caplog: pytest.LogCaptureFixture
) -> None:
    """A 200 of the whole pack to each Range request: a hit's blob (its index held), then a new node's trailer."""
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    with Site(tmp_path, published.packed) as site:
        with node(tmp_path, site.url) as cache:
            assert cache.get("k0") == published.values["k0"]  # the pack's index is held
            site.set("packs/", Fault.no_ranges())
            assert cache.get("k1") is None
            site.server.clear()
            assert cache.get("k1") == published.values["k1"]  # asked again at once: no pause
            counts = cache.counters()
            assert (counts["corrupt"], counts["errors"]) == (0, 0)
            (warning,) = warnings_about(caplog, site.url)
            assert "the whole object to a Range request; packs need a server that honours Range" in warning
        site.set("packs/", Fault.no_ranges())
        with node(tmp_path, site.url, name="new") as cache:
            assert cache.get("k2") is None  # its trailer was not had: no pack known
            assert (cache.counters()["corrupt"], cache.counters()["errors"]) == (0, 0)
            assert site.server.hits(f"/{site.name}/packs/list") >= 2
        assert all("honours Range" in w for w in warnings_about(caplog, site.url))


def _store_of_two_packs(tmp_path: Path) -> tuple[Path, dict[str, bytes], dict[str, bytes]]:
    """A store published twice with --pack: its newer pack's entries and its older one's."""
    store = tmp_path / "two-packs"
    older = {f"old{i}": f"older {i} ".encode() * 40 for i in range(20)}
    newer = {f"new{i}": f"newer {i} ".encode() * 40 for i in range(20)}
    for name, values in (("a", older), ("b", newer)):
        with ContentAddressedProgramCache(tmp_path / name, shared=()) as src:
            for k, v in values.items():
                src[k] = v
        publish([tmp_path / name], store, pack=True)
    assert len(list((store / "packs").glob("*.cpk"))) == 2
    return store, newer, older


@pytest.mark.parametrize("claim", ["2**32-entries", "just-over-the-index-bound", "not-the-file-size"])
def test_a_pack_trailer_claiming_a_huge_index_is_refused_before_the_index_is_fetched(
    tmp_path: Path, published: Published, claim: str
) -> None:
    """A real pack whose trailer claims more entries (a 412 GB index for 2**32), served as that large or not.

    Only the trailer is asked for; the pack is then known bad for the process.
    """
    count = http_store.MAX_INDEX_BYTES // 96 if claim == "just-over-the-index-bound" else 2**32 - 1
    consistent = claim != "not-the-file-size"
    with Site(tmp_path, published.packed) as site, node(tmp_path, site.url) as cache:
        (pack,) = (site.store / "packs").glob("*.cpk")
        site.set(f"packs/{pack.name}", Fault.huge_trailer(count, consistent=consistent))
        for key in published.values:
            data, _took = timed_get(cache, key)
            assert data is None
        compiles_right(cache, published)
        assert site.server.hits(f"/{site.name}/packs/{pack.name}") == 1
        counts = cache.counters()
        assert (counts["corrupt"], counts["errors"]) == (1, 0)


def test_pack_indexes_past_the_bound_are_not_read_and_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Room for one index: the newer pack is read, the older one is not (and not fetched), one WARNING."""
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    store, newer, older = _store_of_two_packs(tmp_path)
    index_size = 1024 + 96 * len(newer)
    monkeypatch.setattr(http_store, "MAX_INDEX_BYTES", index_size + 96 * 5)
    with Site(tmp_path, store) as site, node(tmp_path, site.url) as cache:
        assert all(cache.get(k) == v for k, v in newer.items())
        assert all(cache.get(k) is None for k in older)
        old_pack = min(p.name for p in (site.store / "packs").glob("*.cpk"))
        assert site.server.hits(f"/{site.name}/packs/{old_pack}") == 1  # its trailer: the claim, then no more
        assert cache.counters()["corrupt"] == 0
        (warning,) = warnings_about(caplog, site.url)
        assert "not read" in warning


# -- layout.json: a store that is not one is paused like an outage ----------------------------------------


def _padded_layout(store: Path) -> bytes:
    """The store's own layout.json, made 5 KB with spaces inside its JSON: valid, and over the 4 KB it may be."""
    raw = (store / "layout.json").read_bytes().rstrip()
    assert raw.endswith(b"}")
    return raw[:-1] + b" " * 5000 + b"}"


LAYOUTS = [
    ("content-length-100MB", Fault.endless(100 << 20), None),
    ("endless", Fault.endless(), None),
    ("5KB", None, _padded_layout),
    ("damaged", None, lambda store: b'{"layout": "cuda-program-cas", "version": '),
    ("not-a-store", None, lambda store: b'{"layout": "something-else", "version": 1}\n'),
]


@pytest.mark.parametrize(("fault", "content"), [pytest.param(*row[1:], id=row[0]) for row in LAYOUTS])
def test_a_layout_json_too_large_damaged_or_not_a_store_pauses_the_store(
    tmp_path: Path,
    published: Published,
    clock: FrozenClock,
    fault: Fault | None,
    content: Callable[[Path], bytes] | None,
) -> None:
    """40 lookups cost one request, not 40; the pause's end asks once more; a mended store then reads."""
    with Site(tmp_path, published.loose) as site, node(tmp_path, site.url) as cache:
        good = (site.store / "layout.json").read_bytes()
        if content is not None:
            (site.store / "layout.json").write_bytes(content(site.store))
        if fault is not None:
            site.set("layout.json", fault)
        for i in range(40):
            assert cache.get(f"k{i % len(published.values)}") is None
        assert (site.hits, http_of(cache).engine.requests) == (1, 1)
        assert http_of(cache).miss_reason().startswith("store not usable: not a store")
        clock.advance(RETRY_S)
        assert cache.get("k0") is None
        assert site.hits == 2
        (site.store / "layout.json").write_bytes(good)
        site.server.clear()
        clock.advance(2 * RETRY_S)
        assert cache.get("k0") == published.values["k0"]


# -- memory: a real process reading a hostile store ---------------------------------------------------

#: A node's peak memory may grow by at most this while it reads the hostile store below (docs/http.md).
HOSTILE_GROWTH_BOUND = 50 << 20
#: A manifest's claim under the ceiling (256 MiB), and more than the bound: what a node that gathered
#: the body would hold.
CLAIM = 200 << 20

_HOSTILE_NODE = textwrap.dedent(
    """
    import json, os, resource, sys
    from cuda_program_cas import CacheStore

    # A node that reads whatever the server sends would take the machine: 3 GiB of address space
    # at most, so that it fails here (MemoryError) instead.
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))

    def peak():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) << 10 for l in f if l.startswith("VmHWM:"))

    local, warm_url, url, keys = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    warm = CacheStore(local + "-warm", shared=[warm_url])
    assert warm.get("k0") is not None  # urllib3 imported, the deadline thread running
    store = CacheStore(local, shared=[url])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from the memory in use now
    start = peak()
    missed = {}
    for key in keys:
        missed[key] = [store.get(key) is None, store.inner.shared[0].miss_reason()]
    print(json.dumps({"start": start, "grew": peak() - start, "missed": missed, "tmp": os.listdir(local + "/tmp")}))
    """
)


@pytest.mark.slow
def test_a_node_reading_a_hostile_store_stays_within_its_memory_bound(tmp_path: Path, published: Published) -> None:
    """Endless bodies, a Content-Length of 10 GB, claims of 10**15 and of 200 MiB, a trailer of 2**32 entries.

    Each was a node past 1.5 GB in under 25 s. Here each lookup is a miss and the node's peak
    memory (VmHWM, reset once the node is warm) grows by less than :data:`HOSTILE_GROWTH_BOUND`.
    """
    with Site(tmp_path, published.packed) as site:
        (pack,) = (site.store / "packs").glob("*.cpk")
        site.set(f"packs/{pack.name}", Fault.huge_trailer(2**32 - 1))
        hostile = {  # key: (what its manifest claims, what its blob's URL answers)
            "claims-10**15-endless": (10**15, Fault.endless()),
            "claims-10**15-10GB": (10**15, Fault.endless(10 * 10**9)),
            "claims-200MiB-endless": (CLAIM, Fault.endless()),
            "claims-200MiB-10GB": (CLAIM, Fault.endless(10 * 10**9)),
        }
        digests = {key: digest_of(key.encode()) for key in hostile}
        for key, (size, fault) in hostile.items():
            write_manifest(site.store, key, digests[key], size)
            site.server.set(blob_url_path(site, digests[key]), fault)
        warm = f"{tmp_path.name}-warm"
        shutil.copytree(published.loose, site.store.parent / warm)
        keys = [*hostile, *published.values]
        done = run_python(
            _HOSTILE_NODE, str(tmp_path / "node"), site.server.url(warm), site.url, ",".join(keys),
            env={client.ENV_HTTP_TIMEOUT: TIMEOUTS}, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        out = json.loads(done.stdout.strip().splitlines()[-1])
        asked = {key: site.server.hits(blob_url_path(site, digests[key])) for key in hostile}
        assert site.server.hits(f"/{site.name}/packs/{pack.name}") == 1  # the trailer only
    assert all(missed for missed, _reason in out["missed"].values()), out["missed"]
    for key, (size, _fault) in hostile.items():
        _missed, reason = out["missed"][key]
        if size > env_max_entry_size():  # refused before any request for it
            assert (asked[key], reason) == (0, f"too large: {size} bytes, more than {env_max_entry_size()}")
        else:  # asked, read up to what the manifest claims (or not at all: a Content-Length of 10 GB), cut off
            assert (asked[key], reason) == (1, "bad answer: too large")
    assert out["grew"] < HOSTILE_GROWTH_BOUND, out
    assert out["tmp"] == []
    print(f"peak memory grew by {out['grew'] / 2**20:.1f} MiB (from {out['start'] / 2**20:.1f} MiB)")


_STARVED_NODE = textwrap.dedent(
    """
    import resource, sys
    from cuda_program_cas import CacheStore

    local, url, big, small, other, read_only = sys.argv[1:7]
    store = CacheStore(local, shared=[url], read_only=read_only == "1")
    assert store.get(small) is not None  # warm: urllib3, the deadline thread, an open connection

    def vm_size():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) << 10 for l in f if l.startswith("VmSize:"))

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (32 << 20), hard))  # 32 MiB more: not the 64 MiB blob
    try:
        got = store.get(big)
        reason = store.inner.shared[0].miss_reason()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    print(got is None, reason, store.get(other) is not None, sep="|")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("read_only", [False, True], ids=["staged", "in-memory"])
def test_running_out_of_memory_for_a_large_hit_is_a_miss(tmp_path: Path, read_only: bool) -> None:
    """A real MemoryError: a child whose address space cannot hold a 64 MiB entry (the ceiling allows it).

    Staged (a writable local cache: the body goes to tmp/, the read-back fails) or gathered in
    memory (a read-only one): a miss, and the process reads on.
    """
    src = tmp_path / "src"
    with ContentAddressedProgramCache(src, shared=()) as cache:
        cache["big"] = os.urandom(64 << 20)
        cache["small"], cache["other"] = b"small entry", b"another small entry"
    publish([src], tmp_path / "www" / "store")
    ContentAddressedProgramCache(tmp_path / "node").close()  # exists, for the read-only open
    with FaultServer(tmp_path / "www") as server:
        done = run_python(
            _STARVED_NODE, str(tmp_path / "node"), server.url("store"), "big", "small", "other", str(int(read_only)),
            env={client.ENV_HTTP_TIMEOUT: TIMEOUTS}, timeout=120,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True|could not take the answer in: MemoryError|True", done.stdout


_DISK_FULL_NODE = textwrap.dedent(
    """
    import resource, signal, sys
    from cuda_program_cas import CacheStore

    local, url, big, other = sys.argv[1:5]
    store = CacheStore(local, shared=[url])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit is EFBIG, an OSError
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    got = store.get(big)  # staged past 1 MiB in the local cache's tmp/, which cannot take 8
    print(got is None, store.inner.shared[0].miss_reason(), store.get(other) is not None, sep="|")
    """
)


@pytest.mark.parametrize("packed", [False, True], ids=["loose", "packed"])
def test_a_staging_file_that_cannot_be_written_is_a_miss_not_an_outage(tmp_path: Path, packed: bool) -> None:
    """A hit's staging write fails mid-answer (a real EFBIG): this node's trouble, not the store's; no pause."""
    src = tmp_path / "src"
    with ContentAddressedProgramCache(src, shared=()) as cache:
        cache["big"], cache["other"] = os.urandom(8 << 20), b"another small entry"
    publish([src], tmp_path / "www" / "store", pack=packed)
    with FaultServer(tmp_path / "www") as server:
        done = run_python(
            _DISK_FULL_NODE, str(tmp_path / "node"), server.url("store"), "big", "other",
            env={client.ENV_HTTP_TIMEOUT: TIMEOUTS}, timeout=120,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True|could not take the answer in: OSError|True", done.stdout


# -- TLS and tokens, against nginx -------------------------------------------------------------------


def _nginx_store(
    tmp_path: Path, published: Published, *, token: str | None = None, tls: bool = False, certificate: str = "good"
) -> Nginx:
    """A started nginx serving a copy of the loose store under /store/ (skips where nginx cannot run).

    With ``tls``, its certificate is signed by a CA of its own (``server.cert``), which no one trusts
    unless told to (``CUDA_PROGRAM_CAS_CA_BUNDLE``).
    """
    server = nginx_or_skip(tmp_path / "nginx", token=token, tls=tls, certificate=certificate)
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
        assert http_of(cache).engine.requests == 1  # then paused
        (warning,) = warnings_about(caplog, url)
        assert "tls" in warning and "unable to get local issuer certificate" in warning, warning
        assert server.requests() == []  # the handshake failed: no request was made


#: The certificates signed by the CA that is trusted, and what the WARNING says of each.
BAD_CERTIFICATES = {"expired": "certificate has expired", "wrong-host": "IP address mismatch"}


@pytest.mark.parametrize("certificate", BAD_CERTIFICATES)
def test_tls_with_an_expired_or_wrong_host_certificate_is_a_miss_with_the_ca_trusted(
    tmp_path: Path,
    published: Published,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    certificate: str,
) -> None:
    """Certificates made by openssl and signed by the trusted CA: one expired in 2020, one for wrong.example."""
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    with _nginx_store(tmp_path, published, tls=True, certificate=certificate) as server:
        monkeypatch.setenv(client.ENV_CA_BUNDLE, str(server.cert))
        with node(tmp_path, server.read_url()) as cache:
            url = http_of(cache).root
            assert cache.get("k0") is None
            assert cache.get("k1") is None
            compiles_right(cache, published)
            assert (cache.counters()["errors"], http_of(cache).engine.requests) == (1, 1)
        (warning,) = warnings_about(caplog, url)
        assert "tls" in warning and BAD_CERTIFICATES[certificate] in warning, warning
        assert server.requests() == []


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
            for shared in store.inner.shared:
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
        # The right token: layout.json, packs/list (404), the key list, two manifests and blobs (the missing
        # key is not listed: no request); the wrong one: layout.json, denied. Nothing more: it is paused.
        statuses = sorted(e.status for e in server.requests(wait_for=8))
    assert statuses == [200] * 6 + [401] + [404], statuses
    text = log.read_text()
    assert "denied" in text and "401" in text and "DEBUG" in text
    for output in (text, done.stdout, done.stderr):
        assert right not in output
        assert wrong not in output


def test_a_netrc_in_home_gives_its_token_to_nginx(
    tmp_path: Path, published: Published, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No $NETRC: ``~/.netrc`` of a temp HOME, owner-only as Python's parser wants."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text(f"machine 127.0.0.1\n  login cas\n  password {TOKEN}\n")
    (home / ".netrc").chmod(0o600)
    monkeypatch.delenv("NETRC")
    monkeypatch.setenv("HOME", str(home))
    with _nginx_store(tmp_path, published, token=TOKEN) as server, node(tmp_path, server.read_url()) as cache:
        assert cache.get("k0") == published.values["k0"]
        assert cache.counters()["errors"] == 0
        assert {e.status for e in server.requests()} <= {200, 404}


def _netrc_readable_by_all(path: Path) -> None:
    path.write_text(f"machine 127.0.0.1 login cas password {TOKEN}\n")
    path.chmod(0o644)


#: A .netrc that cannot be used: (where it is: ~/.netrc or $NETRC, how it is made, what the WARNING says).
BAD_NETRCS = {
    "readable-by-all": ("home", _netrc_readable_by_all, "group or others may read it"),
    "garbage-quoting-the-token": (  # Python's message would quote the token: "bad follower token '...'"
        "env",
        lambda path: path.write_text(f"machine 127.0.0.1 {TOKEN} login cas\n"),
        "cannot be parsed (line 1)",
    ),
    "fifo": ("env", lambda path: os.mkfifo(path), "not a regular file"),
    "directory": ("env", lambda path: path.mkdir(), "not a regular file"),
}


@pytest.mark.parametrize("bad", BAD_NETRCS.values(), ids=BAD_NETRCS.keys())
def test_a_netrc_that_cannot_be_used_is_one_warning_and_ignored(
    tmp_path: Path,
    published: Published,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    bad: tuple[str, Callable[[Path], None], str],
) -> None:
    """Never a hang (a FIFO blocked the open), a crash or the token in a log: a WARNING, then no token (401)."""
    where, make, says = bad
    caplog.set_level(logging.DEBUG)  # every logger
    home = tmp_path / "home"
    home.mkdir()
    path = home / ".netrc" if where == "home" else tmp_path / "netrc"
    make(path)
    monkeypatch.setenv("HOME", str(home))
    if where == "home":
        monkeypatch.delenv("NETRC")
    else:
        monkeypatch.setenv("NETRC", str(path))
    try:
        with _nginx_store(tmp_path, published, token=TOKEN) as server, node(tmp_path, server.read_url()) as cache:
            data, _took = timed_get(cache, "k0")
            assert data is None
            assert cache.get("k1") is None
            assert [e.status for e in server.requests(wait_for=1)] == [401]
    finally:
        if path.is_fifo():  # a reader blocked in its open() is let go (ENXIO where there is none)
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    (warning,) = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and str(path) in r.getMessage()
    ]
    assert warning.startswith(f"cuda-program-cas: the .netrc {path} is ignored: ") and says in warning, warning
    for record in caplog.records:
        text = record.getMessage() + (logging.Formatter().formatException(record.exc_info) if record.exc_info else "")
        assert TOKEN not in text


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
        monkeypatch.setenv("CUDA_PROGRAM_CAS_SHARED", " ".join([str(a), url, str(b)]))
        assert env_shared() == [str(a), url, str(b)]
        with ContentAddressedProgramCache(tmp_path / "node", copy_shared_hits=False) as cache:
            stores = cache.store.inner.shared
            assert [type(s.engine) for s in stores] == [DirEngine, HttpEngine, DirEngine]
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
    monkeypatch.setenv("CUDA_PROGRAM_CAS_SHARED", ";".join([good[0], *bad, good[1]]))
    assert env_shared() == good
    assert env_shared() == good  # read again: no second WARNING
    messages = [r.getMessage() for r in caplog.records if r.name == "cuda_program_cas"]
    assert len(messages) == len(bad)
    assert all("left out" in m for m in messages)
    assert all(secret not in m for m in messages)
    assert any("credentials" in m for m in messages) and sum("query or fragment" in m for m in messages) == 2


_SEGMENT = st.text(
    st.characters(blacklist_characters=";|\x00/", blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp")),
    min_size=1,
    max_size=8,
)
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
def test_a_store_list_splits_back_into_what_was_joined(entries: list[str]) -> None:
    """Absolute directories (':' in them too) and URLs (with or without user, password, port) survive the split."""
    assert split_store_list(" ".join(entries)) == entries
    assert split_store_list(" ; ".join(entries)) == entries


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
    # connection of its own; the parent again, on its first connection (the child left it alone). The key
    # list: read by the parent, its copy the child's too.
    assert [r.connection for r in log] == [1] * 5 + [2] * 6 + [1] * 2, log
