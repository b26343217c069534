"""The front door's ``cpcas-trace-*`` folders: a header compile killed with SIGKILL leaves one; they are swept.

Real processes with real NVRTC, each with a ``TMPDIR`` of the test's own, so that
what they leave there (and what a sweep removes) is seen and nothing else is touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import is_root

from cuda_program_cas._cuda.trace import PREFIX, STALE_S, sweep_stale

#: A miss through the front door: a kernel that reads a header, compiled with NVRTC.
_MISS = textwrap.dedent(
    """
    import sys
    from cuda.core import ProgramOptions
    from cuda_program_cas import ContentAddressedProgramCache
    cache = ContentAddressedProgramCache(sys.argv[1])
    src = '#include "slow.h"\\nextern "C" __global__ void k(float* x) { x[0] = slow_sum(); }\\n'
    cache.compile(src, "c++", ProgramOptions(arch="sm_80", std="c++17", include_path=[sys.argv[2]]), "cubin")
    print(cache.counters()["misses"])
    """
)

#: A header NVRTC takes a while over (a few seconds), so that a compile can be killed in its middle.
_SLOW_HEADER = textwrap.dedent(
    """
    #pragma once
    template <int N> struct Sum { static constexpr long long value = N + Sum<N - 1>::value; };
    template <> struct Sum<0> { static constexpr long long value = 0; };
    template <int N> struct Deep { static constexpr long long value = Sum<N>::value + Deep<N - 1>::value; };
    template <> struct Deep<0> { static constexpr long long value = 0; };
    __device__ float slow_sum() { return (float)(Deep<%d>::value); }
    """
)


def trace_dirs(tmp: Path) -> list[Path]:
    return sorted(p for p in tmp.iterdir() if p.name.startswith(PREFIX))


def miss(tmp: Path, cache: Path, include: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _MISS, str(cache), str(include)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )


def backdate(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


def test_a_killed_header_compile_leaves_a_folder_that_a_later_miss_sweeps(tmp_path: Path) -> None:
    tmp, include = tmp_path / "tmp", tmp_path / "inc"
    tmp.mkdir()
    include.mkdir()
    (include / "slow.h").write_text(_SLOW_HEADER % 400)
    proc = miss(tmp, tmp_path / "cas", include)
    try:
        deadline = time.monotonic() + 120
        while not trace_dirs(tmp) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)  # waits for the folder to appear, no longer
        assert trace_dirs(tmp), "the compile ended before its trace folder was seen"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    left = trace_dirs(tmp)
    assert len(left) == 1  # what issue 32 found: nothing can remove it but a sweep

    # A young one stays (it may be a live compile's); an hour old, the next process's first miss sweeps it.
    (include / "slow.h").write_text(_SLOW_HEADER % 3)
    done = miss(tmp, tmp_path / "cas", include)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0 and out.strip() == "1", err
    assert trace_dirs(tmp) == left
    backdate(left[0], STALE_S + 60)
    (include / "slow.h").write_text(_SLOW_HEADER % 4)  # another miss
    done = miss(tmp, tmp_path / "cas", include)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0 and out.strip() == "1", err
    assert trace_dirs(tmp) == []


def test_the_sweep_removes_only_this_user_s_stale_folders(tmp_path: Path) -> None:
    old = STALE_S + 60
    stale = tmp_path / f"{PREFIX}stale"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "trace.json").write_text("{}")
    backdate(stale, old)
    young = tmp_path / f"{PREFIX}young"
    young.mkdir()
    other = tmp_path / "other-tracer-dir"
    other.mkdir()
    backdate(other, old)
    a_file = tmp_path / f"{PREFIX}file"
    a_file.write_text("not a folder")
    backdate(a_file, old)
    target = tmp_path / "kept"
    target.mkdir()
    (target / "mine").write_text("x")
    link = tmp_path / f"{PREFIX}link"
    link.symlink_to(target)
    backdate(link, old)
    expected = ["kept", "other-tracer-dir", f"{PREFIX}file", f"{PREFIX}link", f"{PREFIX}young"]
    if is_root():  # another user's folder: never ours to remove
        theirs = tmp_path / f"{PREFIX}theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        backdate(theirs, old)
        expected.append(theirs.name)
    assert sweep_stale(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)
    assert (target / "mine").read_text() == "x"  # a symlink is not followed
    assert sweep_stale(str(tmp_path / "nowhere")) == 0  # a temp directory that cannot be read: nothing, no error
