#!/usr/bin/env python3
"""The size cap with N writers at once: how far over the cap the cache is at rest, and at peak.

Each ``cuda_program_cas.CacheStore`` instance counts its own writes and lists the cache again after
writing an eighth of the cap (``cuda_program_cas._local.cap``), so N processes writing at once may take
the cache over the cap; one writer never leaves it over the cap at rest. For each N in
``--writers`` and each of ``--rounds`` rounds, this tool starts N worker processes
(fresh interpreters: this file's ``_worker`` mode) on one fresh cache directory, all
with the same cap. They open the cache, say they are ready, and wait on their stdin
until the parent has heard from all of them (the start barrier); then each does
``--writes`` operations and exits:

- ~75 %: a put of a key drawn from a key space of ~4x the entries that fit in the cap;
- ~20 %: a rewrite, with new bytes, of a key the worker wrote a short while ago;
- ~5 %: a delete of such a key (a key already evicted is counted, not an error).

Every value is distinct (worker, write number), so deduplication never helps. After
all workers exit, the parent measures the cache at rest with an uncapped read-only
``CacheStore(path).stats()`` scan: stored bytes (unique blobs plus manifests, what the
cap counts), entries, blobs; and runs ``cuda_program_cas.verify`` on it (a warning line for any
``corrupt_blob`` or ``dangling_manifest``). During the run a sampler thread in the
parent scans ``stats().stored_bytes`` every ~50 ms: the peak is informative only (a
scan is not atomic: it may miss the true peak, or count blobs written while it ran
without their manifests); the at-rest figure is the bound.

    python tools/cap_bound.py                 # N = 1, 4, 8; 3 rounds of 2000 operations (~2.5 min on 2 cores)
    python tools/cap_bound.py --quick         # N = 1, 2; 1 round of 300 operations (seconds)
    python tools/cap_bound.py --json          # one JSON object on stdout
    python tools/cap_bound.py --writers 2,16 --rounds 5 --cap 4M --value-size 16K

Per N the table gives the at-rest stored bytes / cap and the sampled peak / cap (each
the maximum over rounds), the entries at rest (min-max over rounds), the blobs no
manifest names at rest ("orphans": they count in the stored bytes; one left by two
writers racing on one key waits out the 10-minute grace period), and the mean wall
time of a round (start signal to last exit). At rest over the cap with N = 1 would be
a bug in the library: it is printed as one. The at-rest figure is what this workload
measured, not a worst case: workers that finish at different times leave the last
one to bring the cache back under the cap.

Exit status: 0 when the run completed (whatever it measured), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

from _common import (  # tools/ is this script's directory, first on sys.path
    git_state,
    log,
    spawn_worker,
    work_dir,
    worker_spec,
)

KB = 1024
#: Operation mix: the rest of the operations are puts of keys drawn from the key space.
REWRITE_FRACTION = 0.20
DELETE_FRACTION = 0.05
#: The key space holds this many times the entries that fit in the cap.
KEY_SPACE_FACTOR = 4
#: Roughly what a manifest takes on disk (a key id, a digest, a size, a tag).
MANIFEST_ESTIMATE = 160
SAMPLE_INTERVAL_S = 0.05
#: Problems of cuda_program_cas.verify that this workload must never leave.
BAD_KINDS = ("corrupt_blob", "dangling_manifest")
ROUND_TIMEOUT_S = 900.0


# -- configuration ---------------------------------------------------------------------


@dataclass
class Config:
    writers: tuple[int, ...] = (1, 4, 8)
    rounds: int = 3
    writes: int = 2000
    cap: int = 1024 * KB
    value_size: int = 4 * KB
    quick: bool = False

    @property
    def fits(self) -> int:
        """About how many entries the cap holds."""
        return max(1, self.cap // (self.value_size + MANIFEST_ESTIMATE))

    @property
    def key_space(self) -> int:
        return max(16, KEY_SPACE_FACTOR * self.fits)

    def recent_keys(self, n: int) -> int:
        """How many of its latest keys a worker rewrites or deletes from: ones likely still stored."""
        return max(8, self.fits // (2 * n))


# -- the worker ------------------------------------------------------------------------


def _worker_main(spec: dict[str, Any]) -> int:
    """``_worker SPEC_JSON``: open the cache, print "ready", wait for a byte on stdin, work, print a JSON line."""
    import cuda_program_cas
    from cuda_program_cas import WriteResult

    worker, size = spec["worker"], spec["value_size"]
    store = cuda_program_cas.CacheStore(spec["path"], max_size_bytes=spec["cap"])
    rng = random.Random(spec["seed"])
    base = random.Random(size).randbytes(size)
    head = worker.to_bytes(4, "little")
    recent: list[str] = []
    limit = spec["recent"]
    counts = dict.fromkeys(("puts", "rewrites", "deletes", "deletes_missing", "dropped"), 0)
    print("ready", flush=True)
    if not sys.stdin.buffer.read(1):
        return 1  # the parent went away before the start
    t0 = time.perf_counter()
    for i in range(spec["writes"]):
        r = rng.random()
        if recent and r < DELETE_FRACTION:
            key = recent.pop(rng.randrange(len(recent)))
            counts["deletes"] += 1
            try:
                store.delete(key)
            except KeyError:
                counts["deletes_missing"] += 1  # evicted (or deleted by another worker) already
            continue
        if recent and r < DELETE_FRACTION + REWRITE_FRACTION:
            key = recent[rng.randrange(len(recent))]
            counts["rewrites"] += 1
        else:
            key = f"k{rng.randrange(spec['key_space'])}"
            counts["puts"] += 1
            recent.append(key)
            if len(recent) > limit:
                del recent[0]
        data = head + i.to_bytes(8, "little") + base[12:]  # distinct for every write of every worker
        if store.put(key, data) is WriteResult.DROPPED:
            counts["dropped"] += 1
    elapsed = time.perf_counter() - t0
    c = store.counters()
    out = {
        "worker": worker,
        "ops": spec["writes"],
        "elapsed_s": elapsed,
        "evictions": c["evictions"],
        "dropped_writes": c["dropped_writes"],
        **counts,
    }
    print(json.dumps(out), flush=True)
    return 0


# -- the parent ------------------------------------------------------------------------


class Sampler(threading.Thread):
    """Scans the cache's stored bytes every ``interval`` seconds; keeps the peak."""

    def __init__(self, path: str, interval: float = SAMPLE_INTERVAL_S) -> None:
        super().__init__(daemon=True)
        import cuda_program_cas

        self._store = cuda_program_cas.CacheStore(path, read_only=True)
        self._interval = interval
        self._done = threading.Event()
        self.peak = 0
        self.samples = 0
        self.failed = 0

    def sample(self) -> None:
        try:
            stored = self._store.stats().stored_bytes
        except OSError:  # a file vanished mid-scan in a way the scan does not absorb
            self.failed += 1
            return
        self.samples += 1
        self.peak = max(self.peak, stored)

    def run(self) -> None:
        while True:
            self.sample()
            if self._done.wait(self._interval):
                return

    def stop(self) -> None:
        self._done.set()
        self.join()


