"""``Program.compile(cache=...)`` end to end with real NVRTC, cubin and ltoir.

A miss compiles and stores; a hit returns byte-identical code without running
NVRTC. "Without running NVRTC" is proven through the seam cuda-core provides for
exactly this: ``cuda.core._program._program_compile_uncached`` is looked up on
every compile, so replacing it with a function that counts (or raises) shows
whether a compile happened.
"""

from __future__ import annotations

import hashlib
import textwrap
from collections.abc import Callable
from pathlib import Path

import cuda.core._program as program_mod
import pytest
from conftest import SAXPY, compile_program, run_python

from cuda_program_cas import ContentAddressedProgramCache

TARGETS = ["cubin", "ltoir"]


class NvrtcCalls:
    """Counts calls through the compile seam; ``forbid()`` makes any call fail the test."""

    def __init__(self, original: Callable[..., object]) -> None:
        self.original = original
        self.count = 0
        self.forbidden = False

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.count += 1
        if self.forbidden:
            raise AssertionError("NVRTC was called on what should have been a cache hit")
        return self.original(*args, **kwargs)

    def forbid(self) -> None:
        self.forbidden = True


@pytest.fixture
def nvrtc(monkeypatch: pytest.MonkeyPatch) -> NvrtcCalls:
    calls = NvrtcCalls(program_mod._program_compile_uncached)
    monkeypatch.setattr(program_mod, "_program_compile_uncached", calls)
    return calls


@pytest.fixture(scope="module")
def uncached() -> dict[str, bytes]:
    """The code NVRTC produces for SAXPY per target, compiled without any cache."""
    return {target: bytes(compile_program(target=target).code) for target in TARGETS}


def test_seam_counts_real_compiles(nvrtc: NvrtcCalls) -> None:
    # Without this, every "no NVRTC call" assertion below could pass vacuously.
    compile_program(target="cubin")
    assert nvrtc.count == 1
    nvrtc.forbid()
    with pytest.raises(AssertionError, match="NVRTC was called"):
        compile_program(target="cubin")


@pytest.mark.parametrize("target", TARGETS)
def test_miss_stores_hit_is_identical_without_nvrtc(
    cache_dir: Path, nvrtc: NvrtcCalls, uncached: dict[str, bytes], target: str
) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    first = compile_program(target=target, cache=cache)
    assert nvrtc.count == 1
    assert bytes(first.code) == uncached[target]
    stats = cache.stats()
    assert (stats.misses, stats.writes, stats.hits, stats.entries, stats.blobs) == (1, 1, 0, 1, 1)
    # The blob on disk is the binary verbatim (cuobjdump can read it).
    blobs = [p for p in (cache_dir / "blobs").rglob("*") if p.is_file()]
    assert [p.read_bytes() for p in blobs] == [uncached[target]]

    nvrtc.forbid()
    second = compile_program(target=target, cache=cache)
    assert bytes(second.code) == uncached[target]
    assert second.code_type == first.code_type == target
    assert nvrtc.count == 1
    assert cache.stats().hits == 1


@pytest.mark.parametrize("target", TARGETS)
def test_hit_across_close_and_reopen(
    cache_dir: Path, nvrtc: NvrtcCalls, uncached: dict[str, bytes], target: str
) -> None:
    with ContentAddressedProgramCache(cache_dir) as cache:
        compile_program(target=target, cache=cache)
    cache.close()
    assert nvrtc.count == 1
    nvrtc.forbid()
    with ContentAddressedProgramCache(cache_dir) as reopened:
        obj = compile_program(target=target, cache=reopened)
        assert bytes(obj.code) == uncached[target]
        assert reopened.stats().hits == 1
        assert reopened.stats().misses == 0


def test_different_options_are_different_keys(cache_dir: Path, nvrtc: NvrtcCalls) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    sm80 = compile_program(target="cubin", cache=cache, arch="sm_80")
    sm90 = compile_program(target="cubin", cache=cache, arch="sm_90")
    assert nvrtc.count == 2
    assert bytes(sm80.code) != bytes(sm90.code)
    nvrtc.forbid()
    assert bytes(compile_program(target="cubin", cache=cache, arch="sm_90").code) == bytes(sm90.code)
    assert bytes(compile_program(target="cubin", cache=cache, arch="sm_80").code) == bytes(sm80.code)
    assert cache.stats().entries == 2


def test_a_corrupt_entry_recompiles_and_heals(cache_dir: Path, nvrtc: NvrtcCalls, uncached: dict[str, bytes]) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    compile_program(target="cubin", cache=cache)
    (blob,) = [p for p in (cache_dir / "blobs").rglob("*") if p.is_file()]
    data = bytearray(blob.read_bytes())
    data[100] ^= 0x01
    blob.write_bytes(bytes(data))
    obj = compile_program(target="cubin", cache=cache)  # a miss: NVRTC runs again
    assert nvrtc.count == 2
    assert bytes(obj.code) == uncached["cubin"]
    assert cache.stats().corrupt == 1
    nvrtc.forbid()
    assert bytes(compile_program(target="cubin", cache=cache).code) == uncached["cubin"]


_CHILD = textwrap.dedent(
    """
    import hashlib, sys
    import cuda.core._program as program_mod
    from conftest import compile_program
    from cuda_program_cas import ContentAddressedProgramCache

    def no_nvrtc(*args, **kwargs):
        print("NVRTC called", file=sys.stderr)
        sys.exit(3)

    program_mod._program_compile_uncached = no_nvrtc
    with ContentAddressedProgramCache(sys.argv[1]) as cache:
        obj = compile_program(target=sys.argv[2], cache=cache)
        stats = cache.stats()
    if (stats.hits, stats.misses, stats.writes) != (1, 0, 0):
        print(stats, file=sys.stderr)
        sys.exit(4)
    print(hashlib.sha256(bytes(obj.code)).hexdigest())
    """
)


@pytest.mark.parametrize("target", TARGETS)
def test_hit_in_a_fresh_process(cache_dir: Path, uncached: dict[str, bytes], target: str) -> None:
    with ContentAddressedProgramCache(cache_dir) as cache:
        compile_program(target=target, cache=cache)
    tests_dir = str(Path(__file__).resolve().parent)
    result = run_python(_CHILD, str(cache_dir), target, env={"PYTHONPATH": tests_dir})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == hashlib.sha256(uncached[target]).hexdigest()


def test_fresh_process_on_an_empty_cache_does_compile(cache_dir: Path) -> None:
    # The child's exit status 3 is reachable: the check above is not vacuous.
    ContentAddressedProgramCache(cache_dir)
    tests_dir = str(Path(__file__).resolve().parent)
    result = run_python(_CHILD, str(cache_dir), "cubin", env={"PYTHONPATH": tests_dir})
    assert result.returncode == 3, result.stderr


def test_source_change_is_a_miss(cache_dir: Path, nvrtc: NvrtcCalls) -> None:
    cache = ContentAddressedProgramCache(cache_dir)
    compile_program(SAXPY, target="cubin", cache=cache)
    changed = SAXPY.replace("a * x[i] + y[i]", "a * x[i] - y[i]")
    compile_program(changed, target="cubin", cache=cache)
    assert nvrtc.count == 2
    assert cache.stats().blobs == 2
