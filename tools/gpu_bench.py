#!/usr/bin/env python3
"""What the cache buys on a GPU machine: compile versus hit, and a fresh process's first result.

    python tools/gpu_bench.py                      # the full run (about two minutes on an H200 machine)
    python tools/gpu_bench.py --quick              # fewer repetitions
    python tools/gpu_bench.py --json-out r.json    # also write every figure as one JSON object

Two kernels: ``heavy`` (a CUB block reduce and radix sort) and ``light`` (a saxpy). CCCL's
headers come from NVRTC's bundled copy (``use_bundled_headers=True``, which
``compile(cache=...)`` accepts) or an ``include_path``, which it refuses: that mode keys by
hand (``make_program_cache_key(..., extra_digest=...)`` over the CCCL version header and the
directory). Measured in one process: an uncached compile, a miss, a hit, the first hit of a
new cache object and the module load of a hit; and from a fresh process to the first kernel
result checked on the host, cold (empty cache) against warm.

Exit status: 0 when every kernel result was right, 1 when one was wrong, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from testkit.common import SAXPY, cccl_include, cpu_model, work_dir
from testkit.workers import answer, collect, spawn_worker, worker_spec

HEAVY = r"""
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_radix_sort.cuh>

constexpr int BLOCK = 256;
constexpr int ITEMS = 4;

extern "C" __global__ void __launch_bounds__(BLOCK)
block_sum_sort(const int *in, int *sums, int *sorted) {
    using Reduce = cub::BlockReduce<int, BLOCK>;
    using Sort = cub::BlockRadixSort<int, BLOCK, ITEMS>;
    __shared__ union {
        typename Reduce::TempStorage reduce;
        typename Sort::TempStorage sort;
    } tmp;
    int items[ITEMS];
    const int base = blockIdx.x * BLOCK * ITEMS + threadIdx.x * ITEMS;
    int mine = 0;
    for (int i = 0; i < ITEMS; ++i) {
        items[i] = in[base + i];
        mine += items[i];
    }
    const int total = Reduce(tmp.reduce).Sum(mine);
    if (threadIdx.x == 0) sums[blockIdx.x] = total;
    __syncthreads();
    Sort(tmp.sort).Sort(items);
    for (int i = 0; i < ITEMS; ++i) sorted[base + i] = items[i];
}
"""
HEAVY_BLOCK, HEAVY_ITEMS, HEAVY_BLOCKS = 256, 4, 4096

LIGHT_N = 1 << 22


# -- compiling through the cache --------------------------------------------------------


def has_bundled_headers() -> bool:
    """Whether this cuda.core has the option and this NVRTC (13.3 or later) accepts it."""
    from cuda.core import ProgramOptions

    if "use_bundled_headers" not in getattr(ProgramOptions, "__dataclass_fields__", {}):
        return False
    try:
        ProgramOptions(arch="sm_90", use_bundled_headers=True)
    except RuntimeError:  # "use_bundled_headers requires NVRTC >= 13.3"
        return False
    return True


def header_digest(include: str) -> bytes:
    """A fingerprint of the CCCL headers: their directory and the version header's bytes."""
    from blake3 import blake3

    h = blake3(include.encode())
    for rel in ("cuda/std/__cccl/version.h", "cuda/version", "cub/version.cuh"):
        try:
            with open(os.path.join(include, rel), "rb") as fh:
                h.update(rel.encode() + b"\0" + fh.read())
        except OSError:
            continue
    return h.digest()


