"""``ContentAddressedProgramCache``: the ``cuda.core`` ``ProgramCacheResource`` adapter.

This is the only module that imports ``cuda.core``; everything it does beyond
turning values into bytes is :class:`cuda_program_cas.CacheStore`'s.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from cuda.core import LinkerOptions, ObjectCode, Program, ProgramOptions
from cuda.core.utils import ProgramCacheResource

from cuda_program_cas._base.config import (
    ENV_SWITCH,
    NOT_GIVEN,
    default_cache_dir,
    env_max_size,
    env_shared,
    env_switched_off,
    validate_max_size,
)
from cuda_program_cas._base.errors import ReadOnlyCacheError
from cuda_program_cas._local.stats import Counters
from cuda_program_cas._store.store import CacheStore
from cuda_program_cas.index import key_bytes, key_id

from .inputs import install as install_key_seam
from .inputs import taken_for

if TYPE_CHECKING:
    from cuda_program_cas._disk.writer import WriteResult
    from cuda_program_cas._local.cachestats import CacheStats
    from cuda_program_cas._store.store import Inner

__all__ = ["ContentAddressedProgramCache", "SwitchedOff", "inner_of"]


def as_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, ObjectCode):
        code = value.code
        if isinstance(code, str):
            try:
                with open(code, "rb") as fh:
                    return fh.read()
            except FileNotFoundError:
                raise FileNotFoundError(f"cannot cache path-backed ObjectCode: {code} does not exist") from None
        return bytes(code)
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    raise TypeError(
        "cache values must be bytes-like or ObjectCode (bytes, bytearray, memoryview or ObjectCode), "
        f"got {type(value).__name__}: {text}"
    )


class SwitchedOff:
    """The store of a cache that ``CUDA_PROGRAM_CAS=0`` turned off, as ``CCACHE_DISABLE`` turns ccache off.

    It touches nothing on disk. A lookup misses uncounted; a write is dropped and
    counted; ``del`` and ``clear()`` raise ``ReadOnlyCacheError``.
    """

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
        from cuda_program_cas._local.cachestats import CacheStats

        return CacheStats(0, 0, 0, 0, 0, None, **self.counters())

    def close(self) -> None:
        pass


class ContentAddressedProgramCache(ProgramCacheResource):  # type: ignore[misc]  # cuda.core ships no stubs
    """A persistent, deduplicating program cache for ``Program.compile(cache=...)`` (docs/python-api.md).

    ``path``: the cache directory (``$CUDA_PROGRAM_CAS_DIR``, else the user's cache
    directory); ``max_size_bytes`` and ``shared`` not given: from the environment;
    ``read_only``: never write anything under ``path``; ``copy_shared_hits``: copy
    a verified shared hit here. ``CUDA_PROGRAM_CAS=0`` turns it off (:class:`SwitchedOff`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        max_size_bytes: int | None = NOT_GIVEN,
        shared: Iterable[str | os.PathLike[str]] | None = NOT_GIVEN,
        read_only: bool = False,
        copy_shared_hits: bool = True,
    ) -> None:
        self._front_door: Any = None
        #: The store's internal side (see inner_of), made on first use: a hit needs none.
        self._inner: Inner | None = None
        self._store: CacheStore | SwitchedOff
        if env_switched_off():
            self._store = SwitchedOff(default_cache_dir() if path is None else path, max_size_bytes)
            return
        if max_size_bytes is NOT_GIVEN:
            # The environment, else (still NOT_GIVEN) the cache's own setting.
            max_size_bytes = env_max_size() or NOT_GIVEN
        if shared is NOT_GIVEN:
            shared = env_shared() or []
        elif shared is None:
            shared = ()
        self._store = CacheStore(
            default_cache_dir() if path is None else path,
            max_size_bytes=max_size_bytes,
            read_only=read_only,
            shared=shared,
            copy_shared_hits=copy_shared_hits,
        )
        if not self._store.read_only:
            install_key_seam()  # so that a Program.compile(cache=) miss says what it was made of

    @property
    def path(self) -> str:
        """The absolute path of the local cache directory."""
        return self._store.root

    @property
    def switched_off(self) -> bool:
        """Whether ``CUDA_PROGRAM_CAS=0`` turned this cache off when it was made (see the class)."""
        return isinstance(self._store, SwitchedOff)

    @property
    def store(self) -> CacheStore:
        """The underlying bytes-only :class:`cuda_program_cas.CacheStore` (an off cache has none: raises)."""
        if isinstance(self._store, SwitchedOff):
            raise self._store.refuse("give its store")
        return self._store

    def __getitem__(self, key: bytes | str) -> bytes:
        data = self._store.get(key)
        if data is None:
            raise KeyError(key)
        return data

    def get(self, key: bytes | str, default: bytes | None = None) -> bytes | None:
        data = self._store.get(key)
        return default if data is None else data

    def __setitem__(self, key: bytes | str, value: bytes | bytearray | memoryview | ObjectCode) -> None:
        kb = key_bytes(key)  # a bad key is reported before a path-backed value is read
        data = as_bytes(value)
        made = taken_for(kb)  # a Program.compile(cache=) miss of this thread: its inputs and compile time
        result = self._store.put(kb, data)
        if made is not None and result and isinstance(self._store, CacheStore):
            inner_of(self).note_compiled(key_id(kb), made[0], "plain", made[1])

    def __delitem__(self, key: bytes | str) -> None:
        self._store.delete(key)

    def __len__(self) -> int:
        return len(self._store)

    def __contains__(self, key: object) -> bool:
        raise TypeError(
            "`key in cache` is not supported: another process can remove the entry between the check and "
            "the read; use `data = cache.get(key)` and test `data is None`"
        )

    def __iter__(self) -> Iterator[bytes]:
        raise TypeError("a ContentAddressedProgramCache cannot list its keys: they are stored hashed")

    def clear(self) -> None:
        self._store.clear()

    def compile(
        self,
        code: str | bytes,
        code_type: str,
        options: ProgramOptions | None,
        target_type: str,
        *,
        name_expressions: Sequence[str | bytes] = (),
        logs: Any = None,
    ) -> ObjectCode:
        """``Program(code, code_type, options).compile(target_type, name_expressions, logs)`` through the cache,
        also what ``Program.compile(cache=)`` refuses (docs/frontdoor.md).

        Options whose effect cannot be keyed (``pch``, ``use_pch``, ``pch_dir``,
        ``create_pch``, ``time``, ``fdevice_time_trace``) raise ``ValueError``.
        """
        if isinstance(self._store, SwitchedOff):
            program = getattr(Program, "cpcas_original", Program)(code, code_type, options)
            result: ObjectCode = program.compile(target_type, tuple(name_expressions), logs)
            self._store.note_dropped()
            return result
        if self._front_door is None:
            from .frontdoor import FrontDoor

            self._front_door = FrontDoor(self._store)
        obj: ObjectCode = self._front_door.compile(
            code, code_type, options, target_type, name_expressions=name_expressions, logs=logs
        )
        return obj

    def link(self, object_codes: Iterable[ObjectCode], options: LinkerOptions | None, target_type: str) -> ObjectCode:
        """``Linker(*object_codes, options=options).link(target_type)`` through the cache."""
        from .link import link, link_uncached

        if isinstance(self._store, SwitchedOff):
            result: ObjectCode = link_uncached(tuple(object_codes), options, target_type)[0]
            self._store.note_dropped()
            return result
        obj: ObjectCode = link(inner_of(self), object_codes, options, target_type)
        return obj

    def build(self, make: Any, /, **kwargs: Any) -> Any:
        """``make(**kwargs)``, a cuda.compute ``make_*`` factory, through the cache (docs/compute.md)."""
        from .compute import build

        if isinstance(self._store, SwitchedOff):
            self._store.note_dropped()
            return getattr(make, "cpcas_original", make)(**kwargs)
        return build(inner_of(self), make, kwargs)

    def prebuild(self, make: Any, /, *, compute_capabilities: Any, **kwargs: Any) -> dict[tuple[int, int], Any]:
        """:meth:`build` for each architecture of ``compute_capabilities`` (``[(8, 0), (9, 0)]``): no GPU needed.

        Device arrays may be ``cuda.compute.ProxyArray`` and initial values ``ProxyValue``.
        """
        from cuda.compute._cccl_interop import normalize_compute_capabilities

        if "compute_capability" in kwargs:
            raise TypeError("prebuild takes compute_capabilities=, not compute_capability=")
        ccs = normalize_compute_capabilities(compute_capabilities)
        if not ccs:
            raise ValueError(f"compute_capabilities names no architecture: {compute_capabilities!r}")
        return {(int(a), int(b)): self.build(make, **{**kwargs, "compute_capability": (a, b)}) for a, b in ccs}

    def stats(self) -> CacheStats:
        """Entries, blobs, logical and stored bytes (a scan of the disk), and this instance's counters."""
        return self._store.stats()

    def counters(self) -> dict[str, int]:
        """This instance's counters (``hits``, ``misses``, ...) without scanning the disk: cheap enough per call."""
        return self._store.counters()

    def close(self) -> None:
        """Record this instance's counts in the lifetime counters; nothing is held open, the cache stays usable."""
        self._store.close()

    def __enter__(self) -> ContentAddressedProgramCache:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        extra = f", max_size_bytes={self._store.max_size_bytes}" if self._store.max_size_bytes else ""
        if self.switched_off:
            extra += ", switched off by CUDA_PROGRAM_CAS=0"
        elif self._store.read_only:
            extra += ", read_only=True"
        if isinstance(self._store, CacheStore) and (paths := self._store.inner.shared_paths()):
            extra += f", shared={list(paths)!r}"
        return f"ContentAddressedProgramCache({self.path!r}{extra})"


def inner_of(cache: ContentAddressedProgramCache) -> Inner:
    """The internal side of ``cache``'s store, kept with the cache (raises as ``cache.store`` does when off)."""
    inner = cache._inner
    if inner is None:
        inner = cache._inner = cache.store.inner
    return inner