@dataclass
class RoundResult:
    writers: int
    round: int
    at_rest_bytes: int
    peak_bytes: int
    entries: int
    blobs: int
    orphan_blobs: int
    wall_s: float
    samples: int
    workers: list[dict[str, Any]] = field(default_factory=list)
    problems: dict[str, int] = field(default_factory=dict)


def _start_worker(spec: dict[str, Any], err: IO[bytes]) -> subprocess.Popen[bytes]:
    return spawn_worker(__file__, spec, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)


def _tail(err: IO[bytes]) -> str:
    err.seek(0)
    return err.read().decode(errors="replace").strip()[-2000:]


def run_round(cfg: Config, n: int, rnd: int, path: str) -> RoundResult:
    import cuda_program_cas

    cuda_program_cas.CacheStore(path)  # the layout, before the sampler opens it read-only
    procs: list[subprocess.Popen[bytes]] = []
    errs: list[IO[bytes]] = []
    sampler = Sampler(path)
    with contextlib.ExitStack() as files:
        try:
            for w in range(n):
                spec = {
                    "path": path,
                    "cap": cfg.cap,
                    "value_size": cfg.value_size,
                    "writes": cfg.writes,
                    "key_space": cfg.key_space,
                    "recent": cfg.recent_keys(n),
                    "worker": w,
                    "seed": f"{n}/{rnd}/{w}",
                }
                errs.append(files.enter_context(tempfile.TemporaryFile()))
                procs.append(_start_worker(spec, errs[-1]))
            for p, err in zip(procs, errs, strict=True):  # the start barrier: every worker has opened the cache
                assert p.stdout is not None
                line = p.stdout.readline()
                if line.strip() != b"ready":
                    p.wait()
                    raise RuntimeError(f"a worker did not start ({p.returncode}): {_tail(err)}")
            sampler.start()
            t0 = time.perf_counter()
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(b"g")
                p.stdin.flush()  # communicate() closes it
            workers = []
            deadline = time.monotonic() + ROUND_TIMEOUT_S
            for p, err in zip(procs, errs, strict=True):
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if p.returncode != 0:
                    raise RuntimeError(f"a worker failed ({p.returncode}): {_tail(err)}")
                workers.append(json.loads(out.decode().strip().splitlines()[-1]))
            wall = time.perf_counter() - t0
        finally:
            for p in procs:  # first: no worker may outlive a failed round and write on
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if sampler.is_alive():
                sampler.stop()
    sampler.sample()  # the peak includes the state at rest
    stats = cuda_program_cas.CacheStore(path, read_only=True).stats()
    report = cuda_program_cas.verify(path)
    problems: dict[str, int] = {}
    for prob in report.problems:
        problems[prob.kind] = problems.get(prob.kind, 0) + 1
    return RoundResult(
        writers=n,
        round=rnd,
        at_rest_bytes=stats.stored_bytes,
        peak_bytes=sampler.peak,
        entries=stats.entries,
        blobs=stats.blobs,
        orphan_blobs=report.orphan_blobs,
        wall_s=wall,
        samples=sampler.samples,
        workers=workers,
        problems=problems,
    )


