"""NVRTC's version without loading NVRTC, from a record keyed by the library file that would load.

Asking ``nvrtcVersion`` loads ``libnvrtc`` (11 to 17 ms of a fresh process's
first front-door hit). :func:`version` reads a node-local entry instead, keyed
by the file ``cuda.pathfinder`` would load (found without loading), its identity
on a file system with reliable stat data, the boot id and the versions of
cuda-bindings and cuda-pathfinder. It is written only when ``/proc/self/maps``
shows the file loaded is the one predicted.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import weakref
from typing import Any

from cuda_program_cas._base.fork import after_fork_call
from cuda_program_cas._disk.bootrecord import boot_id
from cuda_program_cas._disk.files import FileId, file_id
from cuda_program_cas._disk.fskind import STAT_RELIABLE, fs_type
from cuda_program_cas.index import local_id

__all__ = ["loaded_version", "remember", "version"]

_RECORD = b"cpcas-nvrtc-version/1\0"


class _State:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loaded: str | None = None  # once loaded, NVRTC's version cannot change
        self.known: tuple[str, FileId, str] | None = None  # the file, its identity and version, from a record
        self.remembered: weakref.WeakSet[Any] = weakref.WeakSet()  # stores remember() has seen to
        self.lock = threading.Lock()


_S = _State()
after_fork_call(_S.reset)  # keeps nothing a thread of the parent held: learnt again


def loaded_version() -> str:
    """``"major.minor"`` of NVRTC, asked of the library (loading it if needed); a failure's name otherwise."""
    if _S.loaded is not None:
        return _S.loaded
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return f"unavailable:{err!r}"
    except Exception as exc:  # no NVRTC: the compile that needs it raises its own error
        return f"unavailable:{type(exc).__name__}"
    _S.loaded = f"{int(major)}.{int(minor)}"
    return _S.loaded


def version(inner: Any) -> str:
    """NVRTC's ``"major.minor"`` for a key: from ``inner``'s record when the file is provably the same, else asked."""
    if _S.loaded is not None:
        return _S.loaded
    known = _S.known
    if known is not None and _identity(known[0]) == known[1]:
        return known[2]
    with _S.lock:
        predicted = _predict()
        if predicted is None:
            return loaded_version()
        path, ident = predicted
        kid = _record_id(path, ident)
        found = _read(inner, kid)
        if found is not None:
            _S.known = (path, ident, found)
            return found
        answer = loaded_version()
        if _S.loaded is not None and not inner.store.read_only and _maps_show(ident):
            inner.put_id(kid, answer.encode())
        return answer


def remember(inner: Any) -> None:
    """After a compile loaded NVRTC: record its version for ``inner``'s store (once per store and process)."""
    loaded, store = _S.loaded, inner.store
    if loaded is None or store.read_only or store in _S.remembered:
        return
    with _S.lock:
        _S.remembered.add(store)
        try:
            predicted = _predict(loaded_ok=True)
            if predicted is None:
                return
            path, ident = predicted
            kid = _record_id(path, ident)
            if _read(inner, kid) != loaded and _maps_show(ident):
                inner.put_id(kid, loaded.encode())
        except Exception as exc:  # a record left unwritten costs the next process a load of NVRTC, never this compile
            from cuda_program_cas._base.log import LOGGER

            LOGGER.debug("cuda-program-cas: NVRTC's version not recorded: %r", exc)


def _read(inner: Any, kid: str) -> str | None:
    try:
        found = inner.find(kid)
    except Exception:
        return None
    if found is None:
        return None
    major, dot, minor = found[0].partition(b".")  # "major.minor", each of 1 to 4 digits, else asked again
    if not dot or not all(0 < len(p) <= 4 and p.isdigit() for p in (major, minor)):
        return None
    return str(found[0].decode())


def _predict(*, loaded_ok: bool = False) -> tuple[str, FileId] | None:
    """The libnvrtc ``cuda.bindings`` would load and its identity; None when that cannot be known unloaded."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        from cuda.pathfinder._dynamic_libs.lib_descriptor import LIB_DESCRIPTORS
        from cuda.pathfinder._dynamic_libs.platform_loader import LOADER
        from cuda.pathfinder._dynamic_libs.search_steps import EARLY_FIND_STEPS, SearchContext, run_find_steps

        desc = LIB_DESCRIPTORS["nvrtc"]
        # Loaded already (by another library, LD_PRELOAD): pathfinder takes that one, and asking loads nothing.
        if not loaded_ok and LOADER.check_if_already_loaded_from_elsewhere(desc) is not None:
            return None
        found = run_find_steps(SearchContext(desc), EARLY_FIND_STEPS)
    except Exception:  # another pathfinder than this module knows: load as before
        return None
    if found is None:
        return None  # the dynamic loader's search would decide
    path = os.fspath(found.abs_path)
    ident = _identity(path)
    if ident is None or fs_type(path) not in STAT_RELIABLE:
        return None
    return path, ident


def _identity(path: str) -> FileId | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return file_id(st) if stat.S_ISREG(st.st_mode) else None


def _record_id(path: str, ident: FileId) -> str:
    import cuda.bindings
    import cuda.pathfinder

    parts = (
        boot_id() or "?",
        path,
        ",".join(map(str, ident)),
        str(getattr(cuda.bindings, "__version__", "?")),
        str(getattr(cuda.pathfinder, "__version__", "?")),
    )
    return local_id(_RECORD + "\0".join(parts).encode("utf-8", "surrogateescape"))


def _maps_show(ident: FileId) -> bool:
    """Whether the only ``libnvrtc`` mapped into this process is the file of identity ``ident``."""
    dev, ino = ident[0], ident[1]
    mine = f"{os.major(dev):02x}:{os.minor(dev):02x} {ino} "
    seen = False
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                if "/libnvrtc.so" not in line:
                    continue
                fields = line.split(None, 5)
                if len(fields) < 6:
                    continue
                if f"{fields[3]} {fields[4]} " != mine:
                    return False  # another libnvrtc file: the prediction was wrong
                seen = True
    except OSError:
        return False
    return seen
