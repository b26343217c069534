"""The HTTP engine of a shared store: its objects are files behind a web server, read by GET, written by WebDAV.

The store is static files in the directory layout (``layout.json``, ``index/``,
``blobs/``, ``packs/``), so any server that serves files can serve it: nginx,
Apache, an object store behind HTTPS. It implements
:class:`cuda_program_cas._base.engine.Engine`; the lookup over it (the layout,
the loose entry, the pause after an outage) is :class:`cuda_program_cas._shared.tier.Tier`'s,
and its packs are :class:`.httppacks.HttpPacks`.

- ``get``: one GET through the one client (:func:`.client.request`), which bounds
  it in time and in bytes. 200 is the object, 404 none. A 5xx is an outage; 401
  and 403 are ``denied`` and an outage too (the token is wrong for every object,
  not only this one). Any other status is a ``damaged`` answer.
- ``get`` with a ``digest`` (a blob): the body is decoded as it arrives (one
  :class:`~cuda_program_cas._base.frame.Inflow`: a framed blob decompressed,
  bounded by its stated size, a raw one passed through) and its raw bytes hashed;
  past :data:`~cuda_program_cas._disk.intake.IN_MEMORY_BYTES` of them they go to a staging file in the local
  cache's ``tmp/`` (:class:`cuda_program_cas._disk.intake.Intake`) rather than
  into memory, and only bytes that proved to be the blob are read back. Running
  out of memory or of staging disk meanwhile is this node's trouble: a StoreFailure of kind
  :data:`~cuda_program_cas._base.engine.LOCAL`, never an outage.
- ``get_changed``: a GET with ``If-None-Match`` (the ETag of the copy in hand;
  nginx gives one to every static file): 304 is "unchanged".
- ``size``: HEAD. ``put``/``put_many``: WebDAV PUTs (:func:`.dav.put`: the server
  renames a PUT's body onto its target once whole, so a reader never sees a
  part), in order: a blob before the manifest that names it. ``remove``: DELETE.
- ``get_range``/``get_tail``: one ``Range`` GET, a range streamed into a sink where one is given
  (a packed hit); ``get_ranges``: several in one (a multipart answer). A ``200`` to a
  ``Range`` request is ``no range``: a server that ignores it.
- Its record (:class:`~cuda_program_cas._base.engine.Abilities`): ranges, several
  ranges in one request (its packs' multipart reads), conditional reads; remote, a
  server's answers. No conditional create and no leases: nginx's WebDAV ignores
  conditional PUTs, so per-node claims remain. No listing (no index of a folder).

:attr:`HttpEngine.requests` counts the requests made (the tests read it); :attr:`HttpEngine.outages` the outages met
(the packs list again after one).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import IO, TYPE_CHECKING, TypeVar, cast

from cuda_program_cas._base.engine import LOCAL, Abilities, Landing, StoreFailure, limits_of
from cuda_program_cas._base.frame import Inflow, stored_limit
from cuda_program_cas._base.urls import join, normalize_store_url, shown
from cuda_program_cas._disk.intake import Intake

from .client import HttpFailure, Reply, request, request_many

__all__ = ["HttpEngine"]

_T = TypeVar("_T")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


class HttpEngine:
    """The objects of the store at ``url`` (``http(s)://host[:port]/path``); see the module docstring.

    ``staging``: the local cache's ``tmp/``, where a large body waits while it is
    verified (None: in memory). A bad URL is a ``ValueError``; nothing is asked
    before the first call.
    """

    can = Abilities(ranges=True, multi_range=True, conditional_get=True, remote=True, server=True)
    lost_hint = "is it a real WebDAV store?"
    #: How much of an error answer's body :meth:`fetch` keeps (S3 reads its error code there).
    error_limit = 0
    #: Why every request fails before it is sent (S3: an AWS configuration that cannot be used), or None.
    broken: HttpFailure | None = None

    def __init__(self, url: str, *, staging: str | None = None) -> None:
        self.root = normalize_store_url(url)
        #: The store's address as it may be logged (a store URL has no credentials in it).
        self.shown = shown(self.root)
        self.staging = staging
        #: Requests this engine made (for the tests and the benchmarks).
        self.requests = 0
        #: Outages met: a 5xx, denied, or no answer at all.
        self.outages = 0

    def __repr__(self) -> str:
        return f"HttpEngine({self.shown!r})"

    # -- reads -------------------------------------------------------------------------

    def fetch(
        self,
        name: str,
        *,
        limit: int,
        headers: Mapping[str, str] | None = None,
        sink: Callable[[bytes], object] | None = None,
    ) -> Reply:
        """GET object ``name`` (or a range of it); any status but those :meth:`_check` takes for outages."""
        url = join(self.root, name)
        self.requests += 1
        try:
            if self.broken is not None:
                raise self.broken
            reply = request("GET", url, headers=headers, limit=limit, sink=sink, error_limit=self.error_limit)
            self._check(url, reply)
        except HttpFailure as exc:
            if exc.outage:
                self.outages += 1
            raise
        return reply

    def _check(self, url: str, reply: Reply) -> None:
        """An outage for an answer that holds for every object: a 5xx, or denied."""
        if reply.status >= 500:
            raise HttpFailure(url, "server error", f"status {reply.status}")
        if reply.status in (401, 403):
            raise HttpFailure(url, "denied", f"status {reply.status} (is CUDA_PROGRAM_CAS_HTTP_TOKEN or .netrc right?)")

    def get(self, name: str, *, limit: int, digest: str | None = None) -> bytes | None:
        stored = stored_limit(limit, digest)
        if digest is None:
            reply = self.fetch(name, limit=stored)
            if reply.status == 404:
                return None
            if reply.status != 200:
                raise StoreFailure(join(self.root, name), "damaged", f"status {reply.status}", outage=False)
            return reply.body
        try:
            with Intake(self.staging) as body:
                flow = Inflow(join(self.root, name), limit, body.take)  # the raw bytes, decoded where framed
                reply = self.fetch(name, limit=stored, sink=flow.take)
                if reply.status == 404:
                    return None
                if reply.status == 200:
                    flow.finish()  # a frame cut short: refused
                if reply.status != 200 or body.hexdigest() != digest:
                    detail = f"status {reply.status}, {body.size} raw bytes that do not hash to {digest}"
                    raise StoreFailure(join(self.root, name), "damaged", detail, outage=False)
                return body.read()
        except (MemoryError, OSError) as exc:  # out of memory for a large hit, or its staging file unwritable
            raise StoreFailure(join(self.root, name), LOCAL, type(exc).__name__, outage=False) from None

    def get_changed(
        self, name: str, *, limit: int, tag: str | None
    ) -> tuple[bytes | bytearray | None, str | None] | None:
        """None when ``name`` still has the ETag ``tag`` (a 304); else its bytes (None: a 404) and ETag.

        The body is gathered in one growing buffer, not in chunks joined at the end:
        a key list of 16 MiB is held once while it arrives, not twice.
        """
        into = bytearray()
        reply = self.fetch(name, limit=limit, headers={"If-None-Match": tag} if tag else None, sink=into.extend)
        if reply.status == 304 and tag:
            return None
        if reply.status == 404:
            return None, None
        if reply.status != 200:
            raise StoreFailure(join(self.root, name), "damaged", f"status {reply.status}", outage=False)
        return into, reply.headers.get("etag")

    def get_many(self, names: Sequence[str], *, limit: int | Sequence[int]) -> list[bytes | None]:
        """Each GET in parallel over the pool (:func:`.client.request_many`): about one round trip per 16.

        Each answer lands in a buffer of its limit made, and handed over as ``bytes``,
        here in the caller's thread: done by the pool's threads, the memory of one batch
        after another stayed with each thread's allocator arena (a warm set's loose fetch
        of 40 entries of 4 MiB peaked at 39 MB over its baseline, batches of 8 MiB); done
        here, the next batch reuses what the last one freed (under 16 MiB).
        """
        limits = limits_of(names, limit)
        landings = [Landing(n) for n in limits]
        calls = [
            functools.partial(self._landed, name, n, at) for name, n, at in zip(names, limits, landings, strict=True)
        ]
        found = request_many(calls)
        return [at.value() if ok else None for ok, at in zip(found, landings, strict=True)]

    def _landed(self, name: str, limit: int, landing: Landing) -> bool:
        """GET ``name`` into ``landing``: False for a 404."""
        reply = self.fetch(name, limit=limit, sink=landing.take)
        if reply.status == 404:
            return False
        if reply.status != 200:
            raise StoreFailure(join(self.root, name), "damaged", f"status {reply.status}", outage=False)
        return True

    def get_range(
        self, name: str, offset: int, length: int, *, sink: Callable[[bytes], object] | None = None
    ) -> bytes | None:
        if length == 0:  # nothing is asked for no bytes
            return b""
        landing = Landing(length) if sink is None else None
        got = self._range(name, f"{offset}-{offset + length - 1}", length, sink or cast("Landing", landing).take)
        if got is None:
            return None
        if got[:2] != (offset, length):
            detail = f"asked bytes {offset}+{length}, got {got[0]}+{got[1]} of {got[2]}"
            raise StoreFailure(join(self.root, name), "short", detail, outage=False)
        return b"" if landing is None else landing.value()

    def get_tail(self, name: str, length: int) -> tuple[bytes, int] | None:
        landing = Landing(length)
        got = self._range(name, f"-{length}", length, landing.take)
        if got is None:
            return None
        data = landing.value()
        if got[1] != min(length, got[2]) or got[0] + got[1] != got[2]:
            detail = f"asked its last {length} bytes, got {got[0]}+{got[1]} of {got[2]}"
            raise StoreFailure(join(self.root, name), "short", detail, outage=False)
        return data, got[2]

    def get_ranges(
        self, name: str, spans: Sequence[tuple[int, int]], tail: int = 0
    ) -> tuple[Mapping[int, memoryview], int] | None:
        """One ``Range`` request for all (:mod:`.multipart`): a ``206`` ``multipart/byteranges`` answer read strictly,
        or for one span and no tail a ``206`` of exactly it; anything else is ``no range``. Without ``multi_range``
        (S3) each range is its own GET, all at once over the pool (:func:`.client.request_many`)."""
        from .multipart import PART_OVERHEAD, header, parse

        if not self.can.multi_range:
            return self._each_range(name, spans, tail)
        limit = sum(size for _, size in spans) + tail + PART_OVERHEAD * (len(spans) + 2)
        body = Landing(limit)
        reply = self._ranged(name, header(spans, tail), limit, body.take)
        if reply is None:
            return None
        data = body.value()
        got: tuple[Mapping[int, memoryview], int] | None = None
        span = _CONTENT_RANGE.fullmatch(reply.headers.get("content-range", "").strip())
        if reply.status == 206 and len(spans) == 1 and not tail:
            if span is not None and (int(span.group(1)), len(data)) == spans[0]:
                got = {spans[0][0]: memoryview(data)}, int(span.group(3))
        elif reply.status == 206:
            got = parse(reply.headers.get("content-type", ""), data, spans, tail)
        if got is None:
            kind = reply.headers.get("content-type", "no type")
            detail = f"status {reply.status} ({kind}) to a request for {len(spans)} ranges, not those ranges"
            raise StoreFailure(join(self.root, name), "no range", detail, outage=False)
        return got

    def _each_range(
        self, name: str, spans: Sequence[tuple[int, int]], tail: int
    ) -> tuple[Mapping[int, memoryview], int] | None:
        """:meth:`get_ranges` without ``multi_range``: each span, and the tail, one ranged GET, at once."""
        wanted = [(f"{offset}-{offset + size - 1}", offset, size) for offset, size in spans]
        wanted += [(f"-{tail}", -1, tail)] if tail else []
        landings = [Landing(size) for _, _, size in wanted]
        calls = [
            functools.partial(self._range, name, spec, size, landing.take)
            for (spec, _, size), landing in zip(wanted, landings, strict=True)
        ]
        parts: dict[int, memoryview] = {}
        totals = set()
        for (_, offset, size), landing, got in zip(wanted, landings, request_many(calls), strict=True):
            if got is None:
                return None
            if got[1] != size or offset not in (-1, got[0]):
                detail = f"asked bytes {offset}+{size}, got {got[0]}+{got[1]}"
                raise StoreFailure(join(self.root, name), "short", detail, outage=False)
            parts[got[0]] = memoryview(landing.value())
            totals.add(got[2])
        if len(totals) != 1:
            raise StoreFailure(join(self.root, name), "short", f"ranges of sizes {sorted(totals)}", outage=False)
        return parts, totals.pop()

    def _range(self, name: str, spec: str, limit: int, sink: Callable[[bytes], object]) -> tuple[int, int, int] | None:
        """``(first, bytes given to sink, size)`` of one ranged GET of ``name``; None: no object."""
        got = 0

        def take(chunk: bytes) -> None:
            nonlocal got
            got += len(chunk)
            sink(chunk)

        reply = self._ranged(name, f"bytes={spec}", limit, take)
        if reply is None:
            return None
        if reply.status == 416 and spec.startswith("-") and spec != "-0":
            return 0, 0, 0  # no byte to give from its end: an empty object
        span = _CONTENT_RANGE.fullmatch(reply.headers.get("content-range", "").strip())
        if reply.status == 206 and span is not None:
            return int(span.group(1)), got, int(span.group(3))
        kind = "short" if reply.status == 416 else "no range"  # 416: it begins past the object's end
        raise StoreFailure(join(self.root, name), kind, f"status {reply.status} to a Range request", outage=False)

    def _ranged(self, name: str, spec: str, limit: int, sink: Callable[[bytes], object]) -> Reply | None:
        """GET ``Range: spec`` of ``name``; None for a 404. A server that sends more than asked ignored the Range."""
        try:
            reply = self.fetch(name, limit=limit, headers={"Range": spec}, sink=sink)
        except HttpFailure as exc:
            if exc.kind != "too large":
                raise
            raise StoreFailure(exc.where, "no range", "the whole object to a Range request", outage=False) from None
        return None if reply.status in (404, 410) else reply

    def size(self, name: str) -> int | None:
        from .dav import size_of

        self.requests += 1
        return self._counted(lambda: size_of(join(self.root, name)))

    # -- writes (a store named writable, and publish) ------------------------------------

    def put(self, name: str, data: bytes | IO[bytes]) -> str:
        from .dav import put

        self.requests += 1
        return f"{self._counted(lambda: put(join(self.root, name), data, root=self.root))} to PUT"

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        for name, data in items:  # one at a time, in order: a manifest never lands before its blob
            self.put(name, data)

    def remove(self, name: str) -> None:
        from .dav import delete

        self.requests += 1
        self._counted(lambda: delete(join(self.root, name)))

    def _counted(self, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except HttpFailure as exc:
            if exc.outage:
                self.outages += 1
            raise

    def close(self) -> None:
        """Nothing: the connections are the process's pool's (:func:`.client.close_connections`), shared by stores."""


if TYPE_CHECKING:  # mypy checks that the class keeps the interfaces its record declares
    from cuda_program_cas._base.engine import ConditionalGet, Engine, Ranged

    def _is_engine(engine: HttpEngine) -> tuple[Engine, Ranged, ConditionalGet]:
        return engine, engine, engine
