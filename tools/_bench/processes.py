"""Processes: several processes sharing one cache, and the cold start of a fresh process."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from typing import Any

from testkit.workers import child_env

from .common import (
    KB,
    KINDS,
    Config,
    Result,
    fmt_size,
    interleaved,
    key_for,
    median,
    open_cache,
    payload,
    perf_ns,
    wait_until_old,
)

# -- workload 6: processes sharing one cache -------------------------------------------


def _mp_worker(spec: dict[str, Any], wid: int, go: Any, q: Any) -> None:
    kind, path, nkeys, size, deadline_s = spec["kind"], spec["path"], spec["nkeys"], spec["size"], spec["duration_s"]
    ops = reads = writes = errors = 0
    first_error = ""
    try:
        cache = open_cache(kind, path)
        rng = random.Random(wid)
        keys = [key_for("mp", i) for i in range(nkeys)]
        q.put(("ready", wid))
        go.wait()
        t0 = time.perf_counter()
        end = t0 + deadline_s
        n = 0
        while True:
            now = time.perf_counter()
            if now >= end:
                break
            try:
                if rng.random() < 0.1:
                    n += 1
                    cache[key_for("mp-write", wid, n)] = payload(size, (wid + 1) * 10_000_000 + n)
                    writes += 1
                else:
                    i = rng.randrange(nkeys)
                    v = cache.get(keys[i])
                    reads += 1
                    if v is None or len(v) != size or v[:8] != i.to_bytes(8, "little"):
                        errors += 1
                        first_error = first_error or f"read of key {i} returned {'nothing' if v is None else 'wrong'}"
            except Exception as exc:
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"
            ops += 1
        elapsed = time.perf_counter() - t0
        q.put(("done", wid, ops, reads, writes, errors, elapsed, first_error))
    except BaseException as exc:
        q.put(("failed", wid, f"{type(exc).__name__}: {exc}"))
        raise


def w_processes(cfg: Config, base: str) -> Result:
    import multiprocessing

    ctx = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    res = Result()
    size = 8 * KB
    for nproc in cfg.mp_procs:
        tput: dict[str, float] = {}
        errs: dict[str, int] = {}
        for kind in interleaved(nproc):
            path = os.path.join(base, f"{kind}-{nproc}")
            cache = open_cache(kind, path)
            for i in range(cfg.mp_keys):
                cache[key_for("mp", i)] = payload(size, i)
            spec = {"kind": kind, "path": path, "nkeys": cfg.mp_keys, "size": size, "duration_s": cfg.mp_duration_s}
            go = ctx.Event()
            q = ctx.Queue()
            procs = [ctx.Process(target=_mp_worker, args=(spec, w, go, q)) for w in range(nproc)]
            for p in procs:
                p.start()
            msgs = [q.get(timeout=120) for _ in procs]
            if any(m[0] != "ready" for m in msgs):
                raise RuntimeError(f"{kind}: a worker failed to start: {msgs}")
            go.set()
            msgs = [q.get(timeout=120 + cfg.mp_duration_s) for _ in procs]
            for p in procs:
                p.join(timeout=60)
            failed = [m for m in msgs if m[0] != "done"]
            if failed:
                raise RuntimeError(f"{kind}: worker failed: {failed}")
            ops = sum(m[2] for m in msgs)
            elapsed = max(m[6] for m in msgs)
            tput[kind] = ops / elapsed
            errs[kind] = sum(m[5] for m in msgs)
            res.details[f"{kind}_{nproc}"] = {
                "ops": ops,
                "reads": sum(m[3] for m in msgs),
                "writes": sum(m[4] for m in msgs),
                "errors": errs[kind],
                "first_error": next((m[7] for m in msgs if m[7]), ""),
                "elapsed_s": elapsed,
                "exit_codes": [p.exitcode for p in procs],
            }
        res.add(f"{nproc} processes, 90% reads, throughput", "ops/s", tput["ours"], tput["filestream"],
                target_op=">=", target_ratio=1.0)  # fmt: skip
        res.add(
            f"{nproc} processes, errors",
            "count",
            errs["ours"],
            errs["filestream"],
            target="0 for ours",
            verdict=errs["ours"] == 0,
        )
    res.notes.append(
        f"each process opens the cache and runs {cfg.mp_duration_s:g} s: 90 % get() of {cfg.mp_keys} stored "
        f"{fmt_size(size)} keys (bytes checked), 10 % writes of new keys; {os.cpu_count()} CPUs, so 4 and 8 "
        "processes share them"
    )
    return res


# -- workload 7: cold start ------------------------------------------------------------

_COLD = """
import time
t0 = time.perf_counter_ns()
{imp}
t1 = time.perf_counter_ns()
c = {ctor}({path!r})
t2 = time.perf_counter_ns()
v = c.get({key!r})
t3 = time.perf_counter_ns()
assert v is not None and len(v) == {size}
print(t1 - t0, t2 - t1, t3 - t2)
"""


def w_cold_start(cfg: Config, base: str) -> Result:
    res = Result()
    size = 8 * KB
    paths = {k: os.path.join(base, k) for k in KINDS}
    for kind in KINDS:
        cache = open_cache(kind, paths[kind])
        for i in range(cfg.cold_runs + 1):
            cache[key_for("cold", i)] = payload(size, i)
    wait_until_old(time.time())
    parts: dict[str, list[list[int]]] = {k: [] for k in KINDS}
    walls: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(-1, cfg.cold_runs):  # run -1 warms the OS caches for the interpreter and libraries
        for kind in interleaved(r):
            imp, ctor = (
                ("from cuda_program_cas import ContentAddressedProgramCache", "ContentAddressedProgramCache")
                if kind == "ours"
                else ("from cuda.core.utils import FileStreamProgramCache", "FileStreamProgramCache")
            )
            code = _COLD.format(imp=imp, ctor=ctor, path=paths[kind], key=key_for("cold", r + 1), size=size)
            t0 = perf_ns()
            proc = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=120, check=False
            )
            wall = perf_ns() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"cold start ({kind}) failed: {proc.stderr.strip()[-2000:]}")
            if r >= 0:
                parts[kind].append([int(x) for x in proc.stdout.split()])
                walls[kind].append(wall / 1e6)

    def med(kind: str, i: int | None) -> float:
        vals = [sum(p) if i is None else p[i] for p in parts[kind]]
        return median([v / 1e6 for v in vals])

    res.add("import + open + first hit (in process), median", "ms", med("ours", None), med("filestream", None))
    res.add("  of which import", "ms", med("ours", 0), med("filestream", 0))
    res.add("  of which open", "ms", med("ours", 1), med("filestream", 1))
    res.add("  of which first hit", "ms", med("ours", 2), med("filestream", 2))
    res.add("whole process (spawn to exit), median", "ms", median(walls["ours"]), median(walls["filestream"]))
    res.notes.append(
        f"{cfg.cold_runs} fresh `python -c` processes per cache after one warm-up each; both imports load cuda.core"
    )
    return res


# -- workload 10: a whole job that compiles one small kernel ------------------------------

#: One kernel, compiled the way a job compiles it: uncached, or through a cache that holds it.
_JOB = r"""
import sys
from cuda.core import Program, ProgramOptions
how, path = sys.argv[1], sys.argv[2]
src = (
    'extern "C" __global__ void scale(float *p, int n) '
    "{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) p[i] *= 2.0f; }"
)
opts = ProgramOptions(arch="sm_80")
if how == "uncached":
    Program(src, "c++", options=opts).compile("cubin")
