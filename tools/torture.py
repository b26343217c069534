"""Torture runs: concurrency, crashes, corruption, full disks and hostile paths (docs/torture.md).

    python tools/torture.py --processes 4 --seconds 150
    python tools/torture.py --scenarios crash,corrupt --kills 200 --json

Scenarios: ``mixed``, ``crash``, ``corrupt``, ``fulldisk`` (needs root), ``paths`` and
``shared``; they and the checker are ``testkit.torture``, this file is their command line. A
run exits 1 on any wrong byte, unexpected exception or cache left unclean.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from testkit.common import SAXPY
from testkit.torture import (
    DEFAULT_CAP,
    Report,
    merge_reports,
    run_corruption,
    run_crashes,
    run_full_disk,
    run_mixed,
    run_paths,
    run_shared,
    run_unreadable,
    worker,
)
from testkit.workers import worker_spec

SCENARIOS = ("mixed", "crash", "corrupt", "fulldisk", "paths", "shared")


def _compiler() -> Callable[..., Any] | None:
    try:
        from cuda.core import Program, ProgramOptions
    except ImportError:
        return None

    def compile_program(cache: Any = None, **options: Any) -> Any:
        return Program(SAXPY, "c++", options=ProgramOptions(**options)).compile("cubin", cache=cache)

    return compile_program


def run(args: argparse.Namespace, workdir: str) -> list[Report]:
    reports = []
    for name in args.scenarios:
        t0 = time.monotonic()
        seed, cap = args.seed, args.cap
        if name == "mixed":
            rep = run_mixed(workdir, processes=args.processes, seconds=args.seconds, cap=cap, seed=seed)
        elif name == "crash":
            rounds = args.kills // max(1, args.crash_processes)
            rep = run_crashes(workdir, rounds=rounds, processes=args.crash_processes, cap=cap, seed=seed)
        elif name == "corrupt":
            rep = run_corruption(workdir, rounds=args.corrupt_rounds, seed=seed)
            rep = merge_reports("corrupt", rep, run_unreadable(workdir))
        elif name == "fulldisk":
            rep = run_full_disk(workdir, seed=seed, compile_program=_compiler())
        elif name == "paths":
            rep = run_paths(workdir)
        else:
            nodes = max(1, args.processes - 2)
            rep = run_shared(workdir, nodes=nodes, seconds=args.shared_seconds, cap=cap, seed=seed)
        if not rep.seconds:
            rep.seconds = round(time.monotonic() - t0, 1)
        reports.append(rep)
        if not args.json:
            _print_one(rep)
    return reports


def _print_one(rep: Report) -> None:
    if rep.skipped:
        print(f"{rep.scenario:9} SKIPPED: {rep.skipped}")
        return
    verdict = "ok" if rep.ok else "FAILED"
    print(
        f"{rep.scenario:9} {verdict:6} {rep.processes} proc x {rep.seconds:g} s: {rep.operations:,} ops, "
        f"{rep.hits:,} hits, {rep.misses:,} misses, {rep.writes:,} writes, {rep.dropped_writes:,} dropped, "
        f"{rep.collections:,} collections, {rep.kills} kills, {rep.faults} faults, "
        f"{rep.wrong_bytes} wrong bytes, {rep.exceptions} exceptions"
    )
    for note in rep.notes:
        print(f"          {note}")
    for failure in rep.failures:
        print(f"          FAIL {failure}")


def totals(reports: list[Report]) -> dict[str, int]:
    keys = ("operations", "hits", "kills", "faults", "wrong_bytes", "exceptions")
    return {k: sum(getattr(r, k) for r in reports) for k in keys}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torture.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, from {','.join(SCENARIOS)}")
    p.add_argument("--processes", "-p", type=int, default=4, help="mixed-load processes (default 4)")
    p.add_argument("--seconds", "-t", type=float, default=60.0, help="mixed-load duration (default 60)")
    p.add_argument("--shared-seconds", type=float, default=30.0, help="shared-store duration (default 30)")
    p.add_argument("--kills", type=int, default=100, help="SIGKILLs in the crash scenario (default 100)")
    p.add_argument("--crash-processes", type=int, default=2, help="writers killed per crash round (default 2)")
    p.add_argument("--corrupt-rounds", type=int, default=5, help="rounds of fault injection (default 5)")
    p.add_argument("--cap", type=int, default=DEFAULT_CAP, help=f"size cap in bytes (default {DEFAULT_CAP})")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", help="work directory (default: a temporary one, removed afterwards)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = worker_spec(argv)
    if spec is not None:
        return worker(spec)
    args = build_parser().parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad or args.processes < 1 or args.seconds <= 0 or args.kills < 0:
        print(f"torture.py: error: bad arguments ({', '.join(bad) or 'counts must be positive'})", file=sys.stderr)
        return 2
    workdir = args.dir or tempfile.mkdtemp(prefix="cas-torture-")
    os.makedirs(workdir, exist_ok=True)
    started = time.monotonic()
    try:
        reports = run(args, workdir)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    total = totals(reports)
    ok = all(r.ok for r in reports)
    if args.json:
        scenarios = [r.as_dict() for r in reports]
        seconds = round(time.monotonic() - started, 1)
        print(json.dumps({"ok": ok, "seconds": seconds, "totals": total, "scenarios": scenarios}))
    else:
        print(
            f"{'PASS' if ok else 'FAIL'}: {total['operations']:,} operations, {total['kills']:,} kills, "
            f"{total['faults']:,} faults injected, {total['wrong_bytes']} wrong bytes returned, "
            f"{total['exceptions']} exceptions, in {time.monotonic() - started:.0f} s"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
    sys.exit(1)
