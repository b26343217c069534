"""Write-back and lookups over a real redis-server: what each upload costs the server, and what an outage,
a stalled link and a full server cost the job (nothing but counted drops).

The server is started by the tests on loopback (tools/testkit/redis_server.py); faults between node and
server come from a real forwarder (tools/testkit/proxy.py). Round trips are the server's own
counts (INFO commandstats).
"""

from __future__ import annotations

import logging
import os
import textwrap
from pathlib import Path

import pytest
from conftest import SAXPY, compile_program, run_python
from testkit.proxy import Proxy
from testkit.redis_server import RedisServer, redis_or_skip

from cuda_program_cas import CacheStore, ContentAddressedProgramCache
from cuda_program_cas._shared import writeback
from cuda_program_cas.index import key_id

_server = redis_or_skip


def test_an_upload_is_one_transaction_blob_then_manifest_and_another_node_hits(
    redis: RedisServer, tmp_path: Path, compiles
) -> None:
    store = f"{redis.url}|write"
    redis.reset_stats()
    with ContentAddressedProgramCache(tmp_path / "a", shared=[store]) as cache:
        code = bytes(compile_program(SAXPY, cache=cache).code)
        cache.close()
        assert (cache.stats().uploads, cache.stats().uploads_dropped) == (1, 0)
    calls = redis.commandstats()
    # One MULTI/EXEC: the blob's SET, then the manifest's; then the key list's SET (its read-merge-write).
    assert calls.get("exec") == 1 and calls.get("set") == 3
    with ContentAddressedProgramCache(tmp_path / "b", shared=[redis.url]) as other:
        assert bytes(compile_program(SAXPY, cache=other).code) == code
        assert other.stats().shared_hits == 1
    assert compiles.count == 1


def test_a_dead_server_drops_uploads_counted_and_said_once_and_lookups_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = _server(tmp_path / "redis")
    url = server.url
    server.stop()  # the port is closed now: connection refused
    caplog.set_level(logging.WARNING, logger="cuda_program_cas")
    store = CacheStore(tmp_path / "local", shared=[f"{url}|write"])
    for i in range(20):
        assert store.put(f"k{i}", b"v%d" % i)
    assert store.get("absent") is None  # a miss, not an exception
    store.close()
    counts = store.counters()
    assert counts["writes"] == 20 and counts["uploads"] == 0 and counts["uploads_dropped"] == 20
    drops = [r.getMessage() for r in caplog.records if "uploads to shared store" in r.getMessage()]
    assert len(drops) == 1, drops
    assert all(store.get(f"k{i}") == b"v%d" % i for i in range(20))  # the local cache has everything


def test_a_stalled_link_fills_the_queue_drops_the_rest_and_exit_is_bounded(redis: RedisServer, tmp_path: Path) -> None:
    with Proxy(("127.0.0.1", redis.port)) as proxy:
        proxy.stall = True
        code = textwrap.dedent(
            f"""
            import json, time
            from cuda_program_cas import CacheStore
            from cuda_program_cas._shared.writeback import MAX_QUEUED
            store = CacheStore({str(tmp_path / "local")!r}, shared=["redis://127.0.0.1:{proxy.port}/0|write"])
            worst = 0.0
            for i in range(MAX_QUEUED + 50):
                t = time.perf_counter()
                store.put(f"k{{i}}", b"%d" % i)
                worst = max(worst, time.perf_counter() - t)
            print(json.dumps({{"worst_put_s": worst, **store.counters()}}), flush=True)
            """
        )
        proc = run_python(code, env={"CUDA_PROGRAM_CAS_REDIS_TIMEOUT": "30"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["writes"] == writeback.MAX_QUEUED + 50
    # One upload is stuck in the stalled link, MAX_QUEUED wait behind it, the rest are dropped at once.
    assert got["uploads_dropped"] >= 49
    assert "Traceback" not in proc.stderr
    print(f"\nworst put with a stalled store: {got['worst_put_s'] * 1e3:.2f} ms")


def test_a_full_server_refuses_uploads_and_the_job_goes_on(tmp_path: Path) -> None:
    server = _server(tmp_path / "redis", maxmemory="2mb", policy="noeviction")
    try:
        store = CacheStore(tmp_path / "local", shared=[f"{server.url}|write"])
        # 4.8 MB of noise (stored raw: it does not compress): Redis refuses writes past its 2 MB (OOM).
        values = [os.urandom(600_000) for _ in range(8)]
        for i in range(8):
            store.put(f"k{i}", values[i])
        store.close()
        counts = store.counters()
        assert counts["writes"] == 8
        assert counts["uploads_dropped"] >= 1 and counts["uploads"] + counts["uploads_dropped"] == 8
        reader = CacheStore(tmp_path / "reader", shared=[server.url])
        for i in range(8):  # whatever was stored is whole; the rest is a miss
            assert reader.get(f"k{i}") in (None, values[i])
        assert key_id("k0")
    finally:
        server.stop()


def test_publish_init_lays_out_an_empty_redis_store_that_a_writing_node_uploads_into(
    redis: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from cuda_program_cas._cli.main import main
    from cuda_program_cas._remote.redis import RedisEngine

    assert main(["publish", "--init", redis.url]) == 0
    assert capsys.readouterr().out.startswith("created an empty store at ")
    layout = RedisEngine(redis.url).get("layout.json", limit=4096)
    assert layout is not None and json.loads(layout)["shared"] is True
    writer = CacheStore(tmp_path / "a", shared=[f"{redis.url}|write"])
    assert writer.get("k1") is None
    writer.put("k1", b"w" * 100)
    writer.close()
    assert (writer.counters()["uploads"], writer.counters()["uploads_dropped"]) == (1, 0)
    reader = CacheStore(tmp_path / "b", shared=[redis.url])
    assert reader.get("k1") == b"w" * 100 and reader.counters()["shared_hits"] == 1
    assert main(["publish", "--init", redis.url]) == 0
    assert capsys.readouterr().out.startswith("found the store at ")
