"""The real-NFS harness: its skip path, and its scenarios run on plain directories.

The full run (a VM with the kernel NFS server) takes minutes and is not part of
the unit suite: ``python tools/nfs_harness.py`` (docs/nfs-harness.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

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


def test_scenarios_pass_on_plain_directories(tmp_path: Path) -> None:
    """Every scenario runs (no NFS here: one directory is every mount) and reports its figures."""
    shared = tmp_path / "export"
    shared.mkdir()
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(SCENARIOS), "--publisher", str(shared), "--node", str(shared), "--node", str(shared)]
    cmd += ["--local", str(tmp_path / "local"), "--json", str(out), "--quick", "--keys", "24"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and len(result["scenarios"]) == 5
    by_name = {s["name"]: s for s in result["scenarios"]}
    compile_nodes = by_name["Program.compile on nodes hits the shared store"]["figures"]["nodes"]
    assert [n["nvrtc_compiles"] for n in compile_nodes] == [0, 0]
    publish_nodes = by_name["publish while nodes read"]["figures"]["nodes"]
    assert all(n["hits"] > 0 and n["all_visible_after_s"] is not None for n in publish_nodes)
    packed = by_name["loose against packed stores"]["figures"]
    assert packed["store"]["packed"]["files"] < 10 < packed["store"]["loose"]["files"]
    assert all(v["still_missing"] == 0 for v in packed["visibility"])
    assert "PASSED: 5 of 5" in proc.stdout


def test_a_wrong_byte_fails_the_worker(tmp_path: Path) -> None:
    """The checker the nodes use: a store handing back other bytes is reported, not counted as a hit."""
    sys.path.insert(0, str(SCENARIOS.parent))
    try:
        import scenarios
    finally:
        sys.path.remove(str(SCENARIOS.parent))

    class Tampered:
        def get(self, key: object) -> bytes:
            good = scenarios.value_of("g", 1)
            return good[:10] + bytes([good[10] ^ 1]) + good[11:]

    out: dict[str, list[str]] = {"wrong": [], "exceptions": []}
    assert scenarios._check(Tampered(), "g", 1, out) is None
    assert out["wrong"] and "first difference at 10" in out["wrong"][0]
