"""The HTTP shared-store reader: a published store served by a web server, read as a directory store is.

The store is static files in the directory layout (``layout.json``, ``index/``,
``blobs/``, ``packs/``), so any server that serves files can serve it: nginx,
Apache, an object store behind HTTPS. Nothing here writes to the server.

- ``layout.json`` is fetched once per process, and checked as a directory store's is.
- A loose entry costs two GETs: its manifest, then its blob.
- Packs are listed by ``packs/list`` (publish and repack write it), fetched at the
  first lookup and again, conditionally (``If-None-Match``), every :data:`RELIST_S`.
  Each pack's trailer and index are fetched once per node by two Range requests and
  kept in the local cache as an ordinary entry: packs are immutable by name, so
  later processes of the node need no request for them. A packed hit then costs
  one Range request for the blob.
- Every blob is verified against its blake3 digest before it is returned; the
  caller copies a hit into the local cache, as with a directory store.

What a server says never decides how much is read. An entry larger than the
ceiling (:attr:`HttpStore.max_entry`: ``CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE``, and
what the local cache's cap can hold) is a miss before any request for it; the
indexes of one store's packs together hold at most :data:`MAX_INDEX_BYTES`, a
pack's trailer is checked against that and against the size the server gives
before its index is fetched; a body is read up to what was asked, no further
(:mod:`cuda_program_cas._remote.client`). A blob's body is hashed as it arrives;
past :data:`IN_MEMORY_BYTES` it goes to a staging file in the local cache's
``tmp/`` (:func:`cuda_program_cas._disk.atomic.staging`) rather than into
memory, and only bytes that proved to be the blob are read back.

Outages cost a timeout, not a job. A refused or timed-out connection, a DNS
failure, a TLS failure, a 5xx, a truncated body, a redirect loop, a store that
is not there (no ``layout.json``), or access denied (401, 403): each makes the
lookup a miss and pauses the store. The pause is :data:`RETRY_S` after the first
failure, doubling with each failure in a row up to :data:`RETRY_MAX_S` (threads
that meet one outage together are one failure); any answer resets it. While
paused, lookups miss at once. So a dead server costs a process about one
timeout (a few over a long job), not one per lookup. The first
failure gets one WARNING per process, naming the store and what happened; the
later ones DEBUG. A 404 for a manifest is an ordinary miss; wrong bytes (a digest
that does not match, a wrong size) are a miss counted in ``corrupt``. No failure
here raises into the caller.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from types import TracebackType

from blake3 import blake3

from cuda_program_cas._base.config import ENV_MAX_ENTRY_SIZE, env_max_entry_size
from cuda_program_cas._base.errors import LayoutError
from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._base.signing import Trust
from cuda_program_cas._base.urls import join, normalize_store_url
from cuda_program_cas._disk.atomic import Staging, staging
from cuda_program_cas._disk.layout import BLOBS, INDEX, LAYOUT_FILE, check_layout_data, parse_layout, url_path
from cuda_program_cas._disk.pack import LISTING, RETIRED, TRAILER_SIZE, PackError, PackIndex, parse_listing
from cuda_program_cas._remote.client import HttpFailure, Reply, request
from cuda_program_cas.index import MAX_MANIFEST_BYTES, fits_key, local_id, parse_fields

from .stats import Counters
from .tier import RETRY_S, warn_once_for

__all__ = ["IN_MEMORY_BYTES", "MAX_INDEX_BYTES", "RELIST_S", "RETRY_MAX_S", "HttpStore"]

_log = logging.getLogger("cuda_program_cas")

#: The longest pause after failures in a row (the first is :data:`RETRY_S`).
RETRY_MAX_S = 300.0
#: How long a process trusts its copy of ``packs/list`` before asking again (a 304 when unchanged).
RELIST_S = 60.0
#: The largest ``packs/list`` accepted (about 100,000 packs).
_MAX_LISTING = 4 << 20
#: The pack indexes of one store, all together, hold at most this (about 175,000 entries).
#: Held in memory they cost about 460 bytes an entry (the index, its key ids, the map
#: from key to pack): 80 MB at this bound. Newer packs come first; older ones past it
#: are not read (one WARNING), nor is a trailer that claims more, before its index is fetched.
MAX_INDEX_BYTES = 16 << 20
#: A blob body up to this is gathered in memory; a larger one is staged in the local
#: cache's ``tmp/`` (when there is one that can be written) and read back once verified.
IN_MEMORY_BYTES = 1 << 20
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
_MEMO_PREFIX = "cuda-program-cas: the index of the pack at "

#: ``memo_get(key id)`` -> bytes kept locally, or None; ``memo_put(key id, bytes)``: keep them.
MemoGet = Callable[[str], "bytes | None"]
MemoPut = Callable[[str, bytes], None]


class HttpStore:
    """Lookups in one store served over HTTP(S), read-only; a failure is a miss and a pause (module docstring).

    ``memo_get``/``memo_put`` reach the local cache, where pack indexes are kept
    between processes; without them every process fetches the indexes it needs.
    ``max_entry``: the largest entry the local cache can take (its cap allows),
    bounding :attr:`max_entry` below the ceiling. ``staging``: the local cache's
    ``tmp/``, where a large body waits while it is verified (None: in memory).
    """

    def __init__(
        self,
        url: str,
        *,
        memo_get: MemoGet | None = None,
        memo_put: MemoPut | None = None,
        max_entry: int | None = None,
        staging: str | None = None,
        trust: Trust | None = None,
    ) -> None:
        self.root = normalize_store_url(url)
        self._trust = trust
        #: The largest entry read: the ceiling (``CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE``), or less where the cap says so.
        self.max_entry = min(env_max_entry_size(), max_entry if max_entry is not None else 1 << 62)
        self._staging = staging
        self.counters = Counters()
        #: Requests this instance made (for the tests and the benchmarks).
        self.requests = 0
        self._memo_get = memo_get
        self._memo_put = memo_put
        self._lock = threading.Lock()
        self._fail_lock = threading.Lock()
        self._why = threading.local()
        self._warned: set[str] = set()
        self._opened = False
        self._paused_until = 0.0
        self._failures = 0
        self._why_not = ""
        self._listed_at = float("-inf")
        self._etag: str | None = None
        self._packs: dict[str, PackIndex] = {}
        self._bad_packs: set[str] = set()
        #: Key id (raw) -> the packs holding it, newest first.
        self._where: dict[bytes, list[PackIndex]] = {}
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # the indexes stay: immutable, and verified
        self._fail_lock = threading.Lock()

    # -- lookups ---------------------------------------------------------------------

    def lookup(self, kid: str) -> tuple[bytes, str] | None:
        """The verified bytes of ``kid`` here and their digest, or None."""
        if self._paused_until and time.monotonic() < self._paused_until:
            self._why.reason = f"store not usable: {self._why_not}"
            return None
        try:
            if not self._opened and not self._open():
                return None
            found = self._packed(kid) if self._trust is None else None  # packs carry no signatures yet
            return found if found is not None else self._loose(kid)
        except HttpFailure as exc:
            self._failed(exc)
            return None
        except (MemoryError, OSError) as exc:
            # Out of memory for a large hit, or its staging file could not be written: this
            # node's trouble, not the server's. A miss, and no pause.
            self.counters.add("errors")
            self._missed(f"could not take the answer in: {type(exc).__name__}")
            self._once(f"local {type(exc).__name__}", logging.WARNING, f"an answer could not be taken in: {exc!r}")
            return None

    def miss_reason(self) -> str:
        """Why this thread's last lookup here missed."""
        reason: str = getattr(self._why, "reason", "unknown")
        return reason

    def _missed(self, reason: str) -> None:
        self._why.reason = reason

    def _open(self) -> bool:
        try:
            reply = self._get(LAYOUT_FILE, limit=4096)
        except HttpFailure as exc:
            if exc.outage:
                raise
            # Too large (or any bad answer): not a store, so asked again only when the pause ends.
            raise HttpFailure(exc.url, "not a store", f"its layout.json: {exc.kind}: {exc.detail}") from None
        if reply.status == 404:
            raise HttpFailure(join(self.root, LAYOUT_FILE), "not a store", "no layout.json (404)")
        if reply.status != 200:
            raise HttpFailure(join(self.root, LAYOUT_FILE), "not a store", f"status {reply.status}")
        data = parse_layout(reply.body)
        if data is None:
            raise HttpFailure(join(self.root, LAYOUT_FILE), "not a store", "its layout.json is damaged")
        try:
            self._layout = check_layout_data(self.root, data)  # its manifests are judged by it (fits_key)
        except LayoutError as exc:
            raise HttpFailure(join(self.root, LAYOUT_FILE), "not usable", str(exc)) from None
        self._opened = True
        return True

    def _loose(self, kid: str) -> tuple[bytes, str] | None:
        reply = self._get(url_path(INDEX, kid), limit=MAX_MANIFEST_BYTES)
        if reply.status == 404:
            self._missed("no entry")
            return None
        fields = parse_fields(reply.body) if reply.status == 200 else None
        if fields is None or not fits_key(fields[0], kid, self._layout):
            self._damaged(
                "manifest", f"manifest of {kid}: status {reply.status}, {len(reply.body)} bytes that are not one"
            )
            return None
        if self._trust is not None and not self._trust.verify(reply.body):
            self.counters.add("untrusted")
            self._missed("untrusted (not signed by a trusted key)")
            return None
        _kid, digest, size = fields
        if not self._fits(size, kid):
            return None
        with _Intake(self._staging) as body:
            reply = self._get(url_path(BLOBS, digest), limit=size, sink=body.take)
            if reply.status == 404:
                self._missed("blob missing")
                return None
            if reply.status != 200 or body.size != size or body.hexdigest() != digest:
                self._damaged("blob", f"blob {digest}: status {reply.status}, {body.size} bytes that are not it")
                return None
            return body.read(), digest

    def _fits(self, size: int, kid: str) -> bool:
        """True when an entry of ``size`` bytes may be read; else a miss, said once, with no request for it."""
        if size <= self.max_entry:
            return True
        self._missed(f"too large: {size} bytes, more than {self.max_entry}")
        self._once(
            "too large",
            logging.WARNING,
            f"the entry of {kid} is {size} bytes, more than the {self.max_entry} this node reads "
            f"({ENV_MAX_ENTRY_SIZE}, or the local cache's cap): not fetched; entries that large are misses",
        )
        return False

    def _packed(self, kid: str) -> tuple[bytes, str] | None:
        self._refresh_packs()
        for pack in self._where.get(bytes.fromhex(kid), ()):
            entry = pack.find_key(bytes.fromhex(kid))
            if entry is None or not self._fits(entry.size, kid):
                continue
            with _Intake(self._staging) as body:
                if not self._range(pack.name, entry.offset, entry.size, body):
                    continue
                if body.hexdigest() != entry.digest:
                    self._damaged("pack blob", f"pack {pack.name}: the blob of {kid} does not hash to its digest")
                    continue
                return body.read(), entry.digest
        return None

    # -- packs -----------------------------------------------------------------------

    def _refresh_packs(self) -> None:
        if time.monotonic() - self._listed_at < RELIST_S:
            return
        with self._lock:
            if time.monotonic() - self._listed_at < RELIST_S:
                return
            headers = {"If-None-Match": self._etag} if self._etag else None
            reply = self._get(f"packs/{LISTING}", limit=_MAX_LISTING, headers=headers)
            self._listed_at = time.monotonic()
            if reply.status == 304:
                return
            if reply.status == 404:
                names: list[str] | None = []
            else:
                names = parse_listing(reply.body) if reply.status == 200 else None
            if names is None:
                self._damaged("listing", f"packs/{LISTING}: status {reply.status}, not a listing; the packs known stay")
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
        return min(MAX_INDEX_BYTES, self.max_entry)

    def _no_room(self, name: str) -> None:
        """Pack ``name`` is good but its index does not fit what is left of the bound: not read in this process."""
        self._bad_packs.add(name)
        self._missed("pack not read: the store's pack indexes are over the bound")
        self._once(
            "index room",
            logging.WARNING,
            f"the indexes of its packs hold more than {self._index_bound()} bytes together; pack {name} and older "
            "ones past that are not read, their entries are misses (repack the store into fewer entries, or read "
            "it as a directory)",
        )

    def _index(self, name: str, room: int) -> PackIndex | None:
        """The index of pack ``name``: kept locally, else fetched (and then kept); None when it cannot be had.

        A trailer that claims more than :meth:`_index_bound` (2**32 entries: 412 GB), or
        that does not fit the size the server gives, makes the pack a damaged one before
        its index is asked for. A good one that needs more than ``room`` (what this
        store's newer packs left of the bound) is not fetched either.
        """
        memo = local_id(_MEMO_PREFIX + join(self.root, f"packs/{name}"))  # never published
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
            with _Intake(None, hashed=False) as index:
                if not self._range(name, offset, length, index):
                    return None
                pack = PackIndex(name, size, reply.body, index.read())
        except PackError as exc:
            self._bad_packs.add(name)
            self._damaged("pack", str(exc))
            return None
        if self._memo_put is not None:
            self._memo_put(memo, pack.to_bytes())
        return pack

    def _pack_get(
        self, name: str, headers: dict[str, str], limit: int, sink: Callable[[bytes], object] | None = None
    ) -> Reply:
        """GET (a range of) pack ``name``: in ``packs/``, or in ``packs/retired/`` where a repack moved it."""
        reply = self._get(f"packs/{name}", limit=limit, headers=headers, sink=sink)
        if reply.status == 404:
            self._listed_at = float("-inf")  # the listing is stale: asked again at the next lookup
            reply = self._get(f"packs/{RETIRED}/{name}", limit=limit, headers=headers, sink=sink)
        return reply

    def _range(self, name: str, offset: int, size: int, body: _Intake) -> bool:
        """Bytes ``[offset, offset + size)`` of pack ``name`` into ``body``; False (noted) when they are others."""
        if size == 0:
            return True
        relative = f"packs/{name}"
        reply = self._pack_get(name, {"Range": f"bytes={offset}-{offset + size - 1}"}, size, body.take)
        if reply.status == 404:
            self._missed("pack missing")
            return False
        span = self._content_range(reply, relative)
        if span is None or span[0] != offset or body.size != size:
            if span is not None:
                self._damaged("range", f"{relative}: asked bytes {offset}+{size}, got {span[0]}+{body.size}")
            return False
        return True

    def _content_range(self, reply: Reply, relative: str) -> tuple[int, int, int] | None:
        """``(first, last, size)`` of a 206 reply; None (noted once) for a server that ignores Range."""
        m = _CONTENT_RANGE.fullmatch(reply.headers.get("content-range", "").strip())
        if reply.status == 206 and m is not None:
            first, last, size = (int(g) for g in m.groups())
            return first, last, size
        self._missed("pack not readable")
        self._once(
            "range",
            logging.WARNING,
            f"{relative}: status {reply.status} to a Range request; packs need a server that honours Range "
            "(their entries are misses)",
        )
        return None

    # -- requests and failures ---------------------------------------------------------

    def _get(
        self,
        relative: str,
        *,
        limit: int,
        headers: dict[str, str] | None = None,
        sink: Callable[[bytes], object] | None = None,
    ) -> Reply:
        """GET a file of the store; a 5xx, 401 or 403 is an :class:`HttpFailure` (an outage, or denied)."""
        url = join(self.root, relative)
        self.requests += 1
        reply = request("GET", url, headers=headers, limit=limit, sink=sink)
        if reply.status >= 500:
            raise HttpFailure(url, "server error", f"status {reply.status}")
        if reply.status in (401, 403):
            raise HttpFailure(url, "denied", f"status {reply.status} (is CUDA_PROGRAM_CAS_HTTP_TOKEN or .netrc right?)")
        self._failures = 0
        return reply

    def _failed(self, exc: HttpFailure) -> None:
        self.counters.add("errors")
        if not exc.outage:
            self._missed(f"bad answer: {exc.kind}")
            self._once(f"answer {exc.kind}", logging.DEBUG, str(exc))
            return
        with self._fail_lock:
            if time.monotonic() < self._paused_until:
                # Another thread's request of the same outage failed first and paused the store while
                # this one was out: one outage is one step of the pause, however many threads met it.
                self._missed(f"store not usable: {self._why_not}")
                return
            self._failures += 1
            self._listed_at = float("-inf")  # asked again when the pause ends
            pause = min(RETRY_MAX_S, RETRY_S * 2 ** (self._failures - 1))
            self._paused_until = time.monotonic() + pause
            self._why_not = f"{exc.kind}: {exc.detail}"
        self._missed(f"store not usable: {self._why_not}")
        if warn_once_for(self.root):
            _log.warning(
                "cuda-program-cas: shared store %s is unusable (%s); its lookups are misses, asked again in %g s, "
                "then less often (said once per process)",
                self.root,
                exc,
                pause,
            )
        else:
            _log.debug("cuda-program-cas: shared store %s: %s; paused for %g s", self.root, exc, pause)

    def _damaged(self, what: str, message: str) -> None:
        self.counters.add("corrupt")
        self._missed(f"damaged {what}")
        self._once(f"damaged {what}", logging.DEBUG, message)

    def _once(self, what: str, level: int, message: str) -> None:
        if what in self._warned:
            return
        self._warned.add(what)
        if level >= logging.WARNING and not warn_once_for(f"{self.root} {what}"):
            level = logging.DEBUG
        _log.log(level, "cuda-program-cas: shared store %s: %s", self.root, message)


