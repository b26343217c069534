"""The switch with its shared HTTP store out: compiles and links get their results, and exit is quiet.

A failed request used to leave a reference cycle behind (urllib3's ``urlopen``
keeps the error it raises in a local, and the error's traceback holds that
frame): the frames above it, ``Program.compile``'s ``self`` among them, then
lived until the garbage collector broke the cycle. Its ``tp_clear`` empties the
Program's fields before ``cuda.core``'s ``__dealloc__`` reads them, which printed
``Exception ignored in: 'cuda.core._program.Program.__dealloc__'`` and a traceback,
twice, at the exit of every process that met the outage. Each case runs a real
interpreter, against a port where nothing listens or a real socket that accepts
and never answers.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SAXPY
from testkit.faults import Fault, FaultServer, refused_url

from cuda_program_cas._base.errors import without_frames

#: A compile (cubin), an LTO-IR compile and a link of it, with no cache= anywhere: the switch
#: routes them. Prints the digests of what they gave; argv[1] says whether to collect cycles
#: first (where a process exits without waiting for the collector, the cycle is its last act).
_WORK = textwrap.dedent(
    f"""
    import gc, hashlib, json, sys
    from cuda.core import Linker, LinkerOptions, Program, ProgramOptions
    cubin = Program({SAXPY!r}, "c++", options=ProgramOptions(arch="sm_80")).compile("cubin")
    src = 'extern "C" __global__ void k(float* x) {{ x[0] = 1; }}'
    opts = ProgramOptions(arch="sm_80", relocatable_device_code=True, link_time_optimization=True)
    lto = Program(src, "c++", options=opts).compile("ltoir")
    linked = Linker(lto, options=LinkerOptions(arch="sm_80", link_time_optimization=True)).link("cubin")
    if sys.argv[1] == "collect":
        gc.collect()
    sw = sys.modules.get("cuda_program_cas._cuda.switch")
    print(json.dumps({{
        "digests": [hashlib.sha256(bytes(o.code)).hexdigest() for o in (cubin, lto, linked)],
        "routed": sw.routed() if sw is not None else 0,
    }}))
    """
)


def work(env: dict[str, str | None], when: str) -> tuple[dict[str, object], str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_PROGRAM_CAS")}
    full.update({k: v for k, v in env.items() if v is not None})
    done = subprocess.run(
        [sys.executable, "-c", _WORK, when], capture_output=True, text=True, env=full, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.fixture(scope="module")
def uncached() -> list[str]:
    out, err = work({}, "exit")
    assert out["routed"] == 0 and err == "", err
    digests = out["digests"]
    assert isinstance(digests, list) and len(digests) == 3
    return digests


_FAULTS = {
    "stalled": Fault.stall(),
    "stalled body": Fault.stall_body(),
    "reset": Fault.refuse(),
    "500": Fault.status(500),
}


@pytest.fixture(params=["refused", *_FAULTS, "https to a plain http server"])
def outage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a shared store that is out: nothing listens there; it accepts and never answers (nor
    sends its body after the headers); it resets the connection; it fails (500); it never answers a TLS handshake."""
    if request.param == "refused":
        yield refused_url()
        return
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "layout.json").write_text('{"layout": 2}')
    with FaultServer(tmp_path / "served") as server:
        server.set_default(_FAULTS.get(request.param, Fault.ok()))
        yield (
            server.base_url.replace("http:", "https:")
            if request.param == "https to a plain http server"
            else server.base_url
        )


@pytest.mark.parametrize("when", ["exit", "collect"])
def test_an_outage_costs_the_switch_nothing_and_exit_prints_no_traceback(
    tmp_path: Path, outage: str, when: str, uncached: list[str]
) -> None:
    env = {
        "CUDA_PROGRAM_CAS": "1",
        "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "cas"),
        "CUDA_PROGRAM_CAS_SHARED": outage,
        "CUDA_PROGRAM_CAS_HTTP_TIMEOUT": "0.5,0.5",  # a stall costs one of these, then a pause
    }
    out, err = work(env, when)
    assert out["digests"] == uncached and out["routed"] == 3, out
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = err.splitlines()
    # The store's one WARNING for the outage: it is paused, and every lookup after is a miss.
    assert len(lines) == 1 and f"shared store {outage.rstrip('/')} is unusable" in lines[0], err
    assert hashlib.sha256(b"").hexdigest() not in out["digests"]


class _Held:
    """What a caller's frame holds (a Program, in the switch)."""


def _keeps_its_error() -> None:
    try:
        raise ConnectionRefusedError(111, "refused")
    except OSError as caught:
        kept = caught  # as urllib3's urlopen keeps new_e: a local of a frame of the error's own traceback
        raise ValueError("wrapped") from kept


def _caller(held: _Held, clear: bool) -> BaseException:
    try:
        _keeps_its_error()
    except ValueError as exc:
        return without_frames(exc) if clear else exc
    raise AssertionError("unreachable")


@pytest.mark.parametrize("clear", [True, False], ids=["without_frames", "as raised"])
def test_without_frames_lets_the_caller_s_locals_go_without_the_collector(clear: bool) -> None:
    held = _Held()
    gone = weakref.ref(held)
    was = gc.isenabled()
    gc.disable()
    try:
        error = _caller(held, clear)
        assert str(error) == "wrapped" and isinstance(error.__cause__, ConnectionRefusedError)
        del held, error
        assert (gone() is None) is clear  # as raised, the cycle keeps the caller's frame until a collection
    finally:
        if was:
            gc.enable()
    gc.collect()
    assert gone() is None
