"""A hit imports only what a hit needs (issue 31, item 4): checked in fresh interpreters, by ``sys.modules``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_python

from cuda_program_cas import CacheStore

_HIT = r"""
import json, sys
from pathlib import Path
from cuda.core import Program, ProgramOptions
tmp = Path(sys.argv[1])
how = sys.argv[2]
src = 'extern "C" __global__ void k(int *p) { *p = 1; }'
opts = ProgramOptions(arch="sm_80")
if how == "package":
    import cuda_program_cas
    hits = 0
elif how == "store":
    from cuda_program_cas import CacheStore
    hits = int(CacheStore(tmp / "store").get("k") == b"v")
else:
    from cuda_program_cas import ContentAddressedProgramCache
    cache = ContentAddressedProgramCache(tmp / how)
    if how == "program":
        Program(src, "c++", options=opts).compile("cubin", cache=cache)
    else:
        cache.compile(src, "c++", opts, "cubin")
    hits = cache.counters()["hits"]
print(json.dumps({"hits": hits, "modules": sorted(m for m in sys.modules if m.startswith("cuda_program_cas"))}))
"""

#: Never needed by a hit: maintenance, remote stores, the switch and the linker, the header watch
#: (armed from the second look of a variant in a process), NVRTC's version record (front door only).
NEVER = (
    "cuda_program_cas._verbs",
    "cuda_program_cas._remote",
    "cuda_program_cas._store.http",
    "cuda_program_cas._cli",
    "cuda_program_cas._cuda.switch",
    "cuda_program_cas._cuda.link",
    "cuda_program_cas._cuda.watch",
)
FRONT_DOOR = tuple(
    f"cuda_program_cas._cuda.{m}"
    for m in ("frontdoor", "frontkey", "record", "search", "trace", "nvrtcver", "tracedirs")
)
#: What a hit of the local cache does not need either (issue 31, item 4): the writer, the remover,
#: eviction and its scans, claims and leases, packs, gc's classification, the shared stores and uploads,
#: signatures, layout upgrades, the settings file, the blob store's scans.
WRITE_SIDE = (
    "cuda_program_cas._disk.writer",
    "cuda_program_cas._disk.remove",
    "cuda_program_cas._disk.scan",
    "cuda_program_cas._disk.classify",
    "cuda_program_cas._disk.pack",
    "cuda_program_cas._disk.packsummary",
    "cuda_program_cas._disk.upgrade",
    "cuda_program_cas._disk.settings",
    "cuda_program_cas._disk.blobs",
    "cuda_program_cas._store.cap",
    "cuda_program_cas._store.claims",
    "cuda_program_cas._store.lease",
    "cuda_program_cas._store.tier",
    "cuda_program_cas._store.tiers",
    "cuda_program_cas._store.writeback",
    "cuda_program_cas._base.signing",
    "cuda_program_cas._base.engine",
    "cuda_program_cas._base.urls",
)


def _modules(tmp_path: Path, how: str) -> list[str]:
    done = run_python(_HIT, str(tmp_path), how, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["hits"] == (0 if how == "package" else 1)
    return list(report["modules"])


def _imported(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == n or m.startswith(n + ".") for n in names)]


@pytest.fixture
def filled(tmp_path: Path) -> Path:
    from cuda.core import Program, ProgramOptions

    from cuda_program_cas import ContentAddressedProgramCache

    src = 'extern "C" __global__ void k(int *p) { *p = 1; }'
    opts = ProgramOptions(arch="sm_80")
    Program(src, "c++", options=opts).compile("cubin", cache=ContentAddressedProgramCache(tmp_path / "program"))
    ContentAddressedProgramCache(tmp_path / "front").compile(src, "c++", opts, "cubin")
    CacheStore(tmp_path / "store").put("k", b"v")
    # This process had NVRTC loaded: a fresh one's first front-door call records its version (a write), once.
    _modules(tmp_path, "front")
    return tmp_path


def test_importing_the_package_imports_its_errors_alone(filled: Path) -> None:
    errors_alone = ["cuda_program_cas", "cuda_program_cas._base", "cuda_program_cas._base.errors"]
    assert _modules(filled, "package") == errors_alone


@pytest.mark.parametrize("how", ["store", "program", "front"])
def test_a_hit_in_a_fresh_interpreter_imports_no_maintenance_remote_or_watch(filled: Path, how: str) -> None:
    modules = _modules(filled, how)
    assert _imported(modules, NEVER) == []
    if how != "front":
        assert _imported(modules, FRONT_DOOR) == []


@pytest.mark.parametrize("how", ["store", "program", "front"])
def test_a_hit_imports_no_writer_eviction_scan_or_packs(filled: Path, how: str) -> None:
    assert _imported(_modules(filled, how), WRITE_SIDE) == []


_MISS = r"""
import json, sys
from pathlib import Path
from cuda.core import Program, ProgramOptions
from cuda_program_cas import ContentAddressedProgramCache
cache = ContentAddressedProgramCache(Path(sys.argv[1]))
opts = ProgramOptions(arch="sm_80")
for n in (1, 2):  # a miss that stores, then its hit
    Program('extern "C" __global__ void k(int *p) { *p = 7; }', "c++", options=opts).compile("cubin", cache=cache)
print(json.dumps(cache.counters()))
"""


def test_a_miss_still_stores_what_it_compiled(tmp_path: Path) -> None:
    # The parts a hit does not import come in when a miss needs them.
    done = run_python(_MISS, str(tmp_path / "c"), timeout=300)
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert (counts["misses"], counts["writes"], counts["hits"]) == (1, 1, 1)
