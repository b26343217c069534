"""A stub of the CUDA driver library, for importing cuda.compute where no driver is installed.

cuda.compute's ``libcccl.c.parallel.so`` links ``libcuda.so.1``: without a
driver its bindings do not load, and ``import cuda.compute`` leaves every name
unavailable. Ahead-of-time builds (``compute_capability=``) call NVRTC and
nvJitLink and never the driver, so a library that defines the driver symbols
the shared object imports (read from its dynamic symbol table with ``nm -D
--undefined-only``), each returning ``CUDA_ERROR_NO_DEVICE`` (100), is enough
to build. It is built with gcc into a directory of the caller's, and put first
on ``LD_LIBRARY_PATH`` of a subprocess (never of the process that builds it).
It stands in for nothing that launches: a launch through it fails with
``CUDA_ERROR_NO_DEVICE``. Where a real driver loads, :func:`driver_env` returns
no change at all.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["driver_env", "real_driver"]

#: What every stubbed function returns: CUDA_ERROR_NO_DEVICE.
_NO_DEVICE = 100


def real_driver() -> bool:
    """Whether ``libcuda.so.1`` loads in this process (a real driver, or a stub already on the path)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _cccl_library() -> Path:
    """cuda.compute's ``libcccl.c.parallel.so`` for the installed CUDA major (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("cuda.compute")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("cuda.compute (cuda-cccl) is not installed")
    import cuda.bindings

    major = cuda.bindings.__version__.split(".")[0]
    lib = Path(next(iter(spec.submodule_search_locations))) / f"cu{major}" / "cccl" / "libcccl.c.parallel.so"
    if not lib.is_file():
        raise RuntimeError(f"{lib} is missing")
    return lib


def _driver_symbols(lib: Path) -> list[str]:
    """The ``cu*`` functions ``lib`` imports (its undefined dynamic symbols)."""
    out = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    names = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}
    return sorted(n for n in names if n.startswith("cu") and n[2:3].isupper())


def build_stub(directory: Path) -> Path:
    """Write and compile the stub ``libcuda.so.1`` into ``directory``; returns the directory."""
    if shutil.which("gcc") is None or shutil.which("nm") is None:
        raise RuntimeError("gcc and nm are needed to build the driver stub")
    directory.mkdir(parents=True, exist_ok=True)
    lines = ["/* A stub of the CUDA driver: every function fails with CUDA_ERROR_NO_DEVICE. */"]
    for name in _driver_symbols(_cccl_library()):
        if name == "cuGetErrorString":
            lines.append(
                'int cuGetErrorString(int e, const char **s) { static const char m[] = "no CUDA driver (stub)";'
                f" if (s) *s = m; return {_NO_DEVICE}; }}"
            )
        else:
            lines.append(f"int {name}(void) {{ return {_NO_DEVICE}; }}")
    source = directory / "cudastub.c"
    source.write_text("\n".join(lines) + "\n")
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(directory / "libcuda.so.1"), str(source)],
        check=True,
        capture_output=True,
    )
    return directory


def driver_env(directory: Path) -> dict[str, str]:
    """Variables for a subprocess that imports cuda.compute: the stub first on the path where no driver loads."""
    if real_driver():
        return {}
    stub = build_stub(directory)
    path = os.environ.get("LD_LIBRARY_PATH", "")
    return {"LD_LIBRARY_PATH": f"{stub}{os.pathsep}{path}" if path else str(stub)}
