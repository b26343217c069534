"""cuda.compute algorithm builds as cache entries: real builds with real NVRTC and nvJitLink, in fresh processes.

Every build is ahead of time (``compute_capability=``, ``ProxyArray`` arguments):
this machine has no GPU. Where no CUDA driver loads, each worker process gets a
stub ``libcuda.so.1`` first on ``LD_LIBRARY_PATH`` (``tools/testkit/cudastub.py``: built
here with gcc from the driver symbols cuda.compute's shared object imports, each
failing with CUDA_ERROR_NO_DEVICE), for the bindings' import only: nothing here
launches. Builds are not byte-reproducible (NVRTC's internal names embed a
per-process id), so the tests compare behaviour: what was built, whether it
loads, its cubins' sizes, and how many builds a process ran (cuda.compute's
``call_compile``, counted by wrapping it in the worker).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, run_python

if importlib.util.find_spec("cuda.compute") is None:  # not imported here: without a driver it warns
    pytest.skip("cuda-cccl is not installed", allow_module_level=True)

_WORKER = r"""
import json, os, sys
spec = json.loads(sys.argv[1])
import numpy as np
import cuda.compute as cc
from cuda.compute import ProxyArray, ProxyValue, OpKind
import cuda.compute._cccl_interop as interop

builds = [0]
_compile = interop.call_compile
def counted(*a, **k):
    builds[0] += 1
    return _compile(*a, **k)
interop.call_compile = counted

from cuda_program_cas import ContentAddressedProgramCache
cache = None if spec["via"] == "switch" else ContentAddressedProgramCache(spec["dir"])

def make(factory, **kw):
    if spec["via"] == "switch":
        return factory(**kw)  # the switch routes cuda.compute's own factories
    return cache.build(factory, **kw)

if spec.get("gate"):  # imported: say so, and look up only when told (both workers at once)
    print("ready", flush=True)
    sys.stdin.readline()

made = {}
i32 = np.int32
for name in spec["algos"]:
    cap = tuple(spec.get("cc", (9, 0)))
    if name == "reduce":
        ns = {"np": np}
        exec(spec.get("op", "def add(a, b):\n    return a + b\n"), ns)
        op = next(v for k, v in ns.items() if callable(v) and k != "np")
        made[name] = make(cc.make_reduce_into, d_in=ProxyArray(i32), d_out=ProxyArray(i32), op=op,
                          h_init=ProxyValue(i32), compute_capability=cap)
    elif name == "scan":
        made[name] = make(cc.make_exclusive_scan, d_in=ProxyArray(i32), d_out=ProxyArray(i32), op=OpKind.PLUS,
                          init_value=ProxyValue(i32), compute_capability=cap)
    elif name == "max":
        made[name] = make(cc.make_exclusive_scan, d_in=ProxyArray(i32), d_out=ProxyArray(i32), op=OpKind.MAXIMUM,
                          init_value=ProxyValue(i32), compute_capability=cap)
    elif name == "opaque":
        import types
        o = types.ModuleType("settings")  # a module this cache does not follow: its attributes could be anything
        o.scale = 3
        def scaled(a, b):
            return a + b * o.scale
        made[name] = make(cc.make_reduce_into, d_in=ProxyArray(i32), d_out=ProxyArray(i32), op=scaled,
                          h_init=ProxyValue(i32), compute_capability=cap)
    elif name == "prebuild":
        made.update({f"pre{a}{b}": v for (a, b), v in cache.prebuild(
            cc.make_exclusive_scan, compute_capabilities=spec["ccs"], d_in=ProxyArray(i32), d_out=ProxyArray(i32),
            op=OpKind.PLUS, init_value=ProxyValue(i32)).items()})

def shape(algo):
    # What a build is, without its bytes: its class, its architectures, its cubins' sizes, its blob's size.
    results = algo.build_results
    again = cc.deserialize(cc.serialize(algo))  # a hit's algorithm serializes, and that loads again
    cubins = [len(results[k]._get_cubin()) for k in sorted(results)]
    return {"type": type(algo).__name__, "ccs": sorted(results), "cubins": cubins,
            "blob": len(cc.serialize(algo)), "again": type(again).__name__}

