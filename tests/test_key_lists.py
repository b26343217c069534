"""Key lists: a store says what it holds, so a miss costs no request, and a lookup slower than its compile is skipped.

Against a real nginx and a real redis-server: requests are nginx's access log and
Redis's own INFO commandstats; real delays come from the tests' forwarder
(tools/testkit/proxy.py). A key list can only turn a hit into a miss, never give bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.nginx import Nginx, nginx_or_skip
from testkit.proxy import Proxy
from testkit.redis_server import RedisServer

from cuda_program_cas import CacheStore, digest_of, publish
from cuda_program_cas._disk.direngine import DirEngine
from cuda_program_cas._shared import keylist
from cuda_program_cas._shared.layer import SharedLayer
from cuda_program_cas._shared.tier import Tier
from cuda_program_cas._shared.upload import upload_entry
from cuda_program_cas._shared.writeback import WriteBack
from cuda_program_cas.index import Manifest, key_id


def _layer(store: CacheStore) -> SharedLayer:
    """The store's cluster layer (it names shared stores)."""
    assert store._shared is not None
    return store._shared


def _writeback(store: CacheStore) -> WriteBack:
    wb = _layer(store).writeback
    assert wb is not None
    return wb


def value(i: int) -> bytes:
    return (f"entry {i} ".encode() * 400)[:3000]


def _source(where: Path, keys: list[str]) -> Path:
    src = CacheStore(where)
    for k in keys:
        src.put(k, value(int(k[1:])))
    return where


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Nginx]:
    with nginx_or_skip(tmp_path / "nginx", tmp_path / "served") as server:
        yield server


def _commands(redis: RedisServer) -> dict[str, int]:
    """Redis's own counts of the commands it ran since its last reset (the reset itself left out)."""
    return {name: n for name, n in redis.commandstats().items() if name != "config|resetstat"}


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", maxsplit=1)[0])


# -- misses with no request -------------------------------------------------------------------


def test_over_http_a_key_the_list_lacks_is_a_miss_with_no_request(served: Nginx, tmp_path: Path) -> None:
    publish([_source(tmp_path / "src", ["k1", "k2"])], served.root)
    node = CacheStore(tmp_path / "node", shared=[served.read_url("")])
    assert node.get("k1") == value(1)  # layout.json, packs/list, the key list, then its manifest and blob
    tier = node.inner.shared[0]
    before = tier.engine.requests
    served.reset_log()
    assert all(node.get(f"absent{i}") is None for i in range(20))
    assert tier.engine.requests == before and served.requests() == []
    assert node.counters()["listed_misses"] == 20 and tier.miss_reason() == "not in the store's key list"
    assert node.get("k2") == value(2)  # a listed key is asked as always
    assert [e.uri.rsplit("/", 3)[-3] for e in served.requests(wait_for=2)] == ["index", "blobs"]


def test_over_redis_a_key_the_list_lacks_is_a_miss_with_no_command(redis: RedisServer, tmp_path: Path) -> None:
    writer = CacheStore(tmp_path / "a", shared=[f"{redis.url}|write"])
    writer.put("k1", value(1))
    writer.close()  # the upload, then the key list
    node = CacheStore(tmp_path / "b", shared=[redis.url])
    assert node.get("k1") == value(1)
    redis.reset_stats()
    assert all(node.get(f"absent{i}") is None for i in range(20))
    assert _commands(redis) == {}
    assert node.counters()["listed_misses"] == 20


