"""The cuda-program-cas console script: exit codes, --json shapes, one-line errors, read-only caches."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, is_root, write_orphan

from cuda_program_cas import CacheStore, digest_of
from cuda_program_cas._cli.main import Progress, main
from cuda_program_cas.index import key_id

SUMMARY = re.compile(
    r"^removed [\d,]+ entr(y|ies)(, [\d,]+ blobs?)? and [\d,]+ (blobs?|stale temp files?), "
    r"freed [\d,.]+ (B|KiB|MiB|GiB) of [\d,.]+ (B|KiB|MiB|GiB)$"
)
GC_KEYS = {
    "root", "dry_run", "shared", "exists", "blobs_deferred", "started_ns", "elapsed_s", "entries_before",
    "blobs_before", "bytes_before",
    "entries_removed", "blobs_removed", "bytes_freed", "temp_files_removed", "temp_bytes_freed",
    "kept_changed", "plan", "problems", "problem_count", "entries_after", "blobs_after", "bytes_after", "packs",
}  # fmt: skip
STATS_KEYS = {
    "path", "entries", "loose_entries", "loose_also_packed", "blobs", "logical_bytes", "stored_bytes",
    "dedup_ratio", "max_size_bytes",
    "cap_used_percent", "oldest_use", "newest_use", "files", "directories", "inodes", "disk_bytes",
    "orphan_blobs", "orphan_bytes", "invalid_manifests", "dangling_manifests", "stale_temp_files",
    "quarantined_files", "unreadable_manifests", "size_mismatch_manifests", "blob_bytes", "manifest_bytes",
    "counters", "hit_rate", "counters_zeroed_at", "time_saved_s", "busiest", "packs", "packed_entries", "pack_bytes",
    "pack_raw_bytes", "retired_packs",
    "problems", "problem_count", "exists", "max_size_source", "front_door_records", "front_door_record_bytes",
}  # fmt: skip
VERIFY_KEYS = {
    "root", "repair", "exists", "entries", "blobs", "blobs_checked", "bytes_checked", "orphan_blobs", "elapsed_s",
    "problems_found", "problems_fixed", "problems", "problem_count", "packs", "packed_entries", "pack_bytes",
}  # fmt: skip


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def small_cache(root: Path) -> CacheStore:
    store = CacheStore(root)
    for i in range(6):
        store.put(f"k{i}", bytes([i]) * 3000 if i < 4 else b"same" * 1000)
    # Written ten minutes ago: the collector protects what was written just before its scan.
    ten_minutes_ago = time.time() - 600
    for sub in ("index", "blobs"):
        for dirpath, _dirs, files in os.walk(os.path.join(root, sub)):
            for name in files:
                os.utime(os.path.join(dirpath, name), (ten_minutes_ago, ten_minutes_ago))
    old = time.time() - 7200
    orphan = os.urandom(500)
    write_orphan(root, orphan)
    os.utime(store.inner.blobs.path_for(digest_of(orphan)), (old, old))
    return store


def corrupt_one_blob(store: CacheStore) -> str:
    path = store.inner.blobs.path_for(digest_of(b"same" * 1000))
    Path(path).write_bytes(b"SAME" * 1000)
    return path


def test_gc_human_output_ends_with_one_summary_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = small_cache(tmp_path / "cas")
    code, out, err = cli(capsys, "gc", store.root)
    assert code == 0 and err == ""  # no progress when stderr is not a terminal
    last = out.splitlines()[-1]
    assert SUMMARY.match(last), last
    assert last.startswith("removed 0 entries and 1 blob, freed 500 B of ")
    code, out, _ = cli(capsys, "gc", store.root, "--max-size", "1", "--dry-run")
    assert code == 0 and out.splitlines()[-1].startswith("would remove 6 entries and 5 blobs, freeing ")


def test_every_command_prints_one_json_object(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = small_cache(tmp_path / "cas")
    code, out, _ = cli(capsys, "gc", store.root, "--json", "--verify", "--max-age", "7d", "--max-size", "1G")
    report = json.loads(out)
    assert code == 0 and set(report) == GC_KEYS
    assert report["blobs_removed"] == 1 and report["bytes_freed"] == 500 and report["problems"] == []
    assert report["bytes_after"] == report["bytes_before"] - 500

    monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_SIZE", "1M")
    code, out, _ = cli(capsys, "stats", store.root, "--json")
    stats = json.loads(out)
    assert code == 0 and set(stats) == STATS_KEYS
    assert (stats["entries"], stats["blobs"]) == (6, 5)
    assert stats["logical_bytes"] == 4 * 3000 + 2 * 4000 and stats["max_size_bytes"] == 1 << 20
    assert stats["dedup_ratio"] == round(stats["logical_bytes"] / stats["blob_bytes"], 3)
    assert stats["blob_bytes"] + stats["manifest_bytes"] == stats["stored_bytes"]
    assert stats["cap_used_percent"] == round(100 * stats["stored_bytes"] / (1 << 20), 1)
    assert stats["inodes"] == sum(len(d) + len(f) for _, d, f in os.walk(store.root)) + 1
    code, out, _ = cli(capsys, "stats", store.root, "--json", "--max-size", "2M")
    assert json.loads(out)["max_size_bytes"] == 2 << 20

    code, out, _ = cli(capsys, "verify", store.root, "--json")
    result = json.loads(out)
    assert code == 0 and set(result) == VERIFY_KEYS and result["problems"] == []
    assert result["blobs_checked"] == 5


def test_verify_reports_then_repairs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = small_cache(tmp_path / "cas")
    bad = corrupt_one_blob(store)
    dangling = store.inner.layout.manifest_path(key_id("k0"))
    os.unlink(store.inner.blobs.path_for(digest_of(bytes([0]) * 3000)))
    stale = tmp_path / "cas" / "tmp" / "1-x.tmp"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 7200,) * 2)
    before = sorted(os.walk(store.root))

    code, out, _ = cli(capsys, "verify", store.root)
    assert code == 1 and sorted(os.walk(store.root)) == before
    lines = out.splitlines()
    assert f"corrupt_blob: {bad}" in "\n".join(lines)
    assert any(line.startswith(f"dangling_manifest: {dangling}") for line in lines)
    assert "5 problems (fix with --repair)" in lines[-1]  # 1 blob, its 2 manifests, 1 dangling, 1 temp

    code, out, _ = cli(capsys, "verify", store.root, "--repair", "--json")
    result = json.loads(out)
    assert code == 0 and result["problems_found"] == result["problems_fixed"] == 5
    assert not os.path.exists(bad) and len(os.listdir(tmp_path / "cas" / "quarantine")) == 1
    assert not stale.exists() and not os.path.exists(dangling)
    assert cli(capsys, "verify", store.root)[0] == 0
    assert store.get("k1") == bytes([1]) * 3000


def test_a_damaged_layout_is_reported_and_repaired(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = small_cache(tmp_path / "cas")
    layout = tmp_path / "cas" / "layout.json"
    layout.write_text("{garbled")
    code, _, err = cli(capsys, "gc", store.root)
    assert code == 2 and "damaged layout.json" in err and err.count("\n") == 1
    code, out, _ = cli(capsys, "verify", store.root)
    assert code == 1 and out.startswith("damaged_layout: ")
    assert cli(capsys, "verify", store.root, "--repair")[0] == 0
    assert json.loads(layout.read_text())["layout"] == "cuda-program-cas"
    assert cli(capsys, "gc", store.root)[0] == 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["gc", "--max-size", "12Q"], "not a size: '12Q'"),
        (["gc", "--grace", "soon"], "not a duration"),
        (["gc", "--frobnicate"], "unrecognized arguments"),
        (["verify", "{missing}", "--shared"], "--shared and --no-shared"),
        (["verify", "{file}"], "is not a directory"),
        (["gc", "{foreign}"], "is not a cuda-program-cas cache"),
        (["clear", "{foreign}"], "is not a cuda-program-cas cache"),
        (["verify", "{file}", "--repair"], "is not a directory"),
        (["import-filestream", "{missing}"], "no FileStreamProgramCache"),
        (["import-filestream", "{foreign}", "{cache}"], "has no entries/"),
        ([], "required"),
    ],
)
def test_bad_usage_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    paths = {"missing": tmp_path / "nope", "file": tmp_path / "file", "foreign": tmp_path / "foreign"}
    paths["cache"] = tmp_path / "cas"
    code, out, err = cli(capsys, *(a.format(**paths) for a in argv))
    assert code == 2 and out == ""
    assert needle in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("cuda-program-cas")


def test_the_installed_script_and_tools_gc(tmp_path: Path) -> None:
    store = small_cache(tmp_path / "cas")
    script = shutil.which("cuda-program-cas", path=os.path.dirname(sys.executable))
    assert script, "the console script is not installed (pip install -e .)"
    res = subprocess.run([script, "gc", store.root, "--dry-run"], capture_output=True, text=True, check=False)
    assert res.returncode == 0 and res.stderr == "" and "would remove 0 entries and 1 blob" in res.stdout
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gc.py"), "--json"],
        capture_output=True,
        text=True,
        check=False,
        env=dict(os.environ, CUDA_PROGRAM_CAS_DIR=store.root),
    )
    assert res.returncode == 0 and json.loads(res.stdout)["blobs_removed"] == 1
    res = subprocess.run([script, "--help"], capture_output=True, text=True, check=False)
    assert res.returncode == 0
    for command in ("gc", "stats", "verify", "import-filestream"):
        assert command in res.stdout


def test_progress_shows_on_a_terminal_only_for_long_runs() -> None:
    stream = io.StringIO()
    quiet = Progress(True, stream, delay_s=3600)
    quiet("verifying blobs", 1, 10)
    assert stream.getvalue() == ""
    shown = Progress(True, stream, delay_s=0)
    shown("verifying blobs", 5, 10)
    assert "verifying blobs 5/10" in stream.getvalue()
    shown.done()
    assert stream.getvalue().endswith("\r\x1b[K")
    off = Progress(False, stream := io.StringIO(), delay_s=0)
    off("verifying blobs", 5, 10)
    assert stream.getvalue() == ""


@pytest.mark.mount
def test_a_read_only_mount_can_be_inspected_not_collected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not is_root():
        pytest.skip("bind mounts need root")
    store = small_cache(tmp_path / "cas")
    corrupt_one_blob(store)
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", store.root, str(ro)], capture_output=True, check=False).returncode:
        pytest.skip("mount --bind is not available here")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True, check=False).returncode:
            pytest.skip("cannot remount read-only here")
        before = sorted((p, os.lstat(os.path.join(p, f)).st_mtime_ns) for p, _, fs in os.walk(ro) for f in fs)
        for argv in (["gc"], ["gc", "--verify"], ["verify", "--repair"], ["clear"]):
            code, out, err = cli(capsys, *argv, str(ro))
            assert code == 1 and out == ""
            assert "read-only filesystem" in err and err.count("\n") == 1, err
        for argv in (["max-size", "1G"], ["max-size", "none"]):
            code, out, err = cli(capsys, "config", str(ro), *argv)
            assert code == 1 and out == ""
            assert "read-only filesystem" in err and err.count("\n") == 1, err
        code, out, _ = cli(capsys, "stats", str(ro), "--json")
        assert code == 0 and json.loads(out)["entries"] == 6
        code, out, _ = cli(capsys, "verify", str(ro))
        assert code == 1 and "corrupt_blob" in out  # found, not fixable here
        assert cli(capsys, "gc", str(ro), "--dry-run")[0] == 0
        after = sorted((p, os.lstat(os.path.join(p, f)).st_mtime_ns) for p, _, fs in os.walk(ro) for f in fs)
        assert after == before
    finally:
        subprocess.run(["umount", str(ro)], check=False)
