"""The HTTP engine of a shared store: its objects are files behind a web server, read by GET, written by WebDAV.

The store is static files in the directory layout, so any server of files serves it
(nginx, Apache, an object store behind HTTPS). Every request goes through
:func:`.client.request`, which bounds it in time and bytes. 200 is the object, 404 none;
a 5xx, 401 or 403 is an outage (a wrong token is wrong for every object); any other
status is ``damaged``.

- ``get`` of a blob takes the body in as it arrives (:func:`~cuda_program_cas._disk.intake.verified_intake`:
  a large one staged in the local cache's ``tmp/``).
- ``get_changed``: ``If-None-Match`` with the ETag in hand (nginx gives every file one); 304 is unchanged.
- ``size``: HEAD. ``put``: a WebDAV PUT (nginx renames a whole body onto its target, so a
  reader never sees a part); a 409 makes the missing folders by MKCOL. ``put_many`` puts in
  order, a blob before its manifest. ``remove``: DELETE.
- Ranged reads: one ``Range`` GET, or several ranges in one (:mod:`.multipart`). A ``200``
  to a ``Range`` request is ``no range``: the server ignores it.
- No conditional create and no leases (nginx's WebDAV ignores conditional PUTs), no listing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import IO, TYPE_CHECKING, Any, cast

from cuda_program_cas._base.engine import Abilities, Landing, StoreFailure, limits_of
from cuda_program_cas._base.frame import stored_limit
from cuda_program_cas._base.urls import join, normalize_store_url, shown
from cuda_program_cas._disk.intake import verified_intake

from .client import HttpFailure, Reply, request, request_many

__all__ = ["HttpEngine"]

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
#: What to check when nginx refuses a HEAD or a write (each seen with nginx 1.22: tests/test_http_publish.py).
_HINTS = {
    401: "the server wants a token: set CUDA_PROGRAM_CAS_HTTP_TOKEN or a ~/.netrc entry for the host, with write "
    "access for a publish",
    405: "the server does not accept WebDAV writes there: nginx needs dav_methods PUT MKCOL",
    413: "the body is too large for the server: nginx needs client_max_body_size 0",
    500: "the server could not store it; with nginx, likely causes: the folder is not writable by nginx's worker "
    "user, create_full_put_path is off and a folder is missing, or the disk (or client_body_temp_path's) is "
    "full; nginx's error log says which",
}
_HINTS[403] = _HINTS[401]


class HttpEngine:
    """The objects of the store at ``url`` (``http(s)://host[:port]/path``); a bad URL is a ``ValueError``.

    ``staging``: the local cache's ``tmp/``, where a large body waits while it is verified (None: in memory).
    """

    can = Abilities(ranges=True, multi_range=True, conditional_get=True, remote=True, server=True)
    lost_hint = "is it a real WebDAV store?"
    #: How much of an error answer's body :meth:`fetch` keeps (S3 reads its error code there).
    error_limit = 0
    #: A PUT answered 409 (a folder missing) makes the folders by MKCOL.
    dav = True

    def __init__(self, url: str, *, staging: str | None = None) -> None:
        self.root = normalize_store_url(url)
        #: The store's address as it may be logged (a store URL has no credentials in it).
        self.shown = shown(self.root)
        self.staging = staging
        #: Why every request fails before it is sent (S3: an AWS configuration that cannot be used), or None.
        self.broken: HttpFailure | None = None
        #: Requests this engine made (for the tests and the benchmarks).
        self.requests = 0
        #: Outages met: a 5xx, denied, or no answer at all.
        self.outages = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.shown!r})"

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
        kwargs = {"headers": headers, "limit": limit, "sink": sink, "error_limit": self.error_limit}
        return self._asked("GET", join(self.root, name), self._check, **kwargs)

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
            return reply.body if self._found(name, reply) else None
        return verified_intake(join(self.root, name), digest, limit, self.staging, partial(self._landed, name, stored))

    def get_changed(
        self, name: str, *, limit: int, tag: str | None
    ) -> tuple[bytes | bytearray | None, str | None] | None:
        """None when ``name`` still has the ETag ``tag`` (a 304); else its bytes (None: a 404) and ETag."""
        into = bytearray()  # one growing buffer: a key list of 16 MiB held once while it arrives, not twice
        reply = self.fetch(name, limit=limit, headers={"If-None-Match": tag} if tag else None, sink=into.extend)
        if reply.status == 304 and tag:
            return None
        return (into, reply.headers.get("etag")) if self._found(name, reply) else (None, None)

    def get_many(self, names: Sequence[str], *, limit: int | Sequence[int]) -> list[bytes | None]:
        """Each GET in parallel over the pool (:func:`.client.request_many`): about one round trip per 16. The buffers
        are made in the caller's thread: made by the pool's, they stayed in each thread's allocator arena (40
        entries of 4 MiB peaked 39 MB over the baseline; here, under 16)."""
        limits = limits_of(names, limit)
        landings = [Landing(n) for n in limits]
        calls = [partial(self._landed, name, n, at.take) for name, n, at in zip(names, limits, landings, strict=True)]
        found = request_many(calls)
        return [at.value() if ok else None for ok, at in zip(found, landings, strict=True)]

    def _landed(self, name: str, limit: int, sink: Callable[[bytes], object]) -> bool:
        return self._found(name, self.fetch(name, limit=limit, sink=sink))

    def _found(self, name: str, reply: Reply) -> bool:
        """True for a 200, False for a 404; any other status is a ``damaged`` answer."""
        if reply.status not in (200, 404):
            raise StoreFailure(join(self.root, name), "damaged", f"status {reply.status}", outage=False)
        return reply.status == 200

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
            partial(self._range, name, spec, size, landing.take)
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

    # -- HEAD and WebDAV writes: nginx's dav module renames a whole PUT body onto its target ---

    def size(self, name: str) -> int | None:
        """``name``'s ``Content-Length`` by HEAD (-1 when unsaid); None when there is none."""
        reply = self._send("HEAD", name)
        if reply.status in (404, 410):
            return None
        self._refuse(name, reply, "HEAD")
        length = reply.headers.get("content-length", "")
        return int(length) if length.isdigit() else -1

    def put(self, name: str, data: bytes | IO[bytes]) -> str:
        reply = self._send("PUT", name, data)
        if reply.status == 409 and self.dav:  # a folder is missing: MKCOL each, top down (405: it exists)
            level = ""
            for part in ["", *name.split("/")[:-1]]:
                level += f"{part}/" if part else ""
                made = self._send("MKCOL", level)
                if made.status != 405:
                    self._refuse(level, made, "MKCOL")
            reply = self._send("PUT", name, data)
        self._refuse(name, reply, "PUT")
        return f"{reply.status} to PUT"

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        for name, data in items:  # one at a time, in order: a manifest never lands before its blob
            self.put(name, data)

    def remove(self, name: str) -> None:
        reply = self._send("DELETE", name)
        if reply.status not in (404, 410):
            self._refuse(name, reply, "DELETE")

    def _send(
        self, method: str, name: str, body: bytes | IO[bytes] | None = None, headers: Mapping[str, str] | None = None
    ) -> Reply:
        url, limits = join(self.root, name), {"limit": 1 << 16, "error_limit": self.error_limit}
        return self._asked(method, url, self._vetted, body=body, headers=headers, **limits)

    def _vetted(self, url: str, reply: Reply) -> None:
        """Nothing: a HEAD's or a write's answer is the caller's to judge (S3 raises its outages here)."""

    def _refuse(self, name: str, reply: Reply, method: str) -> None:
        """Nothing for a 2xx; else the failure of ``method`` on ``name``, an outage for a 5xx."""
        if not 200 <= reply.status < 300:
            detail = f"{method} answered {reply.status}{self._why(reply, method)}"
            where = shown(join(self.root, name))
            raise HttpFailure(where, f"HTTP {reply.status}", detail, outage=reply.status >= 500)

    def _why(self, reply: Reply, method: str) -> str:
        hint = _HINTS.get(reply.status) if method in ("PUT", "MKCOL") or reply.status not in (405, 500) else None
        return f" ({hint})" if hint else ""

    def _asked(self, method: str, url: str, vet: Callable[[str, Reply], None], **kwargs: Any) -> Reply:
        """:func:`.client.request`, counted; ``vet`` raises the outages its answer says."""
        self.requests += 1
        try:
            if self.broken is not None:
                raise self.broken
            reply = request(method, url, **kwargs)
            vet(url, reply)
            return reply
        except HttpFailure as exc:
            if exc.outage:
                self.outages += 1
            raise

    def close(self) -> None:
        """Nothing: the connections are the process's pool's, shared by stores."""


if TYPE_CHECKING:  # mypy checks that the class keeps the interfaces its record declares
    from cuda_program_cas._base.engine import ConditionalGet, Engine, Ranged

    def _is_engine(engine: HttpEngine) -> tuple[Engine, Ranged, ConditionalGet]:
        return engine, engine, engine