def test_a_key_added_after_the_list_was_read_is_found_after_the_refresh_and_unchanged_is_a_304(
    served: Nginx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish([_source(tmp_path / "src", ["k1"])], served.root)
    node = CacheStore(tmp_path / "node", shared=[served.read_url("")])
    assert node.get("k1") == value(1)
    publish([_source(tmp_path / "src2", ["k2"])], served.root)  # listed in the store, not yet in the node's copy
    assert node.get("k2") is None and node.inner.shared[0].miss_reason() == "not in the store's key list"
    monkeypatch.setattr(keylist, "REFRESH_S", 0.0)
    served.reset_log()
    assert node.get("k2") == value(2)  # asked again (changed: 200), then its manifest and blob
    keys_asked = [e.status for e in served.requests(wait_for=3) if e.uri.endswith("/keys")]
    assert keys_asked == [200]
    served.reset_log()
    assert node.get("absent") is None  # unchanged since: a 304, and no request for the key
    assert [(e.uri.rsplit("/", 1)[1], e.status) for e in served.requests(wait_for=1)] == [("keys", 304)]
    assert node.inner.shared[0].keys is not None and node.inner.shared[0].keys.unchanged == 1


@pytest.mark.parametrize("damage", ["header", "torn", "unsorted", "repeated", "oversized"])
def test_a_damaged_key_list_is_ignored_and_lookups_ask_as_without_one(
    served: Nginx, tmp_path: Path, damage: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    publish([_source(tmp_path / "src", ["k1", "k2"])], served.root)
    path = served.root / keylist.KEYS
    good = path.read_bytes()
    records = keylist.parse(good)
    assert records is not None and len(records) == 2
    body = good[len(keylist.HEADER) :]
    bad = {
        "header": b"cuda-program-cas keys 9\n" + body,
        "torn": good[:-1],
        "unsorted": keylist.HEADER + body[12:] + body[:12],
        "repeated": keylist.HEADER + body[:12] + body[:12],
        "oversized": good,
    }[damage]
    if damage == "oversized":
        monkeypatch.setattr(keylist, "MAX_BYTES", len(good) - 1)
    path.write_bytes(bad)
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    node = CacheStore(tmp_path / "node", shared=[served.read_url("")])
    assert node.get("k1") == value(1)
    served.reset_log()
    assert node.get("absent") is None  # asked: its manifest's 404
    assert [(e.uri.rsplit("/", 3)[-3], e.status) for e in served.requests(wait_for=1)] == [("index", 404)]
    assert node.counters()["listed_misses"] == 0 and node.inner.shared[0].miss_reason() == "no entry"
    assert node.get("k2") == value(2)
    assert sum("bad key list" in r.getMessage() for r in caplog.records) == 1  # said once, at DEBUG


# -- who keeps it --------------------------------------------------------------------------------


def test_write_back_and_publish_keep_the_list_and_a_third_node_finds_a_new_kernel(
    served: Nginx, tmp_path: Path
) -> None:
    publish([_source(tmp_path / "src", ["k1"])], served.root)
    second = CacheStore(tmp_path / "second", shared=[f"{served.dav_url('')}|write"])
    assert second.get("k1") == value(1)
    assert second.get("k9") is None  # listed miss: no request
    second.put("k9", value(9))  # a new kernel, compiled here, uploaded
    second.inner.note_compiled(key_id("k9"), 0.25, "plain", {})
    assert second.get("k9") == value(9)
    second.close()  # the upload, then the key list merged: k1 from publish kept, k9 added with its compile time
    listed = keylist.parse((served.root / keylist.KEYS).read_bytes())
    assert listed == {keylist.number(key_id("k1")): 0, keylist.number(key_id("k9")): 250}
    third = CacheStore(tmp_path / "third", shared=[served.read_url("")])
    assert third.get("k9") == value(9) and third.get("k1") == value(1)
    assert third.counters()["shared_hits"] == 2


def test_a_node_lists_what_it_wrote_back_at_once(redis: RedisServer, tmp_path: Path) -> None:
    node = CacheStore(tmp_path / "a", shared=[f"{redis.url}|write"])
    assert node.get("k1") is None  # reads the store's (absent) key list
    writer = CacheStore(tmp_path / "w", shared=[f"{redis.url}|write"])
    writer.put("k0", value(0))
    writer.close()  # a key list now, without k1
    node.put("k1", value(1))
    assert _writeback(node).flush(10)
    assert node.inner.shared[0].keys is not None
    assert keylist.number(key_id("k1")) in node.inner.shared[0].keys._ours


def test_the_lease_probe_finds_a_key_the_list_lacks(redis: RedisServer, tmp_path: Path) -> None:
    writer = CacheStore(tmp_path / "w", shared=[f"{redis.url}|write"])
    writer.put("k1", value(1))
    writer.close()
    node = CacheStore(tmp_path / "node", shared=[f"{redis.url}|write"])
    assert node.get("k1") == value(1)  # the node's copy of the key list: k1 alone
    # Another node's upload whose key-list merge has not come yet (it waits for its job to be quiet).
    data = value(2)
    kid = key_id("k2")
    upload_entry(
        node.inner.shared[0].engine, kid, digest_of(data), data, Manifest(digest_of(data), len(data), kid).encode()
    )
    assert node.get("k2") is None and node.inner.shared[0].miss_reason() == "not in the store's key list"
    found = _layer(node).find(kid, None, unlisted=True)  # what SharedLayer._claim_in_cluster's probe asks
    assert found is not None and found[0] == data
    assert node.get("k2") == data  # copied in


def test_publish_into_a_directory_lists_its_whole_index_and_rebuilds_a_damaged_list(tmp_path: Path) -> None:
    store = tmp_path / "store"
    old = CacheStore(store)  # a store written without a key list (as older versions leave one)
    old.put("k5", value(5))
    (store / keylist.KEYS).write_bytes(b"damaged")
    publish([_source(tmp_path / "src", ["k1"])], store)
    listed = keylist.parse((store / keylist.KEYS).read_bytes())
    assert listed is not None and set(listed) == {keylist.number(key_id("k1")), keylist.number(key_id("k5"))}


# -- never slower than compiling -------------------------------------------------------------------


@pytest.mark.parametrize("delay_ms", [20, 0])
def test_a_lookup_slower_than_its_compile_is_skipped_and_said(
    redis: RedisServer, tmp_path: Path, delay_ms: int, caplog: pytest.LogCaptureFixture
) -> None:
    writer = CacheStore(tmp_path / "w", shared=[f"{redis.url}|write"])
    writer.put("k1", value(1))
    writer.inner.note_compiled(key_id("k1"), 0.012, "plain", {})  # 12 ms, known
    writer.put("k2", value(2))  # compile time unknown: never skipped
    writer.close()
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    with Proxy(("127.0.0.1", _port(redis.url))) as link:
        link.delay_up_ms = link.delay_down_ms = delay_ms / 2
        node = CacheStore(tmp_path / "node", shared=[f"redis://127.0.0.1:{link.port}/0"])
        assert node.get("k2") == value(2)  # layout.json, the key list (timed), k2's manifest and blob
        tier = node.inner.shared[0]
        rtt = tier.rtt()
        assert rtt is not None
        redis.reset_stats()
        got = node.get("k1")
        asked = _commands(redis)
    skipped = [r.getMessage() for r in caplog.records if "compiling is faster" in r.getMessage()]
    if delay_ms:
        assert rtt * 2 > 0.012
        assert got is None and asked == {}  # no request
        assert node.counters()["skipped_lookups"] == 1
        assert tier.miss_reason().startswith("skipped: 2 requests x ") and tier.miss_reason().endswith(
            " ms > 12 ms compile"
        )
        assert len(skipped) == 1 and "skipped: 2 requests x" in skipped[0]
    else:
        assert got == value(1) and asked.get("getrange") == 2
        assert node.counters()["skipped_lookups"] == 0 and skipped == []


# -- the codec and lookups, for any keys ------------------------------------------------------------

_records = st.dictionaries(st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 32) - 1), max_size=200)
_kids = st.lists(st.binary(min_size=32, max_size=32).map(bytes.hex), max_size=40, unique=True)


