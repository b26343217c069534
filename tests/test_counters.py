"""Lifetime counters: summed over every process, exact, zeroed on demand, safe under kills and crowds.

Processes here are real interpreters. They are synchronised through pipes (a start
byte on stdin, a line on stdout), never through sleeps; each reports through its
exit status.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest

import cuda_program_cas._local.local as local_mod
import cuda_program_cas._store.store as store_mod
from cuda_program_cas import CacheStore, verify
from cuda_program_cas._cli.main import main
from cuda_program_cas._disk.layout import Layout
from cuda_program_cas._local.lifetime import COMPACT_BYTES, FLUSH_INTERVAL_S, NAMES, read_counters

ZERO = dict.fromkeys(NAMES, 0)


def lifetime(root: Path | str, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    """``cuda-program-cas stats --json`` of ``root``."""
    code = main(["stats", str(root), "--json"])
    out = capsys.readouterr().out
    assert code == 0
    info: dict[str, object] = json.loads(out)
    return info


def counters_of(root: Path | str) -> dict[str, int]:
    return read_counters(Layout(str(root))).counters


def spawn(code: str, **kwargs: Any) -> subprocess.Popen[str]:
    """A fresh interpreter running ``code`` with the repository importable."""
    return subprocess.Popen([sys.executable, "-c", code], text=True, **kwargs)


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, f"{out or ''}{err or ''}"


# -- across processes --------------------------------------------------------------------


def test_three_processes_add_exactly_their_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cas"
    with_parent = CacheStore(root)
    with_parent.put("k", b"stored once")
    with_parent.close()
    child = (
        "import sys\nfrom cas import CacheStore\n"
        f"c = CacheStore({str(root)!r})\n"
        "assert all(c.get('k') == b'stored once' for _ in range(5))\n"
        "assert c.get('missing ' + sys.argv[1]) is None and c.get('also missing') is None\n"
    )
    procs = [spawn(child.replace("sys.argv[1]", repr(str(i))), stderr=subprocess.PIPE) for i in range(3)]
    results = [finish(p) for p in procs]
    assert all(code == 0 for code, _ in results), results
    info = lifetime(root, capsys)
    assert info["counters"] == {**ZERO, "hits": 15, "misses": 6, "writes": 1}
    assert info["hit_rate"] == round(15 / 21, 4)
    assert info["counters_zeroed_at"] is None


def test_many_processes_recording_at_once_lose_nothing(tmp_path: Path) -> None:
    root = tmp_path / "cas"
    CacheStore(root).put("k", b"v")
    start_r, start_w = os.pipe()
    rounds, nprocs = 150, 6
    # Each child flushes after every round: six processes fight for the lock and compact the file.
    child = (
        "import os, sys\nfrom cas import CacheStore\n"
        f"c = CacheStore({str(root)!r})\n"
        "if os.read(0, 1) != b'g':\n    sys.exit('the parent gave up before the start')\n"
        f"for i in range({rounds}):\n"
        "    assert c.get('k') == b'v'\n"
        "    if i % 3 == 0:\n        assert c.get('nothing') is None\n"
        "    c.flush()\n"
        "assert c.flush()\n"
    )
    try:
        procs = [spawn(child, stdin=start_r, stderr=subprocess.PIPE) for _ in range(nprocs)]
    finally:
        os.close(start_r)
    os.write(start_w, b"g" * nprocs)
    os.close(start_w)
    results = [finish(p) for p in procs]
    assert all(code == 0 for code, _ in results), results
    life = read_counters(Layout(str(root)))
    assert life.counters == {**ZERO, "hits": nprocs * rounds, "misses": nprocs * 50, "writes": 1}
    assert life.bad_lines == 0
    assert os.path.getsize(root / "counters") <= COMPACT_BYTES + 100  # compacted as it went


def test_a_sigkilled_process_leaves_counters_readable_and_the_cache_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cas"
    CacheStore(root).put("k", b"v")
    # The child writes, reads and flushes in a loop and says how far it has recorded; the
    # parent kills it somewhere in that loop, likely in a flush or a compaction.
    child = (
        "from cuda_program_cas import CacheStore\n"
        f"c = CacheStore({str(root)!r})\n"
        "i = 0\n"
        "while True:\n"
        "    i += 1\n"
        "    c.put(f'key {i}', f'value {i % 7}'.encode())\n"
        "    assert c.get('k') == b'v'\n"
        "    assert c.flush()\n"
        "    print('recorded', i, flush=True)\n"
    )
    proc = spawn(child, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    recorded = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            recorded = int(line.split()[1])
            if recorded >= 300:  # past several compactions
                break
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        code, _ = finish(proc)
    assert code == -signal.SIGKILL and recorded >= 300

    info = lifetime(root, capsys)
    counts = info["counters"]
    assert isinstance(counts, dict)
    # What it had recorded is there (and maybe more: it went on until the kill), and what is
    # there is whole: each round's write and hit, less at most the hit of the round killed.
    assert counts["hits"] >= recorded
    assert counts["writes"] - 1 - counts["hits"] in (0, 1)
    assert counts["misses"] == counts["corrupt"] == counts["errors"] == 0
    report = verify(root)
    assert report.problems == [], report.problems
    # The file takes more counts, exactly, after the kill.
    after = CacheStore(root)
    assert after.get("k") == b"v" and after.get("missing") is None
    after.close()
    assert counters_of(root) == {**counts, "hits": counts["hits"] + 1, "misses": counts["misses"] + 1}


# -- zeroing -------------------------------------------------------------------------------


def test_zero_sets_every_counter_to_zero_and_counting_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cas"
    store = CacheStore(root)
    store.put("k", b"v")
    assert store.get("k") == b"v" and store.get("x") is None
    store.close()
    assert main(["stats", str(root), "--zero", "--json"]) == 0
    zeroed = json.loads(capsys.readouterr().out)
    assert zeroed == {
        "path": str(root),
        "zeroed": True,
        "counters_before": {**ZERO, "hits": 1, "misses": 1, "writes": 1},
        "problems": [],
        "problem_count": 0,
    }
    info = lifetime(root, capsys)
    assert info["counters"] == ZERO and info["hit_rate"] is None
    assert isinstance(info["counters_zeroed_at"], str)
    # The same instance goes on from where it was: only what it counted since its last flush lands.
    assert store.get("k") == b"v"
    store.close()
    assert counters_of(root) == {**ZERO, "hits": 1}
    assert main(["stats", str(root), "--zero"]) == 0
    assert capsys.readouterr().out.startswith(f"zeroed the lifetime counters of {root} (they were: 1 hits, 0 misses")
    assert counters_of(root) == ZERO
    assert main(["stats", str(root)]) == 0
    text = capsys.readouterr().out
    assert "lookups      0: 0 hits" in text and "counted      since " in text


def test_zero_of_something_that_is_not_a_cache_is_bad_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", str(tmp_path / "nothing"), "--zero"]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()


# -- what is never written, and when a flush happens ----------------------------------------------


def listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_read_only_caches_and_shared_stores_are_never_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = tmp_path / "shared"
    writer = CacheStore(shared)
    writer.put("k", b"shared bytes")
    writer.close()
    del writer
    before = listing(shared)
    ro = CacheStore(shared, read_only=True)
    assert ro.get("k") == b"shared bytes" and ro.get("x") is None
    assert ro.flush() and ro.counters()["hits"] == 1  # counted in the instance only
    ro.close()
    del ro
    node = CacheStore(tmp_path / "local", shared=[shared], copy_shared_hits=False)
    assert node.get("k") == b"shared bytes" and node.get("y") is None
    node.close()
    del node
    gc.collect()
    assert listing(shared) == before
    assert counters_of(shared) == {**ZERO, "writes": 1}
    # The shared hit is counted in the local cache's counters.
    assert lifetime(tmp_path / "local", capsys)["counters"] == {**ZERO, "hits": 1, "shared_hits": 1, "misses": 1}


class _Clock:
    """``time.monotonic`` that a test moves on by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_counts_are_flushed_at_most_once_an_interval_on_the_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr(store_mod, "_monotonic", clock)
    monkeypatch.setattr(local_mod, "_monotonic", clock)
    root = tmp_path / "cas"
    store = CacheStore(root)
    store.put("k", b"v")
    for _ in range(100):
        assert store.get("k") == b"v"
    assert not (root / "counters").exists()  # nothing yet: the interval has not passed
    clock.now += FLUSH_INTERVAL_S
    assert store.get("k") == b"v"  # the first lookup after it records everything so far
    assert (root / "counters").read_bytes().count(b"\n") == 1
    assert counters_of(root) == {**ZERO, "hits": 101, "writes": 1}
    for _ in range(10):
        assert store.get("k") == b"v"
    assert (root / "counters").read_bytes().count(b"\n") == 1
    clock.now += FLUSH_INTERVAL_S
    assert store.get("nothing") is None  # a miss flushes too
    assert counters_of(root) == {**ZERO, "hits": 111, "misses": 1, "writes": 1}


