"""The switch's start-up hook: waits for ``cuda.core`` (numba-cuda's NVVM, cuda.compute) to be imported, then routes.

``cuda_program_cas-switch.pth`` runs this file by path at start-up, with only
what ``site`` imported (importing the package would cost every process tens of
milliseconds). A finder first on ``sys.meta_path`` wraps the loader of each
module of :data:`_TARGETS`, so that its function rebinds what it routes before
the importer reads it.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is not imported at start-up: it costs milliseconds
    from typing import Any

__all__ = ["defer", "remove"]

#: The modules waited for, and the ``module:function`` each one's import runs with the mode.
_TARGETS = {
    "cuda.core": "cuda_program_cas._cuda.switch:activate",
    "numba.cuda.cudadrv.nvvm": "cuda_program_cas._cuda.nvvm:activate",
    "numba_cuda_mlir.numba_cuda.cudadrv.nvvm": "cuda_program_cas._cuda.nvvm:activate",
    "numba_cuda_mlir.mlir_optimization": "cuda_program_cas._cuda.nvvm:activate",  # its _call_llvm70_capi
    "cuda.compute.algorithms": "cuda_program_cas._cuda.switch:activate_compute",  # its make_* factories
}


class _Loader:
    def __init__(self, loader: Any, mode: str, name: str) -> None:
        self._loader = loader
        self._mode = mode
        self._name = name

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        for finder in sys.meta_path:  # no longer waited for; the hook goes once nothing is
            pending = getattr(finder, "pending", None) if getattr(finder, "cpcas_switch_hook", False) else None
            if pending is not None:
                pending.discard(self._name)
                if not pending:
                    remove()
                break
        try:
            _activate(self._mode, self._name)
        except Exception as exc:  # the switch never costs a job its cuda.core
            import logging

            logging.getLogger("cuda_program_cas").warning(
                "cuda-program-cas: the switch could not start, compiles are not cached: %r", exc
            )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _Finder:
    cpcas_switch_hook = True

    def __init__(self, mode: str, pending: set[str]) -> None:
        self.mode = mode
        self.pending = pending

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "cpcas_switch_hook", False):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self.mode, fullname)
                return spec
        return None


def defer(mode: str) -> None:
    """Run the switch in ``mode`` when each module of :data:`_TARGETS` is imported (at once for those that are)."""
    remove()
    pending = {name for name in _TARGETS if name not in sys.modules}
    if pending:
        sys.meta_path.insert(0, _Finder(mode, pending))
    for name in _TARGETS:
        if name not in pending:
            _activate(mode, name)


def _activate(mode: str, name: str) -> None:
    # By name: at start-up this file runs before the package may be imported at all.
    import importlib

    module, _, function = _TARGETS[name].partition(":")
    getattr(importlib.import_module(module), function)(mode)


def remove() -> None:
    """Take every copy of the hook (this file's or the .pth's) off ``sys.meta_path``."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "cpcas_switch_hook", False)]


if __name__ == "cuda_program_cas-switch":  # run by the .pth, at start-up, in the mode the switch checks
    try:
        import os

        if (value := os.environ.get("CUDA_PROGRAM_CAS", "").strip()) not in ("", "0"):
            defer(value)
    except Exception as exc:  # never fail the interpreter's start
        print(f"cuda-program-cas: CUDA_PROGRAM_CAS is set but the switch could not start: {exc!r}", file=sys.stderr)
