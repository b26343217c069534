"""cuda.compute builds from the cache launch and compute the right thing, on a real GPU (skipped without one).

Each test builds in one fresh process and loads in another (a new interpreter,
a new CUDA context), launches on CuPy arrays and checks the result against
NumPy on the host. The probe runs in a subprocess, as in tests/test_gpu.py. The
ahead-of-time case is the one this CPU machine cannot check: an algorithm
prebuilt for the GPU's architecture with ``ProxyArray`` arguments must be what a
build for the device loads, and run right.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, run_python
from test_gpu import _probe_gpu

pytestmark = pytest.mark.gpu

if importlib.util.find_spec("cuda.compute") is None or importlib.util.find_spec("cupy") is None:
    pytest.skip("cuda-cccl and cupy are needed", allow_module_level=True)

_CHILD = r"""
import json, sys
import numpy as np
import cupy as cp
import cuda.compute as cc
import cuda.compute._cccl_interop as interop
from cuda.compute import OpKind, ProxyArray, ProxyValue, SortOrder
from cuda_program_cas import ContentAddressedProgramCache

cfg = json.loads(sys.argv[1])
builds = [0]
for name in ("call_build", "call_compile"):
    real = getattr(interop, name)
    def counted(*a, _real=real, **k):
        builds[0] += 1
        return _real(*a, **k)
    setattr(interop, name, counted)
cache = ContentAddressedProgramCache(cfg["cache"])
i32 = np.int32

def add(a, b):
    return a + b

if cfg["step"] == "prebuild":
    cache.prebuild(cc.make_reduce_into, compute_capabilities=[tuple(cfg["cc"])], d_in=ProxyArray(i32),
                   d_out=ProxyArray(i32), op=add, h_init=ProxyValue(i32))
    cache.prebuild(cc.make_radix_sort, compute_capabilities=[tuple(cfg["cc"])], d_in_keys=ProxyArray(i32),
                   d_out_keys=ProxyArray(i32), d_in_values=None, d_out_values=None, order=SortOrder.ASCENDING)
    print(json.dumps({"builds": builds[0], "ok": True}))
    sys.exit(0)

h = np.random.default_rng(1).integers(0, 1000, 100_000, dtype=i32)
d_in, d_out = cp.asarray(h), cp.empty(1, i32)
init = np.zeros(1, i32)
reduce = cache.build(cc.make_reduce_into, d_in=d_in, d_out=d_out, op=add, h_init=init)
nbytes = reduce(temp_storage=None, d_in=d_in, d_out=d_out, num_items=h.size, op=add, h_init=init)
reduce(temp_storage=cp.empty(nbytes, np.uint8), d_in=d_in, d_out=d_out, num_items=h.size, op=add, h_init=init)
ok = int(d_out.get()[0]) == int(h.sum(dtype=i32))
keys = cp.empty(h.size, i32)
sort = cache.build(cc.make_radix_sort, d_in_keys=d_in, d_out_keys=keys, d_in_values=None, d_out_values=None,
                   order=SortOrder.ASCENDING)
args = dict(d_in_keys=d_in, d_out_keys=keys, d_in_values=None, d_out_values=None, num_items=h.size)
nbytes = sort(temp_storage=None, **args)
sort(temp_storage=cp.empty(max(nbytes, 1), np.uint8), **args)
ok = ok and bool(np.array_equal(keys.get(), np.sort(h)))
print(json.dumps({"builds": builds[0], "ok": ok, "counters": cache.counters()}))
"""


@pytest.fixture
def cc() -> list[int]:
    found, why = _probe_gpu()
    if found is None:
        pytest.skip(f"no usable CUDA GPU and driver: {why}")
    return [int(found[:-1]), int(found[-1])]


def _run(cfg: dict[str, Any]) -> dict[str, Any]:
    proc = run_python(_CHILD, json.dumps(cfg), env={"PYTHONPATH": str(REPO)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_a_loaded_build_runs_right_in_a_fresh_process(tmp_path: Path, cc: list[int]) -> None:
    first = _run({"step": "run", "cache": str(tmp_path / "cas")})
    assert first["ok"] and first["builds"] >= 2
    second = _run({"step": "run", "cache": str(tmp_path / "cas")})
    assert second["ok"] and second["builds"] == 0 and second["counters"]["hits"] == 2


def test_an_ahead_of_time_build_for_the_gpus_architecture_is_what_it_loads_and_runs_right(
    tmp_path: Path, cc: list[int]
) -> None:
    pre = _run({"step": "prebuild", "cache": str(tmp_path / "cas"), "cc": cc})
    assert pre["builds"] >= 2
    run = _run({"step": "run", "cache": str(tmp_path / "cas")})
    assert run["ok"] and run["builds"] == 0 and run["counters"]["hits"] == 2