def summarize(cfg: Config, rounds: list[RoundResult]) -> list[dict[str, Any]]:
    out = []
    for n in cfg.writers:
        rs = [r for r in rounds if r.writers == n]
        if not rs:
            continue
        ops = sum(w["ops"] for r in rs for w in r.workers)
        wall = sum(r.wall_s for r in rs)
        out.append(
            {
                "writers": n,
                "rounds": len(rs),
                "at_rest_over_cap_max": max(r.at_rest_bytes for r in rs) / cfg.cap,
                "peak_over_cap_max": max(r.peak_bytes for r in rs) / cfg.cap,
                "entries_at_rest": [r.entries for r in rs],
                "orphan_blobs_at_rest": [r.orphan_blobs for r in rs],
                "wall_s_mean": wall / len(rs),
                "ops_per_s": ops / wall if wall else None,
                "evictions": sum(w["evictions"] for r in rs for w in r.workers),
                "dropped_writes": sum(w["dropped_writes"] for r in rs for w in r.workers),
                "deletes_missing": sum(w["deletes_missing"] for r in rs for w in r.workers),
                "per_round": [
                    {
                        "round": r.round,
                        "at_rest_bytes": r.at_rest_bytes,
                        "at_rest_over_cap": r.at_rest_bytes / cfg.cap,
                        "peak_bytes": r.peak_bytes,
                        "peak_over_cap": r.peak_bytes / cfg.cap,
                        "entries": r.entries,
                        "blobs": r.blobs,
                        "orphan_blobs": r.orphan_blobs,
                        "wall_s": r.wall_s,
                        "samples": r.samples,
                        "problems": r.problems,
                        "workers": r.workers,
                    }
                    for r in rs
                ],
            }
        )
    return out


def warnings_for(cfg: Config, rounds: list[RoundResult]) -> list[str]:
    warns = []
    for r in rounds:
        bad = {k: v for k, v in r.problems.items() if k in BAD_KINDS}
        if bad:
            warns.append(
                f"WARNING: cuda_program_cas.verify found {', '.join(f'{v} {k}' for k, v in bad.items())} "
                f"after N={r.writers} round {r.round}"
            )
        if r.writers == 1 and r.at_rest_bytes > cfg.cap:
            warns.append(
                f"WARNING (a library bug): one writer left {r.at_rest_bytes:,} stored bytes at rest, over the cap "
                f"of {cfg.cap:,} (round {r.round})"
            )
    return warns


def machine_info() -> dict[str, Any]:
    commit, dirty = git_state()
    return {
        "cores": os.cpu_count(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "git": commit + ("+dirty" if dirty else ""),
    }


def render(report: dict[str, Any]) -> str:
    cfg = report["config"]
    m = report["machine"]
    lines = [
        f"cuda-program-cas cap bound ({'quick' if report['quick'] else 'full'}), {report['elapsed_s']:.0f} s",
        f"machine: {m['cores']} cores, {m['os']}, Python {m['python']}; git {m['git']}",
        f"cap {cfg['cap']:,} B, values {cfg['value_size']:,} B, {cfg['writes']:,} operations per writer "
        f"({DELETE_FRACTION:.0%} deletes, {REWRITE_FRACTION:.0%} rewrites), key space {cfg['key_space']:,} "
        f"(~{cfg['fits']:,} fit), {cfg['rounds']} round(s)",
        "",
    ]
    header = ("N", "at rest/cap", "peak/cap", "entries at rest", "orphans", "wall s", "ops/s", "evictions")
    table = []
    for s in report["results"]:
        ents, orph = s["entries_at_rest"], s["orphan_blobs_at_rest"]
        table.append(
            (
                str(s["writers"]),
                f"{s['at_rest_over_cap_max']:.3f}",
                f"{s['peak_over_cap_max']:.3f}",
                f"{min(ents)}-{max(ents)}" if min(ents) != max(ents) else str(ents[0]),
                f"{min(orph)}-{max(orph)}" if min(orph) != max(orph) else str(orph[0]),
                f"{s['wall_s_mean']:.1f}",
                f"{s['ops_per_s']:,.0f}" if s["ops_per_s"] else "-",
                f"{s['evictions']:,}",
            )
        )
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, *table]:
        lines.append(
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        )
    lines.append("")
    lines.append(
        "at rest/cap and peak/cap: the maximum over rounds; peak: sampled every ~50 ms (informative); "
        "entries and orphan blobs (no manifest names them) at rest: min-max over rounds; "
        "wall s: mean per round, start signal to last exit"
    )
    lines.extend(report["warnings"])
    return "\n".join(lines)


