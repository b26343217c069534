"""The exceptions of cuda-program-cas, all under :class:`CacheError`."""

from __future__ import annotations

__all__ = ["CacheError", "CorruptBlobError", "LayoutError", "ReadOnlyCacheError"]


class CacheError(Exception):
    """Root of every error this library raises on purpose."""


class LayoutError(CacheError, ValueError):
    """The directory is not a cache this version can use: a file, a foreign or newer layout."""


class ReadOnlyCacheError(CacheError, PermissionError):
    """A mutation was asked of a cache opened read-only (or a shared store)."""


class CorruptBlobError(CacheError):
    """A blob's bytes do not hash to the digest that names it."""

    def __init__(self, path: str, expected: str, actual: str) -> None:
        super().__init__(f"blob {path} is corrupt: expected blake3 {expected}, got {actual}")
        self.path = path
        self.expected = expected
        self.actual = actual
