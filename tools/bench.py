#!/usr/bin/env python3
"""Benchmarks: this project's cache beside cuda.core's FileStreamProgramCache, in one run.

    python tools/bench.py                 # the full run
    python tools/bench.py --quick         # every workload small, under a minute; no speed claims
    python tools/bench.py --json          # one JSON object on stdout
    python tools/bench.py --only hit_first,store

docs/benchmarks.md says what each workload measures; they live in tools/_bench/, this file is
the command line. Budget: 15-25 minutes on 2 cores, most of it FileStream writing at the cap
(each of its writes rescans the cache: 0.1-0.6 s at 10,000 entries, 2 s at 50,000), so it is
timed on 500 writes at 10,000 entries and 20 at 50,000; ``--cap-sizes`` changes the sizes.
Exit status: 0 when the run completed (targets met or not), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from _bench import RUNNERS, WORKER_TASKS, WORKLOADS, Config, machine_info, render, tally
from testkit.common import log
from testkit.workers import worker_spec


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = worker_spec(argv)
    if spec is not None:
        task = WORKER_TASKS.get(spec["task"])
        if task is None:
            raise SystemExit(f"unknown worker task {spec['task']!r}")
        print(json.dumps(task(spec)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="every workload small (under a minute); no speed claims")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--dir", help="where the caches are created (default: a new temp dir, removed afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the cache directories")
    ap.add_argument("--only", help=f"comma-separated workloads to run (default all): {','.join(WORKLOADS)}")
    ap.add_argument("--cap-sizes", help="entry counts for cap_writes, e.g. 10000,50000")
    args = ap.parse_args(argv)
    cfg = Config.make(args.quick)
    selected = list(WORKLOADS)
    if args.only:
        selected = [w.strip() for w in args.only.split(",") if w.strip()]
        bad = [w for w in selected if w not in RUNNERS]
        if bad:
            ap.error(f"unknown workload(s) {', '.join(bad)}; choose from {', '.join(WORKLOADS)}")
    if args.cap_sizes:
        try:
            cfg.cap_sizes = tuple(int(x) for x in args.cap_sizes.split(","))
        except ValueError:
            ap.error(f"--cap-sizes must be comma-separated integers, got {args.cap_sizes!r}")
        if any(n <= 0 for n in cfg.cap_sizes):
            ap.error(f"--cap-sizes must be positive, got {args.cap_sizes!r}")
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    bench_dir = tempfile.mkdtemp(prefix="bench-" if args.dir else "cas-bench-", dir=args.dir)  # removed unless --keep
    if "cap_writes" in selected and not cfg.quick:
        log("cap_writes fills each cache with " + " and ".join(f"{n:,}" for n in cfg.cap_sizes) + " entries and "
            "times FileStream rescanning at the cap: expect 15-25 minutes in all on 2 cores")  # fmt: skip
    # Bytecode on disk, as an installed package has it: with PYTHONDONTWRITEBYTECODE (or a checkout
    # just edited) each fresh process would compile the modules it imports, and time that.
    import compileall

    import cuda_program_cas
    import cuda_program_cas.index

    for package in (cuda_program_cas, cuda_program_cas.index):
        compileall.compile_dir(os.path.dirname(str(package.__file__)), quiet=1)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "quick": cfg.quick,
        "command": " ".join(["python", "tools/bench.py", *argv]),
        "dir": bench_dir,
        "machine": machine_info(bench_dir),
        "workloads": {},
    }
    try:
        for name in selected:
            log(f"{name} ...")
            t0 = time.perf_counter()
            wdir = os.path.join(bench_dir, name)
            os.makedirs(wdir)
            result = RUNNERS[name](cfg, wdir)
            report["workloads"][name] = {
                "rows": [r.as_dict() for r in result.rows],
                "notes": result.notes,
                "details": result.details,
                "elapsed_s": time.perf_counter() - t0,
            }
            log(f"{name} done in {time.perf_counter() - t0:.1f} s")
            if not args.keep:
                shutil.rmtree(wdir, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(bench_dir, ignore_errors=True)
    report["elapsed_s"] = time.perf_counter() - started
    report["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    tally(report)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