if spec["via"] == "switch":
    from cuda_program_cas._cuda import switch
    opened = switch._process_cache()
    counters = opened.counters() if opened is not None else {}
else:
    counters = cache.counters()
from cuda_program_cas._cuda.compute import uncacheable_count
print(json.dumps({"builds": builds[0], "counters": counters, "shapes": {k: shape(v) for k, v in made.items()},
                  "uncacheable": uncacheable_count()}))
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment a worker imports cuda.compute with: a stub driver first where no driver loads."""
    from testkit.cudastub import driver_env

    return driver_env(tmp_path_factory.mktemp("cudastub"))


def _run(spec: dict[str, Any], driver: dict[str, str], **env: str) -> dict[str, Any]:
    proc = run_python(_WORKER, json.dumps(spec), env={**driver, "PYTHONPATH": str(REPO), **env}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory, driver: dict[str, str]) -> tuple[Path, dict[str, Any]]:
    """A cache one process filled: a reduction with a Python op and a scan with OpKind.PLUS."""
    root = tmp_path_factory.mktemp("compute") / "cas"
    return root, _run({"via": "build", "dir": str(root), "algos": ["reduce", "scan"]}, driver)


def test_a_second_process_loads_the_builds_without_building(filled: tuple[Path, dict[str, Any]], driver) -> None:
    root, first = filled
    assert first["builds"] == 2
    assert first["counters"]["misses"] == 2 and first["counters"]["writes"] == 2
    second = _run({"via": "build", "dir": str(root), "algos": ["reduce", "scan"]}, driver)
    assert second["builds"] == 0
    assert second["counters"]["hits"] == 2 and second["counters"]["misses"] == 0
    # The same algorithms, loaded: same classes, architectures and cubin sizes; each serializes and loads again.
    assert second["shapes"] == first["shapes"]
    assert second["shapes"]["reduce"]["ccs"] == [90] and second["shapes"]["reduce"]["again"] == "_Reduce"


def test_a_changed_op_or_opkind_is_another_key_and_a_build(filled: tuple[Path, dict[str, Any]], driver) -> None:
    root, _first = filled
    changed = "def add(a, b):\n    return a + b + 1\n"
    out = _run({"via": "build", "dir": str(root), "algos": ["reduce", "max"], "op": changed}, driver)
    assert out["builds"] == 2
    assert out["counters"]["misses"] == 2 and out["counters"]["hits"] == 0
    from cuda_program_cas import explain

    reduce, scan = explain(root).misses[-2:]  # each named by what changed against its own earlier build
    assert reduce.summary == "code changed" and reduce.via == "compute"
    assert scan.verdict == "changed" and scan.summary.startswith("option op: ")


def test_the_switch_routes_cuda_computes_own_factories(tmp_path: Path, driver) -> None:
    env = {"CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "cas")}
    first = _run({"via": "switch", "algos": ["scan"]}, driver, **env)
    assert first["builds"] == 1 and first["counters"]["writes"] == 1 and first["counters"]["switched"] == 1
    second = _run({"via": "switch", "algos": ["scan"]}, driver, **env)
    assert second["builds"] == 0 and second["counters"]["hits"] == 1
    assert second["shapes"] == first["shapes"]
    off = _run({"via": "switch", "algos": ["scan"]}, driver, **{**env, "CUDA_PROGRAM_CAS": "0"})
    assert off["builds"] == 1  # switched off: cuda.compute as it is


def test_an_op_reading_an_opaque_object_builds_uncached_and_explain_names_it(tmp_path: Path, driver) -> None:
    from cuda_program_cas import explain

    root = tmp_path / "cas"
    out = _run({"via": "build", "dir": str(root), "algos": ["opaque"]}, driver)
    assert out["builds"] == 1 and out["uncacheable"] == 1
    assert out["counters"]["writes"] == 0 and out["counters"]["dropped_writes"] == 1
    assert out["shapes"]["opaque"]["type"] == "_Reduce"  # built as without the cache
    (miss,) = explain(root).misses
    assert miss.verdict == "uncacheable" and miss.via == "compute"
    assert "global 'o'" in miss.summary and "module 'settings'" in miss.summary


def test_a_stored_build_that_does_not_load_is_built_again(tmp_path: Path, driver) -> None:
    from cuda_program_cas import CacheStore, explain

    root = tmp_path / "cas"
    first = _run({"via": "build", "dir": str(root), "algos": ["scan"]}, driver)
    assert first["builds"] == 1
    store = CacheStore(root)
    (miss,) = explain(root).misses  # the journal names the entry the build stored
    kid = miss.key_id
    store.inner.put_id(kid, b"cpcas-compute/1\0make_exclusive_scan\0not a build")
    store.close()
    again = _run({"via": "build", "dir": str(root), "algos": ["scan"]}, driver)
    assert again["builds"] == 1 and again["shapes"] == first["shapes"]
    third = _run({"via": "build", "dir": str(root), "algos": ["scan"]}, driver)
    assert third["builds"] == 0  # the build stored over the damaged one


def test_prebuild_fills_each_architecture_for_a_gpu_of_it(tmp_path: Path, driver) -> None:
    root = tmp_path / "cas"
    pre = _run({"via": "build", "dir": str(root), "algos": ["prebuild"], "ccs": [[8, 0], [9, 0]]}, driver)
    assert pre["builds"] == 2 and pre["counters"]["writes"] == 2
    assert pre["shapes"]["pre80"]["ccs"] == [80] and pre["shapes"]["pre90"]["ccs"] == [90]
    # A node of compute capability 8.0 building the same scan for itself: keyed as its GPU would key it.
    node = _run({"via": "build", "dir": str(root), "algos": ["scan"], "cc": [8, 0]}, driver)
    assert node["builds"] == 0 and node["counters"]["hits"] == 1


def test_a_fresh_node_gets_the_builds_through_a_shared_store_and_its_warm_set(tmp_path: Path, driver) -> None:
    from cuda_program_cas import CacheStore

    shared = tmp_path / "shared"
    CacheStore(shared).close()  # laid out: a directory store
    job = {"CUDA_PROGRAM_CAS_JOB": "compute-test"}
    first = _run(
        {"via": "build", "dir": str(tmp_path / "a"), "algos": ["scan"]},
        driver,
        CUDA_PROGRAM_CAS_SHARED=f"{shared}|write",
        **job,
    )
    assert first["builds"] == 1
    cold = _run(
        {"via": "build", "dir": str(tmp_path / "b"), "algos": ["scan"]},
        driver,
        CUDA_PROGRAM_CAS_SHARED=str(shared),
        **job,
    )
    assert cold["builds"] == 0 and cold["counters"]["shared_hits"] == 1
    assert cold["shapes"] == first["shapes"]


def test_two_processes_that_miss_at_once_build_once(tmp_path: Path, driver) -> None:
    import os

    spec = json.dumps({"via": "build", "dir": str(tmp_path / "cas"), "algos": ["scan"], "gate": True})
    env = {**os.environ, **driver, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    for proc in procs:  # both imported cuda.compute: now both look the key up at once
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert sorted(o["builds"] for o in outs) == [0, 1]
    assert sum(o["counters"]["claim_hits"] for o in outs) == 1


def test_the_switch_costs_a_process_that_never_imports_cuda_compute_nothing() -> None:
    code = (
        "import json, sys\nimport cuda.core\n"
        "pending = [sorted(f.pending) for f in sys.meta_path if getattr(f, 'cpcas_switch_hook', False)]\n"
        "ours = sorted(m for m in sys.modules if m.startswith(('cuda_program_cas', 'cuda.compute')))\n"
        "print(json.dumps({'modules': ours, 'pending': pending}))\n"
    )
    proc = run_python(code, env={"CUDA_PROGRAM_CAS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["pending"]) == 1 and "cuda.compute.algorithms" in out["pending"][0]  # the start-up hook waits
    assert "cuda_program_cas._cuda.switch" in out["modules"]  # the switch is on
    # Nothing of cuda.compute's routing is imported before cuda.compute is: not its module, not the store.
    for module in ("cuda_program_cas._cuda.compute", "cuda_program_cas._store.store", "cuda.compute"):
        assert module not in out["modules"]
