"""``cache.link(...)``: ``Linker(...).link(target)`` through the cache, with real NVRTC and nvJitLink.

The inputs are LTO-IR compiled by NVRTC; both NVRTC and nvJitLink run without a
GPU. Every result is checked against the uncached link of the same inputs (bytes,
code type, name, symbol mapping, or the exception's type). Hits are proven not
to link: in this process by counting the linkers cuda-core creates, in a fresh
process by a linker (and nvJitLink bindings) that raise when used.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import is_root, run_python
from cuda.core import Linker, LinkerOptions, ObjectCode, Program, ProgramOptions

from cuda_program_cas import ContentAddressedProgramCache
from cuda_program_cas._cuda.cache import inner_of

CALLER = r'extern "C" __device__ int f(int x); extern "C" __global__ void k(int *p) { p[0] = f(p[1]); }'
CALLEE = r'extern "C" __device__ int f(int x) { return x * 3 + 1; }'
OTHER_CALLEE = r'extern "C" __device__ int f(int x) { return x * 5 + 2; }'
LTO = {"arch": "sm_80", "link_time_optimization": True}


def ltoir(source: str) -> ObjectCode:
    options = ProgramOptions(arch="sm_80", relocatable_device_code=True, link_time_optimization=True)
    return Program(source, "c++", options=options).compile("ltoir")


class Objects(list):  # type: ignore[type-arg]
    """Object codes whose repr does not load them.

    ``ObjectCode``'s repr loads the module through the driver; without a GPU that
    fails, and a second try hangs. pytest reprs a failing frame's arguments.
    """

    def __repr__(self) -> str:
        return "Objects(" + ", ".join(f"{getattr(o, 'code_type', o)!r}:{getattr(o, 'name', '')!r}" for o in self) + ")"


class Inputs(dict):  # type: ignore[type-arg]
    def __repr__(self) -> str:
        return f"Inputs({sorted(self)})"


@pytest.fixture(scope="module")
def objects() -> Inputs:
    return Inputs(caller=ltoir(CALLER), callee=ltoir(CALLEE), other=ltoir(OTHER_CALLEE))


class Links:
    """Counts the linkers cuda-core creates (each link still runs)."""

    def __init__(self, real: Any) -> None:
        self.count = 0
        counter = self

        class Counting:
            which_backend = real.which_backend  # names the backend; links nothing

            def __new__(cls, *objects: Any, options: Any = None) -> Any:
                counter.count += 1
                return real(*objects, options=options)

        self.linker = Counting


@pytest.fixture
def links(monkeypatch: pytest.MonkeyPatch) -> Links:
    import cuda.core._linker as linker_module

    counted = Links(linker_module.Linker)
    monkeypatch.setattr(linker_module, "Linker", counted.linker)
    return counted


def outcome(call: Any) -> tuple[Any, ...]:
    """What a link gives: its result's observable attributes, or its exception's type."""
    try:
        obj = call()
    except Exception as exc:
        return ("raised", type(exc))
    return ("linked", bytes(obj.code), obj.code_type, obj.name, obj.symbol_mapping)


def uncached(objs: Objects, options: LinkerOptions, target: str = "cubin") -> tuple[Any, ...]:
    return outcome(lambda: Linker(*objs, options=options).link(target))


def cached(
    cache: ContentAddressedProgramCache, objs: Objects, options: LinkerOptions, target: str = "cubin"
) -> tuple[Any, ...]:
    return outcome(lambda: cache.link(objs, options, target))


def test_a_miss_links_and_stores_and_a_hit_returns_the_same_without_linking(
    cache_dir: Path, objects: Inputs, links: Links
) -> None:
    objs, options = Objects([objects["caller"], objects["callee"]]), LinkerOptions(**LTO)
    reference = uncached(objs, options)
    assert reference[0] == "linked" and reference[2] == "cubin"
    cache = ContentAddressedProgramCache(cache_dir)
    assert cached(cache, objs, options) == reference
    assert links.count == 1
    assert cache.counters()["misses"] == 1 and cache.counters()["writes"] == 1
    for _ in range(3):
        assert cached(cache, objs, options) == reference
    assert links.count == 1
    assert cache.counters()["hits"] == 3 and cache.counters()["misses"] == 1
    # PTX out of an LTO link, and a name of the caller's: the hit gives both back.
    ptx = LinkerOptions(**LTO, ptx=True, name="mine")
    assert cached(cache, objs, ptx, "ptx") == uncached(objs, ptx, "ptx") == cached(cache, objs, ptx, "ptx")
    assert uncached(objs, ptx, "ptx")[2:4] == ("ptx", "mine")
    assert links.count == 2 and cache.counters()["hits"] == 4


_CHILD = textwrap.dedent(
    """
    import json, sys
    import cuda.core
    import cuda.core._linker as linker_module
    from cuda.bindings import nvjitlink
    from cuda.core import LinkerOptions, ObjectCode
    from cuda_program_cas import ContentAddressedProgramCache

    real = linker_module.Linker

    class Tripwire:
        which_backend = real.which_backend  # names the backend; links nothing

        def __new__(cls, *objects, **options):
            raise RuntimeError("tripwire: a linker was created")

    def trip(*args, **kwargs):
        raise RuntimeError("tripwire: nvJitLink was called")

    linker_module.Linker = cuda.core.Linker = Tripwire
    for name in ("create", "add_data", "add_file", "complete", "get_linked_cubin", "get_linked_ptx"):
        setattr(nvjitlink, name, trip)

    root, caller, callee, caller_name, callee_name = sys.argv[1:6]
    objs = [
        ObjectCode.from_ltoir(open(caller, "rb").read(), name=caller_name),
        ObjectCode.from_ltoir(open(callee, "rb").read(), name=callee_name),
    ]
    cache = ContentAddressedProgramCache(root)
    obj = cache.link(objs, LinkerOptions(arch="sm_80", link_time_optimization=True), "cubin")
    out = {"code": obj.code.hex(), "code_type": obj.code_type, "name": obj.name, "counters": cache.counters()}
    try:  # the same tripwire stops a link that misses: it would have seen one
        cache.link(objs, LinkerOptions(arch="sm_86", link_time_optimization=True), "cubin")
        out["control"] = "linked"
    except RuntimeError as exc:
        out["control"] = str(exc)
    print(json.dumps(out))
    """
)


def test_a_fresh_process_hits_without_running_the_linker(cache_dir: Path, tmp_path: Path, objects: Inputs) -> None:
    caller, callee = objects["caller"], objects["callee"]
    objs, options = Objects([caller, callee]), LinkerOptions(**LTO)
    cache = ContentAddressedProgramCache(cache_dir)
    first = cache.link(objs, options, "cubin")
    cache.close()
    (tmp_path / "caller.ltoir").write_bytes(bytes(caller.code))
    (tmp_path / "callee.ltoir").write_bytes(bytes(callee.code))
    args = [str(cache_dir), str(tmp_path / "caller.ltoir"), str(tmp_path / "callee.ltoir"), caller.name, callee.name]
    done = run_python(_CHILD, *args)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert bytes.fromhex(got["code"]) == bytes(first.code) == bytes(Linker(*objs, options=options).link("cubin").code)
    assert (got["code_type"], got["name"]) == ("cubin", first.name)
    assert got["counters"]["hits"] == 1 and got["counters"]["misses"] == 0, got["counters"]
    assert got["control"] == "tripwire: a linker was created"


def test_every_ingredient_of_the_key_changes_it(cache_dir: Path, objects: Inputs) -> None:
    caller, callee, other = objects["caller"], objects["callee"], objects["other"]
    base = (Objects([caller, callee]), LinkerOptions(**LTO), "cubin")
    variants: dict[str, tuple[Objects, LinkerOptions, str]] = {
        "input bytes": (Objects([caller, other]), LinkerOptions(**LTO), "cubin"),
        "input order": (Objects([callee, caller]), LinkerOptions(**LTO), "cubin"),
        "input name": (
            Objects([ObjectCode.from_ltoir(caller.code, name="renamed"), callee]),
            LinkerOptions(**LTO),
            "cubin",
        ),
        "input code type": (
            Objects([ObjectCode.from_object(caller.code, name=caller.name), callee]),
            LinkerOptions(**LTO),
            "cubin",
        ),
        "target type": (Objects([caller, callee]), LinkerOptions(**LTO), "ptx"),
        "no lto": (Objects([caller, callee]), LinkerOptions(arch="sm_80"), "cubin"),
    }
    changes: dict[str, Any] = {
        "arch": "sm_90",
        "optimization_level": 0,
        "debug": True,
        "lineinfo": True,
        "max_register_count": 16,
        "ftz": True,
        "prec_div": False,
        "prec_sqrt": False,
        "fma": False,
        "kernels_used": ["k"],
        "variables_used": ["v"],
        "optimize_unused_variables": True,
        "ptxas_options": ["-O1"],
        "split_compile": 2,
        "split_compile_extended": 2,
        "no_cache": True,
        "time": True,
        "verbose": True,
        "name": "mine",
        "ptx": True,
    }
    for field, value in changes.items():
        variants[field] = (Objects([caller, callee]), LinkerOptions(**{**LTO, field: value}), "cubin")
    variants["kernels_used as a str"] = (Objects([caller, callee]), LinkerOptions(**LTO, kernels_used="k"), "cubin")
    cache = ContentAddressedProgramCache(cache_dir)
    expected = {name: uncached(*v) for name, v in variants.items()}
    base_expected = uncached(*base)
    assert cached(cache, *base) == base_expected
    assert cache.counters()["misses"] == 1
    for name, variant in variants.items():
        before = cache.counters()
        assert cached(cache, *variant) == expected[name], name
        after = cache.counters()
        assert (after["misses"], after["hits"]) == (before["misses"] + 1, before["hits"]), name
    assert cached(cache, *base) == base_expected
    assert cache.counters()["hits"] == 1
    # Again: each stored variant hits; each that failed misses (nothing was stored) and fails again.
    for name, variant in variants.items():
        before = cache.counters()
        assert cached(cache, *variant) == expected[name], name
        linked = expected[name][0] == "linked"
        after = cache.counters()
        assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (int(linked), int(not linked))
    assert sum(e[0] == "linked" for e in expected.values()) > 10  # most variants link (ftz etc. fail under LTO)


def test_a_path_backed_input_is_keyed_by_its_bytes(tmp_path: Path, objects: Inputs) -> None:
    path = tmp_path / "callee.ltoir"
    path.write_bytes(bytes(objects["callee"].code))
    objs, options = Objects([objects["caller"], ObjectCode.from_ltoir(str(path))]), LinkerOptions(**LTO)
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    first = cached(cache, objs, options)
    assert first == uncached(objs, options) and first[0] == "linked"
    assert cached(cache, objs, options) == first and cache.counters()["hits"] == 1
    staged = tmp_path / "callee.tmp"
    staged.write_bytes(path.read_bytes())
    os.replace(staged, path)  # a copy renamed over it: a new inode, the same bytes: a hit
    os.utime(path)
    assert cached(ContentAddressedProgramCache(tmp_path / "cas"), objs, options) == first
    assert cached(cache, objs, options) == first and cache.counters()["hits"] == 2
    path.write_bytes(bytes(objects["other"].code))  # same path, other bytes: a miss, the new result
    second = cached(cache, objs, options)
    assert second == uncached(objs, options) and second != first
    assert cache.counters()["misses"] == 2


def test_a_failing_link_raises_as_uncached_and_stores_nothing(cache_dir: Path, objects: Inputs) -> None:
    objs, options = Objects([objects["caller"]]), LinkerOptions(**LTO)  # f is an unresolved extern
    reference = uncached(objs, options)
    assert reference[0] == "raised"
    cache = ContentAddressedProgramCache(cache_dir)
    for misses in (1, 2):
        assert cached(cache, objs, options) == reference
        assert cache.counters()["misses"] == misses and cache.counters()["writes"] == 0
    assert len(cache) == 0
    # What the linker refuses before linking, the cache refuses the same way.
    for objs_, target in ((Objects(), "cubin"), (Objects([objects["caller"], b"bytes"]), "cubin"), (objs, "ltoir")):
        assert cached(cache, objs_, options, target) == uncached(objs_, options, target)  # type: ignore[arg-type]
    assert len(cache) == 0 and cache.counters()["misses"] == 2


def test_options_that_cannot_be_keyed_link_uncached(cache_dir: Path, objects: Inputs) -> None:
    class Registers(int):
        pass

    objs = Objects([objects["caller"], objects["callee"]])
    options = LinkerOptions(**LTO, max_register_count=Registers(32))
    cache = ContentAddressedProgramCache(cache_dir)
    for dropped in (1, 2):
        assert cached(cache, objs, options) == uncached(objs, options)
        assert cache.counters()["dropped_writes"] == dropped
    assert cache.counters()["hits"] == cache.counters()["misses"] == 0 and len(cache) == 0


def test_arch_none_is_the_current_device_s(cache_dir: Path, objects: Inputs) -> None:
    """Without a GPU the uncached link fails, and so does the cached one; with one, it is keyed by its arch."""
    objs, options = Objects([objects["caller"], objects["callee"]]), LinkerOptions(link_time_optimization=True)
    cache = ContentAddressedProgramCache(cache_dir)
    reference = uncached(objs, options)
    assert cached(cache, objs, options) == reference == cached(cache, objs, options)
    if reference[0] == "linked":
        assert cache.counters()["hits"] == 1


# -- a cache that cannot be written ----------------------------------------------------------


def test_a_read_only_cache_returns_the_link(cache_dir: Path, objects: Inputs) -> None:
    objs, options = Objects([objects["caller"], objects["callee"]]), LinkerOptions(**LTO)
    reference = uncached(objs, options)
    ContentAddressedProgramCache(cache_dir).close()  # laid out, empty
    reader = ContentAddressedProgramCache(cache_dir, read_only=True)
    assert cached(reader, objs, options) == reference
    assert reader.counters()["dropped_writes"] == 1 and len(reader) == 0
    assert cached(ContentAddressedProgramCache(cache_dir), objs, options) == reference  # stored now
    assert cached(reader, objs, options) == reference and reader.counters()["hits"] == 1


def test_a_store_that_raises_still_returns_the_link(
    cache_dir: Path, objects: Inputs, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs, options = Objects([objects["caller"], objects["callee"]]), LinkerOptions(**LTO)
    reference = uncached(objs, options)
    cache = ContentAddressedProgramCache(cache_dir)

    def broken(*args: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(inner_of(cache), "put_id", broken)  # what the link writes through
    assert cached(cache, objs, options) == reference
    assert cache.counters()["dropped_writes"] == 1
    monkeypatch.setattr(cache.store, "_find", broken)  # under find_or_claim, what the link looks up through
    assert cached(cache, objs, options) == reference


def _mount(*argv: str) -> None:
    proc = subprocess.run(["mount", *argv], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"mount {' '.join(argv)} failed: {proc.stderr.strip()}")


@contextlib.contextmanager
def _mounted(*argv: str, at: Path) -> Iterator[Path]:
    at.mkdir(parents=True, exist_ok=True)
    _mount(*argv, str(at))
    try:
        yield at
    finally:
        subprocess.run(["umount", "-l", str(at)], capture_output=True, check=False)


@pytest.mark.mount
@pytest.mark.skipif(not is_root(), reason="mounting needs root")
def test_a_read_only_directory_and_a_full_disk_return_the_link(tmp_path: Path, objects: Inputs) -> None:
    objs, options = Objects([objects["caller"], objects["callee"]]), LinkerOptions(**LTO)
    reference = uncached(objs, options)
    src = tmp_path / "cas"
    ContentAddressedProgramCache(src).close()
    with _mounted("--bind", str(src), at=tmp_path / "ro") as ro:
        _mount("-o", "remount,bind,ro", str(ro))
        cache = ContentAddressedProgramCache(ro)  # opened read-only, one WARNING
        assert cached(cache, objs, options) == reference
        assert cache.counters()["dropped_writes"] == 1
    with _mounted("-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", at=tmp_path / "full") as full:
        cache = ContentAddressedProgramCache(full / "cas")
        with open(full / "filler", "wb", buffering=0) as fh, contextlib.suppress(OSError):
            while True:  # until the disk is full
                fh.write(b"\0" * 4096)
        assert cached(cache, objs, options) == reference
        assert cache.counters()["dropped_writes"] == 1 and cache.counters()["writes"] == 0


@pytest.mark.skipif(is_root(), reason="root writes a directory whatever its mode")
def test_a_directory_this_user_cannot_write_returns_the_link(cache_dir: Path, objects: Inputs) -> None:
    objs, options = Objects([objects["caller"], objects["callee"]]), LinkerOptions(**LTO)
    reference = uncached(objs, options)
    ContentAddressedProgramCache(cache_dir).close()
    dirs = [cache_dir, *(p for p in cache_dir.rglob("*") if p.is_dir())]
    for d in dirs:
        os.chmod(d, 0o555)
    try:
        cache = ContentAddressedProgramCache(cache_dir)
        assert cached(cache, objs, options) == reference
        assert cache.counters()["dropped_writes"] == 1
    finally:
        for d in dirs:
            os.chmod(d, 0o755)


def test_links_of_the_same_inputs_at_once_run_the_linker_once(
    cache_dir: Path, objects: Inputs, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first thread's link is held inside the linker until the second waits on its claim.
    import cuda.core._linker as linker_module

    from cuda_program_cas._local import claims

    objs, options = Objects([objects["caller"], objects["callee"]]), LinkerOptions(**LTO)
    reference = uncached(objs, options)
    real, inside, go, waiting = linker_module.Linker, threading.Event(), threading.Event(), threading.Event()
    made: list[int] = []
    real_wait = claims._wait

    def wait(fd: int, deadline: float) -> bool:  # the claim's own wait, run as is, announced first
        waiting.set()
        return real_wait(fd, deadline)

    class Held:
        which_backend = real.which_backend

        def __new__(cls, *objects: Any, options: Any = None) -> Any:
            made.append(1)
            inside.set()
            assert go.wait(60), "the second link never waited"
            return real(*objects, options=options)

    monkeypatch.setattr(linker_module, "Linker", Held)
    monkeypatch.setattr(claims, "_wait", wait)
    cache = ContentAddressedProgramCache(cache_dir)
    got: dict[str, tuple[Any, ...]] = {}
    first = threading.Thread(target=lambda: got.__setitem__("first", cached(cache, objs, options)))
    first.start()
    assert inside.wait(60)
    second = threading.Thread(target=lambda: got.__setitem__("second", cached(cache, objs, options)))
    second.start()
    assert waiting.wait(60)
    go.set()
    first.join(60)
    second.join(60)
    assert got == {"first": reference, "second": reference}
    assert len(made) == 1
    counts = cache.counters()
    assert (counts["misses"], counts["hits"], counts["claim_waits"], counts["claim_hits"]) == (1, 1, 1, 1)
