"""One compile per key per cluster: node processes with caches of their own, one real redis-server, a new CUB kernel.

Each node is a separate interpreter with its own local cache, pointed at the same
Redis store named writable (``redis://...|write``). They start together (each says
``ready``, then all get the word on stdin) and compile the same new CUB kernel with
real NVRTC through ``cache.compile`` (the front door: a CUB kernel reads headers). Exactly one NVRTC compile may run
cluster-wide; every other node must get the same bytes from the store. A holder
SIGKILLed mid-compile loses its lease within its time to live, and a waiting node
compiles instead. Timings are printed, not asserted (docs/cluster.md has the figures).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import cccl_or_skip
from testkit.common import CUB_SOURCE
from testkit.redis_server import RedisServer, redis_or_skip

NODE = textwrap.dedent(
    r"""
    import json, sys, time
    from cuda.core import ProgramOptions
    from cuda_program_cas import ContentAddressedProgramCache

    sources, include, local = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    cache = ContentAddressedProgramCache(local)
    options = ProgramOptions(arch="sm_80", include_path=[include], std="c++17")
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    # Headers: the front door. Each source in turn; the last one's bytes are reported.
    codes = [bytes(cache.compile(source, "c++", options, "cubin").code) for source in sources]
    code = codes[-1]
    done = time.monotonic()
    cache.close()  # the holder's upload and the lease's release before its counts are read
    c = cache.stats()
    print(json.dumps({"t0": t0, "done": done, "compiled": c.misses, "hits": c.hits, "shared_hits": c.shared_hits,
                      "waits": c.claim_waits, "claim_hits": c.claim_hits, "uploads": c.uploads,
                      "dropped": c.uploads_dropped,
                      "size": len(code), "code": code.hex()}), flush=True)
    """
)


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the module's clusters, evicting the least recently used keys past 256 MB."""
    server = redis_or_skip(tmp_path_factory.mktemp("redis"), maxmemory="256mb", policy="allkeys-lru")
    yield server
    server.stop()


def _new_kernel() -> str:
    """A CUB kernel no cache has seen: the same kernel with a token of its own in a comment."""
    return f"// {uuid.uuid4().hex}\n" + CUB_SOURCE


class Node:
    def __init__(
        self,
        tmp: Path,
        n: int,
        source: str | list[str],
        store: str,
        ttl: str,
        *,
        also: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        shared = f"{store}|write {also}".strip()  # the Redis store, then (also) read-only stores
        env = {**os.environ, **(env or {}), "CUDA_PROGRAM_CAS_SHARED": shared, "CUDA_PROGRAM_CAS_LEASE_TTL": ttl}
        env.pop("CUDA_PROGRAM_CAS", None)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                NODE,
                json.dumps([source] if isinstance(source, str) else source),
                cccl_or_skip(),
                str(tmp / f"node{n}"),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", line + (self.proc.stderr.read() if self.proc.stderr else "")

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 240) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err
        assert "Traceback" not in err, err
        got: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return got


def _run_cluster(tmp: Path, redis: RedisServer, nodes: int) -> list[dict[str, Any]]:
    source = _new_kernel()
    started = [Node(tmp, n, source, redis.url, "30") for n in range(nodes)]
    for node in started:
        node.go()
    return [node.result() for node in started]


@pytest.mark.parametrize("nodes", [8, pytest.param(32, marks=pytest.mark.slow)])
def test_one_compile_cluster_wide(tmp_path: Path, redis: RedisServer, nodes: int) -> None:
    results = _run_cluster(tmp_path, redis, nodes)
    compiled = [r for r in results if r["compiled"]]
    assert len(compiled) == 1, [(r["compiled"], r["shared_hits"]) for r in results]
    assert sum(r["hits"] for r in results) == nodes - 1
    assert len({r["code"] for r in results}) == 1  # every node has the holder's bytes
    assert (compiled[0]["uploads"], compiled[0]["dropped"]) == (2, 0)  # the binary, then the front door's record
    holder = compiled[0]
    last = max(r["done"] for r in results)
    print(
        f"\n{nodes} nodes: 1 compile of {holder['done'] - holder['t0']:.2f} s; "
        f"last node done {last - holder['t0']:.2f} s after the word"
    )


