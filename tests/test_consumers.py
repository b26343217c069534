"""A real consumer under the switch: numba-cuda, a library that never passes ``cache=``.

What goes through ``cuda.core`` is reached as in every library: the CUDA C++ a kernel links
(NVRTC, below) and the link into a cubin (``cuda.core.Linker``). A Python kernel's NVVM compile
(through ``cuda.bindings.nvvm``, not ``cuda.core``) is reached by the switch's hook on numba's
``CompilationUnit`` (tests/test_nvvm.py); its typing and lowering stay numba's. The last test
holds the docs to that (docs/everywhere.md).

``numba.cuda.cudadrv.nvrtc.compile(src, name, cc, ltoir=...)`` builds a ``cuda.core``
``Program`` with its own ``include_path`` (numba's headers, the CUDA and CCCL include
directories, and ``NUMBA_CUDA_NVRTC_EXTRA_SEARCH_PATHS``) and compiles it; it runs without
a GPU. Each compile here runs in a fresh interpreter with ``CUDA_PROGRAM_CAS=1``; the cache's
lifetime counters say what each process did: a miss is an NVRTC run, a hit is none.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import run_python

from cuda_program_cas._disk.layout import Layout
from cuda_program_cas._local.lifetime import read_counters

# Looked for, not imported: numba is imported by the children only.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("numba_cuda") is None, reason="numba-cuda is not installed (the test extra brings it)"
)

#: A device function that reads a header of the test's own through the extra search path.
SOURCE = '#include "scale.h"\nextern "C" __device__ int scaled(int x) { return x * SCALE; }\n'

#: One numba-cuda compile; prints the digest of the LTO-IR it got.
CHILD = """
import hashlib, json, sys, warnings
warnings.simplefilter("ignore")  # numba-cuda warns of NVRTC log messages; not the point here
from numba.cuda.cudadrv import nvrtc
result, _ = nvrtc.compile(sys.argv[1], "scaled.cu", (8, 0), ltoir=True)
print(json.dumps({"digest": hashlib.sha256(bytes(result.code)).hexdigest(), "type": result.code_type}))
"""


def compile_in_child(cache: Path, headers: Path, *, switch: str = "1") -> dict[str, str]:
    env = {"CUDA_PROGRAM_CAS": switch, "CUDA_PROGRAM_CAS_DIR": str(cache)}
    env["NUMBA_CUDA_NVRTC_EXTRA_SEARCH_PATHS"] = str(headers)
    proc = run_python(CHILD, SOURCE, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def counters(cache: Path) -> dict[str, int]:
    return dict(read_counters(Layout(str(cache))).counters)


def test_numba_cuda_s_cuda_cpp_compiles_are_cached_across_processes_and_see_a_header_edit(tmp_path: Path) -> None:
    headers, cache = tmp_path / "include", tmp_path / "cache"
    headers.mkdir()
    (headers / "scale.h").write_text("#define SCALE 3\n")
    uncached = compile_in_child(tmp_path / "unused", headers, switch="0")
    assert not (tmp_path / "unused").exists()  # off: the package opened no cache

    first = compile_in_child(cache, headers)
    assert first == uncached and first["type"] == "ltoir"
    after_first = counters(cache)
    assert (after_first["misses"], after_first["hits"]) == (1, 0)

    second = compile_in_child(cache, headers)  # a fresh process: a hit, NVRTC not run
    assert second == first
    after_second = counters(cache)
    assert (after_second["misses"], after_second["hits"]) == (1, 1)

    (headers / "scale.h").write_text("#define SCALE 5\n")  # the header numba's compile reads
    edited = compile_in_child(cache, headers)
    assert edited != first
    assert edited == compile_in_child(tmp_path / "unused", headers, switch="0")
    after_edit = counters(cache)
    assert (after_edit["misses"], after_edit["hits"]) == (2, 1)


#: A Python kernel compiled to PTX alone (NVVM), then one calling a device function linked from a
#: CUDA C++ file, compiled with it to LTO-IR; public numba-cuda calls, no GPU needed.
KERNELS = """
import json, os, sys, warnings
warnings.simplefilter("ignore")
from numba import cuda, types
def plain(a):
    a[0] = a[0] + 1
ptx, _ = cuda.compile_ptx(plain, (types.int32[:],), cc=(8, 0))
scaled = cuda.declare_device("scaled", "int32(int32)", link=sys.argv[1])
def calls(a):
    a[0] = scaled(a[0])
codes, _ = cuda.compile_all(calls, (types.int32[:],), device=False, cc=(8, 0), abi="numba", output="ltoir")
print(json.dumps({"ptx": len(ptx), "codes": len(codes)}))
"""


def test_a_python_kernel_s_nvvm_compiles_are_cached_with_the_cuda_cpp_it_links(tmp_path: Path) -> None:
    linked, cache = tmp_path / "scaled.cu", tmp_path / "cache"
    linked.write_text('extern "C" __device__ int scaled(int *out, int x) { *out = 3 * x; return 0; }\n')
    env = {"CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(cache)}
    seen = []
    for _ in range(2):  # two fresh processes on one cache
        proc = run_python(KERNELS, str(linked), env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["ptx"] > 0 and out["codes"] == 2  # the kernel's LTO-IR and the linked file's
        c = counters(cache)
        seen.append((c["switched"], c["misses"], c["hits"]))
    # Each process sent three compiles through the cache: the two NVVM compiles of the Python
    # kernels (one to PTX, one to LTO-IR) and the linked file's NVRTC compile; the second hit all.
    assert seen == [(3, 3, 0), (6, 3, 3)]
