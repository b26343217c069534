"""Time saved: an entry records its compile time; a hit, in another process, adds it to the lifetime counters."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import read_only

from cuda_program_cas import CacheStore, stats
from cuda_program_cas.index import key_id

#: Compiles (or hits) a kernel through Program.compile(cache=) and prints its key id.
_JOB = textwrap.dedent(
    """
    import sys
    from cuda.core import Program, ProgramOptions
    from cuda.core.utils import make_program_cache_key
    from cuda_program_cas import ContentAddressedProgramCache
    from cuda_program_cas.index import key_id

    src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }'
    opts = ProgramOptions(arch="sm_80")
    with ContentAddressedProgramCache(sys.argv[1]) as cache:
        for _ in range(int(sys.argv[2])):
            Program(src, "c++", options=opts).compile("cubin", cache=cache)
        counts = cache.counters()
    print(key_id(make_program_cache_key(code=src, code_type="c++", options=opts, target_type="cubin")))
    print(counts["hits"], counts["misses"])
    """
)


def _job(root: Path, times: int) -> tuple[str, list[int]]:
    out = subprocess.run(
        [sys.executable, "-c", _JOB, str(root), str(times)], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split("\n")
    return out[0], [int(v) for v in out[1].split()]


def test_a_second_process_hits_and_its_stats_show_the_first_ones_compile_time_saved(tmp_path: Path) -> None:
    root = tmp_path / "c"
    kid, (hits, misses) = _job(root, 1)  # compiles and stores
    assert (hits, misses) == (0, 1)
    recorded = CacheStore(root, read_only=True).compile_seconds(kid)
    assert recorded is not None and 0.001 < recorded < 60
    assert stats(root).time_saved_s == 0.0
    _, (hits, misses) = _job(root, 3)  # another process: three hits
    assert (hits, misses) == (3, 0)
    report = stats(root)
    assert report.counters is not None
    assert report.counters["saved_us"] == 3 * round(recorded * 1e6)
    assert report.time_saved_s is not None and abs(report.time_saved_s - 3 * recorded) < 0.002
    assert report.busiest == [
        {"key": kid[:16], "hits": 3, "saved_s": round(3 * recorded, 3), "compile_s": round(recorded, 3)}
    ]
    text = subprocess.run(
        [sys.executable, "-m", "cuda_program_cas", "stats", str(root)], capture_output=True, text=True, check=True
    ).stdout
    # the CLI prints the report's figure (rounded to ms), so compare with that, not with 3 * recorded
    assert f"{report.time_saved_s:,.2f} s of compiling; most by {kid[:16]}" in text
    as_json = json.loads(
        subprocess.run(
            [sys.executable, "-m", "cuda_program_cas", "stats", str(root), "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert as_json["busiest"][0]["hits"] == 3


def test_hits_of_an_entry_without_a_recorded_compile_time_save_nothing_countable(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "c")
    store.put(b"k", b"bytes put by hand: no compile")
    assert store.get(b"k") is not None
    assert store.compile_seconds(key_id(b"k")) is None
    store.close()
    report = stats(tmp_path / "c")
    assert report.counters is not None and report.counters["hits"] == 1
    assert report.counters["saved_us"] == 0 and report.busiest == []


def test_the_ledger_folds_when_it_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda_program_cas._local import usage

    lay = CacheStore(tmp_path / "c").inner.layout
    monkeypatch.setattr(usage, "COMPACT_BYTES", 2000)
    for i in range(200):
        usage.record_compile(lay, f"{i:016x}" + "0" * 48, 0.5)
    for _ in range(50):
        usage.record_hits(lay, {f"{7:016x}" + "0" * 48: 2})
    read = usage.read_usage(lay)
    assert len(read.compile_us) == 200 and read.compile_us[7] == 500_000
    assert read.saved[7] == (100, 100 * 500_000)
    assert Path(lay.usage).stat().st_size < 200 * 60 + 50 * 60


def test_hits_on_both_sides_of_a_flush_each_save_the_compile_time(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "c")
    store.put(b"k", b"a binary")
    store.inner.note_compiled(key_id(b"k"), 0.25, "plain", {"code": "c"})
    assert store.compile_seconds(key_id(b"k")) == 0.25
    assert store.get(b"k") is not None
    assert store.flush()
    assert store.counters()["saved_us"] == 250_000
    assert store.get(b"k") is not None and store.get(b"k") is not None
    store.close()
    report = stats(tmp_path / "c")
    assert report.counters is not None and report.counters["saved_us"] == 750_000
    assert report.busiest == [{"key": key_id(b"k")[:16], "hits": 3, "saved_s": 0.75, "compile_s": 0.25}]


def test_a_read_only_cache_records_no_compile_time_and_no_saved_time(tmp_path: Path) -> None:
    CacheStore(tmp_path / "c").put(b"k", b"a binary")
    reader = CacheStore(tmp_path / "c", read_only=True)
    reader.inner.note_compiled(key_id(b"k"), 1.0, "plain", {})
    assert reader.compile_seconds(key_id(b"k")) is None
    assert not (tmp_path / "c" / "usage").exists() and not (tmp_path / "c" / "misses").exists()


@pytest.mark.mount
def test_hits_appended_before_a_failed_fold_are_not_appended_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ledger's fold runs after the append, under the same lock. If it fails, the hits are in
    # the ledger already: putting them back for the next flush would count them twice.
    from cuda_program_cas._local import usage

    store = CacheStore(tmp_path / "c")
    store.put(b"k", b"a binary")
    store.inner.note_compiled(key_id(b"k"), 0.25, "plain", {"code": "c"})
    lay = store.inner.layout
    monkeypatch.setattr(usage, "COMPACT_BYTES", 1)  # every append is followed by a fold
    assert store.get(b"k") is not None
    with read_only(Path(lay.tmp)):  # the fold's atomic write stages there: EROFS; the append is beside it
        store.flush()
        store.flush()
    store.close()
    assert usage.read_usage(lay).saved[usage.key_number(key_id(b"k"))] == (1, 250_000)