class _Intake:
    """A body as it arrives (:meth:`take`): counted, hashed, held in memory up to :data:`IN_MEMORY_BYTES`, then staged.

    ``staging``: the folder of the staging file (the local cache's ``tmp/``), or
    None to hold any body in memory (it was bounded before it was asked for).
    A staging file that cannot be made leaves the body in memory; one that
    cannot be written fails the lookup (``OSError``: a miss). The file goes when
    the intake is closed.
    """

    def __init__(self, staging: str | None, *, hashed: bool = True) -> None:
        self.size = 0
        self._dir = staging
        self._hash = blake3() if hashed else None
        self._parts: list[bytes] = []
        self._stage: Staging | None = None
        self._stack = ExitStack()

    def __enter__(self) -> _Intake:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._parts = []
        self._stack.close()

    def take(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self._hash is not None:
            self._hash.update(chunk)
        if self._stage is not None:
            self._stage.write(chunk)
            return
        self._parts.append(chunk)
        if self.size > IN_MEMORY_BYTES and self._dir is not None:
            try:
                self._stage = self._stack.enter_context(staging(self._dir))
            except OSError:
                self._dir = None  # a full or read-only disk: in memory, as bounded before the request
                return
            for part in self._parts:
                self._stage.write(part)
            self._parts = []

    def hexdigest(self) -> str:
        assert self._hash is not None
        return self._hash.hexdigest()

    def read(self) -> bytes:
        """The whole body: from memory, or read back from the staging file."""
        if self._stage is not None:
            return self._stage.read()
        return self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
