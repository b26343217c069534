"""Warm sets and parallel first hits, against a real redis-server, a real nginx and a lying server process.

A job's set (the entries it used) is written by write-back when the job ends; a
cold node of the same job fetches the entries it lists in a few requests, each
verified, and its own lookups then find them local. Requests are the servers'
own counts (INFO commandstats, nginx's access log) and round trips the
forwarder's (tools/testkit/proxy.py's ``exchanges``); real delays come from it too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from blake3 import blake3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.faults import Fault, FaultServer
from testkit.nginx import Nginx, nginx_or_skip
from testkit.proxy import Proxy
from testkit.redis_server import RedisServer

from cuda_program_cas import CacheStore, digest_of, publish
from cuda_program_cas._disk.layout import BLOBS, INDEX, url_path
from cuda_program_cas._remote import client, multipart
from cuda_program_cas._shared import warmset
from cuda_program_cas._shared.layer import SharedLayer
from cuda_program_cas._shared.writeback import WriteBack
from cuda_program_cas.index import LONGEST_MANIFEST, key_id

REPO = Path(__file__).resolve().parent.parent
JOB = "train-llm"


def _layer(store: CacheStore) -> SharedLayer:
    """The store's cluster layer (it names shared stores)."""
    assert store._shared is not None
    return store._shared


def _writeback(store: CacheStore) -> WriteBack:
    wb = _layer(store).writeback
    assert wb is not None
    return wb


def value(i: int, size: int = 3000) -> bytes:
    """Entry ``i``'s bytes: random (a pack keeps them raw: its ranges as long as the entries); cf. :func:`text`."""
    return blake3(f"entry {i}".encode()).digest(length=size)


