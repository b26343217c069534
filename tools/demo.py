"""The main job: compile real kernels with option variants through the cache, twice.

    python tools/demo.py [--path DIR] [--clear [--yes]]

Pass 1 compiles every (kernel, variant) through ``Program.compile(cache=...)``: a miss runs
NVRTC and stores the binary. Pass 2, in a fresh process as the next job would, hits every
compile. Then it shows how many distinct binaries the keys share, each pass's counters
(``cache.counters()``, no disk scan) and the cache's ``stats()``.

With the CCCL headers installed (``nvidia-cuda-cccl``, in the test extra) it also compiles a
CUB kernel through ``cache.compile()`` with ``include_path``, then a kernel that reads a header
of the demo's own, edited between compiles. That header's include directory is a temp one,
and a new include directory is a new key, so that kernel goes to a temp cache beside it, both
removed at the end: a run adds to DIR only what a later run can hit.

The cache persists: a second run hits in pass 1 too. ``--clear`` empties it first; on the
default cache directory, which your own jobs use, it asks for ``--yes`` too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from testkit.common import CUB_SOURCE, SAXPY, cccl_include
from testkit.workers import answer, run_worker, worker_spec

KERNELS = {
    "saxpy": SAXPY,
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

#: A small kernel that reads a header of the demo's own (``demo_tile.h``), which the demo edits.
TILE_SOURCE = r"""
#include "demo_tile.h"
extern "C" __global__ void tile_fill(int *out) { out[threadIdx.x] = DEMO_TILE; }
"""
CUB_HEADER = "demo_tile.h"
CUB_HEADER_TEXT = "// The demo's own header: a kernel reads it through include_path.\n#define DEMO_TILE 128\n"


def compile_all(path: str) -> tuple[list[dict[str, object]], dict[str, object]]:
    """Compile every (kernel, variant) through the cache, timed, hit or miss: the rows, and the counters at the end."""
    from cuda.core import Program, ProgramOptions

    from cuda_program_cas import ContentAddressedProgramCache, digest_of

    rows = []
    with ContentAddressedProgramCache(path) as cache:
        for kname, source in KERNELS.items():
            for vname, extra in VARIANTS.items():
                options = ProgramOptions(**{"arch": "sm_80", **extra})
                hits_before = cache.counters()["hits"]
                start = time.perf_counter()
                obj = Program(source, "c++", options=options).compile("cubin", cache=cache)
                elapsed = time.perf_counter() - start
                hit, code = cache.counters()["hits"] > hits_before, bytes(obj.code)
                row = {"kernel": kname, "variant": vname, "hit": hit, "seconds": elapsed}
                rows.append({**row, "digest": digest_of(code), "size": len(code)})
        counters = cache.counters()
    return rows, counters


# -- the front door: a CUB kernel through include_path ----------------------------------


def cub_compile(path: str, source: str, include: list[str]) -> dict[str, object]:
    """``cache.compile()`` of ``source`` with its headers as they are now: hit or miss, time, digest."""
    from cuda.core import ProgramOptions

    from cuda_program_cas import ContentAddressedProgramCache, digest_of

    options = ProgramOptions(arch="sm_80", std="c++17", include_path=include)
    with ContentAddressedProgramCache(path) as cache:
        before = cache.counters()["hits"]
        start = time.perf_counter()
        obj = cache.compile(source, "c++", options, "cubin")
        elapsed = time.perf_counter() - start
        hit = cache.counters()["hits"] > before  # one compile counts one hit or one miss
    return {"hit": hit, "seconds": elapsed, "digest": digest_of(bytes(obj.code))}


def work_dirs(work: str) -> tuple[str, str]:
    """The run's header directory and its throwaway cache, both in the temp directory ``work``."""
    include = os.path.join(work, "include")
    os.makedirs(include, exist_ok=True)
    return include, os.path.join(work, "cache")


def write_header(directory: str, text: str) -> None:
    """Put ``text`` in the demo's header, in place: a new file in the directory would change its mtime,
    which the front door watches (a header added to an include directory may shadow another)."""
    header = Path(directory, CUB_HEADER)
    try:
        if header.read_text() == text:
            return
    except OSError:
        pass
    with header.open("w") as f:
        f.write(text)
    # A result is stored only when its headers are older than the compile's start (a header
    # edited in the same clock tick may have been read half-changed): let the tick pass.
    time.sleep(0.05)


