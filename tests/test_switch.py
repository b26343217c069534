"""The switch: ``CUDA_PROGRAM_CAS=1`` (or ``install()``) sends every ``Program.compile`` through the cache.

Every test runs fresh interpreters of this environment, with real NVRTC: the
switch starts from the ``.pth`` in site-packages, so only a new process shows
what it does. Children report as JSON on their last line of stdout.
"""

from __future__ import annotations

import importlib
import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import SAXPY, StartGate

PTH = "cuda_program_cas-switch.pth"

#: Compiles SAXPY (or argv's source, options and names) as a library would, without cache=, and reports.
_COMPILE = textwrap.dedent(
    """
    import hashlib, json, sys
    spec = json.loads(sys.argv[1])
    from cuda.core import Program, ProgramOptions
    import cuda.core
    p = Program(spec["src"], "c++", options=ProgramOptions(arch="sm_80", **spec.get("options", {})))
    original = cuda.core._program.Program
    out = {"isinstance": isinstance(p, original), "switched_class": type(p) is not original}
    try:
        obj = p.compile("cubin", tuple(spec.get("names", ())))
    except Exception as exc:
        out["error"] = [type(exc).__qualname__, str(exc)]
    else:
        out["sha"] = hashlib.sha256(bytes(obj.code)).hexdigest()
        out["name"] = obj.name
        out["mapping"] = sorted(str(k) for k in (obj.symbol_mapping or {}))
    sw = sys.modules.get("cuda_program_cas._cuda.switch")
    if sw is not None and sw._S.cache is not None:
        out["counters"] = sw._S.cache.counters()
    out["routed"] = sw.routed() if sw is not None else None
    print(json.dumps(out))
    """
)


def child(code: str, *args: str, env: dict[str, str | None], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ)
    for key, value in env.items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=full, check=False
    )


