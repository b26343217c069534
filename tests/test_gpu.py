"""End to end on a real GPU: binaries from the cache load, launch and compute the right thing.

Every test compiles in one process and loads the cached binary in a fresh one (a
new interpreter, a new CUDA context), then launches it and checks the result on
the host. The whole module is skipped, with the reason, where no CUDA driver and
GPU can be used (the probe runs in a subprocess, so a broken driver cannot take
the test run down). On the H200 machine this file takes about 15 s.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import SAXPY, cccl_or_skip, compile_program, is_root, run_python

from cuda_program_cas import CacheStore, digest_of

pytestmark = pytest.mark.gpu

_PROBE = r"""
from cuda.core import Device
dev = Device()
dev.set_current()
print("".join(str(i) for i in dev.compute_capability))
"""


@functools.cache
def _probe_gpu() -> tuple[str | None, str]:
    """(compute capability like "90", "") when a GPU is usable, else (None, why not)."""
    try:
        proc = run_python(_PROBE, timeout=120)
    except subprocess.TimeoutExpired:
        return None, "probing the CUDA driver timed out"
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return None, lines[-1] if lines else f"probe exited with status {proc.returncode}"
    return proc.stdout.strip().splitlines()[-1], ""


@pytest.fixture
def arch() -> str:
    """The GPU's ``sm_XY``; skips the test without a usable GPU and driver."""
    cc, why = _probe_gpu()
    if cc is None:
        pytest.skip(f"no usable CUDA GPU and driver: {why}")
    return f"sm_{cc}"


# The fresh process: compile through the cache (or look the key up by hand),
# launch saxpy on 1M floats, copy back and compare on the host. It prints one
# JSON report and exits 0 only when the result is right.
_CHILD = r"""
import ctypes, json, sys, warnings
import numpy as np
from cuda.bindings import driver, nvrtc
from cuda.core import Device, LaunchConfig, LegacyPinnedMemoryResource, ObjectCode, Program, ProgramOptions, launch
from cuda_program_cas import ContentAddressedProgramCache, digest_of

cfg = json.loads(sys.argv[1])
dev = Device()
dev.set_current()
stream = dev.create_stream()
cache = ContentAddressedProgramCache(
    cfg["cache"], shared=cfg.get("shared", []), read_only=cfg.get("read_only", False), max_size_bytes=None
)
opts = ProgramOptions(arch=cfg["arch"])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if cfg.get("via") == "key":
        from cuda.core.utils import make_program_cache_key

        key = make_program_cache_key(code=cfg["source"], code_type="c++", options=opts, target_type=cfg["target"])
        data = cache.get(key)
        obj = None if data is None else ObjectCode.from_cubin(data)
    else:
        obj = Program(cfg["source"], "c++", options=opts).compile(cfg["target"], cache=cache)
    if cfg.get("extra_miss"):
        # A compile the cache has never seen: a read-only cache compiles it and drops the write.
        other = Program(cfg["source"], "c++", options=ProgramOptions(arch=cfg["arch"], name="other")).compile(
            cfg["target"], cache=cache
        )
        dropped = len(bytes(other.code)) > 0 and cache.counters()["dropped_writes"] == 1
drv = driver.cuDriverGetVersion()[1]
_, major, minor = nvrtc.nvrtcVersion()
report = {
    "stats": {k: getattr(cache.stats(), k) for k in ("hits", "misses", "shared_hits", "writes", "dropped_writes")},
    "runtime_warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    "driver_version": drv,
    "nvrtc_version": [major, minor],
    "driver_can_load_ptx": major * 1000 + minor * 10 <= drv,
    "digest": None if obj is None else digest_of(obj.code.encode() if isinstance(obj.code, str) else bytes(obj.code)),
    "dropped": dropped if cfg.get("extra_miss") else None,
}
ok = obj is not None
if ok and cfg.get("launch", True):
    kernel = obj.get_kernel("saxpy")
    n = 1 << 20
    nbytes = n * 4
    pinned = LegacyPinnedMemoryResource()
    hx, hy, hout = (pinned.allocate(nbytes) for _ in range(3))
    view = lambda buf: np.ctypeslib.as_array((ctypes.c_float * n).from_address(int(buf.handle)))
    rng = np.random.default_rng(7)
    x = view(hx)
    x[:] = rng.random(n, dtype=np.float32) + 0.5
    y = view(hy)
    y[:] = rng.random(n, dtype=np.float32)
    dx, dy = dev.allocate(nbytes, stream=stream), dev.allocate(nbytes, stream=stream)
    hx.copy_to(dx, stream=stream)
    hy.copy_to(dy, stream=stream)
    a = np.float32(2.5)
    launch(stream, LaunchConfig(grid=(n + 255) // 256, block=256), kernel, a, dx, dy, np.int32(n))
    dy.copy_to(hout, stream=stream)
    stream.sync()
    got = view(hout)
    want = a * x + y
    report["max_rel_error"] = float(np.max(np.abs(got - want) / np.abs(want)))
    ok = bool(np.allclose(got, want, rtol=1e-6, atol=0))
report["ok"] = ok
print(json.dumps(report))
sys.exit(0 if ok else 1)
"""


