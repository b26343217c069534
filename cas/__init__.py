"""cuda-program-cas: a content-addressed cache for compiled CUDA programs.

Every name but the errors is imported on first use: the storage layer
(:class:`CacheStore`, the blob store, the maintenance verbs) works without CUDA,
and a process pays for the parts it touches. Each verb returns a report of one
shape (:class:`Report`: ``problems``, ``problem_count``, ``as_dict()``).
``__version__`` is the installed distribution's, or ``"0+unknown"`` in a source
tree never installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._base.errors import CacheError, CollectorBusyError, CorruptBlobError, LayoutError, ReadOnlyCacheError

if TYPE_CHECKING:
    from ._base.config import default_cache_dir, parse_duration, parse_size
    from ._cuda.cache import ContentAddressedProgramCache
    from ._cuda.switch import install, uninstall
    from ._disk.blobs import BlobStore, digest_of
    from ._disk.pack import PackError
    from ._disk.writer import WriteResult
    from ._local.cachestats import CacheStats
    from ._store.store import CacheStore
    from ._verbs.clear import ClearReport, clear
    from ._verbs.common import Report
    from ._verbs.config import ConfigReport, config
    from ._verbs.explain import ExplainReport, MissExplanation, explain
    from ._verbs.gc import GcReport, collect
    from ._verbs.import_filestream import ImportReport, import_filestream
    from ._verbs.publish import PublishReport, publish
    from ._verbs.repack import RepackReport, repack
    from ._verbs.stats import StatsReport, stats
    from ._verbs.verify import Problem, VerifyReport, verify

    __version__: str

#: Names imported on first use, by module: ``import cuda_program_cas`` costs its errors alone.
_LAZY = {
    name: module
    for module, names in {
        "._base.config": ("default_cache_dir", "parse_duration", "parse_size"),
        "._disk.blobs": ("BlobStore", "digest_of"),
        "._disk.writer": ("WriteResult",),
        "._disk.pack": ("PackError",),
        "._local.cachestats": ("CacheStats",),
        "._store.store": ("CacheStore",),
        "._cuda.cache": ("ContentAddressedProgramCache",),
        "._cuda.switch": ("install", "uninstall"),
        "._verbs.clear": ("ClearReport", "clear"),
        "._verbs.common": ("Report",),
        "._verbs.config": ("ConfigReport", "config"),
        "._verbs.explain": ("ExplainReport", "MissExplanation", "explain"),
        "._verbs.gc": ("GcReport", "collect"),
        "._verbs.import_filestream": ("ImportReport", "import_filestream"),
        "._verbs.publish": ("PublishReport", "publish"),
        "._verbs.repack": ("RepackReport", "repack"),
        "._verbs.stats": ("StatsReport", "stats"),
        "._verbs.verify": ("Problem", "VerifyReport", "verify"),
    }.items()
    for name in names
}

__all__ = [
    "BlobStore",
    "CacheError",
    "CacheStats",
    "CacheStore",
    "ClearReport",
    "CollectorBusyError",
    "ConfigReport",
    "ContentAddressedProgramCache",
    "CorruptBlobError",
    "ExplainReport",
    "GcReport",
    "ImportReport",
    "LayoutError",
    "MissExplanation",
    "PackError",
    "Problem",
    "PublishReport",
    "ReadOnlyCacheError",
    "RepackReport",
    "Report",
    "StatsReport",
    "VerifyReport",
    "WriteResult",
    "__version__",
    "clear",
    "collect",
    "config",
    "default_cache_dir",
    "digest_of",
    "explain",
    "import_filestream",
    "install",
    "parse_duration",
    "parse_size",
    "publish",
    "repack",
    "stats",
    "uninstall",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read on first use: importlib.metadata costs an import cuda_program_cas need not pay
        from ._base.config import installed_version

        value: Any = installed_version()
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
