"""cuda-program-cas: a content-addressed cache for compiled CUDA programs.

``from cas import ContentAddressedProgramCache`` gives the ``cuda.core``
``ProgramCacheResource``; it is imported on first use, so the storage layer
(:class:`CacheStore`, the blob store and the maintenance verbs) works on a machine
without CUDA. The maintenance verbs (``collect``, ``verify``, ``publish``,
``import_filestream`` and their reports) are imported on first use too, so a job
that only looks kernels up does not pay for them at start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._blobs import BlobStore, digest_of
from ._config import default_cache_dir, parse_duration, parse_size
from ._errors import CacheError, CollectorBusyError, CorruptBlobError, LayoutError, ReadOnlyCacheError
from ._stats import CacheStats
from ._store import CacheStore
from ._writer import WriteResult

if TYPE_CHECKING:
    from ._cache import ContentAddressedProgramCache
    from ._gc import GcReport, collect
    from ._import_fs import ImportReport, import_filestream
    from ._publish import PublishReport, publish
    from ._verify import Problem, VerifyReport, verify

#: Names imported on first use, and the module each comes from.
_LAZY = {
    "ContentAddressedProgramCache": "._cache",
    "GcReport": "._gc",
    "collect": "._gc",
    "ImportReport": "._import_fs",
    "import_filestream": "._import_fs",
    "PublishReport": "._publish",
    "publish": "._publish",
    "Problem": "._verify",
    "VerifyReport": "._verify",
    "verify": "._verify",
}

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
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cas' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
