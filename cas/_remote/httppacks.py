"""The packs of a store served over HTTP: a :class:`~cuda_program_cas._shared.tier.PackSource`.

- Packs are listed by ``packs/list`` (publish and repack write it), fetched at the
  first lookup and again, conditionally (``If-None-Match``), every :data:`RELIST_S`,
  and at the first lookup after an outage.
- Each pack's trailer and index are fetched once per node by two Range requests and
  kept in the local cache as an ordinary entry (``memo_get``/``memo_put``): packs
  are immutable by name, so later processes of the node need no request for them.
  A packed hit then costs one Range request for the blob's stored bytes, decoded as
  they arrive (:class:`~cuda_program_cas._base.frame.Inflow`: a framed entry is
  decompressed, bounded by the largest entry this node reads, a raw one passed
  through), its raw bytes hashed and staged (:class:`.http.Intake`) and returned
  only when they are the entry's. A bad frame (a bomb, one cut short, a wrong stated
  size) is damage, one line, and a miss.
- A pack a repack retired is read from ``packs/retired/`` until the next listing.

What a server says never decides how much is read: the indexes of one store's
packs together hold at most :data:`MAX_INDEX_BYTES` (and never more than the
largest entry this node reads), newer packs first; a pack's trailer is checked
against that and against the size the server gives before its index is fetched.

Every request is the engine's (:meth:`.http.HttpEngine.fetch`), so an outage is
a :class:`~cuda_program_cas._base.engine.StoreFailure` that the store above
pauses on. A bad answer about one pack is damage, counted and noted through
:attr:`HttpPacks.report` (the store), and the pack is a miss.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol, cast

from cuda_program_cas._base.engine import LOCAL, Landing, StoreFailure
from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._base.frame import HEADER_SIZE, Inflow, room, stated_size
from cuda_program_cas._base.urls import join
from cuda_program_cas._disk.pack import RETIRED, TRAILER_SIZE, PackError
from cuda_program_cas._disk.packindex import PackIndex
from cuda_program_cas._disk.packset import LISTING, is_pack_name, parse_listing
from cuda_program_cas.index import local_id

from .client import Reply
from .http import HttpEngine, Intake

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
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
_MEMO_PREFIX = "cuda-program-cas: the index of the pack at "

#: ``memo_get(key id)`` -> bytes kept locally, or None; ``memo_put(key id, bytes)``: keep them.
MemoGet = Callable[[str], "bytes | None"]
MemoPut = Callable[[str, bytes], None]


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
        self._packs: dict[str, PackIndex] = {}
        self._bad_packs: set[str] = set()
        #: Key id (raw) -> the packs holding it, newest first.
        self._where: dict[bytes, list[PackIndex]] = {}
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # the indexes stay: immutable, and verified

    def _told(self) -> Report:
        assert self.report is not None, "HttpPacks.report is set by the store that asks"
        return self.report

    def lookup(self, kid: str) -> tuple[bytes, str] | None:
        """The verified bytes of ``kid`` in one of the packs and their digest, or None."""
        report = self._told()
        try:
            self._refresh()
            for pack in self._where.get(bytes.fromhex(kid), ()):
                entry = pack.find_key(bytes.fromhex(kid))
                if entry is None or (entry.size > room(report.ceiling()) and not report.fits(entry.size, kid)):
                    continue  # framed, an entry may take more bytes than its raw ones, never more than their room
                with Intake(self.engine.staging) as body:
                    where = f"pack {pack.name}: the blob of {kid}"
                    inflow = Inflow(where, report.ceiling(), cast("Callable[[bytes | memoryview], object]", body.take))
                    try:
                        sized = _Sized(kid, entry.size, report, inflow)
                        if not self._range(pack.name, entry.offset, entry.size, sized.take):
                            continue
                        inflow.finish()
                    except _NotFetched:
                        continue  # its frame states more than this node reads: a miss, said once (report.fits)
                    except StoreFailure as exc:
                        if exc.kind != "damaged" or exc.outage:
                            raise
                        report.damaged("damaged pack blob", str(exc))
                        continue
                    if body.hexdigest() != entry.digest:
                        report.damaged("damaged pack blob", f"{where} does not hash to its digest")
                        continue
                    return body.read(), entry.digest
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
        """Each distinct ``(offset, size)`` span of pack ``name`` and its last ``tail`` bytes, in one request; None
        when not had so.

        Where the engine's record has no ``multi_range`` (S3), each range is its own GET,
        all at once (:meth:`_each_range`). Else one ``Range`` request for all of them (:mod:`.multipart`): a ``206``
        ``multipart/byteranges`` answer read strictly, or for one span and no tail a
        ``206`` of exactly it. Anything else (the whole pack, one range for several, a
        range not asked for, another boundary, a 404) is None, said once: the caller
        reads those entries the ordinary way. The bytes are not verified here (the
        caller hashes each entry). The answer is taken in once (:class:`Landing`) and
        every span is a view of it: a request holds what it asked, once, whatever
        number of spans name the same bytes; the caller bounds what it asks.
        """
        from .multipart import PART_OVERHEAD, coalesce, header, parse

        distinct = sorted(set(spans))
        if not is_pack_name(name) or not distinct or any(size < 1 or offset < 0 for offset, size in distinct):
            return None
        asked = coalesce(distinct)
        if not self.engine.can.multi_range:
            return self._each_range(name, distinct, asked, tail)
        limit = sum(size for _, size in asked) + tail + PART_OVERHEAD * (len(asked) + 2)
        body = Landing(limit)
        try:
            reply = self._pack_get(name, {"Range": header(asked, tail)}, limit, body.take)
        except StoreFailure as exc:
            if exc.outage:
                raise
            self._told().say_once("multi-range", f"packs/{name}: several ranges in one request: {exc.kind}")
            return None
        data = body.value()
        got: tuple[Mapping[int, memoryview], int] | None = None
        if reply.status == 206 and len(asked) == 1 and not tail:
            span = _CONTENT_RANGE.fullmatch(reply.headers.get("content-range", "").strip())
            offset, size = asked[0]
            if span is not None and int(span.group(1)) == offset and len(data) == size:
                got = {offset: memoryview(data)}, int(span.group(3))
        elif reply.status == 206:
            got = parse(reply.headers.get("content-type", ""), data, asked, tail)
        if got is None:
            self._told().say_once(
                "multi-range",
                f"packs/{name}: status {reply.status} ({reply.headers.get('content-type', 'no type')}) to a request "
                f"for {len(asked)} ranges, not those ranges; its entries are read one at a time",
            )
            return None
        return _spans(distinct, *got, tail)

    def _each_range(
        self, name: str, distinct: list[tuple[int, int]], asked: list[tuple[int, int]], tail: int
    ) -> Ranges | None:
        """:meth:`fetch_ranges` where the engine has no multi-range GET (S3): each range one GET, all at once.

        The spans are coalesced as for one request; each, and the tail, is one ranged
        GET over the pool (:func:`.client.request_many`): one round trip for up to
        :data:`.client.PARALLEL` ranges. Any answer that is not exactly its range is None, said once.
        """
        from .client import request_many

        wanted = [(f"bytes={offset}-{offset + size - 1}", offset, size) for offset, size in asked]
        if tail:
            wanted.append((f"bytes=-{tail}", -1, tail))
        landings = [Landing(size) for _, _, size in wanted]
        calls = [
            functools.partial(self._one_range, name, spec, size, landing)
            for (spec, _, size), landing in zip(wanted, landings, strict=True)
        ]
        try:
            replies = request_many(calls)
        except StoreFailure as exc:
            if exc.outage:
                raise
            self._told().say_once("ranges", f"packs/{name}: a range: {exc.kind}: {exc.detail}")
            return None
        parts: dict[int, memoryview] = {}
        total = -1
        for (_, offset, size), landing, span in zip(wanted, landings, replies, strict=True):
            data = landing.value()
            if span is None or len(data) != size or (offset >= 0 and span[0] != offset) or total not in (-1, span[2]):
                self._told().say_once("ranges", f"packs/{name}: a range answered other bytes than asked")
                return None
            total = span[2]
            parts[span[0]] = memoryview(data)
        return _spans(distinct, parts, total, tail)

    def _one_range(self, name: str, spec: str, size: int, landing: Landing) -> tuple[int, int, int] | None:
        """One ranged GET of pack ``name`` into ``landing``: its ``Content-Range``, or None for another answer."""
        reply = self._pack_get(name, {"Range": spec}, size, landing.take)
        m = _CONTENT_RANGE.fullmatch(reply.headers.get("content-range", "").strip())
        if reply.status != 206 or m is None:
            return None
        first, last, total = (int(g) for g in m.groups())
        return first, last, total

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
            headers = {"If-None-Match": self._etag} if self._etag else None
            reply = self.engine.fetch(f"packs/{LISTING}", limit=_MAX_LISTING, headers=headers)
            self._listed_at = time.monotonic()
            if reply.status == 304:
                return
            if reply.status == 404:
                names: list[str] | None = []
            else:
                names = parse_listing(reply.body) if reply.status == 200 else None
            if names is None:
                message = f"packs/{LISTING}: status {reply.status}, not a listing; the packs known stay"
                self._told().damaged("damaged listing", message)
                return
            self._etag = reply.headers.get("etag")
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
        where: dict[bytes, list[PackIndex]] = {}
        for pack in packs.values():
            for key in pack.key_ids():
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

    def _index(self, name: str, room: int) -> PackIndex | None:
        """The index of pack ``name``: kept locally, else fetched (and then kept); None when it cannot be had.

        A trailer that claims more than :meth:`_index_bound` (2**32 entries: 412 GB), or
        that does not fit the size the server gives, makes the pack a damaged one before
        its index is asked for. A good one that needs more than ``room`` (what this
        store's newer packs left of the bound) is not fetched either.
        """
        memo = local_id(_MEMO_PREFIX + join(self.engine.root, f"packs/{name}"))  # never published
        kept = self._memo_get(memo) if self._memo_get is not None else None
        if kept is not None:
            try:
                return PackIndex.from_bytes(name, kept)
            except PackError:
                pass  # verified by the local cache, yet not this pack's: fetched again
        reply = self._pack_get(name, {"Range": f"bytes=-{TRAILER_SIZE}"}, TRAILER_SIZE)
        if reply.status == 404:
            return None  # gone (not retired): its entries are in the pack that replaced it
        span = self._content_range(reply, f"packs/{name}")
        if span is None:
            return None
        try:
            first, last, size = span
            if (first, last, len(reply.body)) != (size - TRAILER_SIZE, size - 1, TRAILER_SIZE):
                raise PackError(f"{name}: asked its last {TRAILER_SIZE} bytes, got {first}-{last}/{size}")
            offset, length = PackIndex.span(size, reply.body, name, max_index=self._index_bound())
            if length > room:
                self._no_room(name)
                return None
            with Intake(None, hashed=False) as index:
                if not self._range(name, offset, length, index.take):
                    return None
                pack = PackIndex(name, size, reply.body, index.read())
        except PackError as exc:
            self._bad_packs.add(name)
            self._told().damaged("damaged pack", str(exc))
            return None
        if self._memo_put is not None:
            self._memo_put(memo, pack.to_bytes())
        return pack

    def _pack_get(
        self, name: str, headers: dict[str, str], limit: int, sink: Callable[[bytes], object] | None = None
    ) -> Reply:
        """GET (a range of) pack ``name``: in ``packs/``, or in ``packs/retired/`` where a repack moved it."""
        reply = self.engine.fetch(f"packs/{name}", limit=limit, headers=headers, sink=sink)
        if reply.status == 404:
            self._listed_at = float("-inf")  # the listing is stale: asked again at the next lookup
            reply = self.engine.fetch(f"packs/{RETIRED}/{name}", limit=limit, headers=headers, sink=sink)
        return reply

    def _range(self, name: str, offset: int, size: int, sink: Callable[[bytes], object]) -> bool:
        """Bytes ``[offset, offset + size)`` of pack ``name`` into ``sink``; False (noted) when they are others."""
        if size == 0:
            return True
        relative = f"packs/{name}"
        got = 0

        def take(chunk: bytes) -> None:
            nonlocal got
            got += len(chunk)
            sink(chunk)

        reply = self._pack_get(name, {"Range": f"bytes={offset}-{offset + size - 1}"}, size, take)
        if reply.status == 404:
            self._told().missed("pack missing")
            return False
        span = self._content_range(reply, relative)
        if span is None or span[0] != offset or got != size:
            if span is not None:
                message = f"{relative}: asked bytes {offset}+{size}, got {span[0]}+{got}"
                self._told().damaged("damaged range", message)
            return False
        return True

    def _content_range(self, reply: Reply, relative: str) -> tuple[int, int, int] | None:
        """``(first, last, size)`` of a 206 reply; None (said once) for a server that ignores Range."""
        m = _CONTENT_RANGE.fullmatch(reply.headers.get("content-range", "").strip())
        if reply.status == 206 and m is not None:
            first, last, size = (int(g) for g in m.groups())
            return first, last, size
        report = self._told()
        report.missed("pack not readable")
        report.say_once(
            "range",
            f"{relative}: status {reply.status} to a Range request; packs need a server that honours Range "
            "(their entries are misses)",
        )
        return None


class _NotFetched(Exception):
    """A packed entry's frame states more raw bytes than this node reads: its request ends there."""


class _Sized:
    """A packed blob's stored bytes on their way to ``inflow``, its raw size judged by ``report.fits`` first.

    The index says how many bytes are stored (``stored``), not how many they stand for: an entry over
    this node's ceiling is known by its frame's header (its first bytes; a raw one's is its stored size),
    and is a miss (``too large``, said once), not damage: the request ends there.
    """

    def __init__(self, kid: str, stored: int, report: Report, inflow: Inflow) -> None:
        self._kid = kid
        self._stored = stored
        self._report = report
        self._inflow = inflow
        self._head: bytes | None = b""  # None once judged

    def take(self, chunk: bytes) -> None:
        if self._head is not None:
            self._head += chunk[: HEADER_SIZE - len(self._head)]
            if len(self._head) >= HEADER_SIZE:
                stated = stated_size(self._head)
                if not self._report.fits(self._stored if stated is None else stated, self._kid):
                    raise _NotFetched
                self._head = None
        self._inflow.take(chunk)


def _spans(distinct: list[tuple[int, int]], parts: Mapping[int, memoryview], total: int, tail: int) -> Ranges:
    """Each span's bytes as a view of the part that holds it, the tail, and the pack's size."""
    out = {}
    for offset, size in distinct:
        for first, part in parts.items():
            if first <= offset and offset + size <= first + len(part):
                out[offset, size] = part[offset - first : offset - first + size]
                break
    return Ranges(out, parts.get(total - tail) if tail else None, total)
