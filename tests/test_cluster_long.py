"""One compile per key per cluster over a job longer than the key list's refresh and a lease's renewal.

Node processes, each with a local cache of its own, share one real redis-server
named writable, start together (``ready``, then the word on stdin) and compile the
same job through ``cache.compile`` with real NVRTC: small kernels and a few CUB
kernels (a CUB compile takes seconds, so the nodes that wait for it are quiet long
enough for write-back to merge their keys into the store's key list meanwhile).
``CUDA_PROGRAM_CAS_KEYS_REFRESH`` and ``CUDA_PROGRAM_CAS_LEASE_TTL`` are short, so
the run crosses many key-list refreshes and lease renewals within seconds.

Each key must be compiled exactly once cluster-wide, every node must hold bytes
equal to an uncached compile of each kernel, and ``claim_hits`` must stay within
``claim_waits`` on every node (docs/counters.md). A waiter that finds the holder's
front-door record must find its result too: the copy of the key list it refreshed
after the wait predates the holder's upload, so it looks past the list.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
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
    import hashlib, json, sys, time
    from cuda.core import ProgramOptions
    from cuda_program_cas import ContentAddressedProgramCache

    kernels, include, local = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    cache = ContentAddressedProgramCache(local)
    plain = ProgramOptions(arch="sm_80")
    cub = ProgramOptions(arch="sm_80", include_path=[include], std="c++17")
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    codes = [hashlib.sha256(bytes(cache.compile(k["source"], "c++", cub if k["cub"] else plain, "cubin").code))
             .hexdigest() for k in kernels]
    done = time.monotonic()
    cache.close()
    c = cache.stats()
    print(json.dumps({"s": done - t0, "compiled": c.misses, "hits": c.hits, "waits": c.claim_waits,
                      "claim_hits": c.claim_hits, "codes": codes}), flush=True)
    """
)

SMALL = r"""
extern "C" __global__ void scale_{n}(float *x, int count) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[i] = x[i] * {n}.0f + 1.0f;
}}
"""


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the module's clusters, evicting the least recently used keys past 256 MB."""
    server = redis_or_skip(tmp_path_factory.mktemp("redis"), maxmemory="256mb", policy="allkeys-lru")
    yield server
    server.stop()


def _job(small: int, cubs: int) -> list[dict[str, Any]]:
    """``small`` small kernels with ``cubs`` CUB kernels spread among them, all new to every cache (a token each)."""
    token = uuid.uuid4().hex
    step = max(1, small // (cubs + 1))
    job: list[dict[str, Any]] = []
    for n in range(small):
        if n and n % step == 0 and sum(k["cub"] for k in job) < cubs:
            threads = 32 * (sum(k["cub"] for k in job) + 2)  # a block size of its own each
            job.append({"source": f"// {token}\n" + CUB_SOURCE.replace("128", str(threads)), "cub": True})
        job.append({"source": f"// {token}\n" + SMALL.format(n=n + 1), "cub": False})
    return job


def _uncached(job: list[dict[str, Any]], include: str) -> list[str]:
    """Each kernel's bytes compiled by NVRTC with no cache at all (sha256)."""
    from cuda.core import Program, ProgramOptions

    out = []
    for k in job:
        options = ProgramOptions(arch="sm_80", include_path=[include], std="c++17") if k["cub"] else None
        options = options or ProgramOptions(arch="sm_80")
        code = bytes(Program(k["source"], "c++", options=options).compile("cubin").code)
        out.append(hashlib.sha256(code).hexdigest())
    return out


def _run(tmp: Path, redis: RedisServer, nodes: int, job: list[dict[str, Any]]) -> list[dict[str, Any]]:
    env = dict(os.environ)
    env.pop("CUDA_PROGRAM_CAS", None)
    env.update(
        {
            "CUDA_PROGRAM_CAS_SHARED": f"{redis.url}|write",
            "CUDA_PROGRAM_CAS_KEYS_REFRESH": "0.5",  # a refresh every half second: dozens in the run
            "CUDA_PROGRAM_CAS_LEASE_TTL": "3",  # renewed every second: a CUB compile crosses several
        }
    )
    procs = []
    try:
        for n in range(nodes):
            env["CUDA_PROGRAM_CAS_LOG"] = str(tmp / f"node{n}.log")
            proc = subprocess.Popen(
                [sys.executable, "-c", NODE, json.dumps(job), cccl_or_skip(), str(tmp / f"node{n}")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            procs.append(proc)
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == "ready\n", line + (proc.stderr.read() if proc.stderr else "")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=400)
            assert proc.returncode == 0 and "Traceback" not in err, err
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.mark.slow  # 16 and 8 node processes (22 s); the short cluster tests run on every Python
@pytest.mark.parametrize("nodes", [8, 16])
def test_one_compile_per_key_holds_past_key_list_refreshes_and_lease_renewals(
    tmp_path: Path, redis: RedisServer, nodes: int
) -> None:
    job = _job(small=12, cubs=2)
    results = _run(tmp_path, redis, nodes, job)
    counts = [(r["compiled"], r["hits"], r["waits"], r["claim_hits"]) for r in results]
    assert sum(r["compiled"] for r in results) == len(job), counts  # exactly one compile per key, cluster-wide
    assert all(r["compiled"] + r["hits"] == len(job) for r in results), counts
    assert all(r["claim_hits"] <= r["waits"] for r in results), counts  # hits after a wait: a subset of the waits
    assert sum(r["waits"] for r in results) >= nodes - 1  # the nodes did wait for one another's leases
    expected = _uncached(job, cccl_or_skip())
    assert all(r["codes"] == expected for r in results)  # every node: the bytes of an uncached compile
    print(
        f"\n{nodes} nodes, {len(job)} kernels: {max(r['s'] for r in results):.1f} s; "
        f"(compiled, hits, waits, claim hits) {counts}"
    )
