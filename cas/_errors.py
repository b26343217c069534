"""The exceptions of cuda-program-cas, all under :class:`CacheError`."""

from __future__ import annotations

import os

__all__ = ["CacheError", "CorruptBlobError", "LayoutError", "ReadOnlyCacheError"]


class CacheError(Exception):
    """Root of every error this library raises on purpose."""


class LayoutError(CacheError, ValueError):
    """The directory is not a cache this version can use: a file, a foreign or newer layout."""


class ReadOnlyCacheError(CacheError, PermissionError):
    """A mutation was asked of a cache opened read-only (or a shared store)."""


class CorruptBlobError(CacheError):
    """A blob's bytes do not hash to the digest that names it (or it has the wrong size).

    ``actual`` is the digest the bytes hash to, or a note of the size found when the
    file was not read; ``stat`` is the file's, for moving it aside only if unchanged.
    """

    def __init__(self, path: str, expected: str, actual: str, stat: os.stat_result | None = None) -> None:
        super().__init__(f"blob {path} is corrupt: expected blake3 {expected}, got {actual}")
        self.path = path
        self.expected = expected
        self.actual = actual
        self.stat = stat
