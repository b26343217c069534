"""numba-cuda's NVVM compiles through the switch (issue 45, item 3): real numba-cuda, real NVVM, on the CPU.

numba-cuda compiles a Python kernel's IR with NVVM through ``cuda.bindings.nvvm``
(``numba.cuda.cudadrv.nvvm.CompilationUnit``), not ``cuda.core``; with the switch
on, ``cuda_program_cas._cuda.nvvm`` sends those compiles through the cache. NVVM
compiles are counted where they happen: ``cuda.bindings.nvvm.compile_program``
(numba-cuda), the ctypes ``nvvmCompileProgram`` (numba-cuda-mlir).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuda_program_cas._disk.layout import Layout
from cuda_program_cas._local.lifetime import read_counters

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("numba_cuda") is None, reason="numba-cuda is not installed (the test extra brings it)"
)

#: A job of two kernels, one to PTX and one to LTO-IR, as a fresh process runs it; prints what
#: it got (digests), how many NVVM compiles ran, and what the switch did.
JOB = r"""
import hashlib, json, sys
from cuda.bindings import nvvm as binding
compiles = [0]
real = binding.compile_program
def counted(*args):
    compiles[0] += 1
    return real(*args)
binding.compile_program = counted
from numba import cuda, types
def axpy(a, x, y):
    i = cuda.grid(1)
    if i < y.size:
        y[i] = a * x[i] + y[i]
def scale(y):
    i = cuda.grid(1)
    if i < y.size:
        y[i] = y[i] * 3 + 1
ptx, _ = cuda.compile_ptx(axpy, (types.float32, types.float32[:], types.float32[:]), cc=(8, 0))
lto, _ = cuda.compile(scale, (types.int32[:],), cc=(8, 0), output="ltoir")
sw = sys.modules.get("cuda_program_cas._cuda.switch")
nv = sys.modules.get("cuda_program_cas._cuda.nvvm")
print(json.dumps({
    "ptx": hashlib.sha256(ptx.encode()).hexdigest(), "lto": hashlib.sha256(lto).hexdigest(),
    "nvvm_compiles": compiles[0], "routed": sw.routed() if sw else 0, "hooked": nv.hooked() if nv else [],
}))
"""


def run_job(cache: Path, switch: str) -> dict[str, Any]:
    proc = run_python(JOB, env={"CUDA_PROGRAM_CAS": switch, "CUDA_PROGRAM_CAS_DIR": str(cache)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


def counters(cache: Path) -> dict[str, int]:
    return dict(read_counters(Layout(str(cache))).counters)


def test_a_fresh_process_hits_every_nvvm_compile_and_gets_the_uncached_bytes(tmp_path: Path) -> None:
    from cuda_program_cas import explain

    cache = tmp_path / "cache"
    uncached = run_job(tmp_path / "unused", "0")
    assert uncached["nvvm_compiles"] == 2 and uncached["routed"] == 0
    cold = run_job(cache, "1")
    assert cold["hooked"] == ["numba.cuda.cudadrv.nvvm"]
    assert (cold["ptx"], cold["lto"], cold["nvvm_compiles"]) == (uncached["ptx"], uncached["lto"], 2)
    c = counters(cache)
    assert (c["switched"], c["misses"], c["hits"], c["writes"]) == (2, 2, 0, 2)
    warm = run_job(cache, "1")
    # The same bytes as NVVM's, and NVVM never ran.
    assert (warm["ptx"], warm["lto"], warm["nvvm_compiles"]) == (uncached["ptx"], uncached["lto"], 0)
    c = counters(cache)
    assert (c["switched"], c["misses"], c["hits"], c["writes"]) == (4, 2, 2, 2)
    # Ordinary entries: their misses are in the journal, with their compile time, for explain.
    report = explain(cache)
    assert [m.via for m in report.misses] == ["nvvm", "nvvm"]
    assert all(m.compile_seconds > 0 for m in report.misses)


def test_the_cache_failing_costs_no_compile(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("not a cache")
    uncached = run_job(tmp_path / "unused", "0")
    out = run_job(not_a_dir, "1")
    assert (out["ptx"], out["lto"], out["nvvm_compiles"]) == (uncached["ptx"], uncached["lto"], 2)
    assert "compiles run uncached instead" in out["stderr"]


# -- in this process: the hook over the real class ----------------------------------------


@pytest.fixture
def switched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The switch on in this process, its cache at a directory of this test's own (returned)."""
    import numba.cuda.cudadrv.nvvm  # noqa: F401  # the module hooked

    import cuda_program_cas
    from cuda_program_cas._cuda import switch

    monkeypatch.setenv("CUDA_PROGRAM_CAS_DIR", str(tmp_path / "cache"))
    switch._S.cache = None  # one cache per process: this test's
    cuda_program_cas.install()
    yield tmp_path / "cache"
    cuda_program_cas.uninstall()
    switch._S.cache = None