elif how == "filestream":
    from cuda.core.utils import FileStreamProgramCache
    Program(src, "c++", options=opts).compile("cubin", cache=FileStreamProgramCache(path))
elif how == "bare":  # no compile at all: what any job that imports cuda.core pays, cached or not
    pass
elif how == "ours":
    from cuda_program_cas import ContentAddressedProgramCache
    Program(src, "c++", options=opts).compile("cubin", cache=ContentAddressedProgramCache(path))
else:  # the front door: cache.compile, keyed without loading NVRTC once its version is recorded
    from cuda_program_cas import ContentAddressedProgramCache
    ContentAddressedProgramCache(path).compile(src, "c++", opts, "cubin")
"""
_JOB_KINDS = ("uncached", "filestream", "ours", "front", "bare")


def _job(how: str, path: str) -> tuple[float, float]:
    """One job's wall and CPU (user + system) time, in ms."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = perf_ns()
    proc = subprocess.run(
        [sys.executable, "-c", _JOB, how, path],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
        check=False,
    )
    wall = (perf_ns() - t0) / 1e6
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"small job ({how}) failed: {proc.stderr.strip()[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1e3


def w_small_job(cfg: Config, base: str) -> Result:
    """Issue 31's whole-process figure: a job whose only kernel is a small one, hit, against FileStream and no cache."""
    res = Result()
    paths = {how: os.path.join(base, how) for how in _JOB_KINDS}
    for how in ("filestream", "ours", "front"):
        _job(how, paths[how])  # the miss that stores it (ours' front door also records NVRTC's version)
    runs = 2 if cfg.quick else 7
    wall: dict[str, list[float]] = {how: [] for how in _JOB_KINDS}
    cpu: dict[str, list[float]] = {how: [] for how in _JOB_KINDS}
    for r in range(-1, runs):  # run -1 warms the page cache
        order = _JOB_KINDS if r % 2 == 0 else _JOB_KINDS[::-1]  # paired: each round runs all five, order alternating
        for how in order:
            w, c = _job(how, paths[how])
            if r >= 0:
                wall[how].append(w)
                cpu[how].append(c)
    for clock, values in (("wall", wall), ("CPU", cpu)):
        for how, label in (("ours", "Program.compile(cache=)"), ("front", "cache.compile")):
            for against, name, target in (("filestream", "FileStream", 1.0), ("uncached", "uncached compile", 0.7)):
                res.add(
                    f"small-kernel job, hit, {clock}: ours ({label}) / {name}",
                    "ms",
                    median(values[how]),
                    median(values[against]),
                    target_ratio=target,
                )
        # The floor under every cached job: the same process with no compile and no cache.
        res.add(
            f"  floor: a job that only imports cuda.core, {clock} / uncached compile",
            "ms",
            median(values["bare"]),
            median(values["uncached"]),
        )
    res.notes.append(
        f"{runs} rounds of 5 fresh processes (no cache, FileStream hit, ours through Program.compile(cache=), ours "
        "through cache.compile, and one that only imports cuda.core: the floor), the order alternating, after a "
        "warm-up round; each imports cuda.core, opens its cache and compiles one saxpy-sized kernel; CPU is the "
        f"child's user + system time. The uncached job took {median(wall['uncached']):.0f} ms wall, "
        f"{median(wall['bare']):.0f} of it starting Python and importing cuda.core"
    )
    return res
