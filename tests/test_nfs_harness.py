"""The real-NFS harness: its skip path, and its scenarios run on plain directories.

The full run (a VM with the kernel NFS server) takes minutes and is not part of
the unit suite: ``python tools/nfs_harness.py`` (docs/nfs-harness.md).
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from testkit.workers import child_env

HARNESS = REPO / "tools" / "nfs_harness.py"
SCENARIOS = REPO / "tools" / "nfs" / "scenarios.py"


def run_harness(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, str(HARNESS), "--cache", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=60, env=full, check=False,
    )  # fmt: skip


def test_skips_cleanly_without_kvm(tmp_path: Path) -> None:
    missing = tmp_path / "no-kvm"
    proc = run_harness(tmp_path, NFS_HARNESS_KVM=str(missing))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("skipped: "), proc.stdout
    assert str(missing) in proc.stdout
    assert not (tmp_path / "cache").exists()  # nothing fetched or built


def test_skips_cleanly_without_qemu(tmp_path: Path) -> None:
    kvm = tmp_path / "kvm"
    kvm.write_bytes(b"")  # stands in for the device: readable and writable
    proc = run_harness(tmp_path, NFS_HARNESS_KVM=str(kvm), NFS_HARNESS_QEMU=str(tmp_path / "no-qemu"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("skipped: ") and "qemu-system-x86_64" in proc.stdout, proc.stdout


@pytest.mark.slow  # every NFS scenario on plain directories (11 s)
def test_scenarios_pass_on_plain_directories(tmp_path: Path) -> None:
    """Every scenario runs (no NFS here: one directory is every mount) and reports its figures."""
    shared = tmp_path / "export"
    shared.mkdir()
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(SCENARIOS), "--publisher", str(shared), "--node", str(shared), "--node", str(shared)]
    cmd += ["--local", str(tmp_path / "local"), "--json", str(out), "--quick", "--keys", "24"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env(), check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and len(result["scenarios"]) == 6
    by_name = {s["name"]: s for s in result["scenarios"]}
    compile_nodes = by_name["Program.compile on nodes hits the shared store"]["figures"]["nodes"]
    assert [n["nvrtc_compiles"] for n in compile_nodes] == [0, 0]
    publish_nodes = by_name["publish while nodes read"]["figures"]["nodes"]
    assert all(n["hits"] > 0 and n["all_visible_after_s"] is not None for n in publish_nodes)
    packed = by_name["loose against packed stores"]["figures"]
    assert packed["store"]["packed"]["files"] < 10 < packed["store"]["loose"]["files"]
    assert all(v["still_missing"] == 0 for v in packed["visibility"])
    # Off NFS: no operation counts to check, no negative lookups cached, nothing stale.
    assert not any(row["nfs"] or row["packed_ops"] for row in packed["per_node"])
    collect_nodes = by_name["collect while nodes read"]["figures"]["nodes"]
    assert all(not n["negative_lookups_cached"] and n["visible_right_after"] == 24 for n in collect_nodes)
    assert all(n["store_errors"] == 0 == n["errors_otherwise_count"] for n in collect_nodes)
    # Claims on one directory: one compile for 4 processes, and for a holder with 3 waiters; a killed
    # holder's waiter takes over.
    claims = {row["case"]: row for row in by_name["claims on an NFS-mounted cache"]["figures"]["cases"]}
    assert claims["one mount, 4 processes at once"]["compiles"] == 1
    assert claims["two mounts, plain"]["compiles"] == 1
    assert all(took < 5.0 for took in claims["holder SIGKILLed mid-compile"]["takeover_s"].values())
    assert "skipped" in claims["NFS-only cases"]
    assert "PASSED: 6 of 6" in proc.stdout


def test_a_wrong_byte_fails_the_worker(tmp_path: Path) -> None:
    """The checker the nodes use: a store handing back other bytes is reported, not counted as a hit."""
    import scenarios

    class Tampered:
        def get(self, key: object) -> bytes:
            good = scenarios.value_of("g", 1)
            return good[:10] + bytes([good[10] ^ 1]) + good[11:]

    out: dict[str, list[str]] = {"wrong": [], "exceptions": []}
    assert scenarios._check(Tampered(), "g", 1, out) is None
    assert out["wrong"] and "first difference at 10" in out["wrong"][0]


# -- the evidence: a real run's result, the claims checked on it, and the cold-start inputs ----------

#: The output of ``tools/nfs_harness.py --json`` from a real run (docs/nfs-harness.md has its figures).
REAL_RUN = REPO / "tests" / "data" / "nfs-harness-run.json"


def _scenarios_module(name: str = "scenarios") -> Any:
    """``tools/nfs/<name>.py``, imported (pytest's ``pythonpath`` has ``tools/nfs``)."""
    return importlib.import_module(name)


def _figures(name: str) -> dict[str, Any]:
    result = json.loads(REAL_RUN.read_text())
    return copy.deepcopy(next(s for s in result["scenarios"] if s["name"] == name)["figures"])


def test_the_real_run_passed_over_nfs() -> None:
    """The fixture is a passing run over NFS mounts, with operation counts on every node."""
    result = json.loads(REAL_RUN.read_text())
    assert result["ok"] and result["harness"]["guest_exit_status"] == 0
    assert [s["ok"] for s in result["scenarios"]] == [True] * 5
    assert all(opts.startswith("nfs") for opts in result["mounts"].values())
    packed = _figures("loose against packed stores")
    assert all(row["nfs"] and row["packed_ops"] and row["loose_ops"] for row in packed["per_node"])


def test_model_inputs_add_up_to_the_worst_nodes_cold_job() -> None:
    scenarios = _scenarios_module()
    figures = _figures("loose against packed stores")
    inputs = scenarios.model_inputs(figures)
    assert inputs == figures["model_inputs"]
    n = figures["entries"]
    for kind in ("loose", "packed"):
        worst = max(sum(row[f"{kind}_ops"].values()) for row in figures["per_node"])
        assert inputs[kind]["ops_fixed"] + n * inputs[kind]["ops_per_hit"] == pytest.approx(worst, abs=0.2)


def test_the_packed_claims_hold_on_the_real_run_and_catch_a_polluted_count() -> None:
    scenarios = _scenarios_module()
    figures = _figures("loose against packed stores")
    assert scenarios.check_packed(figures) == []
    # What an earlier run counted: the loose phase's delegation returns in the packed phase.
    polluted = copy.deepcopy(figures)
    row = polluted["per_node"][0]
    row["packed_ops"]["DELEGRETURN"] = 141
    row["packed_ops_per_hit"] = round(sum(row["packed_ops"].values()) / figures["entries"], 2)
    failures = scenarios.check_packed(polluted)
    assert any("per packed first hit" in f and "DELEGRETURN" in f for f in failures), failures
    more_files = copy.deepcopy(figures)
    more_files["store"]["packed"]["files"] += 1
    assert any("packed store holds" in f for f in scenarios.check_packed(more_files))
    slow = copy.deepcopy(figures)
    next(v for v in slow["visibility"] if v["store"] == "packed")["all_visible_after_s"] = 60.0
    assert any("new generation visible after 60.0 s" in f for f in scenarios.check_packed(slow))


def test_store_errors_count_only_while_the_collector_removes_files() -> None:
    scenarios = _scenarios_module()
    window = [100.0, 110.0]
    events = [[99.5, 100.2, "cannot read (ESTALE)"], [105.0, 105.1, "cannot read (ESTALE)"]]
    node = {"node": "n1", "store_errors": 2, "negative_lookups_cached": True, "visible_right_after": 0}
    node.update(scenarios.errors_in_window(events, window))
    assert node["errors_while_removing"] == 2
    assert scenarios.check_collect([node], 96) == []
    late = {**node, "store_errors": 3}
    late.update(scenarios.errors_in_window([*events, [111.0, 111.2, "cannot read (ESTALE)"]], window))
    assert any("while no file was being removed" in f for f in scenarios.check_collect([late], 96))
    odd = {**node}
    odd.update(scenarios.errors_in_window([[105.0, 105.1, "cannot read (EIO)"], events[0]], window))
    assert any("other than stale files" in f for f in scenarios.check_collect([odd], 96))
    uncounted = {**node, "store_errors": 5}
    assert any("seen by the lookups" in f for f in scenarios.check_collect([uncounted], 96))
    # A node that caches no negative lookups must see every republished key at once.
    eager = {**node, "negative_lookups_cached": False}
    assert any("visible right after" in f for f in scenarios.check_collect([eager], 96))
    assert scenarios.check_collect([{**eager, "visible_right_after": 96}], 96) == []


def test_the_real_runs_collect_figures_pass_its_checks() -> None:
    scenarios = _scenarios_module()
    figures = _figures("collect while nodes read")
    assert scenarios.check_collect(figures["nodes"], figures["keys"]) == []


def test_harness_json_skip_is_one_object(tmp_path: Path) -> None:
    missing = tmp_path / "no-kvm"
    proc = subprocess.run(
        [sys.executable, str(HARNESS), "--cache", str(tmp_path / "cache"), "--json"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "NFS_HARNESS_KVM": str(missing)}, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "skipped": f"{missing} is missing (no hardware virtualization for qemu -enable-kvm)"
    }


def test_close_to_open_claims_hold_on_the_real_run_and_catch_a_lagging_node() -> None:
    scenarios = _scenarios_module()
    figures = _figures("close-to-open visibility")
    m = figures["entries"]
    assert scenarios.check_visibility(figures["nodes"], m) == []
    eager = next(n for n in figures["nodes"] if not n["negative_lookups_cached"])
    lagging = {**eager, "missed_then_published_visible_at_once": 0}
    assert any("visible at once, with no negative lookup cached" in f for f in scenarios.check_visibility([lagging], m))
    never = {**figures["nodes"][0], "still_missing_after_wait": 3}
    assert any("still missing after the wait" in f for f in scenarios.check_visibility([never], m))


#: The claims scenario's figures from real runs (docs/nfs.md): ``before``, of main's claims (commit
#: a9a0e41) under this scenario's first version; ``before_counters``, of bounded claims with the
#: lifetime counters' lock not yet bounded (its no-NLM case); ``after``, of this version.
CLAIMS_RUNS = REPO / "tests" / "data" / "nfs-claims-runs.json"


def test_the_claims_that_broke_over_nfs_are_caught_and_hold_now() -> None:
    """What broke on main over NFS fails the checks; the run after the fixes passes them."""
    claim_scenario = _scenarios_module("claim_scenario")
    runs = json.loads(CLAIMS_RUNS.read_text())
    assert all(opts.startswith("nfs") for opts in runs["after"]["mounts"].values())
    assert claim_scenario.check_claims(runs["after"]["cases"]) == []
    failures = claim_scenario.check_claims(runs["before"]["cases"])
    # rpc.statd stopped: each claim, bounded by 5 s, returned after its 61 s flock.
    statd = [f for f in failures if "statd" in f and "its claim returned after 61." in f]
    assert len(statd) == 3, failures
    # Two v3 mounts: the second mount's waiters each compiled (one after ESTALE).
    assert any("two mounts, v3: 3 compiles" in f for f in failures), failures
    # What the docs say of the run after: one compile a mount, a killed holder taken over at once.
    after = {(row["case"], row.get("mount")): row for row in runs["after"]["cases"]}
    assert after[("one mount, 4 processes at once", "v4one")]["compiles"] == 1
    assert after[("one mount, 4 processes at once", "v3one")]["compiles"] == 1
    assert after[("two mounts, v3", None)]["compiles"] == 2
    # The server's lock manager gone: put hung on the counters' lock, until faulthandler ended it.
    (hung,) = runs["before_counters"]["cases"]
    assert claim_scenario.check_claims([hung]) != []
    for p in hung["processes"]:
        assert p["no_result"] and "compiling" in p["said"] and "stored" not in p["said"]
        assert "in _locked" in p["stderr"] and "in put" in p["stderr"]
