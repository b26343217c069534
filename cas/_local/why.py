"""Why a front door lookup missed: a line, with its kind and the path whose check failed.

A :class:`Why` is a ``str`` (the miss's DEBUG record takes it as it is); the miss journal keeps
its ``kind`` and ``path`` for ``explain``. Imported by a hit: no imports.
"""

from __future__ import annotations

__all__ = [
    "DAMAGED",
    "DIRECTORY_CHANGED",
    "HEADER_CHANGED",
    "HEADER_GONE",
    "NOT_A_CHECK",
    "NO_RECORD",
    "RESULT_GONE",
    "SHADOWED",
    "UNCACHEABLE",
    "Why",
]

NO_RECORD = "no record"
HEADER_CHANGED = "header changed"
HEADER_GONE = "header gone"
DIRECTORY_CHANGED = "directory changed"
SHADOWED = "header shadowed"
RESULT_GONE = "result gone"
DAMAGED = "damaged"
#: Not a lookup's miss: a build that cannot be keyed soundly ran uncached (cuda.compute).
UNCACHEABLE = "uncacheable"


class Why(str):
    """Why a lookup missed: the line it logs (the ``str``), with its ``kind`` and the ``path`` whose check failed.

    ``path`` is empty when no file's check failed; :meth:`as_dict` is its journal form.
    """

    kind: str
    path: str

    def __new__(cls, kind: str, text: str, path: str = "") -> Why:
        self = super().__new__(cls, text)
        self.kind = kind
        self.path = path
        return self

    @classmethod
    def header_changed(cls, path: str) -> Why:
        return cls(HEADER_CHANGED, f"header {path} changed", path)

    @classmethod
    def header_gone(cls, path: str) -> Why:
        return cls(HEADER_GONE, f"header {path} is gone", path)

    @classmethod
    def directory_changed(cls, path: str) -> Why:
        return cls(DIRECTORY_CHANGED, f"directory {path} changed (a header may now be found elsewhere)", path)

    @classmethod
    def shadowed(cls, path: str) -> Why:
        return cls(SHADOWED, f"{path} appeared, where NVRTC looks before a header it read", path)

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "path": self.path, "text": str(self)}


#: Kinds that are no failed check of a variant's files: any other kind is one.
NOT_A_CHECK = frozenset({NO_RECORD, RESULT_GONE, DAMAGED, UNCACHEABLE})
