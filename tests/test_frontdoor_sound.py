"""The front door never serves a binary built from other header bytes (issue 20's findings).

Each test compiles through ``cache.compile`` and compares against an uncached
``Program.compile`` of the files as they are at that moment, with real NVRTC.
Relative names are resolved against the working directory, so these tests chdir
into the tree they build (``monkeypatch.chdir`` restores it).
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path

import pytest
from conftest import NVRTC_RECORD, Compiles, cccl_or_skip
from cuda.core import Program, ProgramOptions
from test_frontdoor import CUB_SOURCE, settle

from cuda_program_cas import CacheStore, ContentAddressedProgramCache, collect
from cuda_program_cas.index import group_of, is_record

KERNEL = r"""
#include "val.h"
extern "C" __global__ void k(int *out) { *out = VAL; }
"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    settle(path)


def uncached(code: str, opts: ProgramOptions) -> bytes:
    return bytes(Program(code, "c++", options=opts).compile("cubin").code)


def cached(cache: ContentAddressedProgramCache, code: str, opts: ProgramOptions) -> bytes:
    return bytes(cache.compile(code, "c++", opts, "cubin").code)


# The spellings of finding 1: each finds val.h through a name relative to the working directory.
SPELLINGS = {
    "relative include dir": ("proj", "proj/hdr/val.h", {"include_path": ["hdr"]}),
    "dot include dir": ("proj", "proj/hdr/val.h", {"include_path": ["./hdr"]}),
    "dot-dot include dir": ("proj/build", "proj/hdr/val.h", {"include_path": ["../hdr"]}),
    "header in the working directory": ("proj", "proj/val.h", {}),
    "header next to a relative source name": ("proj", "proj/src/val.h", {"name": "src/kernel.cu"}),
    "relative pre_include": ("proj", "proj/hdr/val.h", {"include_path": ["hdr"], "pre_include": "hdr/val.h"}),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_an_edited_header_found_through_a_relative_name_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiles: Compiles, spelling: str
) -> None:
    cwd, header, extra = SPELLINGS[spelling]
    (tmp_path / cwd).mkdir(parents=True, exist_ok=True)
    write(tmp_path / header, "#define VAL 1\n")
    monkeypatch.chdir(tmp_path / cwd)
    opts = ProgramOptions(arch="sm_80", **extra)
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    first = cached(cache, KERNEL, opts)
    assert first == uncached(KERNEL, opts)
    assert cached(cache, KERNEL, opts) == first  # a hit
    count = compiles.count
    write(tmp_path / header, "#define VAL 2\n")
    edited = cached(cache, KERNEL, opts)
    assert edited == uncached(KERNEL, opts) != first
    assert compiles.count == count + 2  # the miss and the reference
    assert cached(ContentAddressedProgramCache(tmp_path / "cas"), KERNEL, opts) == edited


def test_two_projects_with_the_same_relative_paths_get_their_own_binaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiles: Compiles
) -> None:
    write(tmp_path / "projA" / "include" / "val.h", "#define VAL 1\n")
    write(tmp_path / "projB" / "include" / "val.h", "#define VAL 2\n")
    opts = ProgramOptions(arch="sm_80", include_path=["include"])
    cache = ContentAddressedProgramCache(tmp_path / "cas")  # one cache, as the default per-user one
    monkeypatch.chdir(tmp_path / "projA")
    a = cached(cache, KERNEL, opts)
    assert a == uncached(KERNEL, opts)
    monkeypatch.chdir(tmp_path / "projB")
    b = cached(cache, KERNEL, opts)
    assert b == uncached(KERNEL, opts) != a
    monkeypatch.chdir(tmp_path / "projA")
    count = compiles.count
    assert cached(ContentAddressedProgramCache(tmp_path / "cas"), KERNEL, opts) == a  # each keeps its own
    assert compiles.count == count


