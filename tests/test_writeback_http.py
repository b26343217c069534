"""Write-back to an HTTP store named writable (``URL|write``), against a real nginx with WebDAV.

A node's new entry reaches nginx's folder by two PUTs, blob first, then the manifest
that names it (counted in nginx's access log); another node, its local cache empty,
hits it with no compile and no write; a node whose store is not named writable
never writes; a server that refuses writes drops the upload, counted, and the
compile goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SAXPY, compile_program
from test_http_publish import _no_token, settled  # noqa: F401 - _no_token: its autouse fixture, here too
from test_writeback import _entries
from testkit.faults import refused_url
from testkit.nginx import Nginx, nginx_or_skip

from cuda_program_cas import CacheStore, ContentAddressedProgramCache, digest_of
from cuda_program_cas._base.engine import StoreFailure
from cuda_program_cas._disk.layout import BLOBS, url_path
from cuda_program_cas._remote.http import HttpEngine


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[Nginx]:
    with nginx_or_skip(tmp_path / "nginx") as server:
        CacheStore(server.root / "cas").close()  # laid out: layout.json, index/, blobs/
        settled(server)  # the log starts here
        yield server


def _paths(entries: list, method: str) -> list[tuple[str, int]]:
    """(path below the store, status) of each request of ``method``, in the order nginx logged them."""
    return [(e.uri.split("/cas/", 1)[1], e.status) for e in entries if e.method == method]


def test_a_new_entry_reaches_nginx_blob_then_manifest_and_another_node_hits_it(
    nginx: Nginx, tmp_path: Path, compiles
) -> None:
    store = nginx.root / "cas"
    with ContentAddressedProgramCache(tmp_path / "a", shared=[f"{nginx.dav_url('cas')}|write"]) as cache:
        code = bytes(compile_program(SAXPY, cache=cache).code)
        cache.close()  # flushes the upload queue
        counts = cache.stats()
    assert compiles.count == 1
    assert (counts.uploads, counts.uploads_dropped) == (1, 0)
    written = settled(nginx)
    (manifest,) = [p.relative_to(store).as_posix() for p in (store / "index").rglob("*") if p.is_file()]
    # Blob, manifest, then the key list that names it (after the job was quiet, or at exit).
    assert _paths(written, "PUT") == [(url_path(BLOBS, digest_of(code)), 201), (manifest, 201), ("keys", 201)]
    assert list(_entries(store).values()) == [code]
    # The first lookup before the compile: layout.json, packs/list (none), the key list (none), the manifest (none
    # yet); then the key list's read-merge-write: read (none), written, read back.
    assert [p for p, _ in _paths(written, "GET")] == ["layout.json", "packs/list", "keys", manifest, "keys", "keys"]

    # A second node, its local cache empty, reading the store only: one hit, five GETs, no write.
    with ContentAddressedProgramCache(tmp_path / "b", shared=[nginx.read_url("cas")]) as other:
        assert bytes(compile_program(SAXPY, cache=other).code) == code
        assert other.stats().shared_hits == 1
        assert other.store.inner.shared[0].engine.requests == 5
    assert compiles.count == 1
    read = settled(nginx)
    assert [p for p, _ in _paths(read, "GET")] == [
        "layout.json",
        "packs/list",
        "keys",
        manifest,
        url_path(BLOBS, digest_of(code)),
    ]
    assert {e.method for e in read} == {"GET"}


def test_a_store_not_named_writable_is_never_written(nginx: Nginx, tmp_path: Path, compiles) -> None:
    with ContentAddressedProgramCache(tmp_path / "a", shared=[nginx.dav_url("cas")]) as cache:
        compile_program(SAXPY, cache=cache)
        cache.close()
        assert (cache.stats().uploads, cache.stats().uploads_dropped) == (0, 0)
    assert compiles.count == 1
    assert {e.method for e in settled(nginx)} == {"GET"}
    assert list((nginx.root / "cas" / "index").iterdir()) == []


def test_a_server_that_refuses_writes_drops_the_upload_and_the_compile_goes_on(
    nginx: Nginx, tmp_path: Path, compiles
) -> None:
    """The read location takes no PUT (405): one PUT tried, the upload dropped and counted, nothing stored."""
    with ContentAddressedProgramCache(tmp_path / "a", shared=[f"{nginx.read_url('cas')}|write"]) as cache:
        code = bytes(compile_program(SAXPY, cache=cache).code)
        cache.close()
        counts = cache.stats()
    assert code and compiles.count == 1
    assert (counts.uploads, counts.uploads_dropped) == (0, 1)
    assert [status for _, status in _paths(settled(nginx), "PUT")] == [405]  # the blob's; the manifest never sent
    assert list((nginx.root / "cas" / "index").iterdir()) == []


def test_the_engine_puts_gets_sizes_and_removes_by_webdav(nginx: Nginx) -> None:
    """HttpEngine against nginx's WebDAV location: each call one request, as the Engine protocol says."""
    engine = HttpEngine(nginx.dav_url("cas") + "/")
    data = b"a blob" * 1000
    digest = digest_of(data)
    name = url_path(BLOBS, digest)
    assert (engine.shown, engine.can.leases) == (nginx.dav_url("cas"), False)
    assert engine.get(name, limit=len(data)) is None and engine.size(name) is None
    engine.put(name, data)
    assert (nginx.root / "cas" / name).read_bytes() == data
    assert engine.size(name) == len(data)
    assert engine.get(name, limit=len(data), digest=digest) == data
    with pytest.raises(StoreFailure) as wrong:
        engine.get(name, limit=len(data), digest=digest_of(b"other bytes"))
    assert (wrong.value.kind, wrong.value.outage) == ("damaged", False)
    with pytest.raises(StoreFailure) as large:
        engine.get(name, limit=len(data) - 1)
    assert (large.value.kind, large.value.outage) == ("too large", False)
    engine.remove(name)
    engine.remove(name)  # gone already: nothing
    assert not (nginx.root / "cas" / name).exists() and engine.get(name, limit=len(data)) is None
    assert engine.requests == 10
    assert [e.method for e in settled(nginx)] == [
        "GET",
        "HEAD",
        "PUT",
        "HEAD",
        "GET",
        "GET",
        "GET",
        "DELETE",
        "DELETE",
        "GET",
    ]


