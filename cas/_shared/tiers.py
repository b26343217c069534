"""The one table that picks a store's engine by its address's scheme, and opens the store over it.

=============================  ============================================  =====================
address                        engine                                        packs
=============================  ============================================  =====================
a path, ``file://``            :class:`cuda_program_cas._disk.direngine.DirEngine`  ``packs/``, listed
``http://``, ``https://``      :class:`cuda_program_cas._remote.http.HttpEngine` (WebDAV writes)  ``packs/list``
``redis://``, ``rediss://``    :class:`cuda_program_cas._remote.redis.RedisEngine`  none
``s3://``                      :class:`cuda_program_cas._remote.s3.S3Engine`  ``packs/list``
=============================  ============================================  =====================

Each engine is imported when a store of its scheme is opened, so a plain cache
never loads the HTTP, Redis or S3 side (botocore). ``ADDRESS|write`` names a store writable
(:func:`cuda_program_cas._base.urls.parse_store_entry`). Publish opens the store
it writes by the same table (:func:`open_engine`), and its packs by the engine's
record (:func:`open_packs`: one publisher for every engine that reads ranges;
none for Redis, where loose entries are all a store holds).
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

    #: The local cache's memo of pack indexes: ``memo_get(key id)`` -> bytes or None; ``memo_put(key id, bytes)``.
    memo_get: MemoGet | None = None
    memo_put: MemoPut | None = None
    #: The keys entries must be signed by (:mod:`cuda_program_cas._base.signing`), or None.
    trust: Trust | None = None
    #: The largest entry worth reading (what the local cap can hold), besides the ceiling; None: the ceiling.
    max_entry: int | None = None
    #: A folder on the local cache's disk where a large body waits while it is verified (HTTP), or None.
    staging: str | None = None
    #: How a directory store's files are written (publish's modes and syncing); None: the writer's defaults.
    modes: DirModes | None = None


class PackTarget(Protocol):
    """A store's packs as a publisher sees them (:class:`cuda_program_cas._disk.packpublish.StorePacks`)."""

    def entries(self) -> dict[str, PackedEntry]:
        """Every packed entry of the store, by key id."""
        ...

    def ok(self, packed: PackedEntry) -> bool:
        """Whether the pack's copy of the entry's blob is good, as far as it is checked here."""
        ...

    def write(self, inputs: Sequence[PackInput], stats: dict[str, int]) -> str | None:
        """One new pack of ``inputs``, stored and listed: where it is (None: nothing to pack)."""
        ...

    def finish(self, wrote: bool) -> None:
        """After the run's last write (``wrote``: a pack was written)."""
        ...

    def written(self) -> dict[str, PackedEntry]:
        """The entries of the packs this run wrote, by key id (where warm sets' lines now point)."""
        ...

    def close(self) -> None: ...


def _dir_engine(address: str, opts: Options) -> Engine:
    from cuda_program_cas._disk.direngine import DirEngine, DirModes

    root = os.path.abspath(address)
    modes = opts.modes
    if modes is None:
        # Write-back into a store that other users' nodes read: the files as publish writes them by
        # default (0644 less the umask; group-shared where the store's top directory is setgid), not the
        # private modes of a local cache.
        try:
            setgid = bool(os.stat(root).st_mode & stat.S_ISGID)
        except OSError:
            setgid = False
        modes = DirModes.for_process(setgid, fsync=False)
    return DirEngine(root, modes=modes)


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
        tier.counters.add("corrupt")
        tier._note("damaged pack", f"{why}; it is a miss")

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


@dataclass(frozen=True)
class _Scheme:
    engine: Callable[[str, Options], Engine]
    tier: Callable[[Any, bool, Options], Tier]


_DIRECTORY = _Scheme(_dir_engine, _directory)
_HTTP = _Scheme(_http_engine, _http)
_REDIS = _Scheme(_redis_engine, _redis)
_S3 = _Scheme(_s3_engine, _http)  # the HTTP engine's requests, signed; its packs read as HTTP's
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
    """The store an entry of a store list names (``ADDRESS`` or ``ADDRESS|write``); ``ValueError`` for a bad one.

    ``options`` are the fields of :class:`Options`.
    """
    address, writable = parse_store_entry(entry)
    opts = Options(**options)
    scheme = _scheme(address)
    return scheme.tier(scheme.engine(address, opts), writable, opts)


def open_engine(address: str, **options: Any) -> Engine:
    """The engine of the store at ``address`` (a path, ``file://``, or a store URL); ``ValueError`` for a bad one."""
    address = parse_store_entry(address).address if scheme_of(address) == "file" else address
    return _scheme(address).engine(address, Options(**options))


def open_packs(engine: Engine) -> PackTarget | None:
    """The packs of the store behind ``engine`` for a publisher, or None where its record says it keeps none.

    Packs need ranged reads; an engine whose objects may go on their own (Redis) keeps loose entries only: a key
    is as cheap there as a pack's entry, and an evicted pack would take many entries with it.
    """
    if engine.can.evicts or ranged(engine) is None:
        return None
    from cuda_program_cas._disk.packpublish import StorePacks

    return StorePacks(engine)