def test_a_symlinked_include_directory_that_now_points_elsewhere_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "v1" / "val.h", "#define VAL 1\n")
    write(tmp_path / "v2" / "val.h", "#define VAL 2\n")
    (tmp_path / "current").symlink_to("v1")
    opts = ProgramOptions(arch="sm_80", include_path=[str(tmp_path / "current")])
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    first = cached(cache, KERNEL, opts)
    (tmp_path / "next").symlink_to("v2")
    os.replace(tmp_path / "next", tmp_path / "current")  # the link moves, atomically
    assert cached(cache, KERNEL, opts) == uncached(KERNEL, opts) != first


def test_a_symlink_followed_by_dot_dot_resolves_as_the_kernel_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # proj/link -> elsewhere/deep; "link/../val.h" is elsewhere/val.h to the kernel, proj/val.h to normpath.
    write(tmp_path / "proj" / "val.h", "#define VAL 1\n")
    write(tmp_path / "elsewhere" / "val.h", "#define VAL 2\n")
    (tmp_path / "elsewhere" / "deep").mkdir()
    (tmp_path / "proj" / "link").symlink_to(tmp_path / "elsewhere" / "deep")
    monkeypatch.chdir(tmp_path / "proj")
    code = KERNEL.replace('"val.h"', '"link/../val.h"')
    opts = ProgramOptions(arch="sm_80")
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    assert cached(cache, code, opts) == uncached(code, opts)
    write(tmp_path / "elsewhere" / "val.h", "#define VAL 3\n")
    assert cached(cache, code, opts) == uncached(code, opts)


def test_a_new_header_in_the_working_directory_is_found_first_and_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A quoted include is looked for next to the source (the working directory) before include_path.
    write(tmp_path / "inc" / "val.h", "#define VAL 1\n")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    opts = ProgramOptions(arch="sm_80", include_path=[str(tmp_path / "inc")])
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    first = cached(cache, KERNEL, opts)
    write(tmp_path / "work" / "val.h", "#define VAL 5\n")
    assert cached(cache, KERNEL, opts) == uncached(KERNEL, opts) != first


def test_angled_includes_through_absolute_directories_do_not_depend_on_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiles: Compiles
) -> None:
    # The common case of libraries (CCCL through an absolute path): shared across directories.
    write(tmp_path / "inc" / "val.h", "#define VAL 1\n")
    code = KERNEL.replace('"val.h"', "<val.h>")
    opts = ProgramOptions(arch="sm_80", include_path=[str(tmp_path / "inc")])
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    first = cached(cache, code, opts)
    monkeypatch.chdir(tmp_path / "b")
    (tmp_path / "b" / "val.h").write_text("#define VAL 9\n")  # not searched for <val.h>
    count = compiles.count
    assert cached(cache, code, opts) == first == uncached(code, opts)
    assert compiles.count == count + 1  # the reference only


def test_debug_information_names_the_working_directory_so_it_is_keyed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiles: Compiles
) -> None:
    # Line tables name the compile's directory (and cuda-core writes the source of a debug
    # compile to a temp file, so two uncached compiles differ): each directory gets its own entry.
    code = 'extern "C" __global__ void k(int *o) { *o = 1; }'
    opts = ProgramOptions(arch="sm_80", lineinfo=True)
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        monkeypatch.chdir(tmp_path / d)
        cached(cache, code, opts)
        assert compiles.count == 1 + (d == "b")
        cached(cache, code, opts)
        assert compiles.count == 1 + (d == "b")
    assert cache.stats().entries == 4 + NVRTC_RECORD  # a record and a result for each directory


#: For the scripts below: the entries the front door stored for the compile (its records and
#: results), less node-local ones (NVRTC's version, remembered by a process that loaded it).
_KEYED_ENTRIES = r"""
def keyed_entries(root):
    from cuda_program_cas.index import is_local_id
    return sum(1 for p in (root / "index").rglob("*") if p.is_file() and not is_local_id(p.parent.name + p.name))
"""

