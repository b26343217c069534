"""``CUDA_PROGRAM_CAS=0``: the cache off everywhere, also for code that passes ``cache=`` (ccache's CCACHE_DISABLE).

Each compile runs in a fresh interpreter with real NVRTC and nvJitLink: the
variable is read when a cache is made, as a job would read it at its start.
Children report as JSON on their last line of stdout; each run of NVRTC is
counted through cuda.core's compile seam, so a hit cannot pass for a compile.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import SAXPY
from test_switch import child, files_under, report, warnings_in

from cuda_program_cas import ContentAddressedProgramCache, ReadOnlyCacheError

#: Compiles SAXPY three ways, each twice, through a cache at argv[1]: ``Program.compile(cache=)``, the
#: front door (a header), and a link of two LTO-IR inputs. Reports the bytes, NVRTC runs and counters.
_THREE_WAYS = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import cuda.core._program as program_mod
    from cuda.core import LinkerOptions, Program, ProgramOptions
    runs = []
    real = program_mod._program_compile_uncached
    def counted(*args, **kwargs):
        runs.append(1)
        return real(*args, **kwargs)
    program_mod._program_compile_uncached = counted
    from cuda_program_cas import ContentAddressedProgramCache
    root, inc = sys.argv[1], sys.argv[2]
    if sys.argv[3] == "install":
        import cuda_program_cas
        cuda_program_cas.install()
    cache = ContentAddressedProgramCache(root)
    opts = ProgramOptions(arch="sm_80")
    lto = ProgramOptions(arch="sm_80", relocatable_device_code=True, link_time_optimization=True)
    header = '#include "scale.h"\\nextern "C" __global__ void k(float* x) { x[0] *= SCALE; }\\n'
    caller = 'extern "C" __device__ int f(int x); extern "C" __global__ void k(int *p) { p[0] = f(p[1]); }'
    callee = 'extern "C" __device__ int f(int x) { return x * 3 + 1; }'
    sha = lambda obj: hashlib.sha256(bytes(obj.code)).hexdigest()
    out = {"plain": [], "front": [], "link": [], "bare": [], "runs": []}
    def step(name, run):
        n = len(runs)
        out[name].append(sha(run()))
        out["runs"][-1][name] = len(runs) - n
    for _ in range(2):
        out["runs"].append({})
        step("plain", lambda: Program(sys.argv[4], "c++", options=opts).compile("cubin", cache=cache))
        step("front", lambda: cache.compile(header, "c++", ProgramOptions(arch="sm_80", include_path=[inc]), "cubin"))
        objs = [Program(s, "c++", options=lto).compile("ltoir") for s in (caller, callee)]
        step("link", lambda: cache.link(objs, LinkerOptions(arch="sm_80", link_time_optimization=True), "cubin"))
        step("bare", lambda: Program(sys.argv[4], "c++", options=opts).compile("cubin"))
    out["counters"] = cache.counters()
    out["switched_off"] = cache.switched_off
    out["repr"] = repr(cache)
    sw = sys.modules.get("cuda_program_cas._cuda.switch")
    out["routed"] = sw.routed() if sw is not None else None
    out["exists"] = os.path.exists(root)
    print(json.dumps(out))
    """
)


