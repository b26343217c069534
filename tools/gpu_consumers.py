"""Libraries that never pass ``cache=``, under ``CUDA_PROGRAM_CAS=1``, cold and warm (needs a GPU).

Each workload runs twice, each time in a fresh interpreter with the switch on, on one
cache that starts empty: cold (the cache misses, the library compiles), then warm. It
checks the result on the host both times, and reads the cache's lifetime counters after
each run: a miss is an NVRTC compile or an nvJitLink link that went through cuda.core,
a hit is one the cache answered instead.

- ``cccl_ltoir``: cuda-cccl's ``cuda.compute._cpp_compile.compile_cpp_to_ltoir`` of a
  C++ device function (``Program(...).compile("ltoir")`` with CCCL's include path);
- ``cccl_reduce``: a first ``cuda.compute.reduce_into`` (``OpKind.PLUS``) over 1M ints;
  most of its build runs in cuda.compute's C extension, which calls NVRTC and nvJitLink
  from C++: no Python-level switch reaches that part;
- ``numba_link``: a numba-cuda kernel that calls a device function from a CUDA C++ file
  (``link=[...]``): numba-cuda compiles the file with cuda.core's ``Program`` and links
  with cuda.core's ``Linker``.

    python tools/gpu_consumers.py [--only cccl_ltoir,numba_link] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from _common import REPO, run_worker, worker_spec

DEVICE_FUNCTION = r"""
extern "C" __device__ int cpcas_triple(int x) { return 3 * x; }
"""

NUMBA_CU = r"""
extern "C" __device__ int cpcas_add_seven(int *out, int x) { *out = x + 7; return 0; }
"""


def cccl_ltoir(_: dict[str, Any]) -> dict[str, Any]:
    from cuda.compute._cpp_compile import compile_cpp_to_ltoir

    ltoir = compile_cpp_to_ltoir(DEVICE_FUNCTION)
    return {"ok": isinstance(ltoir, bytes) and len(ltoir) > 0, "bytes": len(ltoir)}


def cccl_reduce(_: dict[str, Any]) -> dict[str, Any]:
    import cupy as cp
    import numpy as np
    from cuda.compute import OpKind, reduce_into

    n = 1 << 20
    d_in = cp.arange(n, dtype=cp.int64)
    d_out = cp.empty(1, dtype=cp.int64)
    reduce_into(d_in=d_in, d_out=d_out, num_items=n, op=OpKind.PLUS, h_init=np.zeros(1, dtype=np.int64))
    got = int(d_out.get()[0])
    return {"ok": got == n * (n - 1) // 2, "sum": got}


def numba_link(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from numba import cuda

    path = os.path.join(spec["work"], "add_seven.cu")
    with open(path, "w") as fh:
        fh.write(NUMBA_CU)
    add_seven = cuda.declare_device("cpcas_add_seven", "int32(int32)")

    @cuda.jit(link=[path])
    def kernel(out: Any, x: Any) -> None:
        i = cuda.grid(1)
        if i < x.size:
            out[i] = add_seven(x[i])

    x = np.arange(256, dtype=np.int32)
    out = np.zeros_like(x)
    kernel[1, 256](out, x)
    cuda.synchronize()
    return {"ok": bool((out == x + 7).all())}


WORKLOADS = {"cccl_ltoir": cccl_ltoir, "cccl_reduce": cccl_reduce, "numba_link": numba_link}


def worker(spec: dict[str, Any]) -> None:
    import warnings

    warnings.simplefilter("ignore")  # libraries' own warnings (driver versions, NVRTC logs) are not the point
    t0 = time.perf_counter()
    out = WORKLOADS[spec["task"]](spec)
    out["elapsed_s"] = time.perf_counter() - t0
    print(json.dumps(out), flush=True)


def counters(cache: str) -> dict[str, int]:
    from cuda_program_cas import stats

    got: dict[str, int] = stats(cache).as_dict()["counters"]  # type: ignore[assignment]
    return got


def run(task: str, cache: str, work: str) -> dict[str, Any]:
    """One workload in a fresh interpreter with the switch on; its answer, or why it failed."""
    t0 = time.perf_counter()
    try:
        out = run_worker(
            __file__,
            {"task": task, "work": work},
            600,
            settings={"CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": cache},
        )
    except RuntimeError as exc:
        out = {"ok": False, "error": str(exc)[-1500:]}
    out["process_s"] = time.perf_counter() - t0
    return out


def main(argv: list[str]) -> int:
    spec = worker_spec(argv)
    if spec is not None:
        worker(spec)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated workloads (default all): " + ",".join(WORKLOADS))
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    tasks = args.only.split(",") if args.only else list(WORKLOADS)
    unknown = [t for t in tasks if t not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workloads: {', '.join(unknown)}")
    results: dict[str, Any] = {}
    for task in tasks:
        with tempfile.TemporaryDirectory(prefix=f"cpcas-{task}-") as base:
            cache, work = os.path.join(base, "cache"), os.path.join(base, "work")
            os.makedirs(work)
            rows = {}
            before = {"misses": 0, "hits": 0}
            for phase in ("cold", "warm"):
                row = run(task, cache, work)
                now = counters(cache) if os.path.isdir(cache) else {"misses": 0, "hits": 0}
                row["misses"] = now.get("misses", 0) - before.get("misses", 0)
                row["hits"] = now.get("hits", 0) - before.get("hits", 0)
                row["switched"] = now.get("switched", 0)
                before = now
                rows[phase] = row
            results[task] = rows
    if args.json:
        print(json.dumps({"repo": REPO, "results": results}, indent=1))
        return 0
    print(f"{'workload':<14}{'phase':<7}{'ok':<6}{'misses':>7}{'hits':>6}{'workload s':>12}{'process s':>11}")
    for task, rows in results.items():
        for phase, r in rows.items():
            print(
                f"{task:<14}{phase:<7}{r.get('ok')!s:<6}{r['misses']:>7}{r['hits']:>6}"
                f"{r.get('elapsed_s', float('nan')):>12.3f}{r['process_s']:>11.3f}"
            )
            if "error" in r:
                print("   ", r["error"].replace("\n", "\n    "))
    return 0 if all(r.get("ok") for rows in results.values() for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
