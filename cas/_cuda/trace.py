"""Which headers a front-door miss read: NVRTC's time trace (13 and later), else the include trees.

A trace is made in this process while NVRTC's traces can be trusted here, else in a
child process (:class:`_TraceHealth`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from typing import Any

from .frontkey import Uncacheable
from .search import BUILTIN_HEADERS
from .tracedirs import new_trace_dir

__all__ = ["TRACES", "end_nvrtc_tracing", "nvrtc_major", "trace_in_child", "traced_names", "tree_files", "with_trace"]

_log = logging.getLogger("cuda_program_cas")

#: Before NVRTC 13, the include trees are fingerprinted: at most this many files.
_MAX_TREE_FILES = 50_000


def nvrtc_major() -> int:
    try:
        from cuda.bindings import nvrtc

        _err, major, _minor = nvrtc.nvrtcVersion()
        return int(major)
    except Exception:
        return 0


class _TraceHealth:
    """Whether NVRTC's time traces of this process can be trusted.

    After a traced compile fails inside an included file, NVRTC 13.5's later
    traces lack their first events; so after a failure, or a trace without the
    builtin header, misses trace in a child process (about 0.7 s each).
    """

    sound = True


TRACES = _TraceHealth()
#: The child that traces a compile: the inputs come pickled on stdin, the trace goes to a file.
_TRACE_CHILD = (
    "import pickle, sys\n"
    "from cuda.core import Program\n"
    "code, code_type, options, target_type, names = pickle.loads(sys.stdin.buffer.read())\n"
    "Program(code, code_type, options=options).compile(target_type, names)\n"
)


def end_nvrtc_tracing(program: Any, program_options: Any) -> None:
    """Make NVRTC stop tracing after a traced compile failed (13.5 would write ``.json`` into the working
    directory at its next compile): one small traced compile that succeeds, to a temp file."""
    trace_dir = new_trace_dir()
    try:
        options = program_options(arch="sm_80", fdevice_time_trace=os.path.join(trace_dir, "trace"))
        program('extern "C" __global__ void cpcas_end_trace() {}', "c++", options=options).compile("cubin")
    except Exception as exc:
        _log.debug("cuda-program-cas: front door: NVRTC's tracing could not be ended: %r", exc)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def trace_in_child(
    code: object, code_type: str, options: Any, target_type: str, names: tuple[Any, ...], *, trace: str
) -> list[str] | None:
    """The names of the files a compile reads, from a trace made in a child process (None if it failed)."""
    import pickle
    import subprocess
    import sys

    spec = pickle.dumps((code, code_type, with_trace(options, trace), target_type, names))
    try:
        done = subprocess.run(
            [sys.executable, "-c", _TRACE_CHILD],
            input=spec,
            capture_output=True,
            timeout=3600,
            check=False,
            env={**os.environ, "CUDA_PROGRAM_CAS": "0"},  # the child's compile is this miss's: never the cache's
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return traced_names(trace + ".json") if done.returncode == 0 else None


def with_trace(options: Any, trace: str) -> Any:
    """``options`` with NVRTC's time trace written to ``trace`` (a ProgramOptions is a dataclass)."""
    import dataclasses

    return dataclasses.replace(options, fdevice_time_trace=trace)


def traced_names(trace_path: str) -> list[str] | None:
    """The names of the files NVRTC's time trace says it processed, as it spelled them; None if unreadable."""
    try:
        with open(trace_path, "rb") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        return None
    names = set()
    for event in events:
        if isinstance(event, dict) and event.get("name") == "Processing Header File":
            detail = (event.get("args") or {}).get("detail")
            if not isinstance(detail, str) or not detail:
                return None  # a header it read, named in a way we cannot follow
            names.add(detail)
    # NVRTC reads its builtin header first: a trace without it lost its beginning (see _TraceHealth).
    if not names & BUILTIN_HEADERS:
        return None
    return sorted(names)


def tree_files(dirs: Sequence[str]) -> list[str]:
    """Every regular file under ``dirs`` (NVRTC before 13 cannot say what it read)."""
    found: list[str] = []
    for top in dirs:
        for dirpath, _subdirs, files in os.walk(top):
            found.extend(os.path.join(dirpath, f) for f in files)
            if len(found) > _MAX_TREE_FILES:
                raise Uncacheable(f"over {_MAX_TREE_FILES} files under the include directories to fingerprint")
    return found
