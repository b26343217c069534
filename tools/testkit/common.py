"""What the tools and tests share besides servers and workers: the saxpy and CUB kernels, the CCCL
header search, a run's work directory and the checkout's git state."""

from __future__ import annotations

import contextlib
import glob
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from testkit import REPO

#: A saxpy, the small kernel of the demo, the benchmarks and the NFS scenarios.
SAXPY = r"""
extern "C" __global__ void saxpy(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""
#: A CUB kernel: a few hundred CCCL headers behind one include.
CUB_SOURCE = r"""
#include <cub/block/block_reduce.cuh>
extern "C" __global__ void block_sum(const int *in, int *out) {
    using BlockReduce = cub::BlockReduce<int, 128>;
    __shared__ typename BlockReduce::TempStorage temp;
    int s = BlockReduce(temp).Sum(in[blockIdx.x * 128 + threadIdx.x]);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the CCCL headers ----------------------------------------------------------------------


def cccl_include() -> str | None:
    """The directory holding ``cub/``: cuda-pathfinder's answer (the nvidia-cuda-cccl wheel or a
    toolkit), else the usual toolkit places; None when there is none."""
    try:
        import cuda.pathfinder as pf

        locate = getattr(pf, "locate_nvidia_header_directory", None)
        if locate is not None:
            found = locate("cccl")
            path = getattr(found, "abs_path", found)
        else:
            path = pf.find_nvidia_header_directory("cccl")
        if path and os.path.isfile(os.path.join(path, "cub", "cub.cuh")):
            return str(path)
    except Exception:  # no cuda-pathfinder, or its own error for an unusual installation
        pass
    for include in ("/usr/local/cuda/include", *sorted(glob.glob("/usr/local/cuda-*/include"))):
        for path in (os.path.join(include, "cccl"), include):
            if os.path.isfile(os.path.join(path, "cub", "cub.cuh")):
                return path
    return None


@contextlib.contextmanager
def work_dir(parent: str | None, name: str) -> Iterator[str]:
    """A new directory for a run's caches: ``name-*`` under ``parent`` (``--dir``, kept), else a temp dir, removed."""
    if parent:
        os.makedirs(parent, exist_ok=True)
        yield tempfile.mkdtemp(prefix=f"{name}-", dir=parent)
        return
    base = tempfile.mkdtemp(prefix=f"cas-{name}-")
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


# -- the checkout ----------------------------------------------------------------------------


def git_state() -> tuple[str, str]:
    """The checkout's short commit, and what ``git status`` says of cas/ and index/ (empty: clean)."""
    try:
        commit = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", REPO, "status", "--porcelain", "--", "cas", "index"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit, dirty = "", ""
    return commit, dirty
