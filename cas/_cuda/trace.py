"""Which headers a front-door miss read: NVRTC's time trace (13 and later), else the include trees.

A traced miss writes into its own ``cpcas-trace-*`` folder and removes it; one
killed mid-compile cannot, so a process's first folder sweeps this user's folders
unchanged for over an hour (a compile longer than that is not cached).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from .frontkey import Uncacheable
from .nvrtcver import loaded_version
from .search import BUILTIN_HEADERS

__all__ = [
    "PREFIX",
    "STALE_S",
    "TRACES",
    "end_nvrtc_tracing",
    "new_trace_dir",
    "nvrtc_major",
    "sweep_stale",
    "trace_in_child",
    "traced_names",
    "tree_files",
    "with_trace",
]

_log = logging.getLogger("cuda_program_cas")

#: Before NVRTC 13, the include trees are fingerprinted: at most this many files.
_MAX_TREE_FILES = 50_000


def nvrtc_major() -> int:
    major = loaded_version().partition(".")[0]
    return int(major) if major.isdigit() else 0


class _TraceHealth:
    """Whether NVRTC's time traces of this process can be trusted.

    After a traced compile fails inside an included file, NVRTC 13.5's later traces
    lack their first events: misses then trace in a child process (about 0.7 s each).
    """

    sound = True
    swept = False  # the stale trace folders, once per process (a forked child's are its parent's)


TRACES = _TraceHealth()
#: The child that traces a compile: the inputs come pickled on stdin, the trace goes to a file.
_TRACE_CHILD = (
    "import pickle, sys\n"
    "from cuda.core import Program\n"
    "code, code_type, options, target_type, names = pickle.loads(sys.stdin.buffer.read())\n"
    "Program(code, code_type, options=options).compile(target_type, names)\n"
)


def end_nvrtc_tracing(program: Any, program_options: Any) -> None:
    """After a traced compile failed, one that succeeds: else 13.5 writes ``.json`` into the working directory."""
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
    import dataclasses

    return dataclasses.replace(options, fdevice_time_trace=trace)


def traced_names(trace_path: str) -> list[str] | None:
    """The names of the files NVRTC's time trace says it processed; None if unreadable."""
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
    found: list[str] = []
    for top in dirs:
        for dirpath, _subdirs, files in os.walk(top):
            found.extend(os.path.join(dirpath, f) for f in files)
            if len(found) > _MAX_TREE_FILES:
                raise Uncacheable(f"over {_MAX_TREE_FILES} files under the include directories to fingerprint")
    return found


PREFIX = "cpcas-trace-"
#: A folder unchanged for this long is stale (a live one is as old as its compile).
STALE_S = 3600.0


def new_trace_dir() -> str:
    """A new trace folder; the process's first sweeps the stale ones before."""
    if not TRACES.swept:
        TRACES.swept = True
        removed = sweep_stale()
        if removed:
            _log.debug("cuda-program-cas: front door: removed %d stale %s* folders", removed, PREFIX)
    return tempfile.mkdtemp(prefix=PREFIX)


def sweep_stale(directory: str | None = None, *, older_than_s: float = STALE_S) -> int:
    """Remove this user's trace folders in ``directory`` unchanged for ``older_than_s``: how many went."""
    directory = directory or tempfile.gettempdir()
    uid = os.getuid() if hasattr(os, "getuid") else None  # Windows: the temp directory is the user's own
    cutoff = time.time() - older_than_s
    removed = 0
    try:
        with os.scandir(directory) as it:
            stale = []
            for entry in it:
                if not entry.name.startswith(PREFIX):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode) and (uid is None or st.st_uid == uid) and st.st_mtime < cutoff:
                    stale.append(entry.path)
    except OSError:
        return 0
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
        removed += not os.path.lexists(path)
    return removed
