"""Build glue for the switch: ``cuda_program_cas-switch.pth`` into site-packages, in every kind of install.

``CUDA_PROGRAM_CAS=1`` can reach a process before any of its code runs only
through a ``.pth`` file at the top of site-packages: ``site`` executes its lines
that begin with ``import``. The metadata is in pyproject.toml; this file only adds
the ``.pth`` (kept in ``cas/_cuda/``) to the wheel:

- a regular wheel (``pip install .``, ``pip wheel .``): ``build_py`` copies it to
  the root of ``build_lib``, which is the root of the wheel;
- an editable install (``pip install -e .``): setuptools' ``editable_wheel`` writes
  the wheel from a strategy object and never looks at ``build_lib``; the strategy
  it selects is wrapped so that it also writes the ``.pth``.
  ``_select_strategy`` is setuptools' (>= 64) own method, not a documented hook:
  tests/test_switch.py checks that the environment it runs in has the ``.pth``.
"""

from __future__ import annotations

import os
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "cuda_program_cas-switch.pth"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cas", "_cuda", PTH)


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            self.copy_file(SOURCE, os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs: list[str] = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, os.path.join(self.build_lib, PTH)]


class _WithPth:
    """An editable-wheel strategy that also writes the ``.pth``."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    def __enter__(self) -> _WithPth:
        self._strategy.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._strategy.__exit__(*exc)

    def __call__(self, wheel: Any, files: list[str], mapping: Any) -> None:
        self._strategy(wheel, files, mapping)
        with open(SOURCE, "rb") as fh:
            wheel.writestr(PTH, fh.read())


class EditableWheelWithPth(editable_wheel):
    def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
        return _WithPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
