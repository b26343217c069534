"""One contract, every engine: the same tests against each row of :data:`FACTORIES`, on real servers.

Each row makes an engine over a fresh store on its real server (a directory; nginx
read-only and with WebDAV; a redis-server of the test's own; a prefix of its own in a
bucket of SeaweedFS's S3 gateway, one ``weed`` with credentials for the module), and is skipped only
where its server's binary is missing, as the engine's own tests are. What an engine
can do besides get, put and remove is its record (``engine.can``): every ability
the record declares is exercised through its accessor, and every one it denies is
refused (the accessor gives None, and the engine has no such method).

Adding an engine is adding a row: a context manager that yields a :class:`Made`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
from test_compressed import bomb_lying_frame, truncated, wrong_size
from test_compressed import value as compressible
from testkit.nginx import nginx_or_skip
from testkit.redis_server import redis_or_skip
from testkit.weed import WeedServer, weed_or_skip

from cuda_program_cas import CacheStore, digest_of, publish
from cuda_program_cas._base import frame
from cuda_program_cas._base.engine import (
    Abilities,
    Engine,
    StoreFailure,
    conditional,
    creates,
    leases,
    listing,
    ranged,
)
from cuda_program_cas._disk.direngine import DirEngine
from cuda_program_cas._disk.layout import BLOBS, INDEX, url_path
from cuda_program_cas._remote import client
from cuda_program_cas._remote.http import HttpEngine
from cuda_program_cas._remote.redis import RedisEngine
from cuda_program_cas._shared import warmset
from cuda_program_cas._shared.tiers import open_engine

JOB = "contract-job"


@dataclasses.dataclass
class Made:
    """One engine over a fresh store, and how the tests reach that store otherwise.

    ``engine``: the engine under test. ``seed``: an engine that writes where ``engine``
    reads (``engine`` itself where it writes; the served folder for a read-only server).
    ``read``/``write``: the store's address for a node that reads it, and for publish and
    write-back (``write`` without ``|write``). ``packs``: whether publish packs there.
    ``down``: stops the store's server (None: there is none, a directory).
    """

    engine: Engine
    seed: Engine
    read: str
    write: str
    packs: bool = True
    down: Callable[[], None] | None = None

    @property
    def writable(self) -> bool:
        return self.seed is self.engine


@contextmanager
def _directory(tmp: Path) -> Iterator[Made]:
    root = tmp / "store"
    root.mkdir()
    engine = DirEngine(str(root))
    yield Made(engine, engine, str(root), str(root))


@contextmanager
def _http_read_only(tmp: Path) -> Iterator[Made]:
    with nginx_or_skip(tmp / "nginx", tmp / "served") as server:
        engine, seed = HttpEngine(server.read_url("")), DirEngine(str(server.root))
        yield Made(engine, seed, server.read_url(""), str(server.root), down=server.stop)


@contextmanager
def _http_dav(tmp: Path) -> Iterator[Made]:
    with nginx_or_skip(tmp / "nginx", tmp / "served") as server:
        engine = HttpEngine(server.dav_url(""))
        yield Made(engine, engine, server.dav_url(""), server.dav_url(""), down=server.stop)


@contextmanager
def _redis(tmp: Path) -> Iterator[Made]:
    server = redis_or_skip(tmp / "redis")
    try:
        engine = RedisEngine(server.url)
        # Loose entries only (docs/redis.md).
        yield Made(engine, engine, server.url, server.url, packs=False, down=server.stop)
        engine.close()
    finally:
        server.stop()


#: The module's one ``weed`` (started by the first S3 row, stopped with the module, or by a row's ``down``).
_WEED: list[WeedServer] = []


@pytest.fixture(scope="module", autouse=True)
def _weed_stopped() -> Iterator[None]:
    yield
    while _WEED:
        _WEED.pop().stop()


@contextmanager
def _s3(tmp: Path) -> Iterator[Made]:
    from cuda_program_cas._remote.s3 import S3Engine  # botocore: only where this row runs

    if not _WEED:
        _WEED.append(weed_or_skip(tmp / "weed"))
    server = _WEED[0]
    # The server's AWS environment (the user's AWS files ignored), and deadlines as the S3 tests' own.
    saved = {k: v for k, v in os.environ.items() if k.startswith("AWS_") or k == client.ENV_HTTP_TIMEOUT}
    for name in saved:
        del os.environ[name]
    os.environ.update(server.env())
    os.environ[client.ENV_HTTP_TIMEOUT] = "2,5"
    client.close_connections()

    def down() -> None:
        server.stop()
        _WEED.clear()  # the next S3 row starts another

    try:
        address = f"s3://cas/{tmp.name.lower().replace('_', '-')}"
        engine = S3Engine(address)
        yield Made(engine, engine, address, address, down=down)
    finally:
        for name in [k for k in os.environ if k.startswith("AWS_") or k == client.ENV_HTTP_TIMEOUT]:
            del os.environ[name]
        os.environ.update(saved)
        client.close_connections()


#: Every engine the contract holds for, by name: a maker of one over a fresh store on its real server.
FACTORIES: dict[str, Callable[[Path], AbstractContextManager[Made]]] = {
    "directory": _directory,
    "http-read-only": _http_read_only,
    "http-webdav": _http_dav,
    "redis": _redis,
    "s3": _s3,
}

#: Each optional ability: its accessor, and the methods its interface adds to an engine.
ABILITIES: dict[str, tuple[Callable[[Engine], object | None], tuple[str, ...]]] = {
    "ranges": (ranged, ("get_range", "get_tail", "get_ranges")),
    "conditional_get": (conditional, ("get_changed",)),
    "conditional_create": (creates, ("create",)),
    "listing": (listing, ("names",)),
    "leases": (leases, ("lease", "renew", "release")),
}


@pytest.fixture(params=sorted(FACTORIES))
def made(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Made]:
    with FACTORIES[request.param](tmp_path) as m:
        yield m


def _writable(made: Made) -> Engine:
    if not made.writable:
        pytest.skip("a read-only engine: what it reads is written beside it")
    return made.engine


def value(i: int, size: int = 3000) -> bytes:
    return (f"entry {i} ".encode() * (size // 8 + 1))[:size]


# -- what every engine does ---------------------------------------------------------------------


def test_the_record_is_one_frozen_abilities(made: Made) -> None:
    can = made.engine.can
    assert isinstance(can, Abilities)
    with pytest.raises(dataclasses.FrozenInstanceError):
        can.leases = not can.leases  # type: ignore[misc]


def test_a_put_object_reads_back_whole_and_its_size_is_known(made: Made) -> None:
    data = bytes(range(256)) * 40
    made.seed.put("blobs/ab/cdef", data)
    assert made.engine.get("blobs/ab/cdef", limit=len(data)) == data
    assert made.engine.get("blobs/ab/cdef", limit=len(data), digest=digest_of(data)) == data
    assert made.engine.size("blobs/ab/cdef") == len(data)
    assert made.engine.get_many(["blobs/ab/cdef", "blobs/ab/none"], limit=[len(data), 10]) == [data, None]


def test_a_put_replaces_and_a_removed_object_is_gone(made: Made) -> None:
    engine = _writable(made)
    engine.put("index/aa/one", b"first")
    engine.put("index/aa/one", b"second, longer")
    assert engine.get("index/aa/one", limit=100) == b"second, longer"
    engine.remove("index/aa/one")
    assert engine.get("index/aa/one", limit=100) is None
    engine.remove("index/aa/one")  # nothing there: nothing to do


def test_a_missing_name_is_a_miss_not_a_failure(made: Made) -> None:
    assert made.engine.get("index/ff/missing", limit=100) is None
    assert made.engine.size("index/ff/missing") is None
    assert made.engine.get_many(["index/ff/missing"], limit=100) == [None]


def test_an_object_over_the_callers_limit_is_refused_not_held(made: Made) -> None:
    made.seed.put("blobs/cc/big", b"x" * 5000)
    for read in (
        lambda: made.engine.get("blobs/cc/big", limit=4999),
        lambda: made.engine.get_many(["blobs/cc/big"], limit=4999),
    ):
        with pytest.raises(StoreFailure) as caught:
            read()
        assert (caught.value.kind, caught.value.outage) == ("too large", False)
    assert made.engine.get("blobs/cc/big", limit=5000) == b"x" * 5000


def test_bytes_that_do_not_hash_to_the_digest_asked_are_damage(made: Made) -> None:
    made.seed.put("blobs/dd/liar", b"not these bytes")
    with pytest.raises(StoreFailure) as caught:
        made.engine.get("blobs/dd/liar", limit=100, digest=digest_of(b"other bytes"))
    assert (caught.value.kind, caught.value.outage) == ("damaged", False)


def test_a_store_whose_server_is_down_is_an_outage_not_a_miss(made: Made) -> None:
    if made.down is None:
        pytest.skip("no server: a directory that is gone is a missing object, and its tier checks the layout")
    made.seed.put("index/ee/there", b"x")
    made.down()
    for call in (
        lambda: made.engine.get("index/ee/there", limit=10),
        lambda: made.engine.get_many(["index/ee/there"], limit=10),
        lambda: made.engine.size("index/ee/there"),
    ):
        with pytest.raises(StoreFailure) as caught:
            call()
        assert caught.value.outage is True


def test_put_many_never_shows_a_later_object_before_an_earlier_one(made: Made) -> None:
    """A reader polling the manifests while blobs and manifests are put in pairs never finds a manifest first."""
    engine = _writable(made)
    pairs = [(url_path(BLOBS, f"{i:064x}"), url_path(INDEX, f"{i:064x}")) for i in range(30)]
    done = threading.Event()
    early: list[str] = []

    def read() -> None:
        while not done.is_set():
            for blob, manifest in pairs:
                if engine.get(manifest, limit=100) is not None and engine.get(blob, limit=100) is None:
                    early.append(manifest)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i, (blob, manifest) in enumerate(pairs):
            engine.put_many([(blob, f"blob {i}".encode()), (manifest, f"names blob {i}".encode())])
    finally:
        done.set()
        reader.join()
    assert early == []
    assert all(engine.get(m, limit=100) == f"names blob {i}".encode() for i, (_, m) in enumerate(pairs))


# -- the abilities its record declares, and those it denies ---------------------------------------


@pytest.mark.parametrize("ability", sorted(ABILITIES))
def test_an_ability_is_reached_only_where_the_record_declares_it(made: Made, ability: str) -> None:
    accessor, methods = ABILITIES[ability]
    declared = getattr(made.engine.can, ability)
    got = accessor(made.engine)
    if declared:
        assert got is made.engine and all(callable(getattr(made.engine, m, None)) for m in methods)
    else:
        # Refused cleanly: no interface, and no stub that would answer as if it could.
        assert got is None and not any(hasattr(made.engine, m) for m in methods)


def test_ranged_reads_give_exactly_the_bytes_asked(made: Made) -> None:
    engine = ranged(made.engine)
    if engine is None:
        pytest.skip("its record declares no ranges")
    data = bytes(range(256)) * 8
    made.seed.put("packs/some.cpk", data)
    assert engine.get_range("packs/some.cpk", 100, 50) == data[100:150]
    assert engine.get_range("packs/some.cpk", 0, len(data)) == data
    assert engine.get_tail("packs/some.cpk", 32) == (data[-32:], len(data))
    assert engine.get_range("packs/none.cpk", 0, 10) is None
    assert engine.get_tail("packs/none.cpk", 10) is None
    with pytest.raises(StoreFailure) as caught:  # past its end: not a shorter answer
        engine.get_range("packs/some.cpk", len(data) - 10, 20)
    assert (caught.value.kind, caught.value.outage) == ("short", False)
    with pytest.raises(StoreFailure) as caught:  # wholly past it
        engine.get_range("packs/some.cpk", len(data) + 10, 20)
    assert (caught.value.kind, caught.value.outage) == ("short", False)


def test_a_range_streams_into_a_sink_and_a_failing_sink_ends_the_read(made: Made) -> None:
    engine = ranged(made.engine)
    if engine is None:
        pytest.skip("its record declares no ranges")
    data = os.urandom(3 << 20)  # several chunks of any engine's reads (a directory's are of 1 MiB)
    made.seed.put("packs/some.cpk", data)
    chunks: list[bytes] = []
    assert engine.get_range("packs/some.cpk", 1000, 5 << 19, sink=chunks.append) == b""
    assert b"".join(chunks) == data[1000 : 1000 + (5 << 19)] and len(chunks) > 1  # as they came, not gathered first
    assert engine.get_range("packs/none.cpk", 0, 10, sink=chunks.append) is None

    class Enough(OSError):  # as a staging file that cannot be written: not the store's failure
        pass

    def refuse(chunk: bytes) -> None:
        raise Enough

    with pytest.raises(Enough):
        engine.get_range("packs/some.cpk", 0, len(data), sink=refuse)
    assert engine.get_range("packs/some.cpk", 5, 5) == data[5:10]  # and the engine reads on


def test_several_ranges_and_the_tail_come_at_once(made: Made) -> None:
    engine = ranged(made.engine)
    if engine is None:
        pytest.skip("its record declares no ranges")
    data = os.urandom(100_000)
    made.seed.put("packs/some.cpk", data)
    spans = [(10, 100), (20_000, 5000), (60_000, 1)]
    got = engine.get_ranges("packs/some.cpk", spans, 64)
    assert got is not None
    parts, size = got
    assert size == len(data) and {k: bytes(v) for k, v in parts.items()} == {
        **{offset: data[offset : offset + n] for offset, n in spans},
        len(data) - 64: data[-64:],
    }
    one = engine.get_ranges("packs/some.cpk", [(7, 9)])
    assert one is not None and (bytes(one[0][7]), one[1]) == (data[7:16], len(data))
    assert engine.get_ranges("packs/none.cpk", spans, 64) is None
    with pytest.raises(StoreFailure) as caught:
        engine.get_ranges("packs/some.cpk", [(10, 100), (len(data) - 5, 10)])
    assert not caught.value.outage


def test_a_conditional_read_of_an_unchanged_object_holds_no_body(made: Made) -> None:
    engine = conditional(made.engine)
    if engine is None:
        pytest.skip("its record declares no conditional reads")
    assert engine.get_changed("keys", limit=100, tag=None) == (None, None)
    made.seed.put("keys", b"first list")
    data, tag = engine.get_changed("keys", limit=100, tag=None) or (None, None)
    assert data == b"first list" and tag
    assert engine.get_changed("keys", limit=100, tag=tag) is None  # not modified: no bytes at all
    made.seed.put("keys", b"second list")
    changed = engine.get_changed("keys", limit=100, tag=tag)
    assert changed is not None and changed[0] == b"second list" and changed[1] not in (None, tag)
    with pytest.raises(StoreFailure) as caught:
        engine.get_changed("keys", limit=5, tag=None)
    assert caught.value.kind == "too large"


def test_a_second_conditional_create_of_a_name_fails_and_writes_nothing(made: Made) -> None:
    engine = creates(made.engine)
    if engine is None:
        pytest.skip("its record declares no conditional create")
    assert engine.create("packs/list", b"mine") is True
    assert engine.create("packs/list", b"theirs") is False
    assert made.engine.get("packs/list", limit=100) == b"mine"


def test_a_listing_names_the_objects_of_a_folder(made: Made) -> None:
    engine = listing(made.engine)
    if engine is None:
        pytest.skip("its record declares no listing")
    assert engine.names("packs") == []
    for name in ("b.cpk", "a.cpk", "list"):
        made.seed.put(f"packs/{name}", b"x")
    made.seed.put("packs/retired/old.cpk", b"x")  # a folder's folder is not its object
    assert engine.names("packs") == ["a.cpk", "b.cpk", "list"]


def test_a_lease_is_one_holders_until_released(made: Made) -> None:
    engine = leases(made.engine)
    if engine is None:
        pytest.skip("its record declares no leases")
    token = engine.lease("compile/k", 30)
    assert token and engine.lease("compile/k", 30) is None
    assert engine.renew("compile/k", token, 30) is True
    engine.release("compile/k", token)
    assert engine.renew("compile/k", token, 30) is False
    assert engine.lease("compile/k", 30) not in (None, token)


# -- the store above it ------------------------------------------------------------------------


@pytest.mark.parametrize("pack", [False, True], ids=["loose", "packed"])
def test_published_entries_reach_a_cold_node_through_its_jobs_warm_set(
    made: Made, pack: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if pack and not made.packs:
        pytest.skip("publish writes no packs there")
    monkeypatch.setenv("CUDA_PROGRAM_CAS_JOB", JOB)
    source = CacheStore(tmp_path / "source")
    for i in range(12):
        source.put(f"k{i}", value(i))
    source.close()
    publish([tmp_path / "source"], made.write, pack=pack)
    used = [f"k{i}" for i in range(0, 12, 2)]
    writer = CacheStore(tmp_path / "writer", shared=[f"{made.write}|write"])
    assert all(writer.get(k) == value(int(k[1:])) for k in used)
    writer.close()
    assert warmset.parse(made.engine.get(warmset.set_name(JOB), limit=1 << 20)) is not None
    node = CacheStore(tmp_path / "cold", shared=[made.read])
    assert node.get(used[0]) == value(0)  # the first local miss starts the set's fetch
    warm = node.inner.warm
    assert warm is not None and warm.join(30)
    # A packed entry is fetched by the place in its pack that the set's line names, which a writer knows where it
    # reads the packs' indexes by ranges (a remote store), and a reader asks several ranges at once (one multipart
    # request, or parallel ranged GETs); elsewhere the line is a key only, and its lookup finds it.
    wrote, reads = open_engine(made.write).can, made.engine.can
    fetches = not pack or (wrote.remote and wrote.ranges and reads.remote and reads.ranges)
    if fetches:
        assert warm.fetched == len(used) and node.stats().entries == len(used)  # each verified into the local cache
    assert {k: node.get(k) for k in used} == {k: value(int(k[1:])) for k in used}
    assert node.counters()["corrupt"] == 0
    node.close()
    for tier in (*writer.inner.shared, *node.inner.shared):
        tier.engine.close()  # their pooled connections (Redis)


LARGE = 3 << 20

#: A blob as a writer may have put it into a shared store, and the raw bytes its manifest names: a frame that
#: decodes to them, and frames that must be refused (a bomb within the entry limit, one cut short, one stating
#: another size) where they reach any engine.
COMPRESSED: dict[str, tuple[Callable[[], bytes], bytes]] = {
    "framed": (lambda: frame.encode(compressible(1)), compressible(1)),
    # Over 1 MiB: a directory hashes the file in chunks before it reads it, HTTP stages the raw bytes on disk.
    "framed, 3 MiB": (lambda: frame.encode(compressible(1, LARGE), level=3), compressible(1, LARGE)),
    "bomb": (bomb_lying_frame, bytes(1000)),
    "bomb, 3 MiB": (lambda: bomb_lying_frame(LARGE), bytes(LARGE)),
    "truncated": (truncated, compressible(1)),
    "wrong stated size": (wrong_size, compressible(1)),
}


@pytest.mark.parametrize("stored", sorted(COMPRESSED))
def test_a_compressed_blob_reads_back_verified_and_a_bad_frame_is_a_miss(
    made: Made, stored: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make, raw = COMPRESSED[stored]
    source = CacheStore(tmp_path / "source")
    source.put("k", raw)
    source.close()
    publish([tmp_path / "source"], made.write)  # loose: its blob is then replaced by the one under test
    name, digest = url_path(BLOBS, digest_of(raw)), digest_of(raw)
    published = made.engine.get(name, limit=len(raw))
    assert published is not None and frame.is_framed(published)  # every engine's store holds it compressed
    assert made.engine.get(name, limit=len(raw), digest=digest) == raw  # what publish wrote, decoded
    made.seed.put(name, make())
    if stored.startswith("framed"):
        assert made.engine.get(name, limit=len(raw), digest=digest) == raw
    else:
        with pytest.raises(StoreFailure) as caught:
            made.engine.get(name, limit=len(raw), digest=digest)
        assert (caught.value.kind, caught.value.outage) == ("damaged", False)
        assert "a compressed object that" in str(caught.value) and "\n" not in str(caught.value)
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    node = CacheStore(tmp_path / "node", shared=[made.read])
    try:
        got, corrupt = node.get("k"), node.counters()["corrupt"]
    finally:
        node.close()
        for tier in node.inner.shared:
            tier.engine.close()
    assert (got, corrupt) == ((raw, 0) if stored.startswith("framed") else (None, 1))
    said = [r.getMessage() for r in caplog.records if "a compressed object" in r.getMessage()]
    assert len(said) == (0 if stored.startswith("framed") else 1) and "\n" not in "".join(said), said


def test_a_store_mixing_framed_and_raw_blobs_reads_both_raw(made: Made, tmp_path: Path) -> None:
    entries = {f"k{i}": compressible(i) for i in range(4)}
    source = CacheStore(tmp_path / "source")
    for k, v in entries.items():
        source.put(k, v)
    source.close()
    publish([tmp_path / "source"], made.write)  # loose, every blob framed
    for v in list(entries.values())[::2]:  # half of them raw again, as a store written before compression holds them
        made.seed.put(url_path(BLOBS, digest_of(v)), v)
    for v in entries.values():
        assert made.engine.get(url_path(BLOBS, digest_of(v)), limit=len(v), digest=digest_of(v)) == v
    node = CacheStore(tmp_path / "node", shared=[made.read])
    try:
        assert {k: node.get(k) for k in entries} == entries
        assert node.counters()["shared_hits"] == len(entries) and node.counters()["corrupt"] == 0
    finally:
        node.close()
        for tier in node.inner.shared:
            tier.engine.close()
    for v in entries.values():  # the node's local cache keeps raw blobs
        assert (tmp_path / "node" / url_path(BLOBS, digest_of(v))).read_bytes() == v


@pytest.mark.parametrize("size", [100, (1 << 20) + 100], ids=["small", "over 1 MiB"])
@pytest.mark.parametrize("how", ["write-back", "publish loose", "publish packed"])
def test_a_value_that_starts_with_the_magic_and_does_not_compress_reads_back_from_every_store(
    made: Made, how: str, size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Framed so that it is not misread as a frame, such a value is stored larger than itself (issue 48): every
    reader bounds its stored bytes by what a frame of its raw size may take, a warm set's fetch too."""
    if how == "publish packed" and not made.packs:
        pytest.skip("publish writes no packs there")
    monkeypatch.setenv("CUDA_PROGRAM_CAS_JOB", JOB)
    entries = {k: frame.MAGIC + os.urandom(size) for k in ("k", "j")}
    if size > 1 << 20:  # the ceiling exactly the raw size: a packed entry's stored bytes are over it, within its room
        monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE", str(size + len(frame.MAGIC)))
    if how == "write-back":
        CacheStore(tmp_path / "empty").close()
        assert not publish([tmp_path / "empty"], made.write).errors  # the store laid out, as write-back needs
        writer = CacheStore(tmp_path / "writer", shared=[f"{made.write}|write"])
        assert all(writer.put(k, v) for k, v in entries.items())
        writer.close()
    else:
        source = CacheStore(tmp_path / "source")
        assert all(source.put(k, v) for k, v in entries.items())
        source.close()
        assert not publish([tmp_path / "source"], made.write, pack=how == "publish packed").errors
        again = publish([tmp_path / "source"], made.write, pack=how == "publish packed")
        assert not again.errors and again.blobs_published == 0  # each framed blob there is found the right one
    for v in entries.values() if how != "publish packed" else ():
        name, digest = url_path(BLOBS, digest_of(v)), digest_of(v)
        stored = made.engine.get(name, limit=frame.room(len(v)))
        assert stored is not None and frame.is_framed(stored) and len(v) < len(stored) <= frame.room(len(v))
        assert made.engine.get(name, limit=len(v), digest=digest) == v
    if made.write.startswith("s3://") and how != "publish packed":
        from cuda_program_cas._remote.bucket import bucket_verify

        assert bucket_verify(made.write).problems == []
    user = CacheStore(tmp_path / "user", shared=[f"{made.write}|write"])  # its use names the job's warm set
    assert {k: user.get(k) for k in entries} == entries and user.counters()["corrupt"] == 0
    user.close()
    node = CacheStore(tmp_path / "cold", shared=[made.read])
    try:
        assert node.get("j") == entries["j"]  # the first local miss starts the set's fetch
        warm = node.inner.warm
        assert warm is not None and warm.join(30)
        assert node.get("k") == entries["k"] and node.counters()["corrupt"] == 0
    finally:
        node.close()
        for tier in (*user.inner.shared, *node.inner.shared):
            tier.engine.close()
