"""tools/bench.py --quick --json runs every workload for both caches and reports sane numbers.

Speed is never asserted here: only that the tool works end to end and that what it
prints is complete and plausible. Takes about 25-40 s (real NVRTC compiles, fresh
interpreters, a few thousand cache writes).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from _bench import WORKLOADS
from conftest import REPO


def _run_bench(*args: str, timeout: float = 170) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


@pytest.mark.slow  # the whole quick bench (20 s): its work does not depend on the interpreter
def test_quick_json_reports_every_workload_for_both_caches(tmp_path):
    proc = _run_bench("--quick", "--json", "--dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)

    assert list(report["workloads"]) == list(WORKLOADS)
    machine = report["machine"]
    assert machine["cores"] >= 1
    assert machine["python"]
    assert machine["versions"]["cuda-core"]
    assert machine["filesystem"].get("fstype")

    for name, workload in report["workloads"].items():
        rows = workload["rows"]
        assert rows, name
        for row in rows:
            where = f"{name}: {row['metric']}"
            for side in ("ours", "filestream"):
                value = row[side]
                if side == "filestream" and value is None:  # a row about ours alone
                    assert row["ratio"] is None and "ours only" in row["metric"], where
                    continue
                assert isinstance(value, (int, float)), where
                assert math.isfinite(value), where
                if row["unit"] == "count" and "errors" in row["metric"]:
                    assert value >= 0, where
                else:
                    assert value > 0, where
            if row["ratio"] is not None:
                assert row["ratio"] == row["ours"] / row["filestream"], where
            assert row["met"] in (True, False, None), where
        assert workload["notes"], name

    # Rows with a target carry a verdict; the ones the issue names are all there.
    targeted = {(n, r["metric"]) for n, w in report["workloads"].items() for r in w["rows"] if r["met"] is not None}
    assert len(targeted) >= 15
    assert report["targets_met"] + len(report["targets_not_met"]) == len(targeted)
    metrics = {r["metric"] for w in report["workloads"].values() for r in w["rows"]}
    for wanted in (  # the first-hit issue's rows, each with its target in a full run
        "first hit 8 KB, median",
        "first hit 160 KB, median",
        "first hit 8 KB, verified this boot, median",
        "first hit 160 KB, verified this boot, median",
        "repeated hit 8 KB, median",
        "repeated hit 160 KB, median",
        "Program.compile hit, median",
        "front-door hit (cache.compile), median",
        "store new content 8 KB, median",
        "store new content 160 KB, median",
        "store already-stored content, new key 8 KB, median",
        "front-door hit, first call in a fresh process / uncached compile",
        "lifetime counters and records per hit, logging off (ours only)",
        "front-door hit, repeated in that process / uncached compile",
        "small-kernel job, hit, wall: ours (Program.compile(cache=)) / FileStream",
        "small-kernel job, hit, wall: ours (Program.compile(cache=)) / uncached compile",
        "small-kernel job, hit, CPU: ours (cache.compile) / FileStream",
    ):
        assert wanted in metrics, wanted
    assert any(m.startswith("repeated hit 160 KB, 20 keys") for m in metrics)  # beyond the budget in a full run

    # Both caches were really exercised: the processes saw no errors, both evicted at the cap,
    # and the dedup workload stored fewer blobs than entries in ours, one file per entry in FileStream.
    rows = {r["metric"]: r for r in report["workloads"]["processes"]["rows"]}
    assert rows["4 processes, errors"]["ours"] == 0
    assert rows["8 processes, errors"]["ours"] == 0
    for detail in report["workloads"]["cap_writes"]["details"].values():
        assert detail["evicted"] > 0
    fp = {r["metric"]: r for r in report["workloads"]["footprint"]["rows"]}
    assert fp["unique blobs (distinct binaries stored)"]["ours"] < fp["entries"]["ours"]
    assert fp["entries"]["filestream"] == fp["entries"]["ours"]

    # The caches lived under --dir and were removed afterwards.
    assert report["dir"].startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_bad_usage_exits_2(tmp_path):
    proc = _run_bench("--only", "nonsense", "--dir", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert "nonsense" in proc.stderr
