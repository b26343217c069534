"""The one table that picks a store's engine by its address's scheme, and opens the store over it.

=============================  ============================================  =====================
address                        engine                                        packs
=============================  ============================================  =====================
a path, ``file://``            :class:`cuda_program_cas._disk.direngine.DirEngine`  ``packs/``, listed
``http://``, ``https://``      :class:`cuda_program_cas._remote.http.HttpEngine` (WebDAV writes)  ``packs/list``
``redis://``, ``rediss://``    :class:`cuda_program_cas._remote.redis.RedisEngine`  none
``s3://``                      :class:`cuda_program_cas._remote.s3.S3Engine`  ``packs/list``
=============================  ============================================  =====================

Each engine is imported when a store of its scheme is opened. ``ADDRESS|write`` names a store
writable. Publish opens its store by the same table (:func:`open_engine`) and its packs by the
engine's record (:func:`open_packs`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cuda_program_cas._base.engine import Engine, ranged
from cuda_program_cas._base.signing import Trust
from cuda_program_cas._base.urls import check_address, parse_store_entry, scheme_of

from .tier import Tier, ceiling

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cuda_program_cas._disk.direngine import DirModes
    from cuda_program_cas._disk.pack import PackInput
    from cuda_program_cas._disk.packsummary import PackedEntry

__all__ = ["PackTarget", "open_engine", "open_packs", "open_tier"]

#: ``memo_get(key id)`` -> bytes the local cache keeps, or None; ``memo_put(key id, bytes)``: keep them.
MemoGet = Callable[[str], "bytes | None"]
MemoPut = Callable[[str, bytes], None]


@dataclass(frozen=True)
class Options:
    """What the cache above gives each store it opens (every engine takes what applies to it)."""

    memo_get: MemoGet | None = None
    memo_put: MemoPut | None = None
    trust: Trust | None = None
    #: The largest entry worth reading (what the local cap can hold); None: the ceiling.
    max_entry: int | None = None
    #: A folder on the local cache's disk where a large body waits while it is verified, or None.
    staging: str | None = None
    #: How a directory store's files are written; None: as publish writes them.
    modes: DirModes | None = None


class PackTarget(Protocol):
    """A store's packs as a publisher sees them (:class:`cuda_program_cas._disk.packpublish.StorePacks`)."""

    def entries(self) -> dict[str, PackedEntry]: ...
    def ok(self, packed: PackedEntry) -> bool: ...
    def write(self, inputs: Sequence[PackInput], stats: dict[str, int]) -> str | None: ...
    def finish(self, wrote: bool) -> None: ...
    def written(self) -> dict[str, PackedEntry]: ...
    def close(self) -> None: ...


def _dir_engine(address: str, opts: Options) -> Engine:
    from cuda_program_cas._disk.direngine import DirEngine, DirModes

    root = os.path.abspath(address)
    modes = opts.modes
    if modes is None:
        # Write-back into a store other users' nodes read: publish's modes, not a local cache's private ones.
        try:
            setgid = bool(os.stat(root).st_mode & stat.S_ISGID)
        except OSError:
            setgid = False
        modes = DirModes.for_process(setgid, fsync=False)
    return DirEngine(root, modes=modes, staging=opts.staging)


def _directory(engine: Engine, writable: bool, opts: Options) -> Tier:
    from cuda_program_cas._disk.packset import PackSet

    root = engine.shown
    tier: Tier

    def missing() -> str:
        from cuda_program_cas._base.errors import LayoutError
        from cuda_program_cas._disk.layout import check_layout

        try:
            check_layout(root)  # names a file, a foreign directory, a dangling symlink
        except (OSError, LayoutError) as exc:
            return str(exc)
        return "not a cache (no layout.json)" if os.path.isdir(root) else "missing"

    def damaged(_path: str, why: str) -> None:
        tier.damaged("damaged pack", f"{why}; it is a miss")

    tier = Tier(
        engine,
        packs=PackSet(root, on_damage=damaged, max_entry=lambda: ceiling(opts.max_entry)),
        writable=writable,
        missing=missing,
        trust=opts.trust,
        max_entry=opts.max_entry,
    )
    return tier


def _http_engine(address: str, opts: Options) -> Engine:
    from cuda_program_cas._remote.http import HttpEngine

    return HttpEngine(address, staging=opts.staging)


def _http(engine: Any, writable: bool, opts: Options) -> Tier:
    from cuda_program_cas._remote.httppacks import HttpPacks

    packs = HttpPacks(engine, memo_get=opts.memo_get, memo_put=opts.memo_put)
    tier = Tier(
        engine,
        packs=packs,
        writable=writable,
        missing=lambda: "not a store: no layout.json (404)",
        trust=opts.trust,
        max_entry=opts.max_entry,
    )
    packs.report = tier
    return tier


def _redis_engine(address: str, opts: Options) -> Engine:
    from cuda_program_cas._remote.redis import RedisEngine

    return RedisEngine(address)


def _redis(engine: Engine, writable: bool, opts: Options) -> Tier:
    # Redis evicts keys on its own (allkeys-lru, docs/redis.md): its record says so (an empty store needs no layout).
    return Tier(engine, writable=writable, trust=opts.trust, max_entry=opts.max_entry)


def _s3_engine(address: str, opts: Options) -> Engine:
    from cuda_program_cas._remote.s3 import S3Engine

    return S3Engine(address, staging=opts.staging)


#: A scheme's engine, and its tier over that engine.
_Scheme = tuple[Callable[[str, Options], Engine], Callable[[Any, bool, Options], Tier]]
_DIRECTORY: _Scheme = (_dir_engine, _directory)
_HTTP: _Scheme = (_http_engine, _http)
_REDIS: _Scheme = (_redis_engine, _redis)
_S3: _Scheme = (_s3_engine, _http)  # the HTTP engine's requests, signed; its packs read as HTTP's
_ENGINES: dict[str, _Scheme] = {
    "file": _DIRECTORY, "http": _HTTP, "https": _HTTP, "redis": _REDIS, "rediss": _REDIS, "s3": _S3,
}  # fmt: skip


def _scheme(address: str) -> _Scheme:
    check_address(address)  # htp://host/x is no relative directory
    scheme = scheme_of(address) or "file"
    found = _ENGINES.get(scheme)
    if found is None:
        raise ValueError(f"no engine for {scheme}:// stores yet: {address!r}")
    return found


def open_tier(entry: str, **options: Any) -> Tier:
    """The store ``ADDRESS`` or ``ADDRESS|write`` names (``options``: :class:`Options`); ValueError for a bad one."""
    address, writable = parse_store_entry(entry)
    opts = Options(**options)
    engine, tier = _scheme(address)
    return tier(engine(address, opts), writable, opts)


def open_engine(address: str, **options: Any) -> Engine:
    """The engine of the store at ``address`` (a path, ``file://``, or a store URL); ``ValueError`` for a bad one."""
    address = parse_store_entry(address).address if scheme_of(address) == "file" else address
    return _scheme(address)[0](address, Options(**options))


def open_packs(engine: Engine) -> PackTarget | None:
    """The packs of the store behind ``engine`` for a publisher, or None (no ranged reads, or it evicts)."""
    if engine.can.evicts or ranged(engine) is None:
        return None
    from cuda_program_cas._disk.packpublish import StorePacks

    return StorePacks(engine)
