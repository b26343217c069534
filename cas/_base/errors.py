"""The exceptions of cuda-program-cas, all under :class:`CacheError` (and ``PackError`` in ``_disk.pack``).

Every one pickles (a worker process can send it back): each keeps its arguments in ``args``.
"""

from __future__ import annotations

import os
from typing import TypeVar

__all__ = [
    "CacheError",
    "CollectorBusyError",
    "CorruptBlobError",
    "LayoutError",
    "ReadOnlyCacheError",
    "without_frames",
]

_E = TypeVar("_E", bound=BaseException)


class CacheError(Exception):
    """Root of every error this library raises on purpose."""


class LayoutError(CacheError, ValueError):
    """The directory is not a cache this version can use: a file, a foreign, damaged or newer layout."""


class ReadOnlyCacheError(CacheError, PermissionError):
    """A removal (``del``, ``clear``, a maintenance verb) was asked of a cache that cannot be written (a write is
    dropped and counted instead)."""


class CollectorBusyError(CacheError):
    """Another collector or a size-cap eviction holds the cache's lock; nothing was changed."""


class CorruptBlobError(CacheError):
    """A blob's bytes do not hash to the digest that names it (``actual``: their digest, or the size found);
    ``stat`` is the file's, for moving it aside only if unchanged."""

    def __init__(self, path: str, expected: str, actual: str, stat: os.stat_result | None = None) -> None:
        super().__init__(path, expected, actual, stat)
        self.path = path
        self.expected = expected
        self.actual = actual
        self.stat = stat

    def __str__(self) -> str:
        return f"blob {self.path} is corrupt: expected blake3 {self.expected}, got {self.actual}"


def without_frames(exc: _E) -> _E:
    """``exc``, the finished frames of its traceback (and its causes' and contexts') cleared of their locals.

    For an error turned into a miss. urllib3's ``urlopen`` keeps the error in a local of a frame
    of its own traceback: a cycle that keeps the caller's ``Program`` alive until the garbage
    collector clears it before ``cuda.core``'s ``__dealloc__`` reads it (``Exception ignored in``
    at exit).
    """
    import traceback

    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        todo += (err.__cause__, err.__context__)
    return exc