def test_a_dropped_instance_records_its_counts_at_once(tmp_path: Path) -> None:
    root = tmp_path / "cas"
    gc.disable()  # the instance goes with its last reference, not with a garbage collection
    try:
        store = CacheStore(root)
        store.put("k", b"v")
        assert store.get("k") == b"v"
        del store
        assert counters_of(root) == {**ZERO, "hits": 1, "writes": 1}
    finally:
        gc.enable()


def test_a_forked_child_records_only_what_it_counted(tmp_path: Path) -> None:
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    root = tmp_path / "cas"
    store = CacheStore(root)
    store.put("k", b"v")
    for _ in range(3):
        assert store.get("k") == b"v"  # counted, not flushed yet
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a process with threads
        pid = os.fork()
    if pid == 0:
        ok = store.get("k") == b"v" and store.get("k") == b"v" and store.flush()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    store.close()
    assert counters_of(root) == {**ZERO, "hits": 5, "writes": 1}


# -- the file ---------------------------------------------------------------------------------


def test_torn_and_damaged_lines_are_ignored_and_the_next_line_stays_whole(tmp_path: Path) -> None:
    root = tmp_path / "cas"
    store = CacheStore(root)
    store.put("k", b"v")
    store.close()
    good = (root / "counters").read_bytes()
    line = good.splitlines()[0]
    flipped = line[:3] + (b"7" if line[3:4] != b"7" else b"8") + line[4:]
    # A torn line (a writer killed mid-append), a flipped digit, garbage, and a well-formed line of a
    # later version's tag: the first three are ignored, the last kept but not summed.
    future = b"c9 1 2 3 "
    future += b"%08x" % zlib.crc32(future.rstrip())
    (root / "counters").write_bytes(good + flipped + b"\n" + b"\x00garbage\n" + future + b"\n" + line[:10])
    life = read_counters(Layout(str(root)))
    assert life.counters == {**ZERO, "writes": 1} and life.bad_lines == 3
    assert store.get("k") == b"v"
    store.close()
    life = read_counters(Layout(str(root)))
    assert life.counters == {**ZERO, "writes": 1, "hits": 1} and life.bad_lines == 3
    # Compaction folds the good lines into one and keeps the later version's line.
    for _ in range(COMPACT_BYTES // len(line) + 1):
        assert store.get("k") == b"v"
        store.flush()
    data = (root / "counters").read_bytes()
    assert len(data) < COMPACT_BYTES and future + b"\n" in data
    life = read_counters(Layout(str(root)))
    assert life.counters["hits"] == 1 + COMPACT_BYTES // len(line) + 1 and life.bad_lines == 0


def test_counter_files_are_own_names_of_the_cache(tmp_path: Path) -> None:
    root = tmp_path / "cas"
    store = CacheStore(root)
    store.put("k", b"v")
    store.close()
    assert {"counters", "counters.lock"} <= {p.name for p in root.iterdir()}
    assert CacheStore(root, read_only=True).get("k") == b"v"
    # Without its layout.json, a directory holding them is still ours (laid out again), not foreign.
    (root / "layout.json").unlink()
    assert CacheStore(root).get("k") == b"v"
    assert counters_of(root) == {**ZERO, "writes": 1, "hits": 1}
