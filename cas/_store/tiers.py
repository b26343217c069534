"""The one table that picks a store's engine by its address's scheme, and opens the store over it.

=============================  ============================================  =====================
address                        engine                                        packs
=============================  ============================================  =====================
a path, ``file://``            :class:`cuda_program_cas._disk.direngine.DirEngine`  ``packs/``, listed
``http://``, ``https://``      :class:`cuda_program_cas._remote.http.HttpEngine` (WebDAV writes)  ``packs/list``
``redis://``, ``rediss://``    :class:`cuda_program_cas._remote.redis.RedisEngine`  none
=============================  ============================================  =====================

Each engine is imported when a store of its scheme is opened, so a plain cache
never loads the HTTP or Redis side. ``ADDRESS|write`` names a store writable
(:func:`cuda_program_cas._base.urls.parse_store_entry`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cuda_program_cas._base.signing import Trust
from cuda_program_cas._base.urls import parse_store_entry, scheme_of

from .tier import RETRY_S, Tier, ceiling

__all__ = ["open_tier"]

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


def _directory(address: str, writable: bool, opts: Options) -> Tier:
    from cuda_program_cas._disk.direngine import DirEngine
    from cuda_program_cas._disk.pack import PackSet

    root = os.path.abspath(address)
    tier: Tier

    def missing() -> str:
        from cuda_program_cas._base.errors import LayoutError
        from cuda_program_cas._disk.layout import check_layout

        try:
            check_layout(root)  # names a file, a foreign directory, a dangling symlink
        except (OSError, LayoutError) as exc:
            return str(exc)
        return "not a cache (no layout.json)" if os.path.isdir(root) else "missing"

    def damaged(path: str) -> None:
        tier.counters.add("corrupt")
        tier._note("damaged pack", f"{path}: an entry's blob is damaged or unreadable; it is a miss")

    # A directory's check costs a few system calls: made at once, and again every RETRY_S while it fails; a
    # store that worked and is gone later (unmounted) is not a WARNING.
    tier = Tier(
        DirEngine(root),
        packs=PackSet(root, on_damage=damaged, max_entry=lambda: ceiling(opts.max_entry)),
        writable=writable,
        missing=missing,
        retry_max_s=RETRY_S,
        warn_later=False,
        open_now=True,
        trust=opts.trust,
        max_entry=opts.max_entry,
    )
    return tier


def _http(address: str, writable: bool, opts: Options) -> Tier:
    from cuda_program_cas._remote.http import HttpEngine
    from cuda_program_cas._remote.httppacks import HttpPacks

    engine = HttpEngine(address, staging=opts.staging)
    packs = HttpPacks(engine, memo_get=opts.memo_get, memo_put=opts.memo_put)
    # Each check is a request: made at the first lookup, not at open; a dead server is paused from RETRY_S
    # doubling to RETRY_MAX_S, and said once whenever it first fails.
    tier = Tier(
        engine,
        packs=packs,
        writable=writable,
        missing=lambda: "not a store: no layout.json (404)",
        warn_later=True,
        trust=opts.trust,
        max_entry=opts.max_entry,
        server=True,
        layout_once=True,
    )
    packs.report = tier
    return tier


def _redis(address: str, writable: bool, opts: Options) -> Tier:
    from cuda_program_cas._remote.redis import RedisEngine

    # Redis evicts keys on its own (allkeys-lru, docs/redis.md): a store without layout.json is an empty one.
    return Tier(
        RedisEngine(address), writable=writable, layout_optional=True, trust=opts.trust, max_entry=opts.max_entry
    )


_ENGINES: dict[str, Callable[[str, bool, Options], Tier]] = {
    "file": _directory,
    "http": _http,
    "https": _http,
    "redis": _redis,
    "rediss": _redis,
}


def open_tier(entry: str, **options: Any) -> Tier:
    """The store an entry of a store list names (``ADDRESS`` or ``ADDRESS|write``); ``ValueError`` for a bad one.

    ``options`` are the fields of :class:`Options`.
    """
    address, writable = parse_store_entry(entry)
    scheme = scheme_of(address) or "file"
    make = _ENGINES.get(scheme)
    if make is None:
        raise ValueError(f"no engine for {scheme}:// stores yet: {address!r}")
    return make(address, writable, Options(**options))