def _lease_taken(redis: RedisServer, timeout: float = 60) -> None:
    """Until a lease key exists in the store (the first node took its lease and is compiling)."""
    client = redis.client()
    deadline = time.monotonic() + timeout
    while not client.keys("cpcas:lease:*"):
        assert time.monotonic() < deadline, "no node took a lease"
        time.sleep(0.005)


def test_a_holder_killed_mid_compile_loses_its_lease_and_another_node_compiles(
    tmp_path: Path, redis: RedisServer
) -> None:
    source = _new_kernel()
    ttl = 2.0
    holder = Node(tmp_path, 0, source, redis.url, str(ttl))
    others = [Node(tmp_path, n, source, redis.url, str(ttl)) for n in range(1, 5)]
    holder.go()
    _lease_taken(redis)
    for node in others:
        node.go()
    killed_at = time.monotonic()
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.communicate(timeout=30)  # reaped, its pipes closed
    results = [node.result() for node in others]
    compiled = [r for r in results if r["compiled"]]
    assert len(compiled) == 1, [(r["compiled"], r["shared_hits"], r["waits"]) for r in results]
    assert sum(r["hits"] for r in results) == len(others) - 1
    assert len({r["code"] for r in results}) == 1
    last = max(r["done"] for r in results)
    print(f"\nholder killed; every other node done {last - killed_at:.2f} s later (ttl {ttl} s, then one compile)")


def test_with_an_nginx_store_too_published_kernels_are_hits_and_a_new_one_is_compiled_once(
    tmp_path: Path, redis: RedisServer
) -> None:
    """8 nodes read a published store on nginx besides the Redis store they write: an old kernel is a hit
    from nginx on every node (no compile, nothing sent to Redis), the new one is 1 compile cluster-wide."""
    from cuda.core import ProgramOptions
    from testkit.nginx import nginx_or_skip

    from cuda_program_cas import ContentAddressedProgramCache, publish

    old, new = _new_kernel(), _new_kernel()
    with nginx_or_skip(tmp_path / "nginx") as server:
        with ContentAddressedProgramCache(tmp_path / "seed") as seed:
            options = ProgramOptions(arch="sm_80", include_path=[cccl_or_skip()], std="c++17")
            seed.compile(old, "c++", options, "cubin")
        publish([tmp_path / "seed"], server.dav_url("store"))
        server.reset_log()
        nodes = [Node(tmp_path, n, [old, new], redis.url, "30", also=server.read_url("store")) for n in range(8)]
        for node in nodes:
            node.go()
        results = [node.result() for node in nodes]
        blob_gets = [e for e in server.requests() if e.method == "GET" and "/blobs/" in e.uri and e.status == 200]
    assert sum(r["compiled"] for r in results) == 1, [(r["compiled"], r["hits"]) for r in results]
    assert sum(r["hits"] for r in results) == 2 * len(nodes) - 1
    assert all(r["shared_hits"] >= 1 for r in results)  # the old kernel, from nginx
    assert sum(r["uploads"] for r in results) == 2  # the new kernel's binary and record, once
    assert len(blob_gets) >= len(nodes)  # every node read the old kernel's blob from nginx


def test_nodes_that_cannot_publish_take_no_lease_and_finish_within_one_compile(
    tmp_path: Path, redis: RedisServer
) -> None:
    """The signing key's file is missing on every node: each upload is dropped, so no node takes the lease (that
    others would wait on for a result that never comes); the 4 nodes compile side by side and none waits."""
    source = _new_kernel()
    missing = {"CUDA_PROGRAM_CAS_SIGNING_KEY": str(tmp_path / "no-such.key")}
    nodes = [Node(tmp_path, n, source, redis.url, "30", env=missing) for n in range(4)]
    for node in nodes:
        node.go()
    results = [node.result() for node in nodes]
    counts = [(r["compiled"], r["waits"], r["uploads"], r["dropped"]) for r in results]
    assert all(r["compiled"] == 1 and r["waits"] == 0 for r in results), counts  # no node waited for another
    assert all(r["uploads"] == 0 and r["dropped"] >= 1 for r in results), counts
    assert len({r["code"] for r in results}) == 1
    assert [(k, redis.client().get(k)) for k in redis.client().keys("cpcas:lease:*")] == []
    took = [r["done"] - r["t0"] for r in results]
    print(f"\nuploads impossible: 4 nodes done in {', '.join(f'{t:.1f}' for t in sorted(took))} s (each compiled)")


