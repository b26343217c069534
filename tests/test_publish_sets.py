"""Warm sets through publish and repack, against a real nginx (WebDAV) and a real redis-server.

A job's nodes write back into a store directory (``|write``): its entries, and the
job's set in ``sets/``. ``publish`` copies that store into HTTP or Redis, the set
after the entries it names, merged with the target's own; with ``--pack`` (and
after a ``repack`` of a directory store) each line names the pack and offset that
hold its entry now, so a cold node fetches the set in one multi-range request.
Requests are the servers' own counts (nginx's access log, INFO commandstats) and
round trips the forwarder's (tools/testkit/proxy.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.nginx import LogEntry, Nginx, nginx_or_skip
from testkit.proxy import Proxy
from testkit.redis_server import RedisServer

from cuda_program_cas import CacheStore, publish, repack
from cuda_program_cas._cli.main import main as cli_main
from cuda_program_cas._disk.layout import INDEX, url_path
from cuda_program_cas._disk.pack import PackReader
from cuda_program_cas._remote import client
from cuda_program_cas._shared import warmset
from cuda_program_cas.index import key_id

JOB = "train-llm"
N = 40
USED = [f"k{i}" for i in range(0, N, 2)]  # every other entry: ranges of one pack that do not touch


def value(i: int, size: int = 3000) -> bytes:
    return (f"entry {i} ".encode() * (size // 8 + 1))[:size]


def values(keys: list[str]) -> dict[str, bytes | None]:
    return {k: value(int(k[1:])) for k in keys}


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("CUDA_PROGRAM_CAS_JOB", JOB)
    return JOB


@pytest.fixture
def staged(tmp_path: Path, job: str) -> Path:
    """A store directory holding N entries, and the set of a job whose node used USED from it (write-back)."""
    filled = CacheStore(tmp_path / "filled")
    for i in range(N):
        filled.put(f"k{i}", value(i))
    store = tmp_path / "store"
    publish([tmp_path / "filled"], store)
    node = CacheStore(tmp_path / "job-node", shared=[f"{store}|write"])
    assert all(node.get(k) == value(int(k[1:])) for k in USED)
    node.close()
    assert node._shared is not None and node._shared.writeback is not None
    assert node._shared.writeback.sets_sent == 1
    listed = warmset.parse((store / warmset.set_name(job)).read_bytes())
    assert listed is not None and [e.kid for e in listed] == [key_id(k) for k in USED]
    assert all(e.pack is None for e in listed)  # loose in the store it was written to
    return store


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Nginx]:
    with nginx_or_skip(tmp_path / "nginx", tmp_path / "served") as server:
        yield server


def _cold(local: Path, url: str, keys: list[str]) -> tuple[dict[str, bytes | None], CacheStore]:
    node = CacheStore(local, shared=[url])
    assert node.inner.warm is not None and node.inner.warm.join(30)
    return {k: node.get(k) for k in keys}, node


def _logged(server: Nginx) -> list[LogEntry]:
    """Every request logged since the reset: those before a marker request of ours, once it is logged too."""
    client.request("GET", server.read_url("layout.json?marker"), limit=4096)
    for _ in range(100):
        log = server.requests(wait_for=1)
        if any(e.uri.endswith("?marker") for e in log):
            return [e for e in log if not e.uri.endswith("?marker")]
    raise AssertionError("nginx did not log the marker request")


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", maxsplit=1)[0])


# -- Redis ------------------------------------------------------------------------------------------


def test_publish_into_redis_copies_the_set_and_a_cold_node_fetches_it_in_3_round_trips(
    redis: RedisServer, staged: Path, tmp_path: Path, job: str
) -> None:
    report = publish([staged], redis.url)
    assert report.sets_published == 1 and report.problem_count == 0
    held = warmset.parse(redis.client().get(f"cpcas:{warmset.set_name(job)}"))
    assert held == warmset.parse((staged / warmset.set_name(job)).read_bytes())
    redis.reset_stats()
    with Proxy(("127.0.0.1", _port(redis.url))) as link:
        link.delay_up_ms = link.delay_down_ms = 10
        got, node = _cold(tmp_path / "cold", f"redis://127.0.0.1:{link.port}/0", USED)
        assert link.exchanges <= 3  # the handshake and layout.json, the set, one pipeline
    assert got == values(USED) and node.inner.warm is not None and node.inner.warm.fetched == len(USED)
    # layout.json, the set, a manifest and a blob per entry: no lookup after, every entry local.
    assert redis.commandstats()["getrange"] == 2 + 2 * len(USED)
    # Publishing again writes nothing: no entry, no set.
    redis.reset_stats()
    again = publish([staged], redis.url)
    assert again.sets_published == 0 and again.sets_unchanged == 1 and again.published == 0
    assert "set" not in redis.commandstats()


def test_publish_merges_the_set_into_the_one_the_store_has_the_sources_lines_first(
    redis: RedisServer, staged: Path, tmp_path: Path, job: str
) -> None:
    """Another node wrote the job's set into Redis by write-back: publish keeps its lines, after the source's."""
    other = CacheStore(tmp_path / "other", shared=[f"{redis.url}|write"])
    for k in ("x1", "x2", USED[0]):
        other.put(k, value(int(k[1:]) + 1000))
    other.close()
    report = publish([staged], redis.url)
    assert report.sets_published == 1 and report.conflicts == 1  # the store keeps its own USED[0]
    held = warmset.parse(redis.client().get(f"cpcas:{warmset.set_name(job)}"))
    assert held is not None
    assert [e.kid for e in held] == [key_id(k) for k in [*USED, "x1", "x2"]]


# -- HTTP: WebDAV ------------------------------------------------------------------------------------


def test_publish_pack_over_webdav_names_the_pack_and_offsets_and_a_cold_node_makes_3_requests(
    served: Nginx, staged: Path, tmp_path: Path, job: str
) -> None:
    report = publish([staged], served.dav_url(""), pack=True)
    assert report.sets_published == 1 and len(report.packs) == 1 and report.problem_count == 0
    pack = next((served.root / "packs").glob("pack-*.cpk"))
    reader = PackReader(str(pack))
    try:
        offsets = {e.key_id: e.offset for e in reader.entries()}
    finally:
        reader.close()
    held = warmset.parse((served.root / warmset.set_name(job)).read_bytes())
    assert held is not None and [e.kid for e in held] == [key_id(k) for k in USED]
    assert [(e.pack, e.offset) for e in held] == [(pack.name, offsets[e.kid]) for e in held]
    served.reset_log()
    with Proxy(("127.0.0.1", served.port)) as link:
        got, node = _cold(tmp_path / "cold", served.read_url("").replace(f":{served.port}/", f":{link.port}/"), USED)
        assert link.connections == 1 and link.exchanges == 3
    assert got == values(USED) and node.inner.warm is not None and node.inner.warm.fetched == len(USED)
    # The cold node reads under /store/ (publish wrote under /dav/: a late line of its own may follow the reset).
    log = [e for e in served.requests(wait_for=3) if e.uri.startswith("/store/")]
    assert [(e.uri.split("/store/", 1)[1], e.status) for e in log] == [
        ("layout.json", 200),
        (warmset.set_name(job), 200),
        (f"packs/{pack.name}", 206),
    ]
    # One request, several ranges (its entries compressed lie within a few KiB: one span, then the trailer).
    assert log[2].range.count(",") >= 1 and log[2].body_bytes < len(USED) * len(value(0)) // 4
    assert node.inner.shared[0].engine.requests == 3
    # Publishing again writes nothing new: no PUT, no MKCOL.
    served.reset_log()
    again = publish([staged], served.dav_url(""), pack=True)
    assert again.sets_published == 0 and again.sets_unchanged == 1 and again.packs == []
    assert [e.method for e in _logged(served) if e.method not in ("GET", "HEAD")] == []


def test_publish_over_webdav_loose_gives_a_set_of_parallel_gets_and_no_lookup_after(
    served: Nginx, staged: Path, tmp_path: Path, job: str
) -> None:
    report = publish([staged], served.dav_url(""))
    assert report.sets_published == 1
    served.reset_log()
    got, node = _cold(tmp_path / "cold", served.read_url(""), USED)
    assert got == values(USED) and node.inner.warm is not None and node.inner.warm.fetched == len(USED)
    assert node.inner.shared[0].engine.requests == 2 + 2 * len(USED)  # layout.json, the set, a manifest and a blob each


# -- what is copied, and what is refused ---------------------------------------------------------------


def test_a_damaged_source_set_is_refused_with_a_problem_line_and_never_copied(
    staged: Path, tmp_path: Path, job: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = staged / warmset.set_name(job)
    path.write_bytes(path.read_bytes()[:-30])  # cut short
    capsys.readouterr()
    assert cli_main(["publish", str(staged), str(tmp_path / "target")]) == 1
    out = capsys.readouterr().out
    assert f"damaged warm set (skipped): {path}" in out.splitlines()
    assert not (tmp_path / "target" / warmset.set_name(job)).exists()
    # The entries themselves were published: only the set was refused.
    assert CacheStore(tmp_path / "target").get(USED[0]) == value(0)


def test_a_source_line_whose_entry_the_source_no_longer_holds_is_left_out(
    staged: Path, tmp_path: Path, job: str
) -> None:
    (staged / url_path(INDEX, key_id(USED[3]))).unlink()  # evicted from the store since the set was written
    report = publish([staged], tmp_path / "target")
    assert report.sets_published == 1
    held = warmset.parse((tmp_path / "target" / warmset.set_name(job)).read_bytes())
    assert held is not None and [e.kid for e in held] == [key_id(k) for k in USED if k != USED[3]]


# -- repack of a directory store -----------------------------------------------------------------


def test_repack_rewrites_a_set_of_loose_entries_to_the_new_pack_one_request_for_a_cold_node(
    staged: Path, tmp_path: Path, job: str
) -> None:
    """A set written against loose entries would, after repack (and gc), send a node to copies that are gone."""
    with nginx_or_skip(tmp_path / "nginx", staged) as server:
        packed = repack(staged)
        assert packed.pack is not None
        name = Path(packed.pack).name
        held = warmset.parse((staged / warmset.set_name(job)).read_bytes())
        assert held is not None and [e.kid for e in held] == [key_id(k) for k in USED]
        assert {e.pack for e in held} == {name} and all(e.offset is not None for e in held)
        server.reset_log()
        got, node = _cold(tmp_path / "cold", server.read_url(""), USED)
        assert got == values(USED) and node.inner.warm is not None and node.inner.warm.fetched == len(USED)
        assert [e.uri.split("/store/", 1)[1] for e in server.requests(wait_for=3)][-1] == f"packs/{name}"
        assert node.inner.shared[0].engine.requests == 3
        # A second repack retires that pack: the set follows the entries into the newer one.
        second = repack(staged)
        assert second.pack is not None
        held = warmset.parse((staged / warmset.set_name(job)).read_bytes())
        assert held is not None and {e.pack for e in held} == {Path(second.pack).name}
