"""NVRTC's version from a record keyed by the library file's identity (cuda_program_cas._cuda.nvrtcver).

Real processes, a real copy of libnvrtc: each child finds NVRTC through a site-packages
directory of this test's own (``site.getsitepackages`` pointed at it before anything
looks, so that cuda-pathfinder, and through it cuda.bindings, find and load the copy),
and reports whether a front-door hit loaded NVRTC (``/proc/self/maps``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import run_python

_CHILD = r"""
import json, site, sys
from pathlib import Path
tmp = Path(sys.argv[1])
site.getsitepackages = lambda prefixes=None: [str(tmp / "site")]
site.ENABLE_USER_SITE = False
from cuda.core import ProgramOptions
from cuda_program_cas import ContentAddressedProgramCache

opts = ProgramOptions(arch="sm_80", include_path=[str(tmp / "inc")])
if sys.argv[2:] == ["preload"]:  # NVRTC loaded before the cache is asked: an uncached compile first
    from cuda.core import Program
    Program('extern "C" __global__ void u() {}', "c++", options=ProgramOptions(arch="sm_80")).compile("cubin")
cache = ContentAddressedProgramCache(tmp / "cas")
cache.compile('#include "val.h"\nextern "C" __global__ void k(int *o) { *o = VAL; }\n', "c++", opts, "cubin")
maps = [line.split()[-1] for line in open("/proc/self/maps") if "libnvrtc.so" in line]
print(json.dumps({"loaded": sorted(set(maps)), "misses": cache.counters()["misses"]}))
"""


def _nvrtc_dir() -> Path:
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return Path(load_nvidia_dynamic_lib("nvrtc").abs_path).parent


@pytest.fixture
def copied(tmp_path: Path) -> Path:
    """``tmp/site/<the wheel's relative lib dir>/libnvrtc*``: a real copy (another inode), not a link."""
    lib = _nvrtc_dir()
    site_packages = next((p for p in lib.parents if p.name == "site-packages"), None)
    if site_packages is None:
        pytest.skip(f"NVRTC is not from a wheel here ({lib})")
    target = tmp_path / "site" / lib.relative_to(site_packages)
    target.mkdir(parents=True)
    for so in lib.glob("libnvrtc*.so*"):
        shutil.copy2(so, target / so.name)
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "val.h").write_text("#define VAL 7\n")
    return target


def _child(tmp_path: Path, *extra: str) -> dict:
    done = run_python(_CHILD, str(tmp_path), *extra, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_hit_believes_the_record_of_the_same_file_and_not_of_a_touched_one(tmp_path: Path, copied: Path) -> None:
    lib = next(copied.glob("libnvrtc.so*"))
    first = _child(tmp_path)  # a miss: loads the copy, and records its version under its identity
    assert first["misses"] == 1 and first["loaded"] == [str(lib)]
    again = _child(tmp_path)
    assert again == {"loaded": [], "misses": 0}  # the record of this very file: NVRTC not loaded
    st = lib.stat()
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched: another mtime and ctime
    touched = _child(tmp_path)
    assert touched == {"loaded": [str(lib)], "misses": 0}  # not believed: loaded to ask, and still a hit
    assert _child(tmp_path) == {"loaded": [], "misses": 0}  # the new identity is recorded in its turn


def test_a_record_of_another_copy_is_not_believed(tmp_path: Path, copied: Path) -> None:
    lib = next(copied.glob("libnvrtc.so*"))
    assert _child(tmp_path)["misses"] == 1
    # The same bytes, times and size at the same path, but another file (inode, ctime).
    moved = lib.with_name(lib.name + ".old")
    os.rename(lib, moved)
    shutil.copy2(moved, lib)
    assert _child(tmp_path) == {"loaded": [str(lib)], "misses": 0}


def test_a_miss_of_a_process_that_loaded_nvrtc_first_records_its_version(tmp_path: Path, copied: Path) -> None:
    lib = next(copied.glob("libnvrtc.so*"))
    # The miss keys the compile with the loaded library's answer; it still records it under the file.
    first = _child(tmp_path, "preload")
    assert first["misses"] == 1 and first["loaded"] == [str(lib)]
    assert _child(tmp_path) == {"loaded": [], "misses": 0}  # the next process's hit does not load NVRTC
