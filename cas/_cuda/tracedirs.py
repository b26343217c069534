"""The front door's trace folders: one ``cpcas-trace-*`` in the temp directory per traced miss.

A miss removes its own folder; one killed mid-compile cannot. So a process's
first trace folder sweeps this user's ``cpcas-trace-*`` folders unchanged for
over an hour. A traced compile longer than that loses its trace and is not
cached: never a wrong result.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time

from cuda_program_cas._base.log import LOGGER as _log

__all__ = ["PREFIX", "STALE_S", "new_trace_dir", "sweep_stale"]


PREFIX = "cpcas-trace-"
#: A folder unchanged for this long is stale (a live one is as old as its compile).
STALE_S = 3600.0


class _Swept:
    done = False  # once per process; a forked child has its parent's temp directory, swept


def new_trace_dir() -> str:
    """A new trace folder (``tempfile.mkdtemp``); the process's first sweeps the stale ones before."""
    if not _Swept.done:
        _Swept.done = True
        removed = sweep_stale()
        if removed:
            _log.debug("cuda-program-cas: front door: removed %d stale %s* folders", removed, PREFIX)
    return tempfile.mkdtemp(prefix=PREFIX)


def sweep_stale(directory: str | None = None, *, older_than_s: float = STALE_S) -> int:
    """Remove this user's ``cpcas-trace-*`` folders in ``directory`` unchanged for ``older_than_s``; never raises.

    Returns how many went.
    """
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
