"""A numba-cuda job of five kernels: uncached, then cold and warm under ``CUDA_PROGRAM_CAS=1``.

    python tools/numba_bench.py [--ptx] [--runs 3] [--dir DIR]

Each run is a fresh interpreter: ``uncached`` (``CUDA_PROGRAM_CAS=0``), ``cold`` (an empty
cache), ``warm`` (the cache the cold run filled), alternating ``--runs`` times. The job
compiles five kernels (libdevice, atomics, shared memory among them), launches each and checks
it against numpy; ``--ptx`` only compiles them to PTX for sm_80 (no GPU needed). Per run:
``process_s`` (the interpreter, as the parent times it), ``job_s`` (from before ``import
numba.cuda`` to the last checked result) and its ``import_s``, ``nvvm_s`` and
``nvvm_compiles`` (NVVM's ``compile_program``, counted), and the cache's ``hits`` and
``misses``. Medians are printed as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from testkit import REPO
from testkit.common import work_dir
from testkit.workers import answer, run_worker, worker_spec

PHASES = ("uncached", "cold", "warm")


def kernels() -> list[tuple[str, Any, str, Any]]:
    """``(name, python function, signature, check)``: ``check(cuda)`` launches it and compares with numpy."""
    import math

    import numpy as np
    from numba import cuda

    n = 1 << 16
    rng = np.random.default_rng(0)
    x, y = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)

    def axpy(a, x, y, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = a * x[i] + y[i]

    def smooth(x, out):  # calls libdevice (expf, sinf)
        i = cuda.grid(1)
        if i < out.size:
            out[i] = math.exp(-x[i]) * math.sin(x[i])

    def histogram(v, bins):  # atomics
        i = cuda.grid(1)
        if i < v.size:
            cuda.atomic.add(bins, v[i] % bins.size, 1)

    def stencil(a, out):  # 2D
        i, j = cuda.grid(2)
        if 0 < i < a.shape[0] - 1 and 0 < j < a.shape[1] - 1:
            out[i, j] = 0.25 * (a[i - 1, j] + a[i + 1, j] + a[i, j - 1] + a[i, j + 1])

    def block_sum(x, out):  # shared memory
        buf = cuda.shared.array(256, dtype=np.float32)
        t = cuda.threadIdx.x
        i = cuda.blockIdx.x * 256 + t
        buf[t] = x[i] if i < x.size else 0
        cuda.syncthreads()
        s = 128
        while s > 0:
            if t < s:
                buf[t] += buf[t + s]
            cuda.syncthreads()
            s //= 2
        if t == 0:
            out[cuda.blockIdx.x] = buf[0]

    def run_axpy(k: Any) -> bool:
        out = cuda.device_array_like(x)
        k[n // 256, 256](np.float32(2), cuda.to_device(x), cuda.to_device(y), out)
        return bool(np.allclose(out.copy_to_host(), 2 * x + y, rtol=1e-6))

    def run_smooth(k: Any) -> bool:
        out = cuda.device_array_like(x)
        k[n // 256, 256](cuda.to_device(x), out)
        return bool(np.allclose(out.copy_to_host(), np.exp(-x) * np.sin(x), rtol=1e-5, atol=1e-6))

    def run_histogram(k: Any) -> bool:
        v = rng.integers(0, 1000, n, dtype=np.int32)
        bins = cuda.to_device(np.zeros(16, dtype=np.int32))
        k[n // 256, 256](cuda.to_device(v), bins)
        return bool((bins.copy_to_host() == np.bincount(v % 16, minlength=16)).all())

    def run_stencil(k: Any) -> bool:
        a = rng.random((256, 256))
        out = cuda.to_device(np.zeros_like(a))
        k[(16, 16), (16, 16)](cuda.to_device(a), out)
        want = np.zeros_like(a)
        want[1:-1, 1:-1] = 0.25 * (a[:-2, 1:-1] + a[2:, 1:-1] + a[1:-1, :-2] + a[1:-1, 2:])
        return bool(np.allclose(out.copy_to_host(), want))

    def run_block_sum(k: Any) -> bool:
        out = cuda.device_array(n // 256, dtype=np.float32)
        k[n // 256, 256](cuda.to_device(x), out)
        return bool(np.allclose(out.copy_to_host(), x.reshape(-1, 256).sum(axis=1), rtol=1e-4))

    return [
        ("axpy", axpy, "void(float32, float32[:], float32[:], float32[:])", run_axpy),
        ("smooth", smooth, "void(float32[:], float32[:])", run_smooth),
        ("histogram", histogram, "void(int32[:], int32[:])", run_histogram),
        ("stencil", stencil, "void(float64[:, :], float64[:, :])", run_stencil),
        ("block_sum", block_sum, "void(float32[:], float32[:])", run_block_sum),
    ]


def worker(spec: dict[str, Any]) -> None:
    """One run of the job in this fresh interpreter: prints its answer as one JSON line."""
    t0 = time.perf_counter()
    from cuda.bindings import nvvm

    spent = {"n": 0, "s": 0.0}
    real = nvvm.compile_program

    def counted(*args: Any) -> Any:
        t = time.perf_counter()
        try:
            return real(*args)
        finally:
            spent["n"] += 1
            spent["s"] += time.perf_counter() - t

    nvvm.compile_program = counted  # numba calls it as an attribute of the module, at each compile
    from numba import cuda

    import_s = time.perf_counter() - t0
    ok = {}
    for name, func, sig, check in kernels():
        if spec["ptx"]:
            ptx, _ = cuda.compile_ptx(func, sig, cc=(8, 0))
            ok[name] = ".entry" in ptx
        else:
            ok[name] = check(cuda.jit(func))  # compiled at its first launch, as a job's kernels are
    job_s = time.perf_counter() - t0
    switch = sys.modules.get("cuda_program_cas._cuda.switch")
    cache = getattr(getattr(switch, "_S", None), "cache", None)
    counters = cache.counters() if cache is not None else {}
    out = {"ok": all(ok.values()), "kernels": ok, "job_s": job_s, "import_s": import_s}
    out.update(nvvm_s=spent["s"], nvvm_compiles=spent["n"])
    out.update(hits=counters.get("hits", 0), misses=counters.get("misses", 0))
    answer(out)


def run(phase: str, cache: str, ptx: bool) -> dict[str, Any]:
    settings = {"CUDA_PROGRAM_CAS": "0" if phase == "uncached" else "1", "CUDA_PROGRAM_CAS_DIR": cache}
    t0 = time.perf_counter()
    out = run_worker(__file__, {"ptx": ptx}, 600, settings=settings)
    out["process_s"] = time.perf_counter() - t0
    return out


def main(argv: list[str]) -> int:
    spec = worker_spec(argv)
    if spec is not None:
        worker(spec)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ptx", action="store_true", help="compile to PTX only (no GPU needed)")
    ap.add_argument("--runs", type=int, default=3, help="rounds of uncached, cold and warm (default 3)")
    ap.add_argument("--dir", help="where the caches go (default: a temporary directory, removed)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in PHASES}
    with work_dir(args.dir, "numba-bench") as base:
        for i in range(args.runs):
            cache = os.path.join(base, f"cache-{i}")
            for phase in PHASES:
                rows[phase].append(run(phase, cache, args.ptx))
    summary: dict[str, Any] = {}
    for phase, got in rows.items():
        keys = ("process_s", "job_s", "import_s", "nvvm_s", "nvvm_compiles")
        med = {k: statistics.median(r[k] for r in got) for k in keys}
        med.update(ok=all(r["ok"] for r in got), hits=got[-1]["hits"], misses=got[-1]["misses"])
        summary[phase] = med
    un, warm = summary["uncached"], summary["warm"]
    out = {"repo": REPO, "mode": "ptx" if args.ptx else "gpu", "runs": args.runs, "phases": summary}
    out["nvvm_share_of_uncached_job"] = un["nvvm_s"] / un["job_s"]
    out["nvvm_share_of_uncached_compiles"] = un["nvvm_s"] / (un["job_s"] - un["import_s"])
    out.update(warm_saved_job_s=un["job_s"] - warm["job_s"], warm_saved_process_s=un["process_s"] - warm["process_s"])
    print(json.dumps({**out, "all": rows}, indent=1))
    return 0 if all(s["ok"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
