"""Fixtures shared by the whole suite: real NVRTC compiles and fresh cache directories.

Helpers of one test file stay in that file; only what several files need lives here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: A small kernel; with NVRTC its cubin does not depend on `name`, unused macros or `std`.
SAXPY = r"""
extern "C" __global__ void saxpy(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


@pytest.fixture(autouse=True)
def _isolated_default_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test touches the real per-user cache, nor inherits the operator's settings."""
    monkeypatch.setenv("CUDA_PROGRAM_CAS_DIR", str(tmp_path_factory.mktemp("default-cas")))
    monkeypatch.delenv("CUDA_PROGRAM_CAS_SHARED", raising=False)
    monkeypatch.delenv("CUDA_PROGRAM_CAS_MAX_SIZE", raising=False)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    """A path for a new cache (not yet created)."""
    return tmp_path / "cas"


def compile_program(source: str = SAXPY, target: str = "cubin", cache=None, **options):
    """Program(source).compile(target) with real NVRTC; options default to arch sm_80."""
    from cuda.core import Program, ProgramOptions

    options.setdefault("arch", "sm_80")
    if target == "ltoir":
        options.setdefault("relocatable_device_code", True)
        options.setdefault("link_time_optimization", True)
    return Program(source, "c++", options=ProgramOptions(**options)).compile(target, cache=cache)


def run_python(
    code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (the repo importable), capturing output."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=full_env, check=False
    )


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def write_orphan(root: os.PathLike[str] | str, data: bytes) -> str:
    """Put a blob with no manifest into the cache at ``root``, as a writer that died between the two leaves it."""
    from cas import digest_of

    digest = digest_of(data)
    path = Path(root) / "blobs" / digest[:2] / digest[2:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


def write_manifest(root: os.PathLike[str] | str, key: str | bytes, digest: str, size: int) -> Path:
    """Write a manifest by hand (naming whatever blob the test wants), bypassing the write protocol."""
    from cuda_program_cas_index import Manifest, key_id

    kid = key_id(key)
    path = Path(root) / "index" / kid[:2] / kid[2:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(Manifest(digest, size, kid).encode())
    return path