@given(_records)
def test_the_codec_round_trips(records: dict[int, int]) -> None:
    assert keylist.parse(keylist.encode(records)) == records


@given(st.binary(max_size=300))
def test_any_bytes_parse_to_a_list_or_none_never_an_exception(data: bytes) -> None:
    parsed = keylist.parse(keylist.HEADER + data)
    assert parsed is None or keylist.encode(parsed) == keylist.HEADER + data


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_kids, _kids)
def test_no_listed_key_is_ever_reported_missing(listed: list[str], others: list[str]) -> None:
    with tempfile.TemporaryDirectory() as where:
        CacheStore(where).close()  # laid out
        engine = DirEngine(where)
        assert keylist.merge_into(engine, dict.fromkeys(map(keylist.number, others), 1))
        assert keylist.merge_into(engine, dict.fromkeys(map(keylist.number, listed), 0))
        read = DirEngine(where)
        read.can = dataclasses.replace(read.can, remote=True)  # read as a remote store is: through its key list
        tier = Tier(read)
        assert tier.keys is not None
        for kid in listed + others:
            assert tier.lookup(kid) is None  # no entry: asked, a plain miss
            assert tier.miss_reason() == "no entry"
        assert tier.counters.listed_misses == 0


def test_a_key_the_probe_finds_unlisted_makes_the_copy_lag_and_lookups_ask(redis: RedisServer, tmp_path: Path) -> None:
    """A node that waited for another's compile finds its other entries too (the front door's result)."""
    writer = CacheStore(tmp_path / "w", shared=[f"{redis.url}|write"])
    writer.put("k1", value(1))
    writer.close()
    node = CacheStore(tmp_path / "node", shared=[f"{redis.url}|write"])
    assert node.get("k1") == value(1)
    engine = node.inner.shared[0].engine
    for k in ("k2", "k3"):  # another node's compile: two entries, neither listed yet
        data, kid = value(int(k[1:])), key_id(k)
        upload_entry(engine, kid, digest_of(data), data, Manifest(digest_of(data), len(data), kid).encode())
    assert _layer(node).find(key_id("k2"), None, unlisted=True) is not None  # the probe
    assert node.get("k3") == value(3)  # asked, though the copy does not list it
    assert node.get("absent") is None and node.inner.shared[0].miss_reason() == "no entry"


# -- a large key list is held compactly ------------------------------------------------------------------------------

