"""Disk footprint on a real dedup workload: NVRTC compiles of a few kernels in variants that often give one cubin."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

from testkit.common import SAXPY

from .common import KINDS, Config, Result, open_cache

# -- workload 5: disk footprint on a real dedup workload -------------------------------

_KERNELS = {
    "saxpy": SAXPY,
    "vadd": 'extern "C" __global__ void vadd(const float *a, const float *b, float *c, int n) {\n'
    "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < n) c[i] = a[i] + b[i];\n}\n",
    "scale": 'extern "C" __global__ void scale(float *x, float s, int n) {\n'
    "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < n) x[i] *= s;\n}\n",
    "relu": 'extern "C" __global__ void relu(float *x, int n) {\n'
    "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < n) x[i] = x[i] > 0.f ? x[i] : 0.f;\n}\n",
    "reduce": 'extern "C" __global__ void reduce(const float *x, float *out, int n) {\n'
    "    __shared__ float s[256];\n    int t = threadIdx.x; int i = blockIdx.x * 256 + t;\n"
    "    s[t] = i < n ? x[i] : 0.f; __syncthreads();\n"
    "    for (int k = 128; k > 0; k >>= 1) { if (t < k) s[t] += s[t + k]; __syncthreads(); }\n"
    "    if (t == 0) atomicAdd(out, s[0]);\n}\n",
    "transpose": 'extern "C" __global__ void transpose(const float *a, float *b, int w, int h) {\n'
    "    __shared__ float tile[32][33];\n"
    "    int x = blockIdx.x * 32 + threadIdx.x, y = blockIdx.y * 32 + threadIdx.y;\n"
    "    if (x < w && y < h) tile[threadIdx.y][threadIdx.x] = a[y * w + x];\n    __syncthreads();\n"
    "    x = blockIdx.y * 32 + threadIdx.x; y = blockIdx.x * 32 + threadIdx.y;\n"
    "    if (x < h && y < w) b[y * h + x] = tile[threadIdx.x][threadIdx.y];\n}\n",
    "stencil": 'extern "C" __global__ void stencil(const float *a, float *b, int n) {\n'
    "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "    if (i > 0 && i < n - 1) b[i] = 0.25f * a[i - 1] + 0.5f * a[i] + 0.25f * a[i + 1];\n}\n",
    "matmul": 'extern "C" __global__ void matmul(const float *a, const float *b, float *c, int n) {\n'
    "    int r = blockIdx.y * blockDim.y + threadIdx.y, col = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "    if (r < n && col < n) { float acc = 0.f;\n"
    "        for (int k = 0; k < n; ++k) acc += a[r * n + k] * b[k * n + col];\n        c[r * n + col] = acc; }\n}\n",
}

#: (label, source transform, options); the first four give the same cubin as "base", the last three do not.
_VARIANTS: list[tuple[str, Callable[[str], str], dict[str, Any]]] = [
    ("base", lambda s: s, {}),
    ("name", lambda s: s, {"name": "renamed.cu"}),
    ("unused macro", lambda s: s, {"define_macro": "BENCH_UNUSED_MACRO=1"}),
    ("std", lambda s: s, {"std": "c++17"}),
    ("comment", lambda s: "// a comment that changes the source, not the code\n" + s, {}),
    ("arch", lambda s: s, {"arch": "sm_90"}),
    ("max_register_count", lambda s: s, {"max_register_count": 32}),
    ("lineinfo", lambda s: s, {"lineinfo": True}),
]


def disk_usage(root: str) -> dict[str, int]:
    """Regular files' apparent bytes and allocated bytes (st_blocks * 512), and directories' allocation, as du."""
    files = apparent = alloc_files = alloc_dirs = 0
    for dirpath, _dirs, names in os.walk(root):
        alloc_dirs += os.lstat(dirpath).st_blocks * 512
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            files += 1
            apparent += st.st_size
            alloc_files += st.st_blocks * 512
    return {
        "files": files,
        "apparent_bytes": apparent,
        "allocated_file_bytes": alloc_files,
        "allocated_dir_bytes": alloc_dirs,
        "allocated_bytes": alloc_files + alloc_dirs,
    }


def w_footprint(cfg: Config, base: str) -> Result:
    from cuda.core import Program, ProgramOptions
    from cuda.core.utils import make_program_cache_key

    res = Result()
    paths = {k: os.path.join(base, k) for k in KINDS}
    caches = {k: open_cache(k, paths[k]) for k in KINDS}
    names = list(_KERNELS)[: cfg.footprint_kernels]
    compiles = 0
    per_variant_same: dict[str, int] = {label: 0 for label, _, _ in _VARIANTS}
    for kname in names:
        base_code = None
        for label, transform, extra in _VARIANTS:
            src = transform(_KERNELS[kname])
            options = ProgramOptions(**{"arch": "sm_80", **extra})
            key = make_program_cache_key(code=src, code_type="c++", options=options, target_type="cubin")
            code = bytes(Program(src, "c++", options=options).compile("cubin").code)
            compiles += 1
            if label == "base":
                base_code = code
            elif code == base_code:
                per_variant_same[label] += 1
            for cache in caches.values():
                cache[key] = code
    usage = {k: disk_usage(paths[k]) for k in KINDS}
    fs_entries = os.path.join(paths["filestream"], "entries")
    fs_sizes: dict[bytes, int] = {}
    fs_count = 0
    for dirpath, _dirs, files in os.walk(fs_entries):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                data = fh.read()
            fs_sizes[hashlib.sha256(data).digest()] = len(data)
            fs_count += 1
    fs_digests = set(fs_sizes)
    st = caches["ours"].stats()
    snap = caches["ours"].store.inner.snapshot()
    manifest_bytes = snap.manifest_bytes
    res.add("entries", "count", st.entries, fs_count)
    res.add("unique blobs (distinct binaries stored)", "count", st.blobs, len(fs_digests))
    bound = usage["filestream"]["apparent_bytes"] * st.blobs / st.entries + manifest_bytes
    ours_app = usage["ours"]["apparent_bytes"]
    res.add(
        "apparent bytes (regular files)",
        "bytes",
        ours_app,
        usage["filestream"]["apparent_bytes"],
        target=f"≤ {bound:,.0f} (FS x blobs/entries + manifests)",
        verdict=ours_app <= bound,
    )
    res.add(
        "allocated bytes (st_blocks, files + dirs)",
        "bytes",
        usage["ours"]["allocated_bytes"],
        usage["filestream"]["allocated_bytes"],
        target="ratio < 1",
        verdict=usage["ours"]["allocated_bytes"] < usage["filestream"]["allocated_bytes"],
    )
    res.add(
        "allocated bytes (st_blocks, files only)",
        "bytes",
        usage["ours"]["allocated_file_bytes"],
        usage["filestream"]["allocated_file_bytes"],
    )
    res.details = {
        "compiles": compiles,
        "kernels": names,
        "variants": [label for label, _, _ in _VARIANTS],
        "variant_output_same_as_base": per_variant_same,
        "usage": usage,
        "ours_manifest_bytes": manifest_bytes,
        "ours_blob_bytes": snap.blob_bytes,
        "filestream_distinct_content_bytes": sum(fs_sizes.values()),
        "apparent_target_bytes": bound,
    }
    same = ", ".join(f"{k} {v}/{len(names)}" for k, v in per_variant_same.items() if k != "base")
    res.notes.append(
        f"{compiles} real NVRTC compiles ({len(names)} kernels x {len(_VARIANTS)} variants); variants with the same "
        f"cubin as base: {same}; ours' apparent bytes = blobs {snap.blob_bytes:,} + manifests {manifest_bytes:,} + "
        f"layout.json, CACHEDIR.TAG; FileStream's distinct binaries total {sum(fs_sizes.values()):,} bytes"
    )
    return res