def test_a_holder_whose_upload_fails_marks_the_lease_and_every_waiter_compiles_at_once(
    tmp_path: Path, redis: RedisServer
) -> None:
    """The holder's Redis user may write leases and nothing else: its upload is denied after its compile, so it
    gives the lease up with the mark, and each of the 4 waiting nodes stops waiting and compiles (not one of
    them taking the lease while the others wait for it in turn)."""
    client = redis.client()
    client.execute_command(
        "ACL", "SETUSER", "lame", "on", ">lame-pw", "resetkeys", "%R~cpcas:*", "~cpcas:lease:*", "+@all"
    )
    try:
        source = _new_kernel()
        holder = Node(tmp_path, 0, source, redis.url.replace("://", "://lame:lame-pw@"), "30")
        others = [Node(tmp_path, n, source, redis.url, "30") for n in range(1, 5)]
        holder.go()
        _lease_taken(redis)
        for node in others:
            node.go()
        held = holder.result()
        results = [node.result() for node in others]
    finally:
        client.execute_command("ACL", "DELUSER", "lame")
    assert (held["compiled"], held["uploads"]) == (1, 0) and held["dropped"] >= 1, held
    counts = [(r["compiled"], r["hits"], r["waits"]) for r in results]
    assert all(r["compiled"] == 1 and r["waits"] == 1 for r in results), counts  # each waited once, then compiled
    assert [client.get(k) for k in client.keys("cpcas:lease:*")] == [b"compile-now"]  # the mark, until its TTL
    assert len({r["code"] for r in results} | {held["code"]}) == 1
    after = max(r["done"] for r in results) - held["done"]
    print(
        f"\nupload denied: every waiter done {after:.1f} s after the holder "
        f"(one compile of {held['done'] - held['t0']:.1f} s)"
    )


def test_a_node_whose_uploads_fail_takes_no_lease_until_one_succeeds(tmp_path: Path, redis: RedisServer) -> None:
    """Uploads known to fail: after one is denied, this node's claims take no lease (others would wait on it in
    vain); once an upload succeeds again, they do. A lease held without a result to give is left marked."""
    from cuda_program_cas import CacheStore
    from cuda_program_cas.index import key_id

    client = redis.client()
    client.execute_command("ACL", "SETUSER", "lame2", "on", ">pw", "resetkeys", "%R~cpcas:*", "~cpcas:lease:*", "+@all")
    store = CacheStore(tmp_path / "local", shared=[redis.url.replace("://", "://lame2:pw@") + "|write"])
    try:
        wb = store._shared.writeback if store._shared else None
        assert wb is not None
        first, second, third = (key_id(f"lease-{uuid.uuid4().hex}-{n}") for n in range(3))
        with store.inner.claim(first) as got:
            assert got.held and client.get(f"cpcas:lease:{first}") is not None  # no failure known yet: taken
        assert client.get(f"cpcas:lease:{first}") == b"compile-now"  # given up without a result: marked
        assert store.put(f"denied-{uuid.uuid4().hex}", b"v") and wb.flush(10)
        assert store.counters()["uploads_dropped"] >= 1
        with store.inner.claim(second) as got:
            assert not got.waited  # the node's own claim only
            assert client.exists(f"cpcas:lease:{second}") == 0  # its uploads fail: no lease taken
        client.execute_command("ACL", "SETUSER", "lame2", "~cpcas:*")  # writes allowed again
        assert store.put(f"allowed-{uuid.uuid4().hex}", b"v") and wb.flush(10)
        assert store.counters()["uploads"] >= 1
        with store.inner.claim(third) as got:
            assert got.held and client.exists(f"cpcas:lease:{third}") == 1
    finally:
        store.close()
        client.execute_command("ACL", "DELUSER", "lame2")
