"""tools/demo.py, the README's first command: a fresh cache, a warm second run, and --clear's guard."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

DEMO = REPO / "tools" / "demo.py"


def demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.mark.slow
def test_a_fresh_cache_misses_then_a_second_run_says_why_it_hits(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = str(tmp_path / "cas")
    scratch = tmp_path_factory.mktemp("demo-tmpdir")  # its TMPDIR: what it leaves there is seen
    cold = demo("--path", path, env={"TMPDIR": str(scratch)})
    assert cold.returncode == 0, cold.stderr
    out = cold.stdout
    assert "28 compiles took" in out and "all hits" in out
    assert "Pass 1 hit too" not in out
    assert "KB" not in out.replace("KiB", "")  # the CLI's binary units
    assert "dedup ratio" in out and "of unique blobs" in out
    if "CUB kernel" in out:  # the CCCL headers are in the test extra
        assert re.search(r"CUB kernel, include_path=\[CCCL\] +miss", out)
        assert re.search(r"the same compile again +hit", out)
        assert re.search(r"a kernel reading demo_tile.h +miss", out)
        assert re.search(r"demo_tile.h edited +miss", out)
        assert re.search(r"the edited header, fresh process +hit", out)
    else:
        assert "skipped: no CCCL headers found" in out

    # Nothing outside the cache directory it was given: its header directory and the cache of
    # the kernel that reads it were temp ones, removed; so were its front door's trace folders.
    assert os.listdir(tmp_path) == ["cas"]
    assert os.listdir(scratch) == []
    from cuda_program_cas import CacheStore

    entries = len(CacheStore(path))
    assert "why the dedup ratio is not keys per blob: 'N keys -> M blobs' counts keys" in out
    assert re.search(r"the 28 variant keys: 28 keys in \d+ blobs \(\d\.\d\dx by count\)", out)

    warm = demo("--path", path, env={"TMPDIR": str(scratch)})
    assert warm.returncode == 0, warm.stderr
    out = warm.stdout
    assert os.listdir(tmp_path) == ["cas"] and os.listdir(scratch) == []
    # Issue 32: the run added nothing that could never hit (before: the header kernel's 3 entries a run).
    assert len(CacheStore(path)) == entries
    assert "Pass 1 hit too: this cache already held all 28 entries" in out
    assert 'python tools/demo.py --path "$(mktemp -d)"' in out
    rows = [line for line in out.splitlines() if line.split(" ")[0] in ("saxpy", "reduce", "matmul", "stencil")]
    tags = [re.findall(r"\b(hit|miss)\b", row) for row in rows if re.search(r"\d (ms|µs)", row)]
    assert tags == [["hit", "hit"]] * 28  # every row a hit, in both passes
    assert "* the first compile of a process loads NVRTC" in out
    if "CUB kernel" in out:  # the CCCL directory is the same in every run: a hit
        assert re.search(r"CUB kernel, include_path=\[CCCL\] +hit .* stored by an earlier run", out)
        assert re.search(r"the same compile again +hit", out)
        assert re.search(r"a kernel reading demo_tile.h +miss", out)  # a new include directory in each run


def test_clear_refuses_the_default_directory_without_a_path_or_yes(tmp_path: Path) -> None:
    from cuda_program_cas import CacheStore

    default = tmp_path / "default"
    CacheStore(default).put("mine", b"a user's own entry")
    refused = demo("--clear", env={"CUDA_PROGRAM_CAS_DIR": str(default)})
    assert refused.returncode == 2 and refused.stdout == ""
    assert "refusing to --clear the default cache directory" in refused.stderr and "--yes" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert CacheStore(default).get("mine") == b"a user's own entry"