_GONE_BEFORE_RECORDED = r"""
import json, logging, sys
from pathlib import Path
from cuda.core import Program, ProgramOptions
from cuda_program_cas import ContentAddressedProgramCache

tmp = Path(sys.argv[1])
header = tmp / "inc" / "val.h"
header.parent.mkdir()
kernel = '#include "val.h"\\nextern "C" __global__ void k(int *out) { *out = VAL; }\\n'
text = '#define VAL 1\\n#warning "a log line"\\n'


class RemovesWhenLogged:
    # A logs sink: NVRTC's log arrives after NVRTC read the header, before it is recorded.
    def write(self, line):
        if header.exists():
            header.unlink()
        return len(line)


warnings = []
handler = logging.Handler()
handler.emit = lambda record: warnings.append(record.getMessage()) if record.levelno >= logging.WARNING else None
logging.getLogger("cuda_program_cas").addHandler(handler)
opts = ProgramOptions(arch="sm_80", include_path=[str(tmp / "inc")])
cache = ContentAddressedProgramCache(tmp / "cas")
same = []
for _ in range(2):
    header.write_text(text)
    got = bytes(cache.compile(kernel, "c++", opts, "cubin", logs=RemovesWhenLogged()).code)
    header.write_text(text)
    same.append(got == bytes(Program(kernel, "c++", options=opts).compile("cubin").code))
counts = cache.counters()
print(json.dumps({"same": same, "warned": [w for w in warnings if str(header) in w],
                  "dropped": counts["dropped_writes"], "misses": counts["misses"],
                  "entries": keyed_entries(tmp / "cas")}))
"""