def compile_cached(kernel: str, mode: str, arch: str, cache: Any) -> Any:
    """The ObjectCode for ``kernel`` through ``cache`` (None: no cache), as an application would do it."""
    from cuda.core import ObjectCode, Program, ProgramOptions

    if kernel == "light":
        opts = ProgramOptions(arch=arch)
        return Program(SAXPY, "c++", options=opts).compile("cubin", cache=cache)
    if mode == "bundled":
        opts = ProgramOptions(arch=arch, std="c++17", use_bundled_headers=True)
        return Program(HEAVY, "c++", options=opts).compile("cubin", cache=cache)
    include = cccl_include()
    if include is None:
        raise RuntimeError("no CCCL headers found (cuda-pathfinder, /usr/local/cuda/include)")
    opts = ProgramOptions(arch=arch, std="c++17", include_path=[include])
    if cache is None:
        return Program(HEAVY, "c++", options=opts).compile("cubin")
    from cuda.core.utils import make_program_cache_key

    key = make_program_cache_key(
        code=HEAVY, code_type="c++", options=opts, target_type="cubin", extra_digest=header_digest(include)
    )
    data = cache.get(key)
    if data is not None:
        return ObjectCode.from_cubin(data)
    obj = Program(HEAVY, "c++", options=opts).compile("cubin")
    cache[key] = obj
    return obj


# -- running a kernel and checking it on the host -----------------------------------------