def _run_child(**cfg: object) -> dict:
    cfg.setdefault("source", SAXPY)
    cfg.setdefault("target", "cubin")
    proc = run_python(_CHILD, json.dumps(cfg), timeout=180)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1])


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under root with its mode, size and mtime: any write shows up."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@contextlib.contextmanager
def _read_only_view(src: Path, where: Path):
    """A read-only bind mount of src where the test runs as root and mounts work; else src itself."""
    where.mkdir()
    mounted = False
    if is_root():
        first = subprocess.run(["mount", "--bind", str(src), str(where)], capture_output=True, check=False)
        if first.returncode == 0:
            mounted = True
            again = subprocess.run(["mount", "-o", "remount,bind,ro", str(where)], capture_output=True, check=False)
            if again.returncode != 0:
                subprocess.run(["umount", str(where)], check=False)
                mounted = False
    try:
        yield where if mounted else src, mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(where)], check=True)


def test_cubin_from_cache_launches_in_fresh_process(tmp_path: Path, arch: str) -> None:
    from cuda_program_cas import ContentAddressedProgramCache

    cache = ContentAddressedProgramCache(tmp_path / "cas")
    obj = compile_program(SAXPY, "cubin", cache=cache, arch=arch)
    first = cache.stats()
    assert (first.misses, first.writes, first.entries) == (1, 1, 1)
    stored = digest_of(bytes(obj.code))

    # Through Program.compile(cache=...): a hit, no write, the same bytes, and a kernel that computes.
    report = _run_child(cache=str(tmp_path / "cas"), arch=arch)
    assert report["stats"] == {"hits": 1, "misses": 0, "shared_hits": 0, "writes": 0, "dropped_writes": 0}
    assert report["digest"] == stored
    assert report["ok"] and report["max_rel_error"] < 1e-6

    # The manual make_program_cache_key path reads the same entry.
    report = _run_child(cache=str(tmp_path / "cas"), arch=arch, via="key")
    assert report["stats"]["hits"] == 1 and report["stats"]["misses"] == 0
    assert report["digest"] == stored and report["ok"]