def cub_demo(path: str, work: str) -> list[tuple[str, dict[str, object], str]] | str:
    """A miss, a hit, a header edit that misses: the rows, or why it was skipped.

    The CUB kernel goes to the cache at ``path``: its headers stay put, so a later run hits.
    The kernel reading the demo's own header goes to the throwaway cache in ``work``.
    """
    cccl = cccl_include()
    if cccl is None:
        return "skipped: no CCCL headers found (pip install nvidia-cuda-cccl; the test extra has it)"
    first = cub_compile(path, CUB_SOURCE, [cccl])
    again = cub_compile(path, CUB_SOURCE, [cccl])
    include, throwaway = work_dirs(work)
    write_header(include, CUB_HEADER_TEXT)
    tile = cub_compile(throwaway, TILE_SOURCE, [include])
    write_header(include, CUB_HEADER_TEXT.replace("128", "256"))
    edited = cub_compile(throwaway, TILE_SOURCE, [include])
    first_note = "stored by an earlier run" if first["hit"] else "NVRTC ran; the headers it read are recorded"
    edit_note = "a changed header; NVRTC ran" if not edited["hit"] else "stored by an earlier compile"
    return [
        ("CUB kernel, include_path=[CCCL]", first, first_note),
        ("the same compile again", again, "every header checked: unchanged"),
        (f"a kernel reading {CUB_HEADER}", tile, "NVRTC ran: a new include directory (a temp cache keeps it)"),
        (f"{CUB_HEADER} edited", edited, edit_note),
    ]


# -- output -------------------------------------------------------------------------------


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:8.0f} µs"