def run_and_check(kernel: str, obj: Any, dev: Any, stream: Any) -> bool:
    """Launch the kernel on fresh input, copy the output back, compare with numpy."""
    import ctypes

    import numpy as np
    from cuda.core import LaunchConfig, LegacyPinnedMemoryResource, launch

    pinned = LegacyPinnedMemoryResource()

    def view(buf: Any, ctype: Any, n: int) -> Any:
        return np.ctypeslib.as_array((ctype * n).from_address(int(buf.handle)))

    rng = np.random.default_rng(11)
    if kernel == "light":
        n, nbytes = LIGHT_N, LIGHT_N * 4
        hx, hy, hout = (pinned.allocate(nbytes) for _ in range(3))
        x, y = view(hx, ctypes.c_float, n), view(hy, ctypes.c_float, n)
        x[:] = rng.random(n, dtype=np.float32) + 0.5
        y[:] = rng.random(n, dtype=np.float32)
        dx, dy = dev.allocate(nbytes, stream=stream), dev.allocate(nbytes, stream=stream)
        hx.copy_to(dx, stream=stream)
        hy.copy_to(dy, stream=stream)
        a = np.float32(1.5)
        launch(stream, LaunchConfig(grid=n // 256, block=256), obj.get_kernel("saxpy"), a, dx, dy, np.int32(n))
        dy.copy_to(hout, stream=stream)
        stream.sync()
        return bool(np.allclose(view(hout, ctypes.c_float, n), a * x + y, rtol=1e-6, atol=0))
    per_block = HEAVY_BLOCK * HEAVY_ITEMS
    n = HEAVY_BLOCKS * per_block
    hin, hsorted = pinned.allocate(n * 4), pinned.allocate(n * 4)
    hsums = pinned.allocate(HEAVY_BLOCKS * 4)
    data = view(hin, ctypes.c_int32, n)
    data[:] = rng.integers(-(1 << 20), 1 << 20, n, dtype=np.int32)
    din, dsorted = dev.allocate(n * 4, stream=stream), dev.allocate(n * 4, stream=stream)
    dsums = dev.allocate(HEAVY_BLOCKS * 4, stream=stream)
    hin.copy_to(din, stream=stream)
    config = LaunchConfig(grid=HEAVY_BLOCKS, block=HEAVY_BLOCK)
    launch(stream, config, obj.get_kernel("block_sum_sort"), din, dsums, dsorted)
    dsums.copy_to(hsums, stream=stream)
    dsorted.copy_to(hsorted, stream=stream)
    stream.sync()
    blocks = data.reshape(HEAVY_BLOCKS, per_block)
    sums_ok = np.array_equal(view(hsums, ctypes.c_int32, HEAVY_BLOCKS), blocks.sum(axis=1, dtype=np.int64))
    sorted_ok = np.array_equal(view(hsorted, ctypes.c_int32, n).reshape(blocks.shape), np.sort(blocks, axis=1))
    return bool(sums_ok and sorted_ok)


# -- the fresh process ----------------------------------------------------------------------


def child(spec: dict[str, Any]) -> int:
    """One fresh process: everything up to the first checked result, timed from the parent's spawn."""
    marks = {"spawn": spec["t0"]}
    from cuda.core import Device

    from cuda_program_cas import ContentAddressedProgramCache

    marks["imported"] = time.monotonic()
    dev = Device()
    dev.set_current()
    stream = dev.create_stream()
    marks["context"] = time.monotonic()
    cache = ContentAddressedProgramCache(spec["cache"], shared=(), max_size_bytes=None)
    obj = compile_cached(spec["kernel"], spec["mode"], f"sm_{dev.arch}", cache)
    marks["compiled"] = time.monotonic()
    obj.get_kernel("saxpy" if spec["kernel"] == "light" else "block_sum_sort")
    marks["loaded"] = time.monotonic()
    ok = run_and_check(spec["kernel"], obj, dev, stream)
    marks["result"] = time.monotonic()
    stats = cache.stats()
    names = list(marks)
    phases = {b: marks[b] - marks[a] for a, b in itertools.pairwise(names)}
    answer({"ok": ok, "hit": stats.hits == 1, "total_s": marks["result"] - spec["t0"], **phases})
    return 0 if ok else 1


def fresh_process(kernel: str, mode: str, cache: str) -> dict[str, Any]:
    """A fresh process's figures (:func:`child`); a wrong result is a figure (``ok``), not a failure."""
    t0 = time.monotonic()
    spec = {"kernel": kernel, "mode": mode, "cache": cache, "t0": t0}
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    done = collect(spawn_worker(__file__, spec, keep_settings=True, **pipes), 300)
    if done.answer is None or done.timed_out or done.returncode not in (0, 1):
        raise RuntimeError(f"child failed: {done.failure}")
    out = done.answer
    out["exit_s"] = time.monotonic() - t0
    return out


# -- the parent's measurements --------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def facts(dev: Any) -> dict[str, Any]:
    import cuda.bindings
    import cuda.core
    from cuda.bindings import driver, nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    drv = driver.cuDriverGetVersion()[1]
    return {
        "gpu": dev.name,
        "compute_capability": "".join(str(i) for i in dev.compute_capability),
        "driver_cuda_version": f"{drv // 1000}.{drv % 1000 // 10}",
        "nvrtc_version": f"{major}.{minor}",
        "driver_can_load_nvrtc_ptx": major * 1000 + minor * 10 <= drv,
        "cuda_core": cuda.core.__version__,
        "cuda_bindings": cuda.bindings.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "cccl_include": cccl_include(),
        "bundled_headers": has_bundled_headers(),
    }


def in_process(kernel: str, mode: str, *, arch: str, root: str, repeat: int, hits: int) -> dict[str, Any]:
    from cuda_program_cas import ContentAddressedProgramCache

    pc = time.perf_counter
    compile_cached(kernel, mode, arch, None)  # the first compile loads NVRTC and, if asked, installs headers
    uncached, miss, hit, first_hit, load = [], [], [], [], []
    size = 0
    for i in range(repeat):
        t = pc()
        compile_cached(kernel, mode, arch, None)
        uncached.append(pc() - t)
        path = os.path.join(root, f"{kernel}-{mode}-{i}")
        cache = ContentAddressedProgramCache(path, shared=(), max_size_bytes=None)
        t = pc()
        obj = compile_cached(kernel, mode, arch, cache)
        miss.append(pc() - t)
        size = len(bytes(obj.code))
        for _ in range(hits):
            t = pc()
            compile_cached(kernel, mode, arch, cache)
            hit.append(pc() - t)
        cache = ContentAddressedProgramCache(path, shared=(), max_size_bytes=None)
        t = pc()
        obj = compile_cached(kernel, mode, arch, cache)
        first_hit.append(pc() - t)
        t = pc()
        obj.get_kernel("saxpy" if kernel == "light" else "block_sum_sort")
        load.append(pc() - t)
    return {
        "binary_bytes": size,
        "uncached_compile_s": _median(uncached),
        "miss_s": _median(miss),
        "hit_s": _median(hit),
        "first_hit_new_cache_s": _median(first_hit),
        "module_load_s": _median(load),
        "speedup_hit_vs_compile": _median(uncached) / _median(hit),
        "samples": {"uncached": uncached, "miss": miss, "first_hit": first_hit, "load": load},
    }


def fresh_processes(kernel: str, mode: str, root: str, repeat: int) -> dict[str, Any]:
    fresh_process(kernel, mode, os.path.join(root, f"warmup-{kernel}-{mode}"))  # page cache, header install
    cold, warm = [], []
    for i in range(repeat):
        path = os.path.join(root, f"proc-{kernel}-{mode}-{i}")
        cold.append(fresh_process(kernel, mode, path))
        warm.append(fresh_process(kernel, mode, path))
    phases = ("imported", "context", "compiled", "loaded", "result")

    def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "ok": all(r["ok"] for r in runs),
            "hits": sum(r["hit"] for r in runs),
            "first_result_s": _median([r["total_s"] for r in runs]),
            "first_result_min_s": min(r["total_s"] for r in runs),
            "first_result_max_s": max(r["total_s"] for r in runs),
            "exit_s": _median([r["exit_s"] for r in runs]),
            **{f"{p}_s": _median([r[p] for r in runs]) for p in phases},
        }

    out = {"cold": summary(cold), "warm": summary(warm)}
    out["speedup"] = out["cold"]["first_result_s"] / out["warm"]["first_result_s"]
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.0f} us"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json-out", metavar="FILE", help="also write every figure to FILE as one JSON object")
    parser.add_argument("--dir", help="where the caches go (default: a new temporary directory, removed after)")
    spec = worker_spec(sys.argv[1:] if argv is None else argv)
    if spec is not None:
        return child(spec)
    args = parser.parse_args(argv)

    from cuda.core import Device

    dev = Device()
    dev.set_current()
    arch = f"sm_{dev.arch}"
    report: dict[str, Any] = {"facts": facts(dev), "in_process": {}, "fresh_process": {}}
    modes = (["bundled"] if report["facts"]["bundled_headers"] else []) + (
        ["include"] if report["facts"]["cccl_include"] else []
    )
    if not modes:
        print("no CCCL headers: neither use_bundled_headers nor an include directory", file=sys.stderr)
        return 2
    repeat, hits = (2, 10) if args.quick else (3, 50)
    with work_dir(args.dir, "gpu-bench") as root:
        for name, value in report["facts"].items():
            print(f"{name:28} {value}")
        print("\nin one process (medians)")
        for kernel, mode in [("heavy", m) for m in modes] + [("light", "plain")]:
            r = in_process(kernel, mode, arch=arch, root=root, repeat=repeat, hits=hits)
            report["in_process"][f"{kernel}/{mode}"] = r
            print(
                f"  {kernel}/{mode:8} {r['binary_bytes']:>8,} B  compile {_ms(r['uncached_compile_s'])}, "
                f"miss {_ms(r['miss_s'])}, hit {_ms(r['hit_s'])} (first in a new cache object "
                f"{_ms(r['first_hit_new_cache_s'])}), module load {_ms(r['module_load_s'])}: "
                f"hit {r['speedup_hit_vs_compile']:,.0f}x faster than compiling"
            )
        print("\nfresh process to first checked kernel result (medians; cold = empty cache, warm = filled)")
        for kernel, mode in (("heavy", modes[0]), ("light", "plain")):
            r = fresh_processes(kernel, mode, root, 3 if args.quick else 5)
            report["fresh_process"][f"{kernel}/{mode}"] = r
            for state in ("cold", "warm"):
                s = r[state]
                print(
                    f"  {kernel}/{mode:8} {state}: {_ms(s['first_result_s'])} "
                    f"(min {_ms(s['first_result_min_s'])}, max {_ms(s['first_result_max_s'])}; import "
                    f"{_ms(s['imported_s'])}, context {_ms(s['context_s'])}, compile/hit {_ms(s['compiled_s'])}, "
                    f"load {_ms(s['loaded_s'])}, run+check {_ms(s['result_s'])}), hits {s['hits']}, ok {s['ok']}"
                )
            print(f"  {kernel}/{mode:8} cold / warm = {r['speedup']:.2f}x")
    ok = all(s[state]["ok"] for s in report["fresh_process"].values() for state in ("cold", "warm"))
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(report, fh, indent=2)
    print(f"\n{'all kernel results right' if ok else 'A KERNEL RESULT WAS WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
