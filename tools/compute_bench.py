"""cuda.compute's algorithm builds under the switch: uncached, cold, warm, and a fresh node from a shared store.

    python tools/compute_bench.py            # on a GPU (cupy installed)
    python tools/compute_bench.py --aot      # anywhere: builds only

docs/compute.md describes the job of six algorithms and its four runs, each a fresh process.
``--aot`` builds for ``compute_capability=(9, 0)`` with ``ProxyArray`` arguments and launches
nothing, with a stub ``libcuda.so.1`` (``testkit.cudastub``) where no driver loads. Per job: the
builds cuda.compute ran (``call_build`` and ``call_compile``, counted), the time to its first
result, its total and the cache's counters; one JSON object at the end.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from testkit.common import work_dir  # noqa: E402
from testkit.workers import answer, run_worker, worker_spec  # noqa: E402

N = 1 << 16
SEGMENTS = 64


def _ops():
    """The Python ops of the job (module-level functions: keyed by the cache, compiled by cuda.compute)."""

    def add(a, b):
        return a + b

    def affine(x):
        return x * 2 + 1

    def even(x):
        return x % 2 == 0

    return add, affine, even


def _job(aot: bool) -> dict[str, object]:  # one job, step by step
    import cuda_program_cas

    cuda_program_cas.install()  # what the .pth does for CUDA_PROGRAM_CAS=1 (0: routes nothing), also from a checkout
    import cuda.compute as cc
    import cuda.compute._cccl_interop as interop
    import numpy as np
    from cuda.compute import OpKind, SortOrder

    builds = [0]
    for name in ("call_build", "call_compile"):
        real = getattr(interop, name)

        def counted(*a, _real=real, **k):
            builds[0] += 1
            return _real(*a, **k)

        setattr(interop, name, counted)
    add, affine, even = _ops()
    i32 = np.int32
    rng = np.random.default_rng(45)
    h_in = rng.integers(0, 1000, N, dtype=i32)
    offsets = np.linspace(0, N, SEGMENTS + 1).astype(i32)
    first: list[float] = []
    done: list[str] = []

    def result(name: str) -> None:
        done.append(name)
        if not first:
            first.append(time.perf_counter() - _T0)

    if aot:
        from cuda.compute import ProxyArray, ProxyValue

        arr, val, cap = ProxyArray(i32), ProxyValue(i32), {"compute_capability": (9, 0)}
        cc.make_reduce_into(d_in=arr, d_out=arr, op=add, h_init=val, **cap)
        result("reduce")
        cc.make_exclusive_scan(d_in=arr, d_out=arr, op=OpKind.PLUS, init_value=val, **cap)
        result("exclusive_scan")
        cc.make_radix_sort(
            d_in_keys=arr, d_out_keys=arr, d_in_values=None, d_out_values=None, order=SortOrder.ASCENDING, **cap
        )
        result("radix_sort")
        cc.make_unary_transform(d_in=arr, d_out=arr, op=affine, **cap)
        result("unary_transform")
        cc.make_select(d_in=arr, d_out=arr, d_num_selected_out=ProxyArray(np.int64), cond=even, **cap)
        result("select")
        cc.make_segmented_reduce(
            d_in=arr, d_out=arr, start_offsets_in=arr, end_offsets_in=arr, op=OpKind.MAXIMUM, h_init=val, **cap
        )
        result("segmented_reduce")
    else:
        import cupy as cp

        d_in = cp.asarray(h_in)

        def check(name: str, got: object, want: object) -> None:
            if not np.array_equal(np.asarray(got), np.asarray(want)):
                raise SystemExit(f"{name}: wrong result")
            result(name)

        out = cp.empty(1, i32)
        cc.reduce_into(d_in=d_in, d_out=out, op=add, num_items=N, h_init=np.zeros(1, i32))
        check("reduce", out.get()[0], h_in.sum(dtype=i32))
        out = cp.empty(N, i32)
        cc.exclusive_scan(d_in=d_in, d_out=out, op=OpKind.PLUS, init_value=np.zeros(1, i32), num_items=N)
        check("exclusive_scan", out.get(), np.concatenate([[0], np.cumsum(h_in, dtype=i32)[:-1]]))
        out = cp.empty(N, i32)
        cc.radix_sort(d_in_keys=d_in, d_out_keys=out, num_items=N, order=SortOrder.ASCENDING)
        check("radix_sort", out.get(), np.sort(h_in))
        out = cp.empty(N, i32)
        cc.unary_transform(d_in=d_in, d_out=out, op=affine, num_items=N)
        check("unary_transform", out.get(), h_in * 2 + 1)
        out, count = cp.empty(N, i32), cp.zeros(1, np.int64)
        cc.select(d_in=d_in, d_out=out, d_num_selected_out=count, cond=even, num_items=N)
        kept = int(count.get()[0])
        check("select", out.get()[:kept], h_in[h_in % 2 == 0])
        out, starts, ends = cp.empty(SEGMENTS, i32), cp.asarray(offsets[:-1]), cp.asarray(offsets[1:])
        cc.segmented_reduce(
            d_in=d_in,
            d_out=out,
            num_segments=SEGMENTS,
            start_offsets_in=starts,
            end_offsets_in=ends,
            op=OpKind.MAXIMUM,
            h_init=np.array([np.iinfo(i32).min], i32),
        )
        want = [h_in[a:b].max() for a, b in itertools.pairwise(offsets)]
        check("segmented_reduce", out.get(), want)
    counters: dict[str, int] = {}
    from cuda_program_cas._cuda import switch

    cache = switch._process_cache() if switch.installed() else None
    if cache is not None:
        counters = cache.counters()
        cache.close()  # counted and written back before the process ends
    return {
        "algorithms": done,
        "builds": builds[0],
        "first_result_s": round(first[0], 3),
        "total_s": round(time.perf_counter() - _T0, 3),
        "counters": {k: counters.get(k, 0) for k in ("hits", "misses", "writes", "shared_hits", "dropped_writes")},
    }


def _run(args: argparse.Namespace, env: dict[str, str]) -> dict[str, object]:
    try:
        return run_worker(__file__, {"aot": args.aot}, args.timeout, settings=env)
    except RuntimeError as e:
        raise SystemExit(f"job failed ({env.get('CUDA_PROGRAM_CAS')}): {e}") from None


def _jobs(args: argparse.Namespace, work: Path) -> dict[str, dict[str, object]]:
    """The four jobs, each a fresh process, in ``work``."""
    from testkit.cudastub import driver_env

    from cuda_program_cas import CacheStore

    base = {**driver_env(work / "cudastub"), "CUDA_PROGRAM_CAS_JOB": "compute-bench"}
    shared = work / "shared"
    CacheStore(shared).close()  # a directory store, laid out
    on = {**base, "CUDA_PROGRAM_CAS": "1"}
    return {
        "uncached": _run(args, {**base, "CUDA_PROGRAM_CAS": "0"}),
        "cold": _run(
            args, {**on, "CUDA_PROGRAM_CAS_DIR": str(work / "a"), "CUDA_PROGRAM_CAS_SHARED": f"{shared}|write"}
        ),
        "warm": _run(args, {**on, "CUDA_PROGRAM_CAS_DIR": str(work / "a")}),
        "node": _run(args, {**on, "CUDA_PROGRAM_CAS_DIR": str(work / "b"), "CUDA_PROGRAM_CAS_SHARED": str(shared)}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--aot", action="store_true", help="build ahead of time for sm_90, launch nothing")
    parser.add_argument("--dir", help="where the caches go (kept; default: a temporary directory, removed)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job")
    spec = worker_spec(sys.argv[1:] if argv is None else argv)
    if spec is not None:
        answer(_job(spec["aot"]))
        return 0
    args = parser.parse_args(argv)
    with work_dir(args.dir, "compute-bench") as where:
        rows = _jobs(args, Path(where))
    for name, row in rows.items():
        print(
            f"{name:>9}: {row['builds']:>2} builds, first result {row['first_result_s']:7.3f} s,"
            f" total {row['total_s']:7.3f} s, {row['counters']}",
            file=sys.stderr,
        )
    ok = rows["warm"]["builds"] == 0 and rows["node"]["builds"] == 0 and len(rows["cold"]["algorithms"]) == 6  # type: ignore[arg-type]
    print(json.dumps({"mode": "aot sm_90" if args.aot else "gpu", "python": sys.version.split()[0], "ok": ok, **rows}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