def test_an_engine_that_cannot_reach_its_server_fails_as_an_outage() -> None:
    engine = HttpEngine(refused_url())
    for call in (lambda: engine.get("layout.json", limit=10), lambda: engine.put("index/ab/cd", b"x")):
        with pytest.raises(StoreFailure) as failed:
            call()
        assert (failed.value.kind, failed.value.outage) == ("refused", True)
    assert engine.outages == 2


def test_publish_init_creates_an_empty_store_that_a_writing_node_uploads_into(
    nginx: Nginx, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from cuda_program_cas._cli.main import main

    url = nginx.dav_url("fresh")
    before = CacheStore(tmp_path / "n0", shared=[f"{url}|write"])
    assert before.get("k0") is None  # a compile's lookup first: the store has no layout.json (404)
    before.put("k0", b"v" * 100)
    before.close()
    assert (before.counters()["uploads"], before.counters()["uploads_dropped"]) == (0, 1)  # no layout.json: no store
    assert main(["publish", "--init", url]) == 0
    assert capsys.readouterr().out.startswith("created an empty store at ")
    assert json.loads((nginx.root / "fresh" / "layout.json").read_bytes())["shared"] is True
    writer = CacheStore(tmp_path / "n1", shared=[f"{url}|write"])
    assert writer.get("k1") is None
    writer.put("k1", b"w" * 100)
    writer.close()
    assert (writer.counters()["uploads"], writer.counters()["uploads_dropped"]) == (1, 0)
    reader = CacheStore(tmp_path / "n2", shared=[nginx.read_url("fresh")])
    assert reader.get("k1") == b"w" * 100 and reader.counters()["shared_hits"] == 1
    assert main(["publish", "--init", url]) == 0  # again: found, left as it is
    assert capsys.readouterr().out.startswith("found the store at ")
    assert reader.get("k1") == b"w" * 100
