"""cuda-program-cas: a content-addressed cache for compiled CUDA programs.

``from cas import ContentAddressedProgramCache`` gives the ``cuda.core``
``ProgramCacheResource``; it is imported on first use, so the storage layer
(:class:`CacheStore`, the blob store and the maintenance verbs) works on a machine
without CUDA. The maintenance verbs (``collect``, ``verify``, ``publish``,
``import_filestream`` and their reports) are imported on first use too, so a job
that only looks kernels up does not pay for them at start-up.

``cas.__version__`` is the installed distribution's version (read on first use,
from its metadata), or ``"0+unknown"`` when the package runs from a source tree
that was never installed.
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

    __version__: str

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
    "__version__",
    "collect",
    "default_cache_dir",
    "digest_of",
    "import_filestream",
    "parse_duration",
    "parse_size",
    "publish",
    "verify",
]


#: ``cas.__version__`` when ``cuda-program-cas`` is not installed (a source tree on ``sys.path``).
_UNKNOWN_VERSION = "0+unknown"


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cuda-program-cas")
    except PackageNotFoundError:
        return _UNKNOWN_VERSION


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read on first use: importlib.metadata costs an import cas need not pay
        value: Any = _installed_version()
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cas' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
