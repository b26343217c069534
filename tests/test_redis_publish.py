"""Publishing into Redis: a real compiled cache into a real redis-server, then read back by a fresh node.

The source is a local cache filled by real NVRTC compiles; the store is a redis-server on
loopback (tools/testkit/redis_server.py). What publish sent is read from the server itself (its keys and
its command counts); what it means is checked by a node whose only shared tier is the server.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import SAXPY, compile_program
from testkit.redis_server import RedisServer, redis_or_skip

from cuda_program_cas import CacheStore, ContentAddressedProgramCache
from cuda_program_cas._cli.main import main as cli_main

N_KERNELS = 4


_server = redis_or_skip


def kernel(i: int) -> str:
    return SAXPY.replace("a * x[i] + y[i]", f"a * x[i] + y[i] + {i}.0f")


def publish_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, object]]:
    capsys.readouterr()
    status = cli_main(["publish", *args, "--json"])
    return status, json.loads(capsys.readouterr().out)


def publish_fails(capsys: pytest.CaptureFixture[str], *args: str, status: int = 1) -> str:
    """Run publish that must fail: ``status``, nothing on stdout, one line on stderr; that line."""
    capsys.readouterr()
    assert cli_main(["publish", *args]) == status
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, (out, err)
    return err.strip()


def keys(server: RedisServer, pattern: str = "cpcas:*") -> set[str]:
    return {k.decode() for k in server.client().keys(pattern)}


def test_a_compiled_cache_published_into_redis_is_read_whole_by_a_fresh_node(
    redis: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], compiles
) -> None:
    source = tmp_path / "node-a"
    cubins: dict[tuple[str, str], bytes] = {}
    with ContentAddressedProgramCache(source) as cache:
        for i in range(N_KERNELS):
            cubins[(kernel(i), "default_program")] = bytes(compile_program(kernel(i), cache=cache).code)
        cubins[(kernel(0), "renamed")] = bytes(compile_program(kernel(0), cache=cache, name="renamed").code)
    assert compiles.count == N_KERNELS + 1

    status, report = publish_json(capsys, "--dry-run", str(source), redis.url)
    assert (status, report["created"], report["published"]) == (0, True, N_KERNELS + 1)
    assert keys(redis) == set()  # a dry run writes nothing

    redis.reset_stats()
    status, report = publish_json(capsys, str(source), redis.url)
    assert status == 0, report
    assert (report["dest"], report["created"], report["published"]) == (redis.url, True, N_KERNELS + 1)
    assert (report["blobs_published"], report["problem_count"]) == (N_KERNELS, 0)
    stored = keys(redis)
    assert {"cpcas:layout.json", "cpcas:CACHEDIR.TAG", "cpcas:keys"} <= stored
    assert len([k for k in stored if k.startswith("cpcas:blobs/")]) == N_KERNELS
    assert len([k for k in stored if k.startswith("cpcas:index/")]) == N_KERNELS + 1
    assert json.loads(redis.client().get("cpcas:layout.json"))["shared"] is True
    # Each upload was a SET read back at once: a blob by its length, a small file by its bytes.
    calls = redis.commandstats()
    assert calls.get("set") == 2 + N_KERNELS + (N_KERNELS + 1) + 1  # and the key list, last
    assert calls.get("strlen", 0) >= N_KERNELS

    # A fresh node whose only shared tier is the server: every entry a hit, the bytes the compiler gave.
    with ContentAddressedProgramCache(tmp_path / "node-b", shared=[redis.url]) as fresh:
        for (src, name), cubin in cubins.items():
            assert bytes(compile_program(src, cache=fresh, name=name).code) == cubin
        assert fresh.stats().shared_hits == N_KERNELS + 1
    assert compiles.count == N_KERNELS + 1  # not one compile more

    # Again: nothing new, nothing written.
    redis.reset_stats()
    status, report = publish_json(capsys, str(source), redis.url)
    assert (status, report["published"], report["unchanged"], report["blobs_published"]) == (0, 0, N_KERNELS + 1, 0)
    assert redis.commandstats().get("set", 0) == 0


def test_pack_into_redis_is_bad_usage_before_anything_is_written(
    redis: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "node"
    CacheStore(source).put("k", b"bytes")
    err = publish_fails(capsys, "--pack", str(source), redis.url, status=2)
    assert "--pack" in err and "loose entries only" in err
    assert keys(redis) == set()


def _big_source(root: Path, n: int, size: int) -> Path:
    store = CacheStore(root)
    for i in range(n):
        store.put(f"k{i}", os.urandom(size))  # noise: stored raw, as large in the store (it does not compress)
    return root


def test_a_full_redis_fails_the_publish_in_one_line_and_nothing_names_an_absent_blob(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """noeviction: Redis refuses a SET past maxmemory (OOM); the run stops there, before any manifest."""
    server = _server(tmp_path / "redis", maxmemory="2mb", policy="noeviction")
    try:
        source = _big_source(tmp_path / "node", 8, 600_000)  # 4.8 MB of blobs into 2 MB
        err = publish_fails(capsys, str(source), server.url)
        assert err.startswith("cuda-program-cas publish: error: ") and "out of memory" in err
        assert "cpcas:blobs/" in err
        assert keys(server, "cpcas:index/*") == set()  # no manifest was sent
        reader = CacheStore(tmp_path / "reader", shared=[server.url])
        assert all(reader.get(f"k{i}") is None for i in range(8))
    finally:
        server.stop()
