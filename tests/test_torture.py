"""Quick versions of the torture scenarios of tools/testkit/torture/ (about a minute in all on 2 cores).

Each scenario returns a report of figures; a test fails on any wrong byte, any
unexpected exception, or any failure the scenario records (printed in full).
Long runs, through its command line: ``python tools/torture.py --processes 4 --seconds 150``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from blake3 import blake3
from conftest import REPO, compile_program, is_root
from testkit import torture

from cuda_program_cas import CacheStore
from cuda_program_cas.index import key_id


def _assert_clean(rep) -> None:
    assert rep.ok, f"{rep.scenario}: " + "\n".join(rep.failures)
    assert rep.wrong_bytes == 0
    assert rep.exceptions == 0


# -- the harness itself can fail ------------------------------------------------------


def test_harness_detects_wrong_bytes_and_wrong_mappings(tmp_path: Path) -> None:
    """A manifest of key 1 naming key 2's blob (valid, its real size) is served: the checks catch it.

    The cache cannot see this one (the manifest names its own key, and a blob
    that is really there): it is what the torture checks exist to catch if a
    writer ever did it. A manifest merely copied from key 2 names key 2, and is a miss.
    """
    from cuda_program_cas.index import Manifest

    root = str(tmp_path / "c")
    store = CacheStore(root)
    for i in (1, 2):
        store.put(torture.key_name(i), torture.content(i))
    kid1, kid2 = (key_id(torture.key_name(i)) for i in (1, 2))
    with open(store.inner.layout.manifest_path(kid2), "rb") as fh:
        copied = fh.read()
    with open(store.inner.layout.manifest_path(kid1), "wb") as fh:
        fh.write(copied)
    assert CacheStore(root).get(torture.key_name(1)) is None  # misplaced: a miss
    digest2 = blake3(torture.content(2)).hexdigest()
    with open(store.inner.layout.manifest_path(kid1), "wb") as fh:
        fh.write(Manifest(digest2, len(torture.content(2)), kid1).encode())
    rep = torture.Report("self-test")
    torture.check_hit(1, CacheStore(root).get(torture.key_name(1)), rep, "self-test")
    assert rep.wrong_bytes == 1 and not rep.ok
    assert torture.inspect_cache(root, torture.expected_digests())["wrong_mapping"] == 1


def test_content_is_deterministic_and_varied() -> None:
    assert torture.content(3) == torture.content_of_seed(3) == torture.content(3 + torture.N_SEEDS)
    sizes = {len(torture.content(i)) for i in range(torture.N_SEEDS)}
    assert len(sizes) > 200 and min(sizes) >= 64


# -- 1. mixed load -----------------------------------------------------------------------


@pytest.mark.slow
def test_mixed_load(tmp_path: Path) -> None:
    """get, set, delete, clear, eviction and collection in 3 processes at once, every hit checked."""
    rep = torture.run_mixed(str(tmp_path), processes=3, seconds=8)
    _assert_clean(rep)
    assert rep.hits > 100 and rep.writes > 100 and rep.collections > 0, rep


# -- 2. crashes ----------------------------------------------------------------------------


@pytest.mark.slow
def test_crashes(tmp_path: Path) -> None:
    """Writers killed with SIGKILL at random moments; after each round the cache is checked and repaired."""
    rep = torture.run_crashes(str(tmp_path), rounds=6, processes=2)
    _assert_clean(rep)
    assert rep.kills == 12 and rep.checks == 6


# -- 3. corruption -----------------------------------------------------------------------


def test_corruption(tmp_path: Path) -> None:
    """Bit flips, truncation, empty and extended blobs, bad manifests: misses, counted, moved aside, healed."""
    rep = torture.run_corruption(str(tmp_path), rounds=1)
    _assert_clean(rep)
    assert rep.faults >= 20 and rep.hits > 0


@pytest.mark.skipif(not is_root(), reason="handing the cache to an unprivileged user needs root")
def test_unreadable_files_as_unprivileged_user(tmp_path: Path) -> None:
    """chmod 000 on a blob, a manifest and two shard directories, used by uid 65534: misses, counted."""
    rep = torture.run_unreadable(str(tmp_path))
    if rep.skipped:
        pytest.skip(rep.skipped)
    _assert_clean(rep)


# -- 4. full disk ------------------------------------------------------------------------


@pytest.mark.mount
def test_full_disk(tmp_path: Path) -> None:
    """A 1 MiB tmpfs: writes that don't fit are dropped cleanly and counted, compiles go on, space comes back."""
    if not is_root():
        pytest.skip("mounting a tmpfs needs root")
    rep = torture.run_full_disk(str(tmp_path), compile_program=compile_program)
    if rep.skipped:
        pytest.skip(rep.skipped)
    _assert_clean(rep)
    assert rep.dropped_writes > 0 and rep.writes > 0
    assert not os.path.ismount(tmp_path / "tmpfs")


# -- 5. bad inputs and paths -------------------------------------------------------------


def test_bad_inputs(tmp_path: Path) -> None:
    """The table "What a bad input gets": clear exceptions naming the value, nothing written."""
    rep = torture.run_bad_inputs(str(tmp_path))
    _assert_clean(rep)
    assert rep.faults >= 30


def test_hostile_paths_stay_inside_the_root(tmp_path: Path) -> None:
    """Symlinked shards and files, manifests naming ../../etc/passwd: misses; the sentinel next door untouched."""
    rep = torture.run_hostile_paths(str(tmp_path))
    _assert_clean(rep)


# -- 6. shared stores --------------------------------------------------------------------


@pytest.mark.slow
def test_shared_store_published_and_collected_while_nodes_read(tmp_path: Path) -> None:
    """Two nodes read through a shared store while it is published into and collected."""
    rep = torture.run_shared(str(tmp_path), nodes=2, seconds=6)
    if rep.skipped:
        pytest.skip(rep.skipped)
    _assert_clean(rep)
    assert rep.hits > 0 and rep.collections > 0
    assert any("shared hits" in n and not n.endswith(": 0 shared hits") for n in rep.notes), rep.notes


# -- the command line ----------------------------------------------------------------------


def test_command_line_summary_and_exit_status(tmp_path: Path) -> None:
    """One JSON object whose verdict matches the exit status; bad usage exits 2."""
    script = str(REPO / "tools" / "torture.py")

    def torture(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120, check=False)

    out = torture("--scenarios", "corrupt", "--corrupt-rounds", "1", "--json", "--dir", str(tmp_path))
    summary = json.loads(out.stdout)
    assert out.returncode == (0 if summary["ok"] else 1), out.stderr
    assert summary["totals"]["faults"] >= 20 and summary["totals"]["wrong_bytes"] == 0
    assert [s["scenario"] for s in summary["scenarios"]] == ["corrupt"]
    bad = torture("--scenarios", "nonsense")
    assert bad.returncode == 2, bad.stdout + bad.stderr