def three_ways(tmp_path: Path, switch: str | None, how: str = "plain") -> tuple[dict[str, Any], str]:
    inc = tmp_path / "inc"
    inc.mkdir(exist_ok=True)
    (inc / "scale.h").write_text("#define SCALE 2.0f\n")
    root = tmp_path / "cas"
    done = child(
        _THREE_WAYS,
        str(root),
        str(inc),
        how,
        SAXPY,
        env={"CUDA_PROGRAM_CAS": switch, "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "default")},
    )
    return report(done), done.stderr


@pytest.mark.slow
def test_off_compiles_everything_uncached_and_neither_looks_up_nor_stores(tmp_path: Path) -> None:
    on, _ = three_ways(tmp_path, None)
    # Control: the same child with the cache on stores the first round and hits the second
    # (the bare compile passes no cache: NVRTC runs for it every round; a link runs nvJitLink).
    compiled = {"plain": 1, "front": 1, "link": 0, "bare": 1}
    assert (
        on["runs"] == [compiled, {"plain": 0, "front": 0, "link": 0, "bare": 1}]
        and on["counters"]["hits"] == 3
        and on["counters"]["writes"] >= 3
    ), on
    assert on["exists"] and not on["switched_off"]
    stored = files_under(tmp_path / "cas")

    off, err = three_ways(tmp_path, "0")
    assert off["switched_off"] and "switched off by CUDA_PROGRAM_CAS=0" in off["repr"]
    # Every compile ran NVRTC, both rounds, and gave the bytes of the cached run; the link's
    # bytes are those of the stored link, and no hit was counted for it.
    assert off["runs"] == [compiled, compiled], off
    for way in ("plain", "front", "link", "bare"):
        assert off[way] == on[way], way
    # Nothing looked up (not even a miss), nothing stored: three writes dropped a round, counted.
    counters = off["counters"]
    assert (counters["hits"], counters["misses"], counters["writes"]) == (0, 0, 0), counters
    assert counters["dropped_writes"] == 6, counters
    assert files_under(tmp_path / "cas") == stored  # the cache that was there is left as it was
    assert not warnings_in(err), err


@pytest.mark.slow
def test_off_creates_no_cache_and_wins_over_install(tmp_path: Path) -> None:
    off, err = three_ways(tmp_path, "0", how="install")
    compiled = {"plain": 1, "front": 1, "link": 0, "bare": 1}
    assert off["runs"] == [compiled, compiled] and off["counters"]["dropped_writes"] == 6, off
    assert not off["exists"] and not (tmp_path / "default").exists()  # neither the given cache nor the switch's
    assert off["routed"] == 0  # install() armed the switch; CUDA_PROGRAM_CAS=0 kept every compile off the cache
    assert not warnings_in(err), err


def test_a_cache_made_while_off_misses_what_it_holds_and_refuses_to_remove(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cas"
    with ContentAddressedProgramCache(root) as cache:
        cache["k"] = b"held"
    manifest = next(p for p in (root / "index").rglob("*") if p.is_file())
    before = manifest.stat().st_mtime_ns
    monkeypatch.setenv("CUDA_PROGRAM_CAS", "0")
    off = ContentAddressedProgramCache(root)
    assert off.get("k") is None and off.get("k", b"d") == b"d"
    with pytest.raises(KeyError):
        off["k"]
    off["k2"] = b"new"
    assert off.counters()["dropped_writes"] == 1 and off.counters()["misses"] == 0
    with pytest.raises(TypeError):
        off.get(3)  # type: ignore[arg-type]  # bad input is still bad input
    with pytest.raises(ReadOnlyCacheError, match=r"cannot clear: .* is switched off \(CUDA_PROGRAM_CAS=0\)"):
        off.clear()
    with pytest.raises(ReadOnlyCacheError, match="cannot delete"):
        del off["k"]
    with pytest.raises(ReadOnlyCacheError, match="cannot give its store"):
        _ = off.store
    # It holds nothing it would give, and read nothing on disk to say so.
    assert len(off) == 0 and off.stats().entries == 0 and off.stats().dropped_writes == 1
    assert manifest.stat().st_mtime_ns == before and off.path == str(root)
    with pytest.raises(ValueError, match="max_size_bytes"):
        ContentAddressedProgramCache(root, max_size_bytes=0)  # bad input is bad input, on or off
    # Read once, when a cache is made: the one made before stays on.
    assert cache.get("k") == b"held"
    monkeypatch.setenv("CUDA_PROGRAM_CAS", "1")
    assert ContentAddressedProgramCache(root).get("k") == b"held"
    monkeypatch.setenv("CUDA_PROGRAM_CAS", "yes")  # not 0: the cache is on (the switch warns about the value)
    assert ContentAddressedProgramCache(root).get("k") == b"held"
