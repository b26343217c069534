"""A hit imports only what a hit needs (issue 31, item 4): checked in fresh interpreters, by ``sys.modules``."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
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
if sys.argv[3:] == ["young"]:  # a blob this process hashes is remembered though just written
    from cuda_program_cas._disk import bootrecord
    bootrecord.MIN_AGE_NS = 0
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
ours = sorted(m for m in sys.modules if m.startswith("cuda_program_cas"))
seen = [m for m in ("logging", "traceback", "blake3", "zstandard") if m in sys.modules]
print(json.dumps({"hits": hits, "modules": ours + seen}))
"""

#: Never needed by a hit: maintenance, remote stores, the switch and the linker, the header watch
#: (armed from the second look of a variant in a process), the front door's header tracing and its
#: folders (a miss's).
NEVER = (
    "cuda_program_cas._cuda.trace",
    "cuda_program_cas._verbs",
    "cuda_program_cas._remote",
    "cuda_program_cas._store.http",
    "cuda_program_cas._cli",
    "cuda_program_cas._cuda.switch",
    "cuda_program_cas._cuda.link",
    "cuda_program_cas._cuda.watch",
    "cuda_program_cas._base.frame",
    "zstandard",  # only what a shared store holds is compressed
)
FRONT_DOOR = tuple(
    f"cuda_program_cas._cuda.{m}" for m in ("frontdoor", "frontkey", "record", "search", "trace", "nvrtcver")
)
#: What a hit of the local cache does not need either (issue 31, item 4): the writer, the remover,
#: eviction and its scans, claims and leases, packs, gc's classification, the shared stores and uploads,
#: signatures, the settings file, the blob store's scans.
WRITE_SIDE = (
    "cuda_program_cas._disk.writer",
    "cuda_program_cas._disk.remove",
    "cuda_program_cas._disk.scan",
    "cuda_program_cas._disk.classify",
    "cuda_program_cas._disk.pack",
    "cuda_program_cas._disk.packsummary",
    "cuda_program_cas._disk.settings",
    "cuda_program_cas._disk.blobs",
    "cuda_program_cas._local.cap",
    "cuda_program_cas._local.claims",
    "cuda_program_cas._shared",  # the whole cluster layer: a local cache's hit imports none of it
    "cuda_program_cas._base.signing",
    "cuda_program_cas._base.engine",
    "cuda_program_cas._base.urls",
)
#: Nor what only a record someone sees, an error's frames or a snapshot need: ``logging`` (about 3 ms;
#: ``cuda.core`` does not import it), ``traceback``, ``CacheStats`` (a dataclass of 25 fields).
UNSEEN = ("logging", "traceback", "cuda_program_cas._local.cachestats")


def _modules(tmp_path: Path, how: str, *young: str) -> list[str]:
    done = run_python(_HIT, str(tmp_path), how, *young, timeout=300)
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
    # And each first hit hashes its blob and enters it in the boot record (young as it is), as an earlier
    # process of this boot would have.
    for how in ("store", "program", "front"):
        _modules(tmp_path, how, "young")
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


@pytest.mark.parametrize("how", ["package", "store", "program", "front"])
def test_a_hit_imports_no_logging_traceback_or_snapshot(filled: Path, how: str) -> None:
    assert _imported(_modules(filled, how), UNSEEN) == []


def test_a_hit_of_a_blob_verified_this_boot_loads_no_hasher(filled: Path) -> None:
    """blake3's extension (about 0.5 ms to load) is not loaded where a hit hashes nothing (issue 31)."""
    from cuda_program_cas._disk.fskind import CTIME_RELIABLE, fs_type

    if fs_type(str(filled)) not in CTIME_RELIABLE:
        pytest.skip("the boot record vouches only on a local file system of known ctime; this one hashes")
    for how in ("store", "program", "front"):
        assert "blake3" not in _modules(filled, how), how


#: The logger without ``logging`` imported (issue 31): a WARNING still reaches stderr (logging's last
#: resort); a job that imports and configures logging after its first hit gets the next hit's record;
#: a record made through the stand-in names the package's caller, not the stand-in's module.
_LATE_LOGGING = r"""
import sys
from cuda_program_cas import CacheStore
from cuda_program_cas._base.config import say_once
store = CacheStore(sys.argv[1])
assert store.get("k") == b"v"
assert "logging" not in sys.modules
if sys.argv[2] == "warn":
    say_once(("test", "early"), "cuda-program-cas: an early warning %d", 7)
    assert "logging" in sys.modules  # a WARNING imports it
    sys.exit(0)
import logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)
logger = logging.getLogger("cuda_program_cas")
logger.addHandler(Keep())
logger.setLevel(logging.DEBUG)
if sys.argv[2] == "late":
    assert store.get("k") == b"v"
else:  # "caller"
    say_once(("test", "late"), "cuda-program-cas: a late warning")
print(len(records), records[0].module, records[0].funcName)
"""


def _late(filled: Path, mode: str) -> subprocess.CompletedProcess[str]:
    done = run_python(_LATE_LOGGING, str(filled / "store"), mode, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def test_a_warning_without_logging_imported_reaches_stderr(filled: Path) -> None:
    assert "cuda-program-cas: an early warning 7" in _late(filled, "warn").stderr


def test_logging_configured_after_the_first_hit_gets_the_next_hits_record(filled: Path) -> None:
    out = _late(filled, "late").stdout.split()
    assert out == ["1", "events", "lookup_hit"]


def test_a_record_through_the_stand_in_logger_names_the_packages_caller(filled: Path) -> None:
    assert _late(filled, "caller").stdout.split()[-2:] == ["config", "say_once"]


def test_botocore_is_imported_only_when_an_s3_store_is_opened(tmp_path: Path) -> None:
    """An HTTP store's lookup loads no botocore; opening an ``s3://`` store does (the AWS setup, no request)."""
    pytest.importorskip("botocore")
    code = textwrap.dedent(
        """
        import sys
        from cuda_program_cas import CacheStore
        CacheStore(sys.argv[1] + "/a", shared=["http://127.0.0.1:9/store"]).get("k")
        print("botocore" in sys.modules, end=" ")
        CacheStore(sys.argv[1] + "/b", shared=["s3://cas/lazy"])
        print("botocore" in sys.modules)
        """
    )
    aws = {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_DEFAULT_REGION": "us-east-1"}
    out = run_python(code, str(tmp_path), env=aws)
    assert out.stdout.split() == ["False", "True"], out.stderr
