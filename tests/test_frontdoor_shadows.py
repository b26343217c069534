"""The front door checks the names that could shadow a header, not directories; content decides, not inode.

Real NVRTC, real files, real processes. A kernel with ``#include "h.h"`` compiled from
the directory that holds ``h.h`` hits while a job writes and removes other files in
that directory and in its include directory, in one process and in fresh ones; a
header created where NVRTC looks first is a miss that names that path; a header
replaced by an identical copy (``cp h.h t && mv t h.h``), or touched, is a hit, and
its new stat data are written to the record, so that the next process's look is a
stat again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cuda.core import Program, ProgramOptions
from test_frontdoor_sound import write

from cuda_program_cas import ContentAddressedProgramCache, explain
from cuda_program_cas._disk.files import file_id

KERNEL = '#include "h.h"\n#include <g.h>\nextern "C" __global__ void k(int* o) { *o = H + G; }\n'


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``T/work/h.h`` (the working directory: the quoted include's), ``T/inc/g.h``, and a cache in ``T/cas``."""
    write(tmp_path / "work" / "h.h", "#define H 1\n")
    write(tmp_path / "inc" / "g.h", "#define G 2\n")
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path


def _opts(root: Path) -> ProgramOptions:
    return ProgramOptions(arch="sm_80", include_path=[str(root / "inc")])


def _compile(cache: ContentAddressedProgramCache, root: Path) -> bytes:
    return bytes(cache.compile(KERNEL, "c++", _opts(root), "cubin").code)


def _uncached(root: Path) -> bytes:
    return bytes(Program(KERNEL, "c++", options=_opts(root)).compile("cubin").code)


def test_files_of_other_names_created_and_removed_in_every_searched_directory_are_hits(work: Path) -> None:
    want = _uncached(work)
    cache = ContentAddressedProgramCache(work / "cas")
    assert _compile(cache, work) == want
    fresh_hits = 0
    for step, where in enumerate(["work", "inc", "work", "inc"]):
        metrics = work / where / f"metrics-{step}.json"
        write(metrics, "{}")  # what a job writes into its working directory
        assert _compile(cache, work) == want  # the same process
        for change in ("created", "removed"):
            if change == "removed":
                metrics.unlink()
                (work / where / "subdir").mkdir(exist_ok=True)
            fresh = ContentAddressedProgramCache(work / "cas")  # a fresh instance: nothing in memory
            assert _compile(fresh, work) == want
            fresh_hits += fresh.counters()["hits"]
    assert (cache.counters()["hits"], cache.counters()["misses"], fresh_hits) == (4, 1, 8)


@pytest.mark.parametrize("where", ["inc/h.h", "work/g.h"])
def test_a_header_created_where_nvrtc_looks_first_is_a_miss_that_names_its_path(work: Path, where: str) -> None:
    """``work/g.h``: the angled name is looked for in the source's directory too (an over-approximation: sound)."""
    cache = ContentAddressedProgramCache(work / "cas")
    _compile(cache, work)
    write(work / "inc" / "h.h", "#define H 1\n")  # later on the path than work/h.h: never found, a hit
    assert _compile(ContentAddressedProgramCache(work / "cas"), work) == _uncached(work)
    write(work / where, "#define G 7\n" if where.endswith("g.h") else "#define H 7\n")
    if where == "inc/h.h":
        (work / "work" / "h.h").unlink()  # now inc/h.h is found: a miss on the header gone
    fresh = ContentAddressedProgramCache(work / "cas")
    assert _compile(fresh, work) == _uncached(work)
    assert fresh.counters()["misses"] == 1
    (miss,) = explain(str(work / "cas"), last=1).misses
    if where == "work/g.h":
        assert (miss.path, miss.reason) == (
            str(work / where),
            f"{work / where} appeared, where NVRTC looks before a header it read",
        )
    else:
        assert miss.path == str(work / "work" / "h.h")


def test_a_shadowing_header_is_seen_by_the_watch_and_other_names_are_not(work: Path) -> None:
    """Watched hits: an event for another name in a watched directory leaves the variant clean."""
    cache = ContentAddressedProgramCache(work / "cas")
    for _ in range(4):  # a miss, a first look, an armed look, a watched one
        _compile(cache, work)
    door = cache._front_door
    watched = door.watched_hits
    assert watched >= 1, "the variant was never watched: this test proves nothing here"
    (work / "work" / "metrics.json").write_text("{}")
    (work / "inc" / "other.h").write_text("")
    _compile(cache, work)
    assert door.watched_hits == watched + 1  # the events named no candidate
    (work / "inc" / "h.h").write_text("#define H 9\n")  # a candidate? no: h.h is found in work first
    _compile(cache, work)
    assert door.watched_hits == watched + 2
    (work / "work" / "g.h").write_text("#define G 9\n")  # a candidate: the watch says dirty, the check misses
    assert _compile(cache, work) == _uncached(work)
    assert door.watched_hits == watched + 2
    assert cache.counters()["misses"] == 2


def _cp_mv(path: Path) -> None:
    staged = path.with_name(path.name + ".tmp")
    shutil.copyfile(path, staged)
    os.replace(staged, path)


def _record_tags(root: Path) -> set[str]:
    """Every header stat tag the front-door records under ``root/cas`` hold (read as JSON, whatever their version)."""
    tags = set()
    for path in (root / "cas").rglob("*"):
        if path.is_file() and path.read_bytes().startswith(b'{"v":'):
            for variant in json.loads(path.read_bytes())["variants"]:
                tags.update(entry[1] for entries in variant["headers"].values() for entry in entries)
    return tags


@pytest.mark.parametrize("how", ["copy renamed over", "touch", "rewritten in place"])
def test_a_header_with_new_stat_data_and_the_same_bytes_is_a_hit_and_its_stat_is_recorded(work: Path, how: str) -> None:
    from cuda_program_cas._cuda.record import stat_tag

    header = work / "work" / "h.h"
    want = _uncached(work)
    _compile(ContentAddressedProgramCache(work / "cas"), work)
    {"copy renamed over": _cp_mv, "touch": os.utime, "rewritten in place": lambda p: p.write_bytes(p.read_bytes())}[
        how
    ](header)
    write(work / "clock" / "probe", "")  # the clock past the header's new ctime: its stat data are old
    new_tag = stat_tag(file_id(os.stat(header)))
    assert new_tag not in _record_tags(work)
    fresh = ContentAddressedProgramCache(work / "cas")
    assert _compile(fresh, work) == want
    assert fresh.counters()["hits"] == 1
    assert new_tag in _record_tags(work)  # the next process's look is a stat again
    again = ContentAddressedProgramCache(work / "cas")
    assert _compile(again, work) == want and again.counters()["hits"] == 1


def test_through_the_switch_a_job_writing_into_its_working_directory_hits_from_its_second_run(work: Path) -> None:
    job = (
        "import sys, time\n"
        "from cuda.core import Program, ProgramOptions\n"
        "opts = ProgramOptions(arch='sm_80', include_path=[sys.argv[1]])\n"
        f"Program({KERNEL!r}, 'c++', options=opts).compile('cubin')\n"
        "open(f'metrics-{time.time_ns()}.json', 'w').write('{}')\n"
    )
    env = {**os.environ, "CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(work / "sw")}
    for _ in range(4):
        subprocess.run([sys.executable, "-c", job, str(work / "inc")], env=env, check=True, timeout=300)
    misses = explain(str(work / "sw"), last=10).misses
    assert len(misses) == 1, misses  # the first run's miss only: three hits