def test_shared_store_read_only_serves_a_launchable_binary(tmp_path: Path, arch: str) -> None:
    from cuda_program_cas import ContentAddressedProgramCache

    shared = tmp_path / "shared"
    with ContentAddressedProgramCache(shared) as publisher:
        stored = digest_of(bytes(compile_program(SAXPY, "cubin", cache=publisher, arch=arch).code))
    os.chmod(shared, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    before = _tree(shared)

    with _read_only_view(shared, tmp_path / "ro") as (view, mounted):
        print(f"shared store read through a read-only bind mount: {mounted}")
        # A node with an empty local cache finds the binary in the shared store, copies it in, and runs it.
        local = tmp_path / "local"
        report = _run_child(cache=str(local), shared=[str(view)], arch=arch)
        assert report["stats"] == {"hits": 1, "misses": 0, "shared_hits": 1, "writes": 0, "dropped_writes": 0}
        assert report["digest"] == stored and report["ok"]
        assert len(CacheStore(local)) == 1  # the verified hit was copied into the local cache

        # The store itself opened read-only: the hit works, and a miss compiles with its write dropped.
        report = _run_child(cache=str(view), read_only=True, arch=arch, extra_miss=True)
        assert report["stats"] == {"hits": 1, "misses": 1, "shared_hits": 0, "writes": 0, "dropped_writes": 1}
        assert report["digest"] == stored and report["ok"] and report["dropped"]

    assert _tree(shared) == before, "a read of the shared store changed it"


def test_ptx_target_through_cache(tmp_path: Path, arch: str) -> None:
    """PTX is stored like any binary; the driver JIT-compiles it on load.

    cuda.core warns (RuntimeWarning, on a miss and on a hit alike) when the
    driver is older than the NVRTC that made the PTX: such a driver cannot load
    it. The child decides which case holds from the two version numbers, which it
    reads itself, and this test checks the behaviour that case calls for.
    """
    cache = str(tmp_path / "cas")
    miss = _run_child(cache=cache, arch=arch, target="ptx", launch=False)
    assert miss["stats"]["misses"] == 1 and miss["stats"]["writes"] == 1

    hit = _run_child(cache=cache, arch=arch, target="ptx", launch=miss["driver_can_load_ptx"])
    assert hit["stats"]["hits"] == 1 and hit["stats"]["misses"] == 0
    assert hit["digest"] == miss["digest"]
    print(
        f"driver CUDA {hit['driver_version']}, NVRTC {hit['nvrtc_version']}: driver can load the PTX: "
        f"{hit['driver_can_load_ptx']}; RuntimeWarnings on the hit: {hit['runtime_warnings']}"
    )
    if hit["driver_can_load_ptx"]:
        assert hit["runtime_warnings"] == []
        assert hit["ok"] and hit["max_rel_error"] < 1e-6
    else:
        assert len(hit["runtime_warnings"]) == 1 and "driver" in hit["runtime_warnings"][0]
        assert miss["runtime_warnings"] == hit["runtime_warnings"]


# The front door on the GPU: a CUB kernel through include_path and a template through
# name_expressions, compiled by one process, loaded and launched by a fresh one from a hit.
_FRONT_DOOR_CHILD = r"""
import ctypes, json, sys, time
import numpy as np
import cuda.core._program as program_mod
from cuda.core import Device, LaunchConfig, LegacyPinnedMemoryResource, ProgramOptions, launch
from cuda_program_cas import ContentAddressedProgramCache

cfg = json.loads(sys.argv[1])
compiles = []
original = program_mod._program_compile_uncached
program_mod._program_compile_uncached = lambda *a, **k: compiles.append(1) or original(*a, **k)
cache = ContentAddressedProgramCache(cfg["cache"])
t0 = time.perf_counter()
cub_opts = ProgramOptions(arch=cfg["arch"], std="c++17", include_path=[cfg["cccl"]])
cub = cache.compile(cfg["cub"], "c++", cub_opts, "cubin")
t1 = time.perf_counter()
names = ("twice<float>",)
tmpl = cache.compile(cfg["template"], "c++", ProgramOptions(arch=cfg["arch"]), "cubin", name_expressions=names)
symbols = {k: v.decode() for k, v in tmpl.symbol_mapping.items()}
report = {"compiles": len(compiles), "cub_ms": (t1 - t0) * 1e3, "symbols": symbols}
if cfg["launch"]:
    dev = Device()
    dev.set_current()
    stream = dev.create_stream()
    pinned = LegacyPinnedMemoryResource()
    n = 128 * 64
    hin, hout = pinned.allocate(n * 4), pinned.allocate(64 * 4)
    ints = lambda buf, k: np.ctypeslib.as_array((ctypes.c_int32 * k).from_address(int(buf.handle)))
    ints(hin, n)[:] = np.arange(n, dtype=np.int32) % 97
    din, dout = dev.allocate(n * 4, stream=stream), dev.allocate(64 * 4, stream=stream)
    hin.copy_to(din, stream=stream)
    launch(stream, LaunchConfig(grid=64, block=128), cub.get_kernel("block_sum"), din, dout)
    dout.copy_to(hout, stream=stream)
    hf = pinned.allocate(4 * 256)
    floats = np.ctypeslib.as_array((ctypes.c_float * 256).from_address(int(hf.handle)))
    floats[:] = np.arange(256, dtype=np.float32)
    df = dev.allocate(4 * 256, stream=stream)
    hf.copy_to(df, stream=stream)
    launch(stream, LaunchConfig(grid=1, block=256), tmpl.get_kernel("twice<float>"), df)
    hf2 = pinned.allocate(4 * 256)
    df.copy_to(hf2, stream=stream)
    stream.sync()
    want = (np.arange(n, dtype=np.int64) % 97).reshape(64, 128).sum(axis=1)
    report["cub_ok"] = bool((ints(hout, 64) == want).all())
    got = np.ctypeslib.as_array((ctypes.c_float * 256).from_address(int(hf2.handle)))
    report["template_ok"] = bool((got == 2 * np.arange(256, dtype=np.float32)).all())
print(json.dumps(report))
"""

_TEMPLATE = "template <class T> __global__ void twice(T *p) { p[threadIdx.x] = p[threadIdx.x] * 2; }"


def test_front_door_cub_and_template_launch_from_a_hit_in_a_fresh_process(tmp_path: Path, arch: str) -> None:
    from testkit.common import CUB_SOURCE

    cccl = cccl_or_skip()
    cfg = {"cache": str(tmp_path / "cas"), "arch": arch, "cccl": cccl, "cub": CUB_SOURCE, "template": _TEMPLATE}
    runs = []
    for launch_it in (False, True):
        proc = run_python(_FRONT_DOOR_CHILD, json.dumps({**cfg, "launch": launch_it}), timeout=300)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    miss, hit = runs
    print(f"front door, CUB kernel: miss {miss['cub_ms']:.0f} ms, hit in a fresh process {hit['cub_ms']:.1f} ms")
    assert miss["compiles"] == 2 and hit["compiles"] == 0
    assert hit["symbols"] == miss["symbols"] and "twice" in hit["symbols"]["twice<float>"]
    assert hit["cub_ok"] and hit["template_ok"]