def live() -> dict[str, int]:
    """The counters of this process's cache (the switch's), as they are now."""
    from cuda_program_cas._cuda import switch

    return dict(switch._S.cache.counters())


class Counted:
    """NVVM's compiles in this process, counted at ``cuda.bindings.nvvm.compile_program``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from cuda.bindings import nvvm as binding

        real = binding.compile_program
        self.n = 0

        def counted(*args: Any) -> Any:
            self.n += 1
            return real(*args)

        monkeypatch.setattr(binding, "compile_program", counted)


def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, dict[str, Any]]]:
    """The IR and options numba hands ``nvvm.compile_ir`` from now on (recorded; numba's call goes on)."""
    from numba.cuda.cudadrv import nvvm

    calls: list[tuple[Any, dict[str, Any]]] = []
    real = nvvm.compile_ir

    def compile_ir(llvmir: Any, **options: Any) -> Any:
        calls.append((llvmir, dict(options)))
        return real(llvmir, **options)

    monkeypatch.setattr(nvvm, "compile_ir", compile_ir)
    return calls


def uncached(run: Callable[[], Any]) -> Any:
    """``run()`` with the original ``CompilationUnit`` (the hook off for the call)."""
    from cuda_program_cas._cuda import nvvm

    nvvm.unhook()
    try:
        return run()
    finally:
        nvvm.hook()


OPS = st.sampled_from(["+", "-", "*"])
TERMS = st.lists(st.tuples(OPS, st.integers(1, 9)), min_size=1, max_size=4)


#: One compile: a kernel's expression, and the options numba-cuda's ``cuda.compile`` takes.
CASES = st.fixed_dictionaries(
    {
        "terms": TERMS,
        "dtype": st.sampled_from(["float32", "float64", "int32"]),
        "fastmath": st.booleans(),
        "opt": st.booleans(),
        "lineinfo": st.booleans(),
        "output": st.sampled_from(["ptx", "ltoir"]),
        "cc": st.sampled_from([(7, 5), (8, 0), (9, 0)]),
    }
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=CASES)
def test_a_hit_is_what_the_uncached_nvvm_compile_returns(
    switched: Path, monkeypatch: pytest.MonkeyPatch, case: dict[str, Any]
) -> None:
    from numba import cuda, types
    from numba.cuda.core.errors import NumbaDebugInfoWarning
    from numba.cuda.cudadrv import nvvm

    expr = "y[i]" + "".join(f" {op} {n}" for op, n in case["terms"])
    namespace: dict[str, Any] = {"cuda": cuda}
    exec(f"def kernel(y):\n    i = cuda.grid(1)\n    if i < y.size:\n        y[i] = {expr}\n", namespace)  # noqa: S102
    with monkeypatch.context() as m, warnings.catch_warnings():
        # lineinfo on a function made by exec: numba warns that it has no source file.
        warnings.simplefilter("ignore", NumbaDebugInfoWarning)
        calls, count = recorded(m), Counted(m)
        options = {k: case[k] for k in ("cc", "output", "fastmath", "opt", "lineinfo")}
        got, _ = cuda.compile(namespace["kernel"], (getattr(types, case["dtype"])[:],), **options)
        assert count.n == len(calls) == 1  # a new kernel: a miss, compiled by NVVM
        (llvmir, nvvm_options) = calls[0]
        hit = nvvm.compile_ir(llvmir, **nvvm_options)
        assert count.n == 1  # the same IR and options again: a hit, NVVM not asked
        reference = uncached(lambda: nvvm.compile_ir(llvmir, **nvvm_options))
        assert count.n == 2
    assert hit == reference
    assert got == (reference if case["output"] == "ltoir" else reference.decode().strip("\x00").strip())


def unit_compile(ir: bytes, options: dict[str, Any], libdevice: bytes) -> bytes:
    """One NVVM compile as numba's ``compile_ir`` makes it, with the class bound in numba's module now."""
    from numba.cuda.cudadrv import nvvm

    unit = nvvm.CompilationUnit(options)
    unit.add_module(ir)
    unit.verify()
    unit.lazy_add_module(libdevice)
    result: bytes = unit.compile()
    return result


def test_a_changed_kernel_option_or_libdevice_is_another_key(switched: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from numba import cuda, types
    from numba.cuda.cudadrv import nvvm

    def kernel(y: Any) -> None:
        y[0] = 7

    calls = recorded(monkeypatch)
    cuda.compile_ptx(kernel, (types.int32[:],), cc=(8, 0))
    llvmir, options = calls[0]
    ir = nvvm.llvm_replace(llvmir[0] if isinstance(llvmir, list) else llvmir).encode()
    options = {k: v for k, v in options.items() if k != "fastmath"}
    libdevice = nvvm.LibDevice().get()
    count = Counted(monkeypatch)
    variants = {
        "as numba made it": (ir, options, libdevice),
        "a changed kernel": (ir.replace(b"trunc i64 7 to i32", b"trunc i64 8 to i32"), options, libdevice),
        "another option": (ir, {**options, "opt": 0}, libdevice),
        # Bitcode padded with zero words reads as the same bitcode: NVVM takes it, its bytes differ.
        "another libdevice": (ir, options, libdevice + b"\0\0\0\0"),
    }
    assert variants["a changed kernel"][0] != ir
    first = {name: unit_compile(*v) for name, v in variants.items()}
    c = live()
    # numba's own compile missed; made again as numba made it, a hit; each change, a miss and NVVM's compile.
    assert count.n == 3 and (c["misses"], c["hits"]) == (1 + 3, 1)
    assert first["as numba made it"] == first["another libdevice"]  # none of it called: the same PTX
    again = {name: unit_compile(*v) for name, v in variants.items()}
    c = live()
    assert again == first and count.n == 3 and (c["misses"], c["hits"]) == (4, 5)
    assert first == {name: uncached(lambda v=v: unit_compile(*v)) for name, v in variants.items()}
    # explain names what changed, from the miss journal.
    from cuda_program_cas import explain

    changes = [m.changes for m in explain(switched).misses]
    assert [m.via for m in explain(switched).misses] == ["nvvm"] * 4
    assert changes[1:] == [("code changed",), ("option -opt: 3 -> 0",), changes[3]]
    assert len(changes[3]) == 1 and changes[3][0].startswith("libdevice: ")


def test_nvvm_s_errors_are_raised_as_without_the_switch(switched: Path) -> None:
    from numba.cuda.cudadrv import nvvm

    bad = b"this is not LLVM IR\n"
    libdevice = nvvm.LibDevice().get()
    options = {"arch": "compute_80", "opt": 3}
    with pytest.raises(Exception) as plain:  # noqa: PT011  # NVVM's own exception, whatever its type
        uncached(lambda: unit_compile(bad, options, libdevice))
    with pytest.raises(type(plain.value)) as through:
        unit_compile(bad, options, libdevice)
    assert str(through.value) == str(plain.value)
    assert live()["writes"] == 0


def test_numba_cuda_mlir_s_compilation_unit_too(switched: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("numba_cuda_mlir") is None:
        pytest.skip("numba-cuda-mlir is not installed (71 MB; its compile calls need a GPU, its NVVM class does not)")
    from cuda_program_cas._cuda.nvvm import hooked

    fresh = "numba_cuda_mlir.numba_cuda.cudadrv.nvvm" not in sys.modules
    import numba_cuda_mlir.numba_cuda.cudadrv.nvvm as mlir_nvvm
    from numba import cuda, types
    from numba.cuda.cudadrv import nvvm

    if fresh:  # imported after install(): the start-up hook's finder bound the subclass as it loaded
        assert "numba_cuda_mlir.numba_cuda.cudadrv.nvvm" in hooked()

    def kernel(y: Any) -> None:
        y[0] = y[0] * 2

    calls = recorded(monkeypatch)
    cuda.compile_ptx(kernel, (types.float32[:],), cc=(8, 0))
    ir = nvvm.llvm_replace(calls[0][0][0]).encode()
    driver = mlir_nvvm.NVVM()
    real, n = driver.nvvmCompileProgram, [0]

    def counted(*args: Any) -> Any:
        n[0] += 1
        return real(*args)

    monkeypatch.setattr(driver, "nvvmCompileProgram", counted)

    def compile_mlir() -> bytes:
        unit = mlir_nvvm.CompilationUnit({"arch": "compute_80", "opt": 3})
        unit.add_module(ir)
        unit.verify()
        unit.lazy_add_module(mlir_nvvm.LibDevice().get())
        with warnings.catch_warnings():
            result: bytes = unit.compile()
        return result

    first, second = compile_mlir(), compile_mlir()
    assert n[0] == 1 and first == second == uncached(compile_mlir) and n[0] == 2


def test_a_process_that_never_imports_numba_never_loads_the_hook(tmp_path: Path) -> None:
    code = (
        "import json, sys\n"
        "from cuda.core import Program, ProgramOptions\n"
        "Program('extern \"C\" __global__ void k() {}', 'c++', options=ProgramOptions(arch='sm_80')).compile('cubin')\n"
        "print(json.dumps({'switch': 'cuda_program_cas._cuda.switch' in sys.modules,\n"
        "    'loaded': sorted(m for m in sys.modules if m.startswith('numba') or m.endswith('_cuda.nvvm'))}))\n"
    )
    proc = run_python(code, env={"CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"switch": True, "loaded": []}


# -- numba-cuda-mlir's LLVM 7 path (chips below sm_100: the H100s) ---------------------------

#: numba-cuda-mlir compiling two device functions for sm_90 (its ``_call_llvm70_capi``), the C
#: library's translate-and-compile calls counted; its compute capability query answered with
#: sm_90, as there is no GPU to ask (cuda.compute's ``_target_without_a_device`` does the same).
MLIR_JOB = r"""
import hashlib, json, sys
from numba_cuda_mlir import tools
tools._cached_cc = (9, 0)
import numba_cuda_mlir.mlir_optimization as mo
from numba_cuda_mlir import cuda, types
lib = mo._get_llvm70_capi()
real, calls = lib.llvm70_translate_gpu_module_from_op, [0]
def counted(*args):
    calls[0] += 1
    return real(*args)
lib.llvm70_translate_gpu_module_from_op = counted
def add(a, b):
    return a + b
def fma(a, b):
    return a * b + 1
ptx, _ = cuda.compile(add, (types.int32, types.int32), cc=(9, 0), output="ptx")
lto, _ = cuda.compile(fma, (types.float32, types.float32), cc=(9, 0), output="ltoir")
nv = sys.modules.get("cuda_program_cas._cuda.nvvm")
print(json.dumps({
    "ptx": hashlib.sha256(ptx.encode()).hexdigest(), "lto": hashlib.sha256(lto).hexdigest(),
    "calls": calls[0], "hooked": nv.hooked() if nv else [],
}))
"""

needs_mlir = pytest.mark.skipif(
    importlib.util.find_spec("numba_cuda_mlir") is None, reason="numba-cuda-mlir is not installed"
)


def run_mlir_job(cache: Path, switch: str) -> dict[str, Any]:
    proc = run_python(MLIR_JOB, env={"CUDA_PROGRAM_CAS": switch, "CUDA_PROGRAM_CAS_DIR": str(cache)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


@needs_mlir
def test_numba_cuda_mlir_s_llvm7_path_hits_in_a_fresh_process_with_the_uncached_bytes(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    uncached = run_mlir_job(tmp_path / "unused", "0")
    assert uncached["calls"] == 2 and uncached["hooked"] == []
    cold, warm = run_mlir_job(cache, "1"), run_mlir_job(cache, "1")
    assert "numba_cuda_mlir.mlir_optimization" in cold["hooked"]
    assert (cold["calls"], warm["calls"]) == (2, 0)
    for run in (cold, warm):
        assert (run["ptx"], run["lto"]) == (uncached["ptx"], uncached["lto"])
    assert counters(cache)["hits"] >= 2


@needs_mlir
def test_numba_cuda_mlir_s_llvm7_path_with_the_cache_failing_compiles_uncached(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("not a cache")
    uncached = run_mlir_job(tmp_path / "unused", "0")
    out = run_mlir_job(not_a_dir, "1")
    assert (out["ptx"], out["lto"], out["calls"]) == (uncached["ptx"], uncached["lto"], 2)


@pytest.fixture
def llvm70(switched: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """numba-cuda-mlir's LLVM 7 path hooked in this process for sm_90; its C calls counted (the list's one item)."""
    if importlib.util.find_spec("numba_cuda_mlir") is None:
        pytest.skip("numba-cuda-mlir is not installed")
    from numba_cuda_mlir import tools

    monkeypatch.setattr(tools, "_cached_cc", (9, 0))  # the GPU this machine lacks
    import numba_cuda_mlir.mlir_optimization as mo

    from cuda_program_cas._cuda import nvvm

    nvvm.hook()  # imported after install(): as the start-up hook's finder does
    assert nvvm.LLVM70 in nvvm.hooked()
    lib = mo._get_llvm70_capi()
    real, n = lib.llvm70_translate_gpu_module_from_op, [0]

    def counted(*args: Any) -> Any:
        n[0] += 1
        return real(*args)

    monkeypatch.setattr(lib, "llvm70_translate_gpu_module_from_op", counted)
    yield n


def mlir_compile(body: str, output: str = "ptx", **options: Any) -> Any:
    """A fresh device function ``return <body>`` over two float32s, compiled by numba-cuda-mlir for sm_90."""
    from numba_cuda_mlir import cuda, types
    from numba_cuda_mlir.numba_cuda.core.errors import NumbaDebugInfoWarning

    namespace: dict[str, Any] = {}
    exec(f"def f(a, b):\n    return {body}\n", namespace)
    with warnings.catch_warnings():  # line info for a function with no source file: said, not an error
        warnings.simplefilter("ignore", NumbaDebugInfoWarning)
        return cuda.compile(namespace["f"], (types.float32, types.float32), cc=(9, 0), output=output, **options)[0]


def test_numba_cuda_mlir_s_llvm7_path_a_changed_body_or_option_is_another_key(llvm70: list[int]) -> None:
    first = mlir_compile("a + b")
    assert llvm70[0] == 1
    assert mlir_compile("a + b") == first and llvm70[0] == 1  # the same: a hit
    changed = [
        ("a - b", {}),
        ("a + b", {"lineinfo": True}),
        ("a + b", {"opt": False}),
        ("a + b", {"debug": True, "opt": False}),
    ]
    for n, (body, options) in enumerate(changed, start=2):
        mlir_compile(body, **options)
        assert llvm70[0] == n, (body, options)  # a miss each: another key
    assert mlir_compile("a + b", output="ltoir") != first and llvm70[0] == len(changed) + 2


#: One compile of numba-cuda-mlir's LLVM 7 path: a device function's expression, and options.
MLIR_CASES = st.fixed_dictionaries(
    {
        "terms": TERMS,
        "output": st.sampled_from(["ptx", "ltoir"]),
        "lineinfo": st.booleans(),
        "opt": st.booleans(),
        "fastmath": st.booleans(),
    }
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=MLIR_CASES)
def test_numba_cuda_mlir_s_llvm7_hit_is_what_the_uncached_call_returns(llvm70: list[int], case: dict[str, Any]) -> None:
    body = "a" + "".join(f" {op} {k}" for op, k in case["terms"]) + " + b"
    options = {name: case[name] for name in ("lineinfo", "opt", "fastmath")}
    first = mlir_compile(body, case["output"], **options)
    before = llvm70[0]
    assert mlir_compile(body, case["output"], **options) == first and llvm70[0] == before  # a hit
    assert uncached(lambda: mlir_compile(body, case["output"], **options)) == first and llvm70[0] == before + 1