def test_a_header_gone_before_it_is_recorded_is_not_cached_and_warned_once(tmp_path: Path) -> None:
    # In a process of its own: NVRTC's traces there are whole (see the test after a failed compile).
    import json

    from conftest import run_python

    done = run_python(_KEYED_ENTRIES + _GONE_BEFORE_RECORDED, str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["same"] == [True, True]
    assert len(report["warned"]) == 1  # one WARNING per process, naming the header
    assert (report["dropped"], report["misses"], report["entries"]) == (2, 2, 0)


def test_a_removed_working_directory_compiles_uncached_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    code = 'extern "C" __global__ void k(int *o) { *o = 1; } // #include "nothing.h" in a comment'
    opts = ProgramOptions(arch="sm_80")
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    (tmp_path / "gone").mkdir()
    monkeypatch.chdir(tmp_path / "gone")
    (tmp_path / "gone").rmdir()
    with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
        for _ in range(2):
            assert bytes(cache.compile(code, "c++", opts, "cubin").code) == uncached(code, opts)
    assert len([r for r in caplog.records if "working directory" in r.getMessage()]) == 1
    assert cache.counters()["dropped_writes"] == 2
    assert cache.stats().entries == 0


def test_one_compile_counts_one_hit_or_one_miss_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda_program_cas._local.lifetime import read_counters

    write(tmp_path / "inc" / "val.h", "#define VAL 1\n")
    opts = ProgramOptions(arch="sm_80", include_path=[str(tmp_path / "inc")])
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    cached(cache, KERNEL, opts)
    assert (cache.counters()["hits"], cache.counters()["misses"]) == (0, 1)
    header = tmp_path / "inc" / "val.h"
    header.write_bytes(header.read_bytes())  # touched: same bytes
    os.utime(header, ns=(1, 1))
    fresh = ContentAddressedProgramCache(tmp_path / "cas")
    cached(fresh, KERNEL, opts)
    assert (fresh.counters()["hits"], fresh.counters()["misses"]) == (1, 0)
    cache.close()
    fresh.close()
    lifetime = read_counters(CacheStore(tmp_path / "cas").inner.layout)
    assert (lifetime.counters["hits"], lifetime.counters["misses"]) == (1, 1)


def test_a_miss_says_which_header_changed_or_that_the_inputs_are_new(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path / "inc" / "val.h", "#define VAL 1\n")
    opts = ProgramOptions(arch="sm_80", include_path=[str(tmp_path / "inc")])
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    with caplog.at_level(logging.DEBUG, logger="cuda_program_cas"):
        cached(cache, KERNEL, opts)
        write(tmp_path / "inc" / "val.h", "#define VAL 2\n")
        cached(cache, KERNEL, opts)
    misses = [r.cas_reason for r in caplog.records if getattr(r, "cas_event", None) == "miss"]
    assert len(misses) == 2
    assert "new inputs" in misses[0]
    assert f"header {tmp_path / 'inc' / 'val.h'} changed" in misses[1]


def _groups_whole(root: Path) -> int:
    """The front-door groups in the cache at ``root``; asserts each has its record and at least one result."""
    groups: dict[str, set[str]] = {}
    for shard in (root / "index").iterdir():
        for f in shard.iterdir():
            kid = shard.name + f.name
            group = group_of(kid)
            if group is not None:
                groups.setdefault(group, set()).add("record" if is_record(kid) else "result")
    for members in groups.values():
        assert members == {"record", "result"}, members
    return len(groups)


def _some_front_door_entries(tmp_path: Path, cache: ContentAddressedProgramCache, n: int) -> None:
    opts = ProgramOptions(arch="sm_80", include_path=[str(tmp_path / "inc")])
    for i in range(n):
        write(tmp_path / "inc" / "val.h", f"#define VAL {i}\n")  # a variant each: results under one record
        cached(cache, KERNEL.replace("k(", f"k{i % 3}("), opts)


def test_gc_max_size_and_max_age_keep_records_and_results_together(tmp_path: Path) -> None:
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    _some_front_door_entries(tmp_path, cache, 9)
    cache.close()
    before = _groups_whole(tmp_path / "cas")
    assert before == 3
    size = CacheStore(tmp_path / "cas").stats().stored_bytes
    report = collect(tmp_path / "cas", max_size=size // 2)
    assert report.entries_removed > 0
    after = _groups_whole(tmp_path / "cas")
    assert 0 < after < before
    report = collect(tmp_path / "cas", max_age_s=0.0)
    assert _groups_whole(tmp_path / "cas") == 0


def test_the_cap_evicts_records_and_results_together(tmp_path: Path) -> None:
    cache = ContentAddressedProgramCache(tmp_path / "cas", max_size_bytes=40_000)
    _some_front_door_entries(tmp_path, cache, 12)
    cache.close()
    records = _groups_whole(tmp_path / "cas")
    assert records >= 1
    assert CacheStore(tmp_path / "cas").stats().stored_bytes <= 40_000


def test_a_damaged_result_takes_its_record_with_it(tmp_path: Path) -> None:
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    _some_front_door_entries(tmp_path, cache, 1)
    cache.close()
    for blob in (tmp_path / "cas" / "blobs").rglob("*"):
        if blob.is_file() and not blob.read_bytes().startswith(b"{"):
            blob.unlink()  # the result's binary: its manifest now dangles
    report = collect(tmp_path / "cas")
    assert report.plan["partner_entries"]["count"] == 1  # the record, unreachable without its result
    assert _groups_whole(tmp_path / "cas") == 0


def test_a_variant_pushed_out_of_its_record_takes_its_result_with_it(tmp_path: Path) -> None:
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    opts = ProgramOptions(arch="sm_80", include_path=[str(tmp_path / "inc")])
    for i in range(6):  # six variants of one record, which keeps four
        write(tmp_path / "inc" / "val.h", f"#define VAL {i}\n")
        cached(cache, KERNEL, opts)
    assert cache.stats().entries == 1 + 4 + NVRTC_RECORD


@pytest.mark.slow
def test_a_cub_record_is_small_against_its_binary(tmp_path: Path) -> None:
    inc = cccl_or_skip()
    opts = ProgramOptions(arch="sm_80", std="c++17", include_path=[inc])
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    binary = cached(cache, CUB_SOURCE, opts)
    stats = cache.stats()
    record_bytes = stats.blob_bytes - len(binary)
    assert stats.entries == 2 + NVRTC_RECORD
    assert record_bytes < len(binary) / 2, (record_bytes, len(binary))


def test_bundled_headers_edited_by_hand_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # NVRTC's up-to-date check of its installed headers reads only their version file, so a hand
    # edit stays, and NVRTC compiles it: the front door must see it.
    from cuda.bindings import nvrtc

    if "use_bundled_headers" not in inspect.signature(ProgramOptions).parameters:
        pytest.skip("this cuda-core's ProgramOptions has no use_bundled_headers (added in cuda-core 1.2)")
    # cuda-core refuses the option itself (a RuntimeError from ProgramOptions) below NVRTC 13.3.
    _err, major, minor = nvrtc.nvrtcVersion()
    if (major, minor) < (13, 3):
        pytest.skip(f"use_bundled_headers needs NVRTC >= 13.3; this one is {major}.{minor}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # NVRTC installs its headers here
    code = (
        "#include <cuda/std/cstdint>\n#ifdef CPCAS_EDITED\n#define VAL 7\n#else\n#define VAL 8\n#endif\n"
        'extern "C" __global__ void k(int *out) { *out = VAL; }\n'
    )
    opts = ProgramOptions(arch="sm_80", use_bundled_headers=True)
    reference = uncached(code, opts)
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    assert cached(cache, code, opts) == reference
    headers = list((tmp_path / "xdg").rglob("cstdint"))
    assert headers, "NVRTC did not install its headers under XDG_CACHE_HOME"
    header = headers[0]
    write(header, header.read_text() + "\n#define CPCAS_EDITED 1\n")
    edited = uncached(code, opts)
    assert edited != reference
    assert cached(cache, code, opts) == edited
    assert cached(ContentAddressedProgramCache(tmp_path / "cas"), code, opts) == edited


def test_stats_counts_front_door_records_as_what_they_are(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    cache = ContentAddressedProgramCache(tmp_path / "cas")
    _some_front_door_entries(tmp_path, cache, 2)  # two kernels: two records, two binaries
    cache.close()
    out = subprocess.run(
        [sys.executable, "-m", "cuda_program_cas", "stats", str(tmp_path / "cas"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    info = json.loads(out)
    assert info["front_door_records"] == 2 and info["entries"] == 4 + NVRTC_RECORD
    assert 0 < info["front_door_record_bytes"] < info["blob_bytes"]


def test_gc_of_a_packed_store_keeps_records_and_results_together(tmp_path: Path) -> None:
    from cuda_program_cas import publish
    from cuda_program_cas._disk.pack import PackReader
    from cuda_program_cas._disk.packset import list_packs

    cache = ContentAddressedProgramCache(tmp_path / "cas")
    _some_front_door_entries(tmp_path, cache, 9)  # three records of three variants each
    cache.close()
    publish([tmp_path / "cas"], tmp_path / "store", pack=True)

    def packed_groups() -> dict[str, set[str]]:
        groups: dict[str, set[str]] = {}
        for path in list_packs(str(tmp_path / "store" / "packs")):
            reader = PackReader(path)
            try:
                for entry in reader.entries():
                    group = group_of(entry.key_id)
                    if group is not None:
                        kind = "record" if is_record(entry.key_id) else "result"
                        groups.setdefault(group, set()).add(kind)
            finally:
                reader.close()
        return groups

    assert len(packed_groups()) == 3
    size = sum(os.path.getsize(p) for p in list_packs(str(tmp_path / "store" / "packs")))
    report = collect(tmp_path / "store", max_size=size // 2, grace_s=86400)
    assert report.packs["entries_dropped"] > 0
    after = packed_groups()
    assert 0 < len(after) < 3
    assert all(kinds == {"record", "result"} for kinds in after.values()), after


def test_a_trace_that_lost_its_beginning_is_not_trusted(tmp_path: Path) -> None:
    # NVRTC always reads its builtin header first; a trace without it lost the headers read
    # in its first milliseconds (NVRTC 13.5 was seen doing so in long-running processes).
    import json

    from cuda_program_cas._cuda.trace import traced_names

    write(tmp_path / "inc" / "val.h", "#define VAL 1\n")
    trace = tmp_path / "t"
    opts = ProgramOptions(arch="sm_80", include_path=[str(tmp_path / "inc")], fdevice_time_trace=str(trace))
    Program(KERNEL, "c++", options=opts).compile("cubin")
    whole = tmp_path / "t.json"
    names = traced_names(str(whole))
    assert names is not None and str(tmp_path / "inc" / "val.h") in names
    data = json.loads(whole.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    cut = [e for e in events if not (isinstance(e, dict) and "__nv_nvrtc" in str(e.get("args")))]
    assert len(cut) == len(events) - 1
    cut_path = tmp_path / "cut.json"
    cut_path.write_text(json.dumps({**data, "traceEvents": cut} if isinstance(data, dict) else cut))
    assert traced_names(str(cut_path)) is None


def test_a_hit_keeps_the_name_of_its_own_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two spellings of one source name compile to the same bytes; each ObjectCode keeps its own name.
    write(tmp_path / "proj" / "src" / "val.h", "#define VAL 1\n")
    monkeypatch.chdir(tmp_path / "proj")
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    for name in ("src/kernel.cu", "../proj/src/kernel.cu", "src/kernel.cu"):
        opts = ProgramOptions(arch="sm_80", name=name)
        obj = cache.compile(KERNEL, "c++", opts, "cubin")
        assert obj.name == Program(KERNEL, "c++", options=opts).compile("cubin").name == name


_AFTER_A_FAILED_COMPILE = r"""
import json, os, sys
from pathlib import Path
from cuda.core import Program, ProgramOptions
from cuda_program_cas import ContentAddressedProgramCache

tmp = Path(sys.argv[1])
(tmp / "inc").mkdir()
(tmp / "inc" / "a.h").write_text('#include "gone.h"\n')
(tmp / "inc" / "val.h").write_text("#define VAL 1\n")
opts = ProgramOptions(arch="sm_80", include_path=[str(tmp / "inc")])
cache = ContentAddressedProgramCache(tmp / "cas")
try:  # a traced compile that fails inside an include: NVRTC's later traces lose their beginning
    cache.compile('#include "a.h"\n', "c++", opts, "cubin")
    sys.exit("the compile should have failed")
except Exception:
    pass
work = tmp / "work"
work.mkdir()
os.chdir(work)  # NVRTC left tracing on would now write .json here
Program('extern "C" __global__ void k2() {}', "c++", options=ProgramOptions(arch="sm_80")).compile("cubin")
littered = os.listdir(work)
probe = tmp / "probe"
Program('#include "val.h"\n', "c++", options=ProgramOptions(arch="sm_80", include_path=[str(tmp / "inc")],
        fdevice_time_trace=str(probe))).compile("cubin")
poisoned = "__nv_nvrtc_builtin_header.h" not in (probe.with_suffix(".json")).read_text()
kernel = '#include "val.h"\nextern "C" __global__ void k(int *o) { *o = VAL; }\n'
first = bytes(cache.compile(kernel, "c++", opts, "cubin").code)
stored = keyed_entries(tmp / "cas")
(tmp / "inc" / "val.h").write_text("#define VAL 2\n")
changed = (tmp / "inc" / "val.h").stat().st_ctime_ns
while (tmp / "clock").write_bytes(b"") is not None and (tmp / "clock").stat().st_mtime_ns <= changed:
    pass  # the file system's clock past the edit, as a person editing lets it be
edited = bytes(cache.compile(kernel, "c++", opts, "cubin").code)
reference = bytes(Program(kernel, "c++", options=opts).compile("cubin").code)
hit = ContentAddressedProgramCache(tmp / "cas")
again = bytes(hit.compile(kernel, "c++", opts, "cubin").code)
print(json.dumps({"poisoned": poisoned, "littered": littered, "stored": stored,
                  "edited_ok": edited == reference != first, "hit": hit.counters()["hits"],
                  "again_ok": again == reference}))
"""


def test_after_a_failed_traced_compile_misses_are_traced_in_a_child_and_still_cached(tmp_path: Path) -> None:
    import json

    from conftest import run_python

    done = run_python(_KEYED_ENTRIES + _AFTER_A_FAILED_COMPILE, str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["poisoned"], "NVRTC no longer loses trace events after a failed compile: the fallback is untested"
    assert report == {"poisoned": True, "littered": [], "stored": 2, "edited_ok": True, "hit": 1, "again_ok": True}


def _rewrite_records(root: Path, change) -> int:
    """Rewrites each front-door record at ``root`` through the store, its variants passed through ``change``."""
    import json

    store = CacheStore(root)
    done = 0
    for shard in (root / "index").iterdir():
        for f in shard.iterdir():
            kid = shard.name + f.name
            if not is_record(kid):
                continue
            raw, _shared = store.inner.find(kid)
            data = json.loads(raw)
            data["variants"] = [change(v) for v in data["variants"]]
            store.inner.put_id(kid, json.dumps(data, separators=(",", ":")).encode())
            done += 1
    store.close()
    return done


def test_a_variant_is_proven_by_one_tag_of_its_stat_data_which_misses_nothing(
    tmp_path: Path, compiles: Compiles
) -> None:
    # A fresh process compares the recorded proof of every header's and guard's stat data
    # first; each change below alters the stat data of one file or directory, and a fresh
    # cache (nothing known in the process) must return what NVRTC makes of the tree now.
    inc, early = tmp_path / "inc", tmp_path / "early"
    early.mkdir()
    write(inc / "val.h", "#define VAL 1\n")
    write(inc / "sub" / "more.h", "#define MORE 10\n")
    code = '#include "val.h"\n#include "sub/more.h"\nextern "C" __global__ void k(int *o) { *o = VAL + MORE; }\n'
    opts = ProgramOptions(arch="sm_80", include_path=[str(early), str(inc)])
    first = cached(ContentAddressedProgramCache(tmp_path / "cas"), code, opts)
    assert _rewrite_records(tmp_path / "cas", lambda v: v) == 1  # rewritten as it was: the record is one
    kept = []
    _rewrite_records(tmp_path / "cas", lambda v: kept.append(v["proof"]) or v)
    assert kept and all(isinstance(p, str) and len(p) == 32 for p in kept)

    def fresh() -> bytes:
        got = cached(ContentAddressedProgramCache(tmp_path / "cas"), code, opts)
        assert got == uncached(code, opts)
        return got

    count = compiles.count
    assert fresh() == first and compiles.count == count + 1  # a hit (the reference compiled)
    # In place, same size, mtime put back: only the ctime tells.
    st = (inc / "val.h").stat()
    with open(inc / "val.h", "r+b") as fh:
        fh.write(b"#define VAL 2\n")
    os.utime(inc / "val.h", ns=(st.st_atime_ns, st.st_mtime_ns))
    settle(inc / "val.h")
    second = fresh()
    assert second != first
    # A header that would now be found first, in an earlier search directory (a guard).
    write(early / "sub" / "more.h", "#define MORE 20\n")
    third = fresh()
    assert third not in (first, second)
    # Touched, same bytes: the proof differs, the per-file check hashes it and hits (no
    # settle here: its probe file would change the header's directory, a guard).
    count = compiles.count
    os.utime(inc / "val.h")
    assert fresh() == third and compiles.count == count + 1


def test_a_record_without_a_proof_or_with_a_wrong_one_is_checked_file_by_file(
    tmp_path: Path, compiles: Compiles
) -> None:
    write(tmp_path / "inc" / "val.h", "#define VAL 1\n")
    opts = ProgramOptions(arch="sm_80", include_path=[str(tmp_path / "inc")])
    first = cached(ContentAddressedProgramCache(tmp_path / "cas"), KERNEL, opts)

    def without(v: dict) -> dict:
        v.pop("proof")
        return v

    for change in (without, lambda v: {**v, "proof": "0" * 32}, lambda v: {**v, "proof": 7}):
        assert _rewrite_records(tmp_path / "cas", change) == 1
        count = compiles.count
        assert cached(ContentAddressedProgramCache(tmp_path / "cas"), KERNEL, opts) == first
        assert compiles.count == count  # a hit: a record written before the proof was kept still serves
    write(tmp_path / "inc" / "val.h", "#define VAL 2\n")  # and the per-file check still sees a change
    assert cached(ContentAddressedProgramCache(tmp_path / "cas"), KERNEL, opts) == uncached(KERNEL, opts) != first