def _positive_list(text: str) -> tuple[int, ...]:
    values = tuple(int(x) for x in text.split(",") if x.strip())
    if not values or any(v <= 0 for v in values):
        raise ValueError(text)
    return values


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = worker_spec(argv)
    if spec is not None:
        return _worker_main(spec)
    import cuda_program_cas

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 1,2; 300 operations; 1 round (seconds)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--writers", help="comma-separated numbers of writer processes (default 1,4,8)")
    ap.add_argument("--rounds", type=int, help="rounds per N (default 3)")
    ap.add_argument("--writes", type=int, help="operations per writer (default 2000)")
    ap.add_argument("--cap", default="1M", help="max_size_bytes of every writer (default 1M)")
    ap.add_argument("--value-size", default="4K", help="bytes per value (default 4K)")
    ap.add_argument("--dir", help="where the caches are created (default: a new temp dir, removed afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the cache directories")
    args = ap.parse_args(argv)
    cfg = Config(quick=args.quick)
    if args.quick:
        cfg.writers, cfg.writes, cfg.rounds = (1, 2), 300, 1
    if args.writers is not None:
        try:
            cfg.writers = tuple(dict.fromkeys(_positive_list(args.writers)))
        except ValueError:
            ap.error(f"--writers must be comma-separated positive integers, got {args.writers!r}")
    for name in ("rounds", "writes"):
        value = getattr(args, name)
        if value is not None:
            if value <= 0:
                ap.error(f"--{name} must be positive, got {value}")
            setattr(cfg, name, value)
    try:
        cfg.cap = cuda_program_cas.parse_size(args.cap)
        cfg.value_size = cuda_program_cas.parse_size(args.value_size)
    except ValueError as exc:
        ap.error(str(exc))
    if cfg.value_size < 16:
        ap.error(f"--value-size must be at least 16 bytes, got {cfg.value_size}")
    if cfg.fits < 4:
        ap.error(f"--cap {args.cap} holds fewer than 4 values of {cfg.value_size} bytes")
    base = work_dir(args.dir, "cap-bound")
    started = time.perf_counter()
    rounds: list[RoundResult] = []
    try:
        for n in cfg.writers:
            for rnd in range(cfg.rounds):
                path = os.path.join(base, f"n{n}-r{rnd}")
                r = run_round(cfg, n, rnd, path)
                rounds.append(r)
                log(
                    f"N={n} round {rnd}: at rest {r.at_rest_bytes / cfg.cap:.3f} x cap, "
                    f"peak {r.peak_bytes / cfg.cap:.3f} x cap, {r.entries} entries, {r.wall_s:.1f} s"
                )
                if not args.keep:
                    shutil.rmtree(path, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    report: dict[str, Any] = {
        "quick": cfg.quick,
        "command": " ".join(["python", "tools/cap_bound.py", *argv]),
        "dir": base,
        "kept": bool(args.keep),
        "machine": machine_info(),
        "config": {
            "writers": list(cfg.writers),
            "rounds": cfg.rounds,
            "writes": cfg.writes,
            "cap": cfg.cap,
            "value_size": cfg.value_size,
            "fits": cfg.fits,
            "key_space": cfg.key_space,
            "rewrite_fraction": REWRITE_FRACTION,
            "delete_fraction": DELETE_FRACTION,
            "sample_interval_s": SAMPLE_INTERVAL_S,
        },
        "results": summarize(cfg, rounds),
        "warnings": warnings_for(cfg, rounds),
        "elapsed_s": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        for w in report["warnings"]:
            log(w)
    else:
        print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
