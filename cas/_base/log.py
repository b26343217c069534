"""The ``cuda_program_cas`` logger, with :mod:`logging` imported only when a record could go somewhere.

Importing :mod:`logging` costs about 3 ms, and ``cuda.core`` does not. :data:`LOGGER` stands
for ``logging.getLogger("cuda_program_cas")``: while nobody has imported :mod:`logging`, it is
in its defaults, so a record below WARNING is dropped as it would be; a WARNING imports it.
Once imported, the first call binds the real logger's methods onto :data:`LOGGER`.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import logging

__all__ = ["DEBUG", "INFO", "LOGGER", "NAME", "WARNING"]

NAME = "cuda_program_cas"
#: :mod:`logging`'s levels, spelled without importing it.
DEBUG = 10
INFO = 20
WARNING = 30

_modules = sys.modules
_BOUND = ("isEnabledFor", "debug", "info", "warning", "log")


class _Logger:
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

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        self._emit(level, msg, args, kwargs)

    def __getattr__(self, name: str) -> Any:  # only for names not found above: the real logger's
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.real(), name)


LOGGER = _Logger()
