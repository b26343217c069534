"""What the tools share: the worker protocol, the CCCL header search, the checkout's git state.

Each tool is run as ``python tools/X.py`` from the repository, so this folder is first on
``sys.path`` and ``from _common import ...`` finds this module: nothing needs installing
beyond the package (tools/gpu_bench.py runs on a GPU machine with only the repository
and carried wheels).

The worker protocol: a tool that needs a fresh interpreter re-runs itself as
``python tools/X.py _worker '<JSON spec>'``. :func:`spawn_worker` (or :func:`run_worker`,
which waits and reads the JSON answer from the last line of stdout) starts it, and the
tool's ``main`` hands the spec to its worker when :func:`worker_spec` finds one in argv.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The first argument that makes a tool a worker.
WORKER = "_worker"

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


# -- the worker protocol -----------------------------------------------------------------


def child_env(*, keep_settings: bool = False) -> dict[str, str]:
    """This environment for a child interpreter, the checkout first on its ``PYTHONPATH``.

    Without ``keep_settings`` the cache's ``CUDA_PROGRAM_CAS_*`` variables are dropped, so an
    operator's settings do not change what a benchmark measures.
    """
    env = {k: v for k, v in os.environ.items() if keep_settings or not k.startswith("CUDA_PROGRAM_CAS_")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def worker_command(script: str, spec: dict[str, Any]) -> list[str]:
    """The command line that re-runs ``script`` as a worker for ``spec``."""
    return [sys.executable, os.path.abspath(script), WORKER, json.dumps(spec)]


def spawn_worker(
    script: str, spec: dict[str, Any], *, keep_settings: bool = False, **popen: Any
) -> subprocess.Popen[Any]:
    """Start ``script`` as a worker for ``spec``; ``popen`` goes to :class:`subprocess.Popen` (pipes and the like)."""
    return subprocess.Popen(worker_command(script, spec), env=child_env(keep_settings=keep_settings), **popen)


def run_worker(
    script: str, spec: dict[str, Any], timeout: float = 300, *, settings: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``script`` as a worker for ``spec`` and wait; its answer, the JSON object on its last line of stdout.

    ``settings``: ``CUDA_PROGRAM_CAS_*`` variables the worker gets (the operator's are dropped).
    Raises :class:`RuntimeError` with the end of the worker's stderr when it fails.
    """
    env = child_env()
    env.update(settings or {})
    proc = subprocess.run(
        worker_command(script, spec), capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"worker {spec.get('task', script)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def worker_spec(argv: list[str]) -> dict[str, Any] | None:
    """The spec when ``argv`` makes this process a worker (``_worker '<JSON>'``), else None."""
    if argv[:1] != [WORKER]:
        return None
    spec: dict[str, Any] = json.loads(argv[1])
    return spec


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


def work_dir(parent: str | None, name: str) -> str:
    """A new directory for a run's caches: ``name-*`` under ``parent`` (``--dir``, made if need be), else a temp dir."""
    if parent:
        os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(prefix=f"{name}-", dir=parent)
    return tempfile.mkdtemp(prefix=f"cas-{name}-")


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