def _tag(row: dict[str, object]) -> str:
    return "hit " if row["hit"] else "miss"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", help="cache directory (default: the default cache directory)")
    parser.add_argument("--clear", action="store_true", help="empty the cache first, to see every miss")
    parser.add_argument("--yes", action="store_true", help="with --clear on the default cache directory: empty it")
    spec = worker_spec(sys.argv[1:] if argv is None else argv)
    if spec is not None:  # pass 2: the cache, and the parent's header and throwaway cache
        rows, counts = compile_all(spec["path"])
        cub = None
        if cccl_include():
            include, throwaway = work_dirs(spec["work"])
            cub = cub_compile(throwaway, TILE_SOURCE, [include])
        answer({"rows": rows, "counters": counts, "cub": cub})
        return 0
    args = parser.parse_args(argv)

    from cuda_program_cas import default_cache_dir

    path = args.path or str(default_cache_dir())

    from cuda_program_cas import ContentAddressedProgramCache

    if args.clear:
        if args.path is None and not args.yes:
            print(
                f"demo.py: refusing to --clear the default cache directory {path}: your own jobs use it. "
                "Give --path DIR for a directory of the demo's own, or add --yes to empty it anyway.",
                file=sys.stderr,
            )
            return 2
        ContentAddressedProgramCache(path).clear()
    work = tempfile.mkdtemp(prefix="program-cas-demo-")
    try:
        return _run(path, work, args.path is None)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(path: str, work: str, default_dir: bool) -> int:
    """The demo's two passes and its report (``work``, the header and throwaway cache, is the caller's to remove)."""
    from cuda_program_cas import ContentAddressedProgramCache
    from cuda_program_cas._cli.main import fmt_bytes

    where = "the default cache directory" if default_dir else "given with --path"
    print(f"cache: {path} ({where})")
    first, first_counts = compile_all(path)
    cub = cub_demo(path, work)
    # Pass 2 in a fresh process: what the next job on this node pays.
    try:  # the operator's settings stay: pass 2 is the next job on this node
        child = run_worker(__file__, {"path": path, "work": work}, 3600, keep_settings=True)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    second, second_counts = child["rows"], child["counters"]

    print(f"\n{'kernel':9} {'variant':13} {'pass 1 (this process)':>24} {'pass 2 (fresh process)':>25} {'speedup':>8}")
    for n, (a, b) in enumerate(zip(first, second, strict=True)):
        speed = f"{a['seconds'] / b['seconds']:7.0f}x" if not a["hit"] and b["seconds"] else f"{'-':>8}"
        mark_a = "*" if n == 0 and a["hit"] else " "
        mark_b = "*" if n == 0 and b["hit"] else " "
        print(
            f"{a['kernel']:9} {a['variant']:13} {_tag(a)} {_fmt_time(a['seconds']):>17}{mark_a} "
            f"{_tag(b)} {_fmt_time(b['seconds']):>18}{mark_b} {speed}"
        )
    if any(r["hit"] for r in first[:1] + second[:1]):
        print(
            "* the first compile of a process loads NVRTC, even on a hit (cuda.core builds a Program, which opens "
            "libnvrtc); later hits take tens of microseconds"
        )
    misses = [r for r in first if not r["hit"]]
    if misses:
        compile_s = sum(r["seconds"] for r in misses)
        hit_s = sum(b["seconds"] for a, b in zip(first, second, strict=True) if not a["hit"])
        print(
            f"\n{len(misses)} compiles took {compile_s:.2f} s; "
            f"the same {len(misses)} compiles in a fresh process, all hits, took {hit_s * 1e3:.1f} ms"
        )
    if len(misses) < len(first):
        held = "all" if not misses else f"{len(first) - len(misses)} of the"
        print(
            f"\nPass 1 hit too: this cache already held {held} {len(first)} entries, stored by an earlier run "
            "(entries stay until evicted or collected: that is what the cache is for).\n"
            "To see what a fresh cache shows, give the demo a new directory:\n"
            '    python tools/demo.py --path "$(mktemp -d)"'
        )

    print("\ncache.compile() with include_path: keys that cover the headers a compile read")
    if isinstance(cub, str):
        print(f"  {cub}")
    else:
        rows = [*cub, ("the edited header, fresh process", child["cub"], "the edited entry was stored")]
        for label, row, note in rows:
            if row is not None:
                print(f"  {label:33} {_tag(row)} {_fmt_time(row['seconds']):>12}  {note}")

    with ContentAddressedProgramCache(path) as cache:
        st = cache.stats()
    shown = ("hits", "misses", "writes", "dedup_writes", "corrupt", "evictions")
    print("\ncounters() of each pass (the option variants):")
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
        f"cache: {st.entries} entries in {st.blobs} blobs: {fmt_bytes(st.logical_bytes)} of entries stored as "
        f"{fmt_bytes(st.blob_bytes)} of unique blobs (dedup ratio {st.dedup_ratio:.2f}x), "
        f"plus {fmt_bytes(st.manifest_bytes)} of manifests"
    )
    print(_why_the_ratios_differ(first, st.entries, st.logical_bytes))
    return 0


def _why_the_ratios_differ(rows: list[dict[str, object]], entries: int, logical: int) -> str:
    """Keys per blob count keys; the dedup ratio weighs bytes, over every entry of the cache: say both."""
    from cuda_program_cas._cli.main import fmt_bytes

    sizes = {str(r["digest"]): int(str(r["size"])) for r in rows}
    v_logical = sum(int(str(r["size"])) for r in rows)
    v_unique = sum(sizes.values())
    o_entries, o_logical = entries - len(rows), logical - v_logical
    by_count, by_bytes = len(rows) / len(sizes), v_logical / v_unique
    why = ""
    if by_bytes < by_count - 0.005:
        why = ": the blobs that no other key shares are the larger ones"
    elif by_bytes > by_count + 0.005:
        why = ": the blobs that several keys share are the larger ones"
    text = (
        f"why the dedup ratio is not keys per blob: 'N keys -> M blobs' counts keys, the dedup ratio weighs bytes "
        f"over the whole cache.\n  the {len(rows)} variant keys: {len(rows)} keys in {len(sizes)} blobs "
        f"({by_count:.2f}x by count), {fmt_bytes(v_logical)} in {fmt_bytes(v_unique)} "
        f"({v_logical / v_unique:.2f}x by bytes{why})"
    )
    if o_entries > 0 and logical > 0:
        text += (
            f"\n  the cache's other {o_entries} entries (the CUB kernel, the records cache.compile() keeps of its "
            f"headers, whatever else is stored there) hold {fmt_bytes(o_logical)}, {100 * o_logical / logical:.0f}% "
            "of the bytes the ratio weighs"
        )
    return text


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
