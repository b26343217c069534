"""The S3 engine's failures: a throttled, stalled, resetting or absent server is a miss with one clear line.

The endpoint (``AWS_ENDPOINT_URL_S3``) is the tests' fault server (tools/testkit/faults.py), serving a
published store's files as path-style objects (``/BUCKET/PREFIX/...``); it ignores the
signature, so each test chooses what the "S3 server" does. Each fault must make a lookup a
miss within the HTTP client's deadline (never botocore's 60 s and retries), with
``Program.compile(cache=)`` still returning the right bytes, an upload dropped rather than
raised, one WARNING naming the store and what happened, and no secret in any record. A wrong
secret and a missing bucket are a real server's answers: tests/test_s3_engine.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import compile_program
from testkit.faults import Fault, FaultServer, refused_url

from cuda_program_cas import CacheStore, ContentAddressedProgramCache, publish
from cuda_program_cas._remote import client

SECRET = "fault-test-secret-value"  # noqa: S105 - grepped for in the logs


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """A store published from a cache holding SAXPY's compile and a few values; the compile's bytes."""
    pytest.importorskip("botocore")
    base = tmp_path_factory.mktemp("published")
    with ContentAddressedProgramCache(base / "src", shared=()) as src:
        code = bytes(compile_program(cache=src).code)
    store = CacheStore(base / "src")
    for i in range(3):
        store.put(f"k{i}", f"value {i}".encode() * 100)
    store.close()
    publish([base / "src"], base / "store")
    return base / "store", code


@pytest.fixture
def site(tmp_path: Path, published: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultServer]:
    """The fault server with the store at ``/cas/<test>/``, and the environment that makes it the S3 endpoint."""
    shutil.copytree(published[0], tmp_path / "www" / "cas" / _prefix(tmp_path))
    server = FaultServer(tmp_path / "www").start()
    _aws(monkeypatch, server.base_url)
    yield server
    server.stop()
    client.close_connections()


def _aws(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "fault-test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv(client.ENV_HTTP_TIMEOUT, "0.5,1")  # the stalls wait out a short timeout
    client.close_connections()


def _prefix(tmp_path: Path) -> str:
    return tmp_path.name.lower().replace("_", "-")


#: (id, the object prefix the fault hits, the fault, what the WARNING says).
FAULTS = [
    ("slowdown", "", Fault.status(503), "server error: status 503"),
    ("slowdown-blob", "blobs/", Fault.status(503), "server error: status 503"),
    ("accepts-never-answers", "", Fault.stall(), "timeout"),
    ("headers-then-nothing", "blobs/", Fault.stall_body(), "timeout"),
    ("reset-mid-body", "blobs/", Fault.truncate(), "truncated"),
    ("reset", "index/", Fault.refuse(), "protocol"),
]


@pytest.mark.parametrize("fault", [pytest.param(f[1:], id=f[0]) for f in FAULTS])
def test_a_fault_is_a_miss_an_upload_dropped_and_one_warning_within_the_deadline(
    tmp_path: Path,
    site: FaultServer,
    published: tuple[Path, bytes],
    caplog: pytest.LogCaptureFixture,
    fault: tuple[str, Fault, str],
) -> None:
    where, how, said = fault
    prefix = _prefix(tmp_path)
    site.set(f"/cas/{prefix}/{where}", how)
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    store = f"s3://cas/{prefix}"
    started = time.monotonic()
    with ContentAddressedProgramCache(tmp_path / "node", shared=[f"{store}|write"]) as cache:
        assert bytes(compile_program(cache=cache).code) == published[1]  # compiled: a miss, the right bytes
        took = time.monotonic() - started
        assert cache.get("k0") is None  # paused: no request
        cache.close()
        counts = cache.stats()
    assert took < 8, took  # one deadline (0.5 s + 1 s and the bytes' time), not botocore's 60 s with retries
    assert (counts.shared_hits, counts.errors, counts.corrupt, counts.uploads) == (0, 1, 0, 0)
    assert counts.uploads_dropped >= 1  # the compile's upload: dropped, never raised
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said in warnings[0] and store in warnings[0], warnings
    assert len(warnings) <= 2 and all(store in w for w in warnings), warnings  # the store's, the upload dropped
    if how.kind == "status":
        assert "throttles" in warnings[0]  # a 503 is S3's SlowDown: what to do is said
    assert SECRET not in caplog.text + "".join(r.getMessage() for r in caplog.records)


def test_a_server_that_is_down_is_a_miss_with_one_warning(
    tmp_path: Path, published: tuple[Path, bytes], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    _aws(monkeypatch, refused_url("").rstrip("/"))
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    store = "s3://cas/down"
    with ContentAddressedProgramCache(tmp_path / "node", shared=[f"{store}|write"]) as cache:
        assert bytes(compile_program(cache=cache).code) == published[1]
        assert cache.get("k1") is None
        cache.close()
        counts = cache.stats()
    assert (counts.shared_hits, counts.errors, counts.uploads) == (0, 1, 0) and counts.uploads_dropped >= 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "refused" in warnings[0] and store in warnings[0], warnings
    client.close_connections()


def test_the_store_read_through_the_fault_server_hits_when_nothing_is_wrong(
    tmp_path: Path, site: FaultServer, published: tuple[Path, bytes]
) -> None:
    """What the faults above take away: the same store, served right, is a hit for each entry."""
    with ContentAddressedProgramCache(tmp_path / "node", shared=[f"s3://cas/{_prefix(tmp_path)}"]) as cache:
        assert bytes(compile_program(cache=cache).code) == published[1]
        for i in range(3):
            assert cache.get(f"k{i}") == f"value {i}".encode() * 100
        assert (cache.stats().shared_hits, cache.stats().errors) == (4, 0)
    assert all("authorization" in r.headers for r in site.log)  # signed, though this server ignores it
