"""The main job: compile real kernels with option variants through the cache, twice.

    python tools/demo.py [--path DIR] [--clear]

Pass 1 compiles every (kernel, variant) through ``Program.compile(cache=...)``:
a miss runs NVRTC and stores the binary. Pass 2 runs in a fresh process, as the
next job on this machine would: every compile is a hit. Then it shows how many
distinct binaries the keys share (deduplication), each pass's counters and the
cache's ``stats()``. Hit or miss comes from ``cache.counters()``, which reads
the instance's counters without scanning the disk (``stats()`` scans it, once,
at the end). Uses the default cache directory unless ``--path`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KERNELS = {
    "saxpy": r"""
extern "C" __global__ void saxpy(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
""",
    "reduce": r"""
extern "C" __global__ void block_sum(const float *in, float *out, int n) {
    __shared__ float buf[256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    buf[threadIdx.x] = i < n ? in[i] : 0.0f;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(out, buf[0]);
}
""",
    "matmul": r"""
#define TILE 16
extern "C" __global__ void matmul(const float *a, const float *b, float *c, int n) {
    __shared__ float ta[TILE][TILE], tb[TILE][TILE];
    int row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.0f;
    for (int t = 0; t < (n + TILE - 1) / TILE; ++t) {
        int ac = t * TILE + threadIdx.x, br = t * TILE + threadIdx.y;
        ta[threadIdx.y][threadIdx.x] = (row < n && ac < n) ? a[row * n + ac] : 0;
        tb[threadIdx.y][threadIdx.x] = (col < n && br < n) ? b[br * n + col] : 0;
        __syncthreads();
        for (int k = 0; k < TILE; ++k) acc += ta[threadIdx.y][k] * tb[k][threadIdx.x];
        __syncthreads();
    }
    if (row < n && col < n) c[row * n + col] = acc;
}
""",
    "stencil": r"""
template <typename T>
__device__ T clampi(T v, T lo, T hi) { return v < lo ? lo : (v > hi ? hi : v); }
extern "C" __global__ void blur(const float *in, float *out, int w, int h) {
    int x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x >= w || y >= h) return;
    float s = 0.0f;
    for (int dy = -1; dy <= 1; ++dy)
        for (int dx = -1; dx <= 1; ++dx)
            s += in[clampi(y + dy, 0, h - 1) * w + clampi(x + dx, 0, w - 1)];
    out[y * w + x] = s / 9.0f;
}
""",
}

#: Option variants. The first four give byte-identical cubins to "base" with NVRTC
#: (deduplicated); the others change the binary.
VARIANTS = {
    "base": {},
    "name": {"name": "renamed.cu"},
    "unused macro": {"define_macro": "UNUSED_FLAG"},
    "std=c++17": {"std": "c++17"},
    "sm_90": {"arch": "sm_90"},
    "maxreg=32": {"max_register_count": 32},
    "lineinfo": {"lineinfo": True},
}


def compile_all(path: str) -> tuple[list[dict[str, object]], dict[str, object]]:
    """Compile every (kernel, variant) through the cache; time each and say hit or miss.

    Returns the rows and the cache's counters at the end.
    """
    from cuda.core import Program, ProgramOptions

    from cas import ContentAddressedProgramCache, digest_of

    rows = []
    with ContentAddressedProgramCache(path) as cache:
        for kname, source in KERNELS.items():
            for vname, extra in VARIANTS.items():
                options = ProgramOptions(**{"arch": "sm_80", **extra})
                hits_before = cache.counters()["hits"]
                start = time.perf_counter()
                obj = Program(source, "c++", options=options).compile("cubin", cache=cache)
                elapsed = time.perf_counter() - start
                hit = cache.counters()["hits"] > hits_before
                rows.append(
                    {
                        "kernel": kname,
                        "variant": vname,
                        "hit": hit,
                        "seconds": elapsed,
                        "digest": digest_of(bytes(obj.code)),
                    }
                )
        counters = cache.counters()
    return rows, counters


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:8.0f} µs"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", help="cache directory (default: the default cache directory)")
    parser.add_argument("--clear", action="store_true", help="empty the cache first, to see every miss")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from cas import default_cache_dir

    path = args.path or str(default_cache_dir())
    if args.child:
        rows, counts = compile_all(path)
        print(json.dumps({"rows": rows, "counters": counts}))
        return 0

    from cas import ContentAddressedProgramCache

    if args.clear:
        ContentAddressedProgramCache(path).clear()
    print(f"cache: {path}")
    first, first_counts = compile_all(path)
    # Pass 2 in a fresh process: what the next job on this node pays.
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "--path", path], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        return 1
    child = json.loads(proc.stdout)
    second, second_counts = child["rows"], child["counters"]

    print(f"\n{'kernel':9} {'variant':13} {'pass 1 (this process)':>24} {'pass 2 (fresh process)':>25} {'speedup':>8}")
    for a, b in zip(first, second, strict=True):
        speed = a["seconds"] / b["seconds"] if b["seconds"] else float("inf")
        tag_a = "hit " if a["hit"] else "miss"
        tag_b = "hit " if b["hit"] else "miss"
        print(
            f"{a['kernel']:9} {a['variant']:13} {tag_a} {_fmt_time(a['seconds']):>18} "
            f"{tag_b} {_fmt_time(b['seconds']):>19} {speed:7.0f}x"
        )
    misses = [r for r in first if not r["hit"]]
    if misses:
        compile_s = sum(r["seconds"] for r in misses)
        hit_s = sum(b["seconds"] for a, b in zip(first, second, strict=True) if not a["hit"])
        print(
            f"\n{len(misses)} compiles took {compile_s:.2f} s; "
            f"the same {len(misses)} compiles in a fresh process, all hits, took {hit_s * 1e3:.1f} ms"
        )

    with ContentAddressedProgramCache(path) as cache:
        st = cache.stats()
    shown = ("hits", "misses", "writes", "dedup_writes", "corrupt", "evictions")
    print("\ncounters() of each pass:")
    print("  pass 1: " + ", ".join(f"{k}={first_counts[k]}" for k in shown))
    print("  pass 2: " + ", ".join(f"{k}={second_counts[k]}" for k in shown))
    print("\ndeduplication (variants that compile to the same bytes share one blob):")
    for kname in KERNELS:
        groups: dict[str, list[str]] = {}
        for row in first:
            if row["kernel"] == kname:
                groups.setdefault(str(row["digest"]), []).append(str(row["variant"]))
        shared = " | ".join(" = ".join(g) for g in groups.values())
        print(f"  {kname:9} {len(VARIANTS)} keys -> {len(groups)} blobs: {shared}")
    print(
        f"cache: {st.entries} entries in {st.blobs} blobs; {_fmt_bytes(st.logical_bytes)} of entries stored in "
        f"{_fmt_bytes(st.stored_bytes)} (dedup ratio {st.dedup_ratio:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
