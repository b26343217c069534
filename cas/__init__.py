"""cuda-program-cas: a content-addressed cache for compiled CUDA programs.

``from cas import ContentAddressedProgramCache`` gives the ``cuda.core``
``ProgramCacheResource``; it is imported on first use, so the storage layer
(:class:`CacheStore`, the blob store and the maintenance code) works on a machine
without CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._blobs import BlobStore, digest_of
from ._config import default_cache_dir, parse_duration, parse_size
from ._errors import CacheError, CorruptBlobError, LayoutError, ReadOnlyCacheError
from ._stats import CacheStats
from ._store import CacheStore

if TYPE_CHECKING:
    from ._cache import ContentAddressedProgramCache

__all__ = [
    "BlobStore",
    "CacheError",
    "CacheStats",
    "CacheStore",
    "ContentAddressedProgramCache",
    "CorruptBlobError",
    "LayoutError",
    "ReadOnlyCacheError",
    "default_cache_dir",
    "digest_of",
    "parse_duration",
    "parse_size",
]


def __getattr__(name: str) -> Any:
    if name == "ContentAddressedProgramCache":
        from ._cache import ContentAddressedProgramCache

        return ContentAddressedProgramCache
    raise AttributeError(f"module 'cas' has no attribute {name!r}")
