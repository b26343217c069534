"""The packs of a store served over HTTP: a :class:`~cuda_program_cas._shared.tier.PackSource`.

- Packs are listed by ``packs/list`` (publish and repack write it), fetched at the
  first lookup and again, conditionally (``If-None-Match``), every :data:`RELIST_S`,
  and at the first lookup after an outage.
- Each pack's trailer and index are fetched once per node by two ranged reads and
  kept in the local cache as an ordinary entry (``memo_get``/``memo_put``): packs
  are immutable by name, so later processes of the node need no request for them.
  Each is then a :class:`~cuda_program_cas._disk.pack.PackReader` over ranged reads: a packed
  hit costs one ranged read of the blob's stored bytes, verified as they arrive. A bad frame
  is damage, one line, and a miss; a frame stating more than this node reads is a miss, said once.
- A pack a repack retired is read from ``packs/retired/`` until the next listing.

What a server says never decides how much is read: the indexes of one store's
packs together hold at most :data:`MAX_INDEX_BYTES` (and never more than the
largest entry this node reads), newer packs first; a pack's trailer is checked
against that and against the size the server gives before its index is fetched.

Every request is the engine's, through its interfaces only (``get_changed``,
``get_tail``, ``get_range`` into a sink, ``get_ranges``): the engine owns HTTP, so an
outage is a :class:`~cuda_program_cas._base.engine.StoreFailure` that the store above
pauses on. A bad answer about one pack (``short``) is damage, counted and noted through
:attr:`HttpPacks.report` (the store), a server that ignores ``Range`` (``no range``)
one WARNING, and the pack is a miss.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import NamedTuple, Protocol, TypeVar

from cuda_program_cas._base.engine import LOCAL, StoreFailure
from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._base.urls import join
from cuda_program_cas._disk.intake import Intake
from cuda_program_cas._disk.pack import RETIRED, TRAILER_SIZE, PackError, PackReader, RangeSource, index_span
from cuda_program_cas._disk.packset import LISTING, is_pack_name, parse_listing
from cuda_program_cas.index import local_id

from .http import HttpEngine

__all__ = ["MAX_INDEX_BYTES", "RELIST_S", "HttpPacks", "Ranges", "Report"]

#: How long a process trusts its copy of ``packs/list`` before asking again (a 304 when unchanged).
RELIST_S = 60.0
#: The largest ``packs/list`` accepted (about 100,000 packs).
_MAX_LISTING = 4 << 20
#: The pack indexes of one store, all together, hold at most this (about 175,000 entries).
#: Held in memory they cost about 460 bytes an entry (the index, its key ids, the map
#: from key to pack): 80 MB at this bound. Newer packs come first; older ones past it
#: are not read (one WARNING), nor is a trailer that claims more, before its index is fetched.
MAX_INDEX_BYTES = 16 << 20
_MEMO_PREFIX = "cuda-program-cas: the index of the pack at "

#: ``memo_get(key id)`` -> bytes kept locally, or None; ``memo_put(key id, bytes)``: keep them.
MemoGet = Callable[[str], "bytes | None"]
MemoPut = Callable[[str, bytes], None]
_T = TypeVar("_T")


class Ranges(NamedTuple):
    """What :meth:`HttpPacks.fetch_ranges` had: each span's bytes by ``(offset, size)``, the tail, the pack's size."""

    spans: Mapping[tuple[int, int], memoryview]
    tail: memoryview | None
    size: int


class Report(Protocol):
    """What the packs tell the store above them (:class:`~cuda_program_cas._shared.tier.Tier` is one)."""

    def damaged(self, why: str, message: str) -> None:
        """A bad answer about one object: counted in ``corrupt``, noted once per ``why``."""
        ...

    def missed(self, reason: str) -> None:
        """Why this thread's lookup missed."""
        ...

    def say_once(self, what: str, message: str) -> None:
        """A WARNING the first time this process meets ``what`` here, DEBUG after."""
        ...

    def fits(self, size: int, kid: str) -> bool:
        """Whether an entry of ``size`` bytes may be read; else a miss, said once, with no request for it."""
        ...

    def ceiling(self) -> int:
        """The largest entry this node reads."""
        ...


