"""cuda-program-cas: a content-addressed cache for compiled CUDA programs.

``from cuda_program_cas import ContentAddressedProgramCache`` gives the ``cuda.core``
``ProgramCacheResource``; it is imported on first use, so the storage layer
(:class:`CacheStore`, the blob store and the maintenance verbs) works on a machine
without CUDA. Every name but the errors is imported on first use: a process pays for
the parts it touches. The maintenance verbs (``collect``, ``verify``, ``publish``,
``import_filestream``, ``stats``, ``repack``, ``clear``, ``config``) are imported
on first use too, so a job that only looks kernels up does not pay for them at
start-up. Each returns a report of one shape (:class:`Report`): ``problems`` (a
list), ``problem_count`` and ``as_dict()``, what the command line prints.

``cuda_program_cas.__version__`` is the installed distribution's version (read on first use,
from its metadata), or ``"0+unknown"`` when the package runs from a source tree
that was never installed.
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

#: Names imported on first use, and the module each comes from: ``import cuda_program_cas``
#: costs its errors alone (0.6 ms here, against 18-30 ms when the store came with it).
_LAZY = {
    "default_cache_dir": "._base.config",
    "parse_duration": "._base.config",
    "parse_size": "._base.config",
    "BlobStore": "._disk.blobs",
    "digest_of": "._disk.blobs",
    "WriteResult": "._disk.writer",
    "CacheStats": "._local.cachestats",
    "CacheStore": "._store.store",
    "ContentAddressedProgramCache": "._cuda.cache",
    "PackError": "._disk.pack",
    "ClearReport": "._verbs.clear",
    "clear": "._verbs.clear",
    "Report": "._verbs.common",
    "ConfigReport": "._verbs.config",
    "config": "._verbs.config",
    "ExplainReport": "._verbs.explain",
    "MissExplanation": "._verbs.explain",
    "explain": "._verbs.explain",
    "install": "._cuda.switch",
    "uninstall": "._cuda.switch",
    "GcReport": "._verbs.gc",
    "collect": "._verbs.gc",
    "ImportReport": "._verbs.import_filestream",
    "import_filestream": "._verbs.import_filestream",
    "PublishReport": "._verbs.publish",
    "publish": "._verbs.publish",
    "Problem": "._verbs.verify",
    "VerifyReport": "._verbs.verify",
    "RepackReport": "._verbs.repack",
    "repack": "._verbs.repack",
    "StatsReport": "._verbs.stats",
    "stats": "._verbs.stats",
    "verify": "._verbs.verify",
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