_RSS = """
import sys
from cuda_program_cas import CacheStore

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

small, large, node = sys.argv[1:]
warm = CacheStore(node + "-warm", shared=[small])
assert warm.get("absent") is None  # the HTTP side imported, its pool made, a small key list read
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak is now what the process holds
before = kib("VmRSS")
cold = CacheStore(node, shared=[large])
assert cold.get("absent") is None and cold.counters()["listed_misses"] == 1  # the large list read, and used
print(kib("VmHWM") - before)
"""


def test_a_full_size_key_list_costs_a_reader_at_most_twice_its_size(served: Nginx, tmp_path: Path) -> None:
    """The largest key list a store may hold (16 MiB, 1.4 million keys) peaks a node's memory at most at twice it."""
    from conftest import run_python

    for name, keys in (("small", ["k1"]), ("large", ["k2"])):
        publish([_source(tmp_path / f"src-{name}", keys)], served.root / name)
    count = (keylist.MAX_BYTES - len(keylist.HEADER)) // 12
    step = (1 << 64) // count
    records = {i * step: i % 5000 for i in range(count)}
    data = keylist.encode(records)
    assert len(data) <= keylist.MAX_BYTES and keylist.view(data) is not None
    (served.root / "large" / keylist.KEYS).write_bytes(data)
    del records
    done = run_python(_RSS, served.read_url("small"), served.read_url("large"), str(tmp_path / "node"))
    assert done.returncode == 0, done.stderr
    grew_kib = int(done.stdout.split()[-1])
    assert grew_kib * 1024 <= 2 * len(data), f"{grew_kib} KiB for a {len(data) >> 10} KiB key list"


def test_over_redis_a_full_size_key_list_costs_a_reader_at_most_twice_its_size(
    redis: RedisServer, tmp_path: Path
) -> None:
    """The same over a real redis-server: the reply's one bulk string is the list a node keeps, not a copy of it."""
    from conftest import run_python

    small, large = redis.url[: -len("/0")] + "/1", redis.url
    for url, keys in ((small, ["k1"]), (large, ["k2"])):
        publish([_source(tmp_path / f"src-{keys[0]}", keys)], url)
    count = (keylist.MAX_BYTES - len(keylist.HEADER)) // 12
    step = (1 << 64) // count
    data = keylist.encode({i * step: i % 5000 for i in range(count)})
    assert len(data) <= keylist.MAX_BYTES and keylist.view(data) is not None
    from cuda_program_cas._remote.redis import RedisEngine

    engine = RedisEngine(large)
    engine.put(keylist.KEYS, data)
    engine.close()
    done = run_python(_RSS, small, large, str(tmp_path / "node"))
    assert done.returncode == 0, done.stderr
    grew_kib = int(done.stdout.split()[-1])
    assert grew_kib * 1024 <= 2 * len(data), f"{grew_kib} KiB for a {len(data) >> 10} KiB key list"


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 32) - 1), max_size=60), st.data())
def test_the_held_list_answers_as_the_dict_of_its_records(records: dict[int, int], data: st.DataObject) -> None:
    listed = keylist.view(keylist.encode(records))
    assert listed is not None and len(listed) == len(records) and list(listed) == sorted(records)
    probes = data.draw(st.lists(st.integers(-1, 1 << 64), max_size=20)) + list(records)
    for k in probes:
        assert (k in listed) == (k in records)
        assert listed.get(k, -1) == records.get(k, -1)


def test_a_key_the_probe_finds_before_any_list_makes_a_later_copy_that_lacks_it_lag(
    redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store has no key list when the probe finds another node's entries; the copy fetched next (another
    writer's list, merged before that upload) lacks them, and lookups still ask: the front door's result is found."""
    node = CacheStore(tmp_path / "node", shared=[f"{redis.url}|write"])
    assert node.get("absent") is None  # the first fetch: no key list in the store yet
    engine = node.inner.shared[0].engine
    for k in ("k2", "k3"):  # another node's compile: two entries, neither listed
        data, kid = value(int(k[1:])), key_id(k)
        upload_entry(engine, kid, digest_of(data), data, Manifest(digest_of(data), len(data), kid).encode())
    assert _layer(node).find(key_id("k2"), None, unlisted=True) is not None  # the probe, while no copy is held
    writer = CacheStore(tmp_path / "w", shared=[f"{redis.url}|write"])
    writer.put("k1", value(1))
    writer.close()  # a key list now: k1 alone
    monkeypatch.setattr(keylist, "REFRESH_S", 0.0)
    assert node.get("k3") == value(3)  # the new copy lacks k2 and k3: it lags, and the lookup asks
    keys = node.inner.shared[0].keys
    assert keys is not None and keys.fetches >= 2
