"""The store of a cache that ``CUDA_PROGRAM_CAS=0`` turned off, as ``CCACHE_DISABLE`` turns ccache off.

:class:`cuda_program_cas.ContentAddressedProgramCache` stands on it instead of a
:class:`cuda_program_cas.CacheStore` when the variable is ``0`` as the cache is
made. It holds nothing and touches nothing on disk: no directory is created,
read, written or locked, no shared store is asked. Every lookup misses without
being counted (nothing was looked up); every write is dropped and counted in
``dropped_writes``, as a read-only cache counts it. ``del`` and ``clear()``
raise :class:`cuda_program_cas.ReadOnlyCacheError`, as on a read-only cache.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from cuda_program_cas._base.config import ENV_SWITCH, NOT_GIVEN, validate_max_size
from cuda_program_cas._base.errors import ReadOnlyCacheError
from cuda_program_cas._local.stats import Counters
from cuda_program_cas.index import key_id

if TYPE_CHECKING:
    from cuda_program_cas._disk.writer import WriteResult
    from cuda_program_cas._local.cachestats import CacheStats

__all__ = ["SwitchedOff"]


class SwitchedOff:
    """What the adapter asks of its store, answered for a cache that is off (see the module)."""

    read_only = True
    max_size_bytes: int | None = None

    def __init__(self, path: str | os.PathLike[str], max_size_bytes: object) -> None:
        root = os.fspath(path)
        if not isinstance(root, str) or root == "":
            raise ValueError(f"cache path must be a non-empty path, got {path!r}")
        if max_size_bytes is not NOT_GIVEN:
            validate_max_size(max_size_bytes)  # bad input is bad input, on or off
        self.root = os.path.abspath(root)
        self._counters = Counters()

    def get(self, key: object) -> bytes | None:
        key_id(key)  # a key that is neither str nor bytes is still refused
        return None

    def put(self, key: object, data: bytes) -> WriteResult:
        from cuda_program_cas._disk.writer import WriteResult

        key_id(key)
        if not isinstance(data, bytes):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        self.note_dropped()
        return WriteResult.DROPPED

    def note_dropped(self) -> None:
        self._counters.add("dropped_writes")

    def refuse(self, what: str) -> ReadOnlyCacheError:
        return ReadOnlyCacheError(f"cannot {what}: cache {self.root!r} is switched off ({ENV_SWITCH}=0)")

    def delete(self, key: object) -> None:
        key_id(key)
        raise self.refuse("delete")

    def clear(self) -> None:
        raise self.refuse("clear")

    def __len__(self) -> int:
        return 0

    def counters(self) -> dict[str, int]:
        return self._counters.as_dict()

    def stats(self) -> CacheStats:
        """An empty cache, and the writes this instance dropped: an off cache holds nothing it would give."""
        from cuda_program_cas._local.cachestats import CacheStats

        return CacheStats(0, 0, 0, 0, 0, None, **self.counters())

    def close(self) -> None:
        pass