def report(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def compile_in_child(cache: Path | None, mode: str | None = "1", **spec: Any) -> tuple[dict[str, Any], str]:
    spec.setdefault("src", SAXPY)
    env = {"CUDA_PROGRAM_CAS": mode, "CUDA_PROGRAM_CAS_DIR": None if cache is None else str(cache)}
    done = child(_COMPILE, json.dumps(spec), env=env)
    return report(done), done.stderr


def warnings_in(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "cuda-program-cas:" in line]


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def test_the_environment_has_the_pth() -> None:
    """Regular and editable installs alike put the .pth at the top of site-packages (setup.py)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    found = [d for d in dirs if os.path.isfile(os.path.join(d, PTH))]
    assert found, f"{PTH} is in none of {dirs}: the switch cannot start in this environment"
    text = Path(found[0], PTH).read_text()
    assert text.startswith("import ") and text.count("\n") == 1, "site runs one line that begins with import"
    # tests/test_switch_start.py runs the installed copy: one older than the source tests the old one.
    source = Path(__file__).resolve().parent.parent / "cas" / "_cuda" / PTH
    assert text == source.read_text(), f"{found[0]}/{PTH} is not {source}: reinstall (pip install -e .)"


def test_a_plain_compile_is_stored_then_hit_by_a_fresh_interpreter(tmp_path: Path) -> None:
    cache = tmp_path / "cas"
    first, err = compile_in_child(cache)
    assert first["switched_class"] and first["isinstance"]
    assert first["counters"]["misses"] == 1 and first["counters"]["writes"] == 1, first
    assert first["counters"]["switched"] == 1 and first["routed"] == 1
    assert not warnings_in(err), err
    second, _ = compile_in_child(cache)
    # NVRTC did not run: one hit, no miss, nothing written; the same bytes and name.
    assert second["counters"]["hits"] == 1 and second["counters"]["misses"] == 0, second
    assert second["counters"]["writes"] == 0
    assert second["sha"] == first["sha"] and second["name"] == first["name"]
    uncached, _ = compile_in_child(None, mode=None)
    assert not uncached["switched_class"] and uncached["routed"] is None
    assert uncached["sha"] == first["sha"]


def test_a_compile_reading_headers_goes_through_the_front_door(tmp_path: Path) -> None:
    cache = tmp_path / "cas"
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "scale.h").write_text("#define SCALE 2.0f\n")
    src = '#include "scale.h"\nextern "C" __global__ void k(float* x) { x[0] *= SCALE; }\n'
    spec = {"src": src, "options": {"include_path": [str(inc)]}}
    first, _ = compile_in_child(cache, **spec)
    second, _ = compile_in_child(cache, **spec)
    assert first["counters"]["misses"] == 1 and second["counters"]["hits"] == 1, (first, second)
    assert second["sha"] == first["sha"]
    (inc / "scale.h").write_text("#define SCALE 3.0f\n")
    third, _ = compile_in_child(cache, **spec)
    assert third["counters"]["misses"] == 1 and third["counters"]["hits"] == 0, third
    uncached, _ = compile_in_child(None, mode=None, **spec)
    assert third["sha"] == uncached["sha"] != first["sha"]


def test_name_expressions_go_through_the_front_door(tmp_path: Path) -> None:
    cache = tmp_path / "cas"
    src = "template <typename T> __global__ void twice(T* x) { x[0] *= 2; }\n"
    spec = {"src": src, "names": ["twice<float>"]}
    first, _ = compile_in_child(cache, **spec)
    second, _ = compile_in_child(cache, **spec)
    assert second["counters"]["hits"] == 1 and second["mapping"] == first["mapping"] == ["twice<float>"]
    assert second["sha"] == first["sha"]


_LIBRARY = textwrap.dedent(
    """
    from cuda.core import Program, ProgramOptions

    def build(src, cache=None):
        return Program(src, "c++", options=ProgramOptions(arch="sm_80")).compile("cubin", cache=cache)
    """
)

_INSTALL = textwrap.dedent(
    """
    import json, sys
    src, own_dir = sys.argv[1], sys.argv[2]
    import before  # did `from cuda.core import Program` before install()
    import cuda.core
    import types
    shim = sys.modules["cuda.core.experimental"] = types.ModuleType("cuda.core.experimental")  # as older versions have
    shim.Program = cuda.core.Program
    import cuda_program_cas
    from cuda_program_cas._cuda import switch
    cuda_program_cas.install()
    out = {"installed": switch.installed()}
    out["before_rebound"] = before.Program is cuda.core.Program is not cuda.core._program.Program
    import after  # imports the name after install()
    out["after_rebound"] = after.Program is cuda.core.Program
    out["shim_rebound"] = shim.Program is cuda.core.Program
    out["internal_kept"] = sys.modules["cuda.core._program"].Program is not cuda.core.Program
    p = after.Program(src, "c++", options=after.ProgramOptions(arch="sm_80"))
    out["isinstance"] = isinstance(p, cuda.core._program.Program)
    before.build(src)
    after.build(src)
    out["routed_by_libraries"] = switch.routed()
    own = cuda_program_cas.ContentAddressedProgramCache(own_dir)
    before.build(src, cache=own)
    out["routed_with_own_cache"] = switch.routed()
    out["own_counters"] = own.counters()
    cuda_program_cas.uninstall()
    # (the original class read from cuda.core._program: a global of __main__ bound to it is rebound too)
    out["restored"] = [m.Program is cuda.core._program.Program for m in (cuda.core, before, after)]
    before.build(src)
    out["routed_after_uninstall"] = switch.routed()
    out["installed_after_uninstall"] = switch.installed()
    print(json.dumps(out))
    """
)


def test_install_covers_libraries_imported_before_and_after_and_uninstall_restores(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "before.py").write_text(_LIBRARY)
    (lib / "after.py").write_text(_LIBRARY)
    env = {"CUDA_PROGRAM_CAS": None, "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "cas"), "PYTHONPATH": str(lib)}
    out = report(child(_INSTALL, SAXPY, str(tmp_path / "own"), env=env))
    assert out["installed"] == "on"
    assert out["before_rebound"] and out["after_rebound"] and out["isinstance"]
    assert out["shim_rebound"] and out["internal_kept"]
    assert out["routed_by_libraries"] == 2
    # A cache the caller passes wins: the switch does not route that compile.
    assert out["routed_with_own_cache"] == 2
    assert out["own_counters"]["misses"] == 1 and out["own_counters"]["writes"] == 1
    assert out["restored"] == [True, True, True]
    assert out["routed_after_uninstall"] == 2 and out["installed_after_uninstall"] is None


def test_read_only_uses_hits_and_writes_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cas"
    out, err = compile_in_child(cache, mode="read-only")  # no cache yet: nothing to hit, nothing created
    assert out["sha"] and out["routed"] == 0 and files_under(cache) == [] and not warnings_in(err), (out, err)
    compile_in_child(cache)  # a writable process stores it
    before = files_under(cache)
    hit, err = compile_in_child(cache, mode="read-only")
    assert hit["counters"]["hits"] == 1 and hit["sha"] == out["sha"], hit
    other, _ = compile_in_child(
        cache, mode="read-only", options={"define_macro": "OTHER"}, src="#if OTHER\n" + SAXPY + "#endif\n"
    )
    assert other["counters"]["misses"] == 1 and other["counters"]["dropped_writes"] == 1, other
    assert other["counters"]["writes"] == 0
    assert files_under(cache) == before, "a read-only switch wrote to the cache"
    assert not warnings_in(err), err


_OFF = textwrap.dedent(
    """
    import json, sys
    at_start = sorted(m for m in sys.modules if m.startswith(("cuda_program_cas", "cuda.core")))
    import cuda.core
    print(json.dumps({
        "at_start": at_start,
        "after_cuda_core": sorted(m for m in sys.modules if m.startswith("cuda_program_cas")),
        "original": cuda.core.Program is cuda.core._program.Program,
    }))
    """
)


@pytest.mark.parametrize("value", [None, "0", ""])
def test_off_imports_nothing_and_changes_nothing(value: str | None) -> None:
    out = report(child(_OFF, env={"CUDA_PROGRAM_CAS": value}))
    assert out == {"at_start": [], "after_cuda_core": [], "original": True}


def test_on_imports_neither_cuda_core_nor_the_cache_at_start_up() -> None:
    out = report(child(_OFF, env={"CUDA_PROGRAM_CAS": "1"}))
    assert out["at_start"] == [] and not out["original"]
    assert "cuda_program_cas._cuda.switch" in out["after_cuda_core"]


def test_an_unknown_value_is_one_warning_and_off(tmp_path: Path) -> None:
    done = child(_OFF, env={"CUDA_PROGRAM_CAS": "yes please"})
    out = report(done)
    assert out["original"]
    assert len(warnings_in(done.stderr)) == 1 and "ignored" in done.stderr, done.stderr


def _break_layout(root: Path) -> None:
    compile_in_child(root)
    (root / "layout.json").unlink()
    (root / "layout.json").mkdir()


def _a_file(root: Path) -> None:
    root.write_text("not a directory")


@pytest.mark.parametrize("damage", [_break_layout, _a_file], ids=["layout.json a directory", "cache dir a file"])
def test_a_failing_cache_still_returns_the_uncached_result(tmp_path: Path, damage: Any) -> None:
    cache = tmp_path / "cas"
    damage(cache)
    uncached, _ = compile_in_child(None, mode=None)
    spec = {"src": SAXPY}
    twice = "\n".join([_COMPILE.replace("print(json.dumps(out))", 'obj2 = p.compile("cubin")\nprint(json.dumps(out))')])
    env = {"CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(cache)}
    done = child(twice, json.dumps(spec), env=env)
    out = report(done)
    assert out["sha"] == uncached["sha"]
    assert len(warnings_in(done.stderr)) == 1, done.stderr


_BAD = 'extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n'


@pytest.mark.parametrize("options", [{}, {"include_path": ["."]}], ids=["plain", "front door"])
def test_a_compile_error_propagates_as_uncached(tmp_path: Path, options: dict[str, Any]) -> None:
    cache = tmp_path / "cas"
    switched, err = compile_in_child(cache, src=_BAD, options=options)
    uncached, _ = compile_in_child(None, mode=None, src=_BAD, options=options)
    assert switched["error"] == uncached["error"] and "undefined_name" in uncached["error"][1]
    assert not warnings_in(err), err


@pytest.mark.parametrize(
    "call",
    ['compile("cubin")', 'compile("cubin", name_expressions=["k"])', 'compile("cubin")#include'],
    ids=["plain", "name expressions", "front door"],
)
def test_an_uncaught_compile_error_prints_its_traceback_and_nothing_else(tmp_path: Path, call: str) -> None:
    """The job's own error, as Python prints it: no "Error in sys.excepthook" blocks at the interpreter's end."""
    call, _, include = call.partition("#")
    extra = ', include_path=["."]' if include else ""
    code = (
        "from cuda.core import Program, ProgramOptions\n"
        f"Program({_BAD!r}, 'c++', ProgramOptions(arch='sm_80'{extra})).{call}\n"
    )
    done = child(code, env={"CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "cas")})
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr and "undefined_name" in done.stderr
    assert "NVRTC_ERROR_COMPILATION" in done.stderr
    assert "Error in sys.excepthook" not in done.stderr and "Original exception was" not in done.stderr, done.stderr
    assert not warnings_in(done.stderr), done.stderr


_LINK = textwrap.dedent(
    """
    import json, hashlib
    from cuda.core import Program, ProgramOptions, Linker, LinkerOptions
    import cuda.core
    src = 'extern "C" __global__ void k(float* x) { x[0] = 1; }'
    opts = ProgramOptions(arch="sm_80", relocatable_device_code=True, link_time_optimization=True)
    lto = Program(src, "c++", options=opts).compile("ltoir")
    linker = Linker(lto, options=LinkerOptions(arch="sm_80", link_time_optimization=True))
    out = linker.link("cubin")
    print(json.dumps({
        "isinstance": isinstance(linker, cuda.core._linker.Linker),
        "switched_class": type(linker) is not cuda.core._linker.Linker,
        "sha": hashlib.sha256(bytes(out.code)).hexdigest(),
    }))
    """
)


def test_linker_is_rebound_and_links(tmp_path: Path) -> None:
    env = {"CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "cas")}
    on = report(child(_LINK, env=env))
    off = report(child(_LINK, env={"CUDA_PROGRAM_CAS": None}))
    assert on["isinstance"] and on["switched_class"] and not off["switched_class"]
    assert on["sha"] == off["sha"]


@pytest.mark.parametrize("damage", [_break_layout, _a_file], ids=["layout.json a directory", "cache dir a file"])
def test_a_link_with_a_cache_that_cannot_open_links_uncached(tmp_path: Path, damage: Any) -> None:
    """The link half of the switch meets the same unopenable cache: the link's own result, one warning."""
    cache = tmp_path / "cas"
    damage(cache)
    off = report(child(_LINK, env={"CUDA_PROGRAM_CAS": None}))
    done = child(_LINK, env={"CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(cache)})
    assert report(done)["sha"] == off["sha"]
    assert len(warnings_in(done.stderr)) <= 1, done.stderr


def test_the_log_says_it_is_on(tmp_path: Path) -> None:
    log = tmp_path / "log"
    env = {"CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "cas"), "CUDA_PROGRAM_CAS_LOG": str(log)}
    report(child(_COMPILE, json.dumps({"src": SAXPY}), env=env))
    text = log.read_text()
    assert text.count("switch on") == 1 and str(tmp_path / "cas") in text, text
    # stats says so too: the lifetime counter, in its table and in --json.
    for args in ([], ["--json"]):
        shown = subprocess.run(
            [sys.executable, "-m", "cuda_program_cas", "stats", str(tmp_path / "cas"), *args],
            capture_output=True,
            text=True,
            check=False,
        )
        if args:
            assert json.loads(shown.stdout)["counters"]["switched"] == 1
        else:
            assert "switch       1 compiles and links sent here" in shown.stdout, shown.stdout


_FORK = textwrap.dedent(
    """
    import json, os, sys
    from cuda.core import Program, ProgramOptions
    from cuda_program_cas._cuda import switch

    def build(macro):
        src = "#if " + macro + "\\n" + sys.argv[1] + "#endif\\n"
        opts = ProgramOptions(arch="sm_80", define_macro=macro)
        return Program(src, "c++", options=opts).compile("cubin")

    build("PARENT")  # opens the process's cache
    pid = os.fork()
    if pid == 0:
        build("CHILD")  # the parent's cache, in the child: stores
        c = switch._S.cache.counters()
        os._exit(0 if c["writes"] == 2 and c["misses"] == 2 else 1)
    _, status = os.waitpid(pid, 0)
    build("CHILD")  # the child's entry
    print(json.dumps({"child_status": status, "counters": switch._S.cache.counters()}))
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_compiles_through_the_parent_s_cache(tmp_path: Path) -> None:
    env = {"CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "cas")}
    out = report(child(_FORK, SAXPY, env=env))
    assert out["child_status"] == 0
    assert out["counters"]["hits"] == 1 and out["counters"]["misses"] == 1, out


_EARLY = textwrap.dedent(
    """
    import json, sys
    import cuda_program_cas
    cuda_program_cas.install()
    out = {"cuda_core_imported_by_install": "cuda.core" in sys.modules}
    from cuda.core import Program
    import cuda.core
    out["rebound_on_import"] = Program is cuda.core.Program is not cuda.core._program.Program
    cuda_program_cas.uninstall()
    cuda_program_cas.install()
    cuda_program_cas.uninstall()
    out["restored"] = cuda.core.Program is cuda.core._program.Program
    print(json.dumps(out))
    """
)


def test_install_before_cuda_core_is_imported_waits_for_it(tmp_path: Path) -> None:
    env = {"CUDA_PROGRAM_CAS": None, "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "cas")}
    out = report(child(_EARLY, env=env))
    assert out == {"cuda_core_imported_by_install": False, "rebound_on_import": True, "restored": True}


_BAD_PTX = textwrap.dedent(
    """
    import json
    from cuda.core import Program, ProgramOptions
    try:
        Program("this is not ptx", "ptx", ProgramOptions(arch="sm_80")).compile("cubin")
    except Exception as exc:
        print(json.dumps([type(exc).__qualname__, str(exc)]))
    """
)


def test_a_ptx_compile_runs_uncached_and_its_error_propagates(tmp_path: Path) -> None:
    on = child(_BAD_PTX, env={"CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "cas")})
    off = child(_BAD_PTX, env={"CUDA_PROGRAM_CAS": None})
    assert report(on) == report(off)
    assert not warnings_in(on.stderr), on.stderr
    assert files_under(tmp_path / "cas") == []


#: Waits at a start gate (a byte on stdin), then compiles SAXPY as _COMPILE does.
_GATED = "import os, sys\nif os.read(0, 1) != b'g':\n    sys.exit('the test gave up before the start')\n" + _COMPILE


def test_processes_that_miss_a_plain_compile_at_once_run_nvrtc_once(tmp_path: Path) -> None:
    # The plain route (Program.compile(cache=) under the switch) holds the node's claim on the key
    # for the whole compile: however the four interleave, one misses and three hit.
    cache = tmp_path / "cache"
    gate = StartGate()
    env = dict(os.environ, CUDA_PROGRAM_CAS="1", CUDA_PROGRAM_CAS_DIR=str(cache))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GATED, json.dumps({"src": SAXPY})],
            stdin=gate.fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(4)
    ]
    try:
        gate.open(len(procs))
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        gate.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert len({r["sha"] for r in results}) == 1
    assert all("counters" in r for r in results), [err for _, err in outs]
    counted = [r["counters"] for r in results]
    assert sum(c["misses"] for c in counted) == 1, counted
    assert sum(c["hits"] for c in counted) == 3, counted
    assert sum(c["claim_hits"] for c in counted) == sum(c["claim_waits"] for c in counted)


def test_the_suite_itself_runs_with_the_switch_off() -> None:
    # conftest takes back what an operator's CUDA_PROGRAM_CAS=1 armed in this process at start-up.
    import cuda.core
    import cuda.core._program

    assert cuda.core.Program is cuda.core._program.Program
    assert not any(getattr(f, "cpcas_switch_hook", False) for f in sys.meta_path)


#: A hit of a header compile through the switch, then what the program object still does: reports whether NVRTC loaded.
_DEFERRED = textwrap.dedent(
    """
    import json, sys
    from cuda.core import Program, ProgramOptions
    spec = json.loads(sys.argv[1])
    def nvrtc_mapped():
        with open("/proc/self/maps") as fh:
            return "libnvrtc" in fh.read()
    p = Program(spec["src"], "c++", options=ProgramOptions(arch="sm_80", include_path=spec["include"]))
    out = {"closed_before": getattr(p, "is_closed", False)}  # cuda-core 1.1 has no is_closed
    code = bytes(p.compile("cubin").code)
    out["nvrtc_after_hit"] = nvrtc_mapped()
    out["backend"] = str(p.backend)  # made now, from the inputs as given
    out["nvrtc_after_backend"] = nvrtc_mapped()
    p.close()
    out["closed"] = getattr(p, "is_closed", True)
    try:
        p.compile("cubin")
    except Exception as exc:
        out["after_close"] = type(exc).__name__
    q = Program(spec["src"], "c++", options=ProgramOptions(arch="sm_80", include_path=spec["include"]))
    q.close()
    try:
        q.compile("cubin")
    except Exception as exc:
        out["closed_unmade"] = type(exc).__name__
    out["len"] = len(code)
    print(json.dumps(out))
    """
)


def test_a_hit_through_the_switch_does_not_load_nvrtc_and_the_program_still_works(tmp_path: Path) -> None:
    """``Program(...)`` under the switch makes NVRTC's program only when something needs it: a hit does not."""
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "scale.h").write_text("#define SCALE 2.0f\n")
    src = '#include "scale.h"\nextern "C" __global__ void k(float* x) { x[0] *= SCALE; }\n'
    env = {"CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "cas")}
    spec = json.dumps({"src": src, "include": [str(inc)]})
    report(child(_DEFERRED, spec, env=env))  # the miss stores (and its process loads NVRTC to compile)
    out = report(child(_DEFERRED, spec, env=env))
    closed_error = report(child(_DEFERRED, spec, env={"CUDA_PROGRAM_CAS": "0"}))["after_close"]
    if not hasattr(importlib.import_module("cuda.core").Program, "is_closed"):
        # cuda-core 1.1: a closed program's compile fails inside NVRTC (NVRTCError); one closed before
        # NVRTC's was made fails before it (ValueError). Either way a closed program does not compile.
        assert out["closed_unmade"] in ("ValueError", closed_error), out
        out["closed_unmade"] = closed_error
    assert out == {
        "closed_before": False,
        "nvrtc_after_hit": False,
        "backend": out["backend"],
        "nvrtc_after_backend": True,
        "closed": True,
        "after_close": closed_error,
        "closed_unmade": closed_error,
        "len": out["len"],
    }, out
    assert "NVRTC" in out["backend"].upper()