class HttpPacks:
    """The packs of the store ``engine`` serves (module docstring); ``report`` is set by the store that asks.

    ``memo_get``/``memo_put`` reach the local cache, where pack indexes are kept
    between processes; without them every process fetches the indexes it needs.
    """

    def __init__(self, engine: HttpEngine, *, memo_get: MemoGet | None = None, memo_put: MemoPut | None = None) -> None:
        self.engine = engine
        self.report: Report | None = None
        self._memo_get = memo_get
        self._memo_put = memo_put
        self._lock = threading.Lock()
        self._listed_at = float("-inf")
        self._outages = 0
        self._etag: str | None = None
        self._packs: dict[str, PackReader] = {}
        self._bad_packs: set[str] = set()
        #: Key id (raw) -> the packs holding it, newest first.
        self._where: dict[bytes, list[PackReader]] = {}
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # the indexes stay: immutable, and verified

    def _told(self) -> Report:
        assert self.report is not None, "HttpPacks.report is set by the store that asks"
        return self.report

    def lookup(self, kid: str) -> tuple[bytes, str] | None:
        """The verified bytes of ``kid`` in one of the packs and their digest, or None."""
        report = self._told()
        key = bytes.fromhex(kid)
        try:
            self._refresh()
            for pack in self._where.get(key, ()):
                entry = pack.find_key(key)
                if entry is None:
                    continue
                try:
                    # An entry over what this node reads is a miss, said once (report.fits), not damage.
                    fits = partial(report.fits, kid=kid)
                    data = pack.read(entry, report.ceiling(), fits=fits, staging=self.engine.staging)
                except PackError as exc:
                    report.damaged("damaged pack blob", str(exc))
                    continue
                if data is not None:
                    return data, entry.digest
        except (MemoryError, OSError) as exc:  # this node's trouble (memory, the staging disk), not the server's
            raise StoreFailure(self.engine.shown, LOCAL, type(exc).__name__, outage=False) from None
        return None

    def where(self, kid: str) -> tuple[str, int, int, int] | None:
        """``(pack, offset, length, at)`` of ``kid``'s blob (its stored bytes) and index entry in the packs this
        process has listed (no request); None if unknown."""
        for pack in self._where.get(bytes.fromhex(kid), ()):
            entry = pack.find_key(bytes.fromhex(kid))
            if entry is not None:
                return pack.name, entry.offset, entry.size, entry.at
        return None

    def fetch_ranges(self, name: str, spans: Sequence[tuple[int, int]], tail: int = 0) -> Ranges | None:
        """Each distinct ``(offset, size)`` span of pack ``name`` and its last ``tail`` bytes, at once (coalesced), as
        views of what the engine took in once; None, said once, for anything else (the caller reads those entries
        the ordinary way). Not verified here (the caller hashes each entry), nor bounded (the caller bounds it).
        """
        from .multipart import coalesce

        distinct = sorted(set(spans))
        if not is_pack_name(name) or not distinct or any(size < 1 or offset < 0 for offset, size in distinct):
            return None
        why = "no such pack"
        try:
            got = self._either(name, lambda n: self.engine.get_ranges(n, coalesce(distinct), tail))
        except StoreFailure as exc:
            if exc.outage:
                raise
            got, why = None, f"{exc.kind}: {exc.detail}"
        if got is None:
            self._told().say_once("multi-range", f"packs/{name}: {why}; its entries are read one at a time")
            return None
        return _spans(distinct, *got, tail)

    # -- the listing ---------------------------------------------------------------------

    def _refresh(self) -> None:
        if self.engine.outages != self._outages:
            self._outages = self.engine.outages
            self._listed_at = float("-inf")  # asked again after an outage (the pause has ended)
        if time.monotonic() - self._listed_at < RELIST_S:
            return
        with self._lock:
            if time.monotonic() - self._listed_at < RELIST_S:
                return
            why = "not a listing"
            try:
                got = self.engine.get_changed(f"packs/{LISTING}", limit=_MAX_LISTING, tag=self._etag)
            except StoreFailure as exc:
                if exc.outage:
                    raise
                got, why = (b"", None), f"{exc.kind}: {exc.detail}"
            self._listed_at = time.monotonic()
            if got is None:
                return  # unchanged
            names = [] if got[0] is None else parse_listing(got[0])
            if names is None:
                self._told().damaged("damaged listing", f"packs/{LISTING}: {why}; the packs known stay")
                return
            self._etag = got[1]
            self._update(names)

    def _update(self, names: list[str]) -> None:
        packs = {}
        room = self._index_bound()
        for name in names:  # newest first
            pack = self._packs.get(name)
            if pack is None and name not in self._bad_packs:
                pack = self._index(name, room)
            if pack is not None and pack.index_size > room:
                self._no_room(name)
                pack = None
            if pack is not None:
                packs[name] = pack
                room -= pack.index_size
        where: dict[bytes, list[PackReader]] = {}
        for pack in packs.values():
            for key in pack.loaded_keys() or ():
                where.setdefault(key, []).append(pack)
        self._packs, self._where = packs, where

    def _index_bound(self) -> int:
        """Bytes of index one store's packs may hold together (an index is kept in the local cache as an entry)."""
        return min(MAX_INDEX_BYTES, self._told().ceiling())

    def _no_room(self, name: str) -> None:
        """Pack ``name`` is good but its index does not fit what is left of the bound: not read in this process."""
        self._bad_packs.add(name)
        report = self._told()
        report.missed("pack not read: the store's pack indexes are over the bound")
        report.say_once(
            "index room",
            f"the indexes of its packs hold more than {self._index_bound()} bytes together; pack {name} and older "
            "ones past that are not read, their entries are misses (repack the store into fewer entries, or read "
            "it as a directory)",
        )

    # -- one pack ------------------------------------------------------------------------

    def _index(self, name: str, room: int) -> PackReader | None:
        """The index of pack ``name``: kept locally, else fetched (and then kept); None when it cannot be had.

        A trailer that claims more than :meth:`_index_bound` (2**32 entries: 412 GB), or does not fit the size the
        server gives, is damage before the index is asked for; a good one over ``room`` (what newer packs left of
        the bound) is not fetched either.
        """
        memo = local_id(_MEMO_PREFIX + join(self.engine.root, f"packs/{name}"))  # never published
        kept = self._memo_get(memo) if self._memo_get is not None else None
        if kept is not None and len(kept) >= 8 + TRAILER_SIZE:
            (size,) = struct.unpack_from("<Q", kept)
            try:
                return self._reader(name, size, kept[8 : 8 + TRAILER_SIZE], kept[8 + TRAILER_SIZE :])
            except PackError:
                pass  # verified by the local cache, yet not this pack's: fetched again
        tail = self._ask(name, lambda n: self.engine.get_tail(n, TRAILER_SIZE), missing=False)
        if tail is None:
            return None  # gone (not retired: its entries are in the pack that replaced it), or not readable
        trailer, size = tail
        try:
            if len(trailer) != TRAILER_SIZE:
                raise PackError(f"{name}: {size} bytes, shorter than its trailer")
            offset, length = index_span(size, trailer, name, max_index=self._index_bound())
            if length > room:
                self._no_room(name)
                return None
            with Intake(None, hashed=False) as index:
                read = partial(self.engine.get_range, offset=offset, length=length, sink=index.take)
                if self._ask(name, read) is None:
                    return None
                raw = index.read()
            pack = self._reader(name, size, trailer, raw)
        except PackError as exc:
            self._bad_packs.add(name)
            self._told().damaged("damaged pack", str(exc))
            return None
        if self._memo_put is not None:
            self._memo_put(memo, struct.pack("<Q", size) + trailer + raw)
        return pack

    def _reader(self, name: str, size: int, trailer: bytes, index: bytes) -> PackReader:
        """Pack ``name``, its blobs read by ranges through :meth:`_ask` (so ``packs/retired/`` too)."""

        def get_range(offset: int, length: int, sink: Callable[[bytes], object] | None = None) -> bytes | None:
            return self._ask(name, partial(self.engine.get_range, offset=offset, length=length, sink=sink))

        return PackReader.over(name, RangeSource(get_range), size, trailer, index)

    def _either(self, name: str, call: Callable[[str], _T | None]) -> _T | None:
        """``call`` of pack ``name`` in ``packs/``, or in ``packs/retired/`` where a repack moved it; None: neither."""
        got = call(f"packs/{name}")
        if got is None:
            self._listed_at = float("-inf")  # the listing is stale: asked again at the next lookup
            got = call(f"packs/{RETIRED}/{name}")
        return got

    def _ask(self, name: str, call: Callable[[str], _T | None], *, missing: bool = True) -> _T | None:
        """:meth:`_either`, None (noted: a miss, or damage) where the pack is not there (``missing``: a miss) or its
        server does not give the bytes asked."""
        report = self._told()
        try:
            got = self._either(name, call)
        except StoreFailure as exc:
            if exc.outage or exc.kind not in ("no range", "short"):
                raise
            if exc.kind == "short":
                report.damaged("damaged range", f"packs/{name}: {exc.detail}")
                return None
            report.missed("pack not readable")
            report.say_once(
                "range",
                f"packs/{name}: {exc.detail}; packs need a server that honours Range (their entries are misses)",
            )
            return None
        if got is None and missing:
            report.missed("pack missing")
        return got


def _spans(distinct: list[tuple[int, int]], parts: Mapping[int, memoryview], total: int, tail: int) -> Ranges:
    """Each span's bytes as a view of the part that holds it, the tail, and the pack's size."""
    out = {}
    for offset, size in distinct:
        for first, part in parts.items():
            if first <= offset and offset + size <= first + len(part):
                out[offset, size] = part[offset - first : offset - first + size]
                break
    return Ranges(out, parts.get(total - tail) if tail else None, total)
