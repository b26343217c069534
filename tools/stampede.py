"""A cold start of one node: N processes that start together and compile the same kernels.

    python tools/stampede.py                  # 8 processes, 20 kernels (4 CUB)
    python tools/stampede.py -p 4 -k 10 --cub 2 --json
    python tools/stampede.py --cluster -p 8 -k 4 --cub 2

Each worker opens the same cold cache, says it is ready, waits for the word, then compiles
K kernels in one order through ``cache.compile`` (small ones and a few CUB kernels). Three
runs, each on a cache of its own: one process alone; N at once, where one compiles each kernel
and the others wait for its claim and hit; N at once with ``CUDA_PROGRAM_CAS_CLAIM_WAIT=0``
(the stampede without single flight). With ``--cluster`` the processes are nodes, each with
a local cache of its own, and two more runs: N nodes sharing one writable Redis store (one
compiles each kernel under its lease, the others hit its upload), and N with no shared store.
Per run: the compiles NVRTC ran, the waits and the hits after one, and the wall time from the
word to the last process done, against one process alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from testkit.common import CUB_SOURCE, cccl_include, git_state, work_dir
from testkit.workers import spawn_worker, worker_spec

SMALL_SOURCE = r"""
extern "C" __global__ void scale_{n}(float *x, int count) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[i] = x[i] * {n}.0f + 1.0f;
}}
"""


def kernels(count: int, cub: int) -> list[dict[str, Any]]:
    """``count`` distinct kernels, ``cub`` of them CUB kernels (spread through the list)."""
    out: list[dict[str, Any]] = []
    step = max(1, count // max(1, cub))
    for n in range(count):
        if cub and n % step == 0 and sum(k["cub"] for k in out) < cub:
            threads = 32 * (len(out) % 8 + 1)  # a distinct block size each
            source = CUB_SOURCE.replace("128", str(threads))
            out.append({"source": source, "cub": True})
        else:
            out.append({"source": SMALL_SOURCE.format(n=n + 1), "cub": False})
    return out


def worker(spec: dict[str, Any]) -> None:
    """Open the cache, say ``ready``, wait for a line on stdin, compile every kernel, answer in JSON."""
    os.environ["CUDA_PROGRAM_CAS_CLAIM_WAIT"] = str(spec["claim_wait"])
    if spec.get("store"):
        os.environ["CUDA_PROGRAM_CAS_SHARED"] = spec["store"] + "|write"
    from cuda.core import ProgramOptions

    from cuda_program_cas import ContentAddressedProgramCache

    cache = ContentAddressedProgramCache(spec["cache"])
    plain = ProgramOptions(arch="sm_80")
    cub = ProgramOptions(arch="sm_80", std="c++17", include_path=[spec["include"]]) if spec["include"] else None
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    for k in spec["kernels"]:
        cache.compile(k["source"], "c++", cub if k["cub"] else plain, "cubin")
    elapsed = time.perf_counter() - t0
    counts = cache.counters()
    cache.close()
    print(json.dumps({"elapsed_s": elapsed, "counters": counts}), flush=True)


def run(processes: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Start ``processes`` workers on ``spec``, release them together, and sum what they did."""
    # Nodes (``spec["nodes"]``): a local cache each, as on separate machines.
    specs = [
        {**spec, "cache": os.path.join(spec["cache"], f"node{n}")} if spec.get("nodes") else spec
        for n in range(processes)
    ]
    procs = [spawn_worker(__file__, s, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for s in specs]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"a worker did not get ready: {line!r}")
        t0 = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        answers = []
        for p in procs:
            assert p.stdout is not None
            answers.append(json.loads(p.stdout.readline()))
        wall = time.perf_counter() - t0
        for p in procs:
            if p.wait(timeout=120) != 0:
                raise RuntimeError(f"a worker failed with status {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    total = {name: sum(a["counters"][name] for a in answers) for name in ("misses", "hits", "claim_waits")}
    total["claim_hits"] = sum(a["counters"].get("claim_hits", 0) for a in answers)
    return {"processes": processes, "wall_s": wall, "compiles": total["misses"], **total}


def measure_cluster(processes: int, common: dict[str, Any], base: str) -> dict[str, dict[str, Any]]:
    """The cluster runs: ``processes`` nodes with one Redis store, and with none (each on cold caches)."""
    from testkit.redis_server import RedisServer

    server = RedisServer(os.path.join(base, "redis"), maxmemory="512mb", policy="allkeys-lru").start()
    try:
        nodes = {**common, "nodes": True, "claim_wait": 300}
        return {
            "one node alone": run(1, {**nodes, "cache": os.path.join(base, "alone")}),
            f"{processes} nodes, one Redis store": run(
                processes, {**nodes, "cache": os.path.join(base, "redis-nodes"), "store": server.url}
            ),
            f"{processes} nodes, no shared store": run(processes, {**nodes, "cache": os.path.join(base, "apart")}),
        }
    finally:
        server.stop()


def measure(processes: int, common: dict[str, Any], base: str) -> dict[str, dict[str, Any]]:
    """The three runs, each on a cold cache of its own under ``base``."""
    return {
        "one process alone": run(1, {**common, "cache": os.path.join(base, "alone"), "claim_wait": 300}),
        f"{processes} processes, claims": run(
            processes, {**common, "cache": os.path.join(base, "claims"), "claim_wait": 300}
        ),
        f"{processes} processes, no waiting": run(
            processes, {**common, "cache": os.path.join(base, "stampede"), "claim_wait": 0}
        ),
    }


def main(argv: list[str]) -> int:
    spec = worker_spec(argv)
    if spec is not None:
        worker(spec)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", "-p", type=int, default=8, help="processes that start together (default 8)")
    ap.add_argument("--kernels", "-k", type=int, default=20, help="distinct kernels each compiles (default 20)")
    ap.add_argument("--cub", type=int, default=4, help="how many of them are CUB kernels (default 4)")
    ap.add_argument("--dir", help="where the caches are created (default: a new temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument(
        "--cluster", action="store_true", help="nodes with caches of their own and one redis-server (see above)"
    )
    args = ap.parse_args(argv)
    if args.processes < 1 or args.kernels < 1 or not 0 <= args.cub <= args.kernels:
        ap.error("--processes and --kernels must be at least 1, --cub between 0 and --kernels")
    include = cccl_include()
    cub = args.cub if include else 0
    common = {"kernels": kernels(args.kernels, cub), "include": include}
    with work_dir(args.dir, "stampede") as base:
        runs = (measure_cluster if args.cluster else measure)(args.processes, common, base)
    alone = next(iter(runs.values()))["wall_s"]
    commit, dirty = git_state()
    out = {
        "processes": args.processes,
        "kernels": args.kernels,
        "cub_kernels": cub,
        "cpus": os.cpu_count(),
        "git": commit + (" (cas/ or index/ modified)" if dirty else ""),
        "runs": {name: {**r, "ratio": r["wall_s"] / alone} for name, r in runs.items()},
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"{args.kernels} kernels ({cub} CUB) compiled through cache.compile by processes started together "
        f"on a cold cache; {os.cpu_count()} CPUs; git {out['git']}"
    )
    print(f"{'run':<30}{'NVRTC compiles':>15}{'waits':>8}{'hits after a wait':>19}{'wall s':>9}{'ratio':>8}")
    for name, r in out["runs"].items():
        print(
            f"{name:<30}{r['compiles']:>15}{r['claim_waits']:>8}{r['claim_hits']:>19}"
            f"{r['wall_s']:>9.2f}{r['ratio']:>8.2f}"
        )
    if not include:
        print("no CCCL headers found (pip install nvidia-cuda-cccl): small kernels only")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