def text(i: int, size: int = 3000) -> bytes:
    """Entry ``i``'s bytes as what compresses (a pack keeps them framed, a tenth of their size)."""
    return (f"entry {i} ".encode() * (size // 8 + 1))[:size]


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("CUDA_PROGRAM_CAS_JOB", JOB)
    return JOB


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", maxsplit=1)[0])


def _write_set(local: Path, store: str, keys: list[str], size: int = 3000) -> CacheStore:
    """A node of the job that stores (or finds) ``keys`` in order, and ends: its set goes to ``store``."""
    node = CacheStore(local, shared=[store])
    for k in keys:
        if node.get(k) is None:
            node.put(k, value(int(k[1:]), size))
    node.close()
    return node


# -- Redis ------------------------------------------------------------------------------------


def test_a_cold_node_fetches_its_set_in_one_pipeline_every_entry_verified(
    redis: RedisServer, tmp_path: Path, job: str
) -> None:
    keys = [f"k{i}" for i in range(60)]
    writer = _write_set(tmp_path / "a", f"{redis.url}|write", keys)
    assert _writeback(writer).sets_sent == 1
    # One blob damaged in the store: it is not fetched, and its lookup is a miss, never wrong bytes.
    redis.client().set(f"cpcas:{url_path(BLOBS, digest_of(value(7)))}", b"x" * 3000)
    redis.reset_stats()
    with Proxy(("127.0.0.1", _port(redis.url))) as link:
        link.delay_up_ms = link.delay_down_ms = 10
        node = CacheStore(tmp_path / "b", shared=[f"redis://127.0.0.1:{link.port}/0"])
        assert node.inner.warm is not None and node.inner.warm.join(30)
        fetched = redis.commandstats()
        # layout.json (none: an empty Redis store is one), the set, then a manifest and a blob per entry.
        assert fetched["getrange"] == 2 + 2 * len(keys)
        assert link.exchanges <= 3  # the connection's handshake and layout.json, the set, one pipeline
        assert node.inner.warm.fetched == len(keys) - 1 and node.counters()["corrupt"] == 1
        got = {k: node.get(k) for k in keys}
    assert got == {k: (None if k == "k7" else value(int(k[1:]))) for k in keys}
    # Only k7 was asked again (the store's key list, read at this first store lookup, then k7's manifest and its
    # damaged blob): every other entry was local.
    assert redis.commandstats()["getrange"] == fetched["getrange"] + 3


def test_a_warm_node_whose_lookups_all_hit_locally_never_reads_its_set(
    redis: RedisServer, tmp_path: Path, job: str
) -> None:
    """The fetch starts at the first local miss: a node that has everything asks the store for nothing."""
    keys = [f"k{i}" for i in range(30)]
    _write_set(tmp_path / "a", f"{redis.url}|write", keys)
    redis.reset_stats()
    node = CacheStore(tmp_path / "a", shared=[redis.url])  # the writer's own cache: every entry local
    assert all(node.get(k) == value(int(k[1:])) for k in keys)
    node.close()
    assert redis.commandstats().get("getrange", 0) <= 1  # layout.json at most: not the set, no entry
    assert node.inner.warm is not None and node.inner.warm.fetched == 0 and node.inner.warm.listed == 0


def test_a_set_naming_entries_that_are_gone_costs_only_their_misses(
    redis: RedisServer, tmp_path: Path, job: str
) -> None:
    keys = [f"k{i}" for i in range(40)]
    _write_set(tmp_path / "a", f"{redis.url}|write", keys)
    gone = keys[10:20]
    for k in gone:
        redis.client().unlink(f"cpcas:{url_path(INDEX, key_id(k))}")  # evicted by Redis, say
    redis.reset_stats()
    node = CacheStore(tmp_path / "b", shared=[redis.url])
    assert node.inner.warm is not None and node.inner.warm.join(30)
    assert node.inner.warm.fetched == len(keys) - len(gone)
    asked = redis.commandstats()["getrange"]
    assert asked == 2 + 2 * len(keys)
    got = {k: node.get(k) for k in keys}
    assert got == {k: (None if k in gone else value(int(k[1:]))) for k in keys}
    # The key list (read at the first store lookup; it still names them), then one manifest GET each: their misses.
    assert redis.commandstats()["getrange"] == asked + 1 + len(gone)
    assert node.counters()["corrupt"] == 0


def test_a_set_larger_than_the_cap_is_fetched_in_order_of_use_until_the_cap(
    redis: RedisServer, tmp_path: Path, job: str
) -> None:
    keys = [f"k{i}" for i in range(40)]
    _write_set(tmp_path / "a", f"{redis.url}|write", keys)
    cap = 10 * (3000 + LONGEST_MANIFEST) + 100
    redis.reset_stats()
    node = CacheStore(tmp_path / "b", max_size_bytes=cap, shared=[redis.url])
    assert node.inner.warm is not None and node.inner.warm.join(30)
    assert node.inner.warm.fetched == 10
    assert redis.commandstats()["getrange"] == 2 + 2 * 10
    stats = node.stats()
    assert stats.entries == 10 and stats.stored_bytes <= cap
    alone = CacheStore(tmp_path / "b", max_size_bytes=cap)  # the local cache by itself: the first ten, in order of use
    assert [k for k in keys if alone.get(k) is not None] == keys[:10]


def test_nodes_merge_their_sets_and_one_with_nothing_new_writes_none(
    redis: RedisServer, tmp_path: Path, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = f"{redis.url}|write"
    _write_set(tmp_path / "a", store, [f"k{i}" for i in range(10)])
    second = _write_set(tmp_path / "b", store, [f"k{i}" for i in range(10, 20)] + ["k0", "k1"])
    assert _writeback(second).sets_sent == 1
    listed = warmset.parse(redis.client().get(f"cpcas:{warmset.set_name(job)}"))
    assert listed is not None
    order = [f"k{i}" for i in range(10, 20)] + ["k0", "k1"] + [f"k{i}" for i in range(2, 10)]
    assert [e.kid for e in listed] == [key_id(k) for k in order]
    redis.reset_stats()
    third = _write_set(tmp_path / "c", store, ["k3", "k12"])
    assert _writeback(third).sets_sent == 0
    assert "set" not in redis.commandstats()
    # Another job's set is another object: this job's is untouched by it.
    monkeypatch.setenv("CUDA_PROGRAM_CAS_JOB", "another")
    _write_set(tmp_path / "d", store, ["k5"])
    assert warmset.parse(redis.client().get(f"cpcas:{warmset.set_name(job)}")) == listed


def test_a_damaged_set_is_ignored_and_lookups_go_on(redis: RedisServer, tmp_path: Path, job: str) -> None:
    keys = [f"k{i}" for i in range(5)]
    _write_set(tmp_path / "a", f"{redis.url}|write", keys)
    name = f"cpcas:{warmset.set_name(job)}"
    redis.client().set(name, redis.client().get(name)[:-20])  # cut short
    node = CacheStore(tmp_path / "b", shared=[redis.url])
    assert node.inner.warm is not None and node.inner.warm.join(30)
    assert node.inner.warm.fetched == 0
    assert {k: node.get(k) for k in keys} == {k: value(int(k[1:])) for k in keys}


# -- HTTP ---------------------------------------------------------------------------------------


class _OneRange(Nginx):
    """nginx that answers at most one range a request (``max_ranges 1``): several get the whole file."""

    def _server(self, listen: str, tls: str, auth: str, root: str) -> str:
        return super()._server(listen, tls, auth, root).replace("etag on;", "etag on;\n            max_ranges 1;")


def _packed(tmp_path: Path, n: int, size: int) -> Path:
    src = CacheStore(tmp_path / "src")
    for i in range(n):
        src.put(f"k{i}", value(i, size))
    return tmp_path / "src"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Nginx]:
    with nginx_or_skip(tmp_path / "nginx", tmp_path / "served") as server:
        yield server


def _packed_set(server: Nginx, tmp_path: Path, used: list[str], size: int) -> None:
    """A packed store of 40 entries on ``server``, and the set of a job that used ``used`` (read through the packs)."""
    publish([_packed(tmp_path, 40, size)], server.root, pack=True)
    writer = _write_set(tmp_path / "writer", f"{server.dav_url('')}|write", used, size)
    assert _writeback(writer).sets_sent == 1
    listed = warmset.parse((server.root / warmset.set_name(JOB)).read_bytes())
    assert listed is not None and all(e.pack is not None for e in listed)  # where each is, from the pack index


@pytest.mark.parametrize("framed", [False, True], ids=["raw entries", "framed entries"])
def test_a_packed_store_gives_a_set_in_one_multi_range_request_every_entry_verified(
    served: Nginx, tmp_path: Path, job: str, framed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if framed:
        monkeypatch.setattr(sys.modules[__name__], "value", text)  # what compresses: the pack holds frames
    used = [f"k{i}" for i in range(0, 40, 2)]  # every other entry: 20 ranges that do not touch
    _packed_set(served, tmp_path, used, 8000)
    pack_size = next((served.root / "packs").glob("pack-*.cpk")).stat().st_size
    assert (pack_size < 40 * 8000 // 10) == framed
    served.reset_log()
    node = CacheStore(tmp_path / "b", shared=[served.read_url("")])
    got = {k: node.get(k) for k in used}
    assert got == {k: value(int(k[1:]), 8000) for k in used}
    assert node.inner.warm is not None and node.inner.warm.fetched == len(used)
    log = served.requests(wait_for=3)
    pack = next((served.root / "packs").glob("pack-*.cpk")).name
    assert [(e.uri.split("/store/", 1)[1], e.status) for e in log] == [
        ("layout.json", 200),
        (warmset.set_name(job), 200),
        (f"packs/{pack}", 206),
    ]
    # One request for several ranges (entries within a few KiB in the pack asked as one: framed, the 20 blobs and
    # their index entries lie in one span, the trailer in another), less than the pack.
    assert (
        log[2].range.count(",") >= (1 if framed else 2)
        and log[2].body_bytes < (served.root / "packs" / pack).stat().st_size
    )
    assert node.inner.shared[0].engine.requests == 3


def test_a_lookup_that_missed_locally_just_before_its_entry_was_kept_finds_it_local_with_no_request(
    served: Nginx, tmp_path: Path, job: str
) -> None:
    # The window: a lookup misses locally, the fetch keeps its entry and is done, then the lookup asks the set.
    used = [f"k{i}" for i in range(0, 40, 2)]
    _packed_set(served, tmp_path, used, 8000)
    node = CacheStore(tmp_path / "b", shared=[served.read_url("")])
    warm = node.inner.warm
    assert warm is not None and warm.join(30) and warm.fetched == len(used)
    before = node.inner.shared[0].engine.requests
    found = _layer(node).find(key_id(used[0]), None)  # what CacheStore.get does after its local miss
    assert found is not None and found[0] == value(0, 8000)
    assert node.inner.shared[0].engine.requests == before  # found local, not asked of the store again
    node.close()


@pytest.mark.parametrize("refusing", ["max_ranges 1", "boundary", "unasked", "single", "bytes"])
def test_a_server_that_will_not_answer_several_ranges_truly_costs_misses_never_wrong_bytes(
    tmp_path: Path, job: str, refusing: str
) -> None:
    used = [f"k{i}" for i in range(0, 40, 2)]
    with nginx_or_skip(tmp_path / "nginx", tmp_path / "served") as server:
        _packed_set(server, tmp_path, used, 8000)
    root = tmp_path / "served"
    if refusing == "max_ranges 1":
        with _OneRange(tmp_path / "one", root).start() as one:
            one.reset_log()
            got, node = _cold(tmp_path / "b", one.read_url(""), used)
            made = node.inner.shared[0].engine.requests
            statuses = [(e.status, e.range.count(",")) for e in one.requests(wait_for=made)]
            assert statuses[2][0] == 200 and statuses[2][1] >= 2  # the whole pack, not the ranges: refused (too long)
    else:
        with FaultServer(root) as site:
            site.set_default(Fault.lie_ranges(refusing))
            got, node = _cold(tmp_path / "b", site.url(""), used)
            asked = [r.headers.get("range", "") for r in site.log]
        assert sum("," in r for r in asked) == 1  # the one multi-range request, then entries one by one
    assert got == {k: value(int(k[1:]), 8000) for k in used}
    assert node.inner.warm is not None
    # A part's first byte flipped damages the first blob of each part: those are not fetched (counted), nor is the
    # key whose index entry begins the part of index entries (its line no longer matches the pack's word).
    damaged = node.counters()["corrupt"]
    assert damaged >= 2 if refusing == "bytes" else damaged == 0
    if refusing == "bytes":
        assert len(used) - damaged - 1 <= node.inner.warm.fetched <= len(used) - damaged
    else:
        assert node.inner.warm.fetched == 0
    not_fetched = len(used) - node.inner.warm.fetched
    assert node.counters()["shared_hits"] >= not_fetched
    # The ordinary way: the listing, the pack's trailer and index, one range per entry (after layout, set, refused).
    assert node.inner.shared[0].engine.requests == 3 + 3 + not_fetched


def _cold(local: Path, url: str, keys: list[str]) -> tuple[dict[str, bytes | None], CacheStore]:
    node = CacheStore(local, shared=[url])
    assert node.inner.warm is not None and node.inner.warm.join(30)
    return {k: node.get(k) for k in keys}, node


def test_a_loose_store_gives_a_set_by_parallel_gets(served: Nginx, tmp_path: Path, job: str) -> None:
    keys = [f"k{i}" for i in range(48)]
    publish([_packed(tmp_path, 48, 3000)], served.root)
    _write_set(tmp_path / "writer", f"{served.dav_url('')}|write", keys)
    served.reset_log()
    got, node = _cold(tmp_path / "b", served.read_url(""), keys)
    assert got == {k: value(int(k[1:])) for k in keys}
    assert node.inner.shared[0].engine.requests == 2 + 2 * len(
        keys
    )  # layout, set, a manifest and a blob each: no lookup after
    log = served.requests(wait_for=node.inner.shared[0].engine.requests)
    assert 1 < len({e.connection for e in log}) <= client.PARALLEL


# -- bursts of first hits ---------------------------------------------------------------------------


def _through(server: Nginx, link: Proxy) -> str:
    return server.read_url("").replace(f":{server.port}/", f":{link.port}/")


def _burst(node: CacheStore, keys: list[str]) -> tuple[dict[str, bytes | None], list[threading.Thread]]:
    got: dict[str, bytes | None] = {}
    start = threading.Barrier(len(keys))

    def look(k: str) -> None:
        start.wait()
        got[k] = node.get(k)

    threads = [threading.Thread(target=look, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got, threads


def test_32_threads_of_first_hits_go_in_parallel_over_at_most_16_connections(served: Nginx, tmp_path: Path) -> None:
    keys = [f"k{i}" for i in range(32)]
    publish([_packed(tmp_path, 32, 3000)], served.root)
    with Proxy(("127.0.0.1", served.port)) as link:
        link.delay_up_ms = link.delay_down_ms = 10
        node = CacheStore(tmp_path / "b", shared=[_through(served, link)])
        node.get("warm-up")  # layout.json and packs/list, so the burst is the 32 lookups alone
        served.reset_log()
        got, threads = _burst(node, keys)
        assert not any(t.is_alive() for t in threads)
    assert got == {k: value(int(k[1:])) for k in keys}
    log = served.requests(wait_for=2 * len(keys))
    connections = {e.connection for e in log}
    # In parallel (many connections at once), bounded: never more than PARALLEL.
    assert client.PARALLEL // 2 <= len(connections) <= client.PARALLEL
    assert link.connections <= client.PARALLEL + 1


def test_a_dead_server_costs_32_threads_one_batch_of_requests_and_no_hang(
    served: Nginx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(client.ENV_HTTP_TIMEOUT, "0.5,0.5")
    client.close_connections()
    publish([_packed(tmp_path, 32, 3000)], served.root)
    try:
        with Proxy(("127.0.0.1", served.port)) as link:
            node = CacheStore(tmp_path / "b", shared=[_through(served, link)])
            node.get("warm-up")
            before = link.connections
            link.stall = True  # a server that takes connections and never answers
            got, threads = _burst(node, [f"k{i}" for i in range(32)])
            assert not any(t.is_alive() for t in threads)  # each gave up within its deadline
            assert set(got.values()) == {None} and node.inner.shared[0].paused()
            assert link.connections - before <= client.PARALLEL  # one batch; the others waited, then gave up
            again, _ = _burst(node, [f"k{i}" for i in range(32)])
            assert set(again.values()) == {None} and link.connections - before <= client.PARALLEL  # paused: no request
    finally:
        client.close_connections()


# -- several ranges from a real nginx, read by the strict parser ---------------------------------


@pytest.fixture(scope="module")
def ranged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Nginx, bytes]]:
    where = tmp_path_factory.mktemp("ranged")
    data = os.urandom(200_000)
    (where / "served").mkdir()
    (where / "served" / "file").write_bytes(data)
    with nginx_or_skip(where / "nginx", where / "served") as server:
        yield server, data


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 199_000), st.integers(1, 5000)), min_size=1, max_size=30))
def test_nginx_answers_to_several_ranges_parse_to_exactly_the_bytes_asked(
    ranged: tuple[Nginx, bytes], spans: list[tuple[int, int]]
) -> None:
    server, data = ranged
    spans = [(a, min(n, len(data) - a)) for a, n in spans]
    asked = multipart.coalesce(spans)
    reply = client.request("GET", server.read_url("file"), headers={"Range": multipart.header(asked)}, limit=1 << 22)
    assert reply.status == 206
    if len(asked) == 1:
        assert reply.body == data[asked[0][0] : sum(asked[0])]
        return
    got = multipart.parse(reply.headers["content-type"], reply.body, asked)
    assert got is not None and got == ({a: data[a : a + n] for a, n in asked}, len(data))
    # The same answer judged against other ranges than were asked: never bytes, only None.
    shifted = [(a + 1, n) if i == 0 else (a, n) for i, (a, n) in enumerate(asked)]
    assert multipart.parse(reply.headers["content-type"], reply.body, shifted) is None
    assert multipart.parse(reply.headers["content-type"].replace("boundary=", "boundary=x"), reply.body, asked) is None
    assert multipart.parse(reply.headers["content-type"], reply.body[:-10], asked) is None


def test_a_directory_store_named_writable_keeps_the_set_as_a_file_its_tools_accept(tmp_path: Path, job: str) -> None:
    from cuda_program_cas import verify

    CacheStore(tmp_path / "store").close()
    keys = [f"k{i}" for i in range(8)]
    writer = _write_set(tmp_path / "a", f"{tmp_path / 'store'}|write", keys)
    assert _writeback(writer).sets_sent == 1
    listed = warmset.parse((tmp_path / "store" / warmset.set_name(job)).read_bytes())
    assert listed is not None and [e.kid for e in listed] == [key_id(k) for k in keys]
    got, node = _cold(tmp_path / "b", str(tmp_path / "store"), keys)
    assert (
        got == {k: value(int(k[1:])) for k in keys}
        and node.inner.warm is not None
        and node.inner.warm.fetched == len(keys)
    )
    assert verify(tmp_path / "store").problem_count == 0  # sets/ is no problem of the store's


def test_a_store_that_never_answers_costs_a_cold_node_one_timeout_for_its_set_and_its_lookups(
    served: Nginx, tmp_path: Path, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(client.ENV_HTTP_TIMEOUT, "0.5,0.5")
    client.close_connections()
    keys = [f"k{i}" for i in range(16)]
    publish([_packed(tmp_path, 16, 3000)], served.root, pack=True)
    _write_set(tmp_path / "writer", f"{served.dav_url('')}|write", keys)
    try:
        with Proxy(("127.0.0.1", served.port)) as link:
            link.stall = True
            node = CacheStore(tmp_path / "b", shared=[_through(served, link)])
            got, threads = _burst(node, keys)  # they wait for the set, which never comes; then the store is paused
            assert not any(t.is_alive() for t in threads)
            assert node.inner.warm is not None and node.inner.warm.join(10) and node.inner.warm.fetched == 0
            assert set(got.values()) == {None} and node.inner.shared[0].paused()
            assert link.connections == 1  # the set's request alone: no lookup asked the dead server again
    finally:
        client.close_connections()


def test_the_job_is_the_variable_else_the_main_script_and_none_for_an_interactive_session(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("from cuda_program_cas._shared.warmset import job_name\nprint(job_name())\n")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_PROGRAM_CAS_JOB"}

    def job(*argv: str, **extra: str) -> str:
        done = subprocess.run(
            [sys.executable, *argv], env={**env, **extra}, capture_output=True, text=True, check=True, timeout=60
        )
        return done.stdout.strip()

    by_script = job(str(script))
    assert by_script.startswith("train.py-") and len(by_script) == len("train.py-") + 8
    assert job(str(script)) == by_script  # stable: every node running this script is one job
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "train.py").write_text(script.read_text())
    assert job(str(other / "train.py")) != by_script  # a script of the same name elsewhere is another job
    assert job("-c", script.read_text().replace("\n", ";")) == "None"
    assert job(str(script), CUDA_PROGRAM_CAS_JOB="train-llm") == "train-llm"
    assert job(str(script), CUDA_PROGRAM_CAS_JOB="off") == "None"
