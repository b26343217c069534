"""cuda-program-cas: a content-addressed cache for compiled CUDA programs.

``from cas import ContentAddressedProgramCache`` gives the ``cuda.core``
``ProgramCacheResource``; it is imported on first use, so the storage layer
(:class:`CacheStore`, the blob store and the maintenance verbs) works on a machine
without CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._blobs import BlobStore, digest_of
from ._config import default_cache_dir, parse_duration, parse_size
from ._errors import CacheError, CollectorBusyError, CorruptBlobError, LayoutError, ReadOnlyCacheError
from ._gc import GcReport, collect
from ._import_fs import ImportReport, import_filestream
from ._publish import PublishReport, publish
from ._stats import CacheStats
from ._store import CacheStore
from ._verify import Problem, VerifyReport, verify
from ._writer import WriteResult

if TYPE_CHECKING:
    from ._cache import ContentAddressedProgramCache

__all__ = [
    "BlobStore",
    "CacheError",
    "CacheStats",
    "CacheStore",
    "CollectorBusyError",
    "ContentAddressedProgramCache",
    "CorruptBlobError",
    "GcReport",
    "ImportReport",
    "LayoutError",
    "Problem",
    "PublishReport",
    "ReadOnlyCacheError",
    "VerifyReport",
    "WriteResult",
    "collect",
    "default_cache_dir",
    "digest_of",
    "import_filestream",
    "parse_duration",
    "parse_size",
    "publish",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name == "ContentAddressedProgramCache":
        from ._cache import ContentAddressedProgramCache

        return ContentAddressedProgramCache
    raise AttributeError(f"module 'cas' has no attribute {name!r}")
