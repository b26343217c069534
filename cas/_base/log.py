"""The ``cuda_program_cas`` logger, with :mod:`logging` imported only when a record could go somewhere.

Importing :mod:`logging` costs a process about 3 ms (it brings ``traceback``,
``string`` and its formatters), and ``cuda.core`` does not import it: a job whose
only use of the cache is a hit would pay it for records nobody sees. :data:`LOGGER`
stands for ``logging.getLogger("cuda_program_cas")`` and gives the same answers:

- while no one in the process has imported :mod:`logging`, nothing can have set a
  level or added a handler, so logging is in its defaults (the root logger at
  WARNING, no handler, nothing disabled): ``isEnabledFor`` answers as those defaults
  do, and a DEBUG or INFO record is dropped, as :mod:`logging` would drop it;
- a WARNING or above imports :mod:`logging` and goes to the real logger (with no
  handler anywhere, to ``logging.lastResort``: stderr, as before);
- once :mod:`logging` is in ``sys.modules`` (anyone imported it: the job, a test's
  ``caplog``, ``CUDA_PROGRAM_CAS_LOG``), the first call binds the real logger's
  methods onto :data:`LOGGER`, and every later call is the real logger's own (the
  same cost, the same caller in each record).

Any other attribute (``addHandler``, ``level``, ``handlers``...) is the real
logger's, importing :mod:`logging` if need be. Modules that run only when their
work needs logging anyway (the writer, the verbs) may import :mod:`logging`
themselves; the logger is the same one.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import logging

__all__ = ["DEBUG", "INFO", "LOGGER", "NAME", "WARNING"]

#: The logger's name.
NAME = "cuda_program_cas"
#: :mod:`logging`'s levels, spelled without importing it.
DEBUG = 10
INFO = 20
WARNING = 30

_modules = sys.modules
#: The methods bound onto :data:`LOGGER` once :mod:`logging` is imported.
_BOUND = ("isEnabledFor", "debug", "info", "warning", "error", "exception", "log")


class _Logger:
    """``logging.getLogger("cuda_program_cas")``, resolved on first need (see the module's docstring)."""

    def real(self) -> logging.Logger:
        """The real logger (imports :mod:`logging`); from then on this object's methods are its."""
        real: logging.Logger | None = self.__dict__.get("_real")
        if real is None:
            import logging

            real = logging.getLogger(NAME)
            for name in _BOUND:  # instance attributes shadow the class's methods below
                self.__dict__[name] = getattr(real, name)
            self.__dict__["_real"] = real
        return real

    def isEnabledFor(self, level: int) -> bool:  # logging's spelling
        if "logging" in _modules:
            return self.real().isEnabledFor(level)
        return level >= WARNING  # logging's defaults: nobody imported it, so nobody changed them

    def _emit(self, level: int, msg: object, args: tuple[object, ...], kwargs: dict[str, Any]) -> None:
        if level < WARNING and "logging" not in _modules:
            return  # dropped, as logging in its defaults drops it
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 2  # the record names our caller, not this class
        self.real().log(level, msg, *args, **kwargs)

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        self._emit(DEBUG, msg, args, kwargs)

    def info(self, msg: object, *args: object, **kwargs: Any) -> None:
        self._emit(INFO, msg, args, kwargs)

    def warning(self, msg: object, *args: object, **kwargs: Any) -> None:
        self._emit(WARNING, msg, args, kwargs)

    def error(self, msg: object, *args: object, **kwargs: Any) -> None:
        self._emit(40, msg, args, kwargs)

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        kwargs.setdefault("exc_info", True)
        self._emit(40, msg, args, kwargs)

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        self._emit(level, msg, args, kwargs)

    def __getattr__(self, name: str) -> Any:  # only for names not found above: the real logger's
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.real(), name)


#: The package's logger (see the module's docstring).
LOGGER = _Logger()
