"""The one interface of a store's storage engine: named objects, read and written whole.

A store is the directory layout (``layout.json``, ``index/``, ``blobs/``,
``packs/``) kept by some engine: files in a directory, files behind a web
server (WebDAV for writes), keys of a Redis server. An engine knows nothing of
manifests, digests or packs: it gets, puts and removes objects named by their
store-relative path (``index/ab/cdef...``, as :func:`cuda_program_cas._disk.layout.url_path`
builds it), and says what it can do besides (batches, leases). Lookup,
verification, the pause after an outage, publish and write-back are written once,
over this interface, by the store above it.

Rules every engine keeps:

- ``get`` returns None only for "there is no such object"; every other failure
  is a :class:`StoreFailure`, never another exception (``MemoryError`` included).
- ``limit`` is the cache's own bound: an object larger than it is refused
  (``StoreFailure`` with ``outage=False``, kind ``too large``) before more than
  ``limit + 1`` bytes of it are read, whatever the server claims.
- ``digest`` (a blob's): with one, ``get`` returns the blob's raw bytes, decoded
  where framed (:mod:`cuda_program_cas._base.frame`), ``limit`` bounding the raw
  bytes (the stored ones by :func:`~cuda_program_cas._base.frame.stored_limit`), only
  when they hash to it; else ``StoreFailure`` kind ``damaged`` (``outage=False``).
  A streamed answer goes through :func:`~cuda_program_cas._disk.intake.verified_intake`
  (on disk past a MiB), never gathered unverified in memory first; an object in hand
  (Redis) through :func:`~cuda_program_cas._base.frame.verified`. Without a digest,
  ``get`` returns the stored bytes as they are.
- Every call has one overall deadline (the engine's timeout), covering connect
  and the whole answer.
- ``put`` is atomic: a reader sees the old object, none, or the whole new one.
  It returns what the store answered, as a message may quote it (``201 to PUT``):
  a claim, which an uploader reads back (:mod:`cuda_program_cas._shared.upload`).
- A password or token never appears in ``shown`` or in any message.

What an engine can do besides is declared once, in its :class:`Abilities` record
(``engine.can``), and nowhere else: no attribute probes. Each optional ability is a
typed interface reached through one accessor that the record decides
(:func:`ranged`, :func:`conditional`, :func:`creates`, :func:`listing`,
:func:`leases`: the interface, or None where the record denies it); an engine
implements the methods of exactly the abilities it declares.

- :class:`Ranged` (``ranges``): part of an object (HTTP by ``Range``, a directory by ``pread``),
  streamed into a sink, or several at once; ``multi_range``: those in one request (HTTP's
  multipart answer), else one each, all at once (S3).
- :class:`ConditionalGet` (``conditional_get``): an object read only when its tag changed
  (HTTP's ``If-None-Match``, a Redis script comparing a hash).
- :class:`Creates` (``conditional_create``: Redis ``SET NX``), :class:`Listing` (``listing``: a
  directory), :class:`Leases` (``leases``: Redis; without them, per-node claims).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Protocol, cast

from .errors import CacheError

__all__ = [
    "LEASE_MARK",
    "LOCAL",
    "Abilities",
    "ConditionalGet",
    "Creates",
    "Engine",
    "Landing",
    "Leases",
    "Listing",
    "Ranged",
    "StoreFailure",
    "conditional",
    "creates",
    "leases",
    "limits_of",
    "listing",
    "not_stored",
    "ranged",
]

#: The kind of a StoreFailure that is this node's trouble, not the store's: no memory, or no
#: staging disk, for an answer. Not an outage: the store is not paused.
LOCAL = "could not take the answer in"
#: What a lease holds once its holder gave it up without a result it could publish (its upload
#: failed, or its compile): a node waiting for it compiles at once (:mod:`cuda_program_cas._shared.lease`).
LEASE_MARK = "compile-now"


class StoreFailure(CacheError):
    """A request to a store that got no usable answer; ``kind`` says what (``refused``, ``timeout``, ``too large``...).

    ``outage`` is True when the store (or the way to it) may be down, so asking it
    again at once would cost another timeout; False when only this answer was bad.
    ``where`` is the store or object as it may be shown (no credentials).
    """

    def __init__(self, where: str, kind: str, detail: str, *, outage: bool = True) -> None:
        super().__init__(where, kind, detail, outage)
        self.where = where
        self.kind = kind
        self.detail = detail
        self.outage = outage

    def __str__(self) -> str:
        return f"{self.where}: {self.kind}: {self.detail}"


class _Kept(io.BytesIO):
    """A ``BytesIO`` whose finalizer does not close it: a landing given up part-filled can be garbage in a cycle
    with a view of it (a traceback's frame), and ``close()`` with a view left is an unraisable ``BufferError``
    (Python 3.13). The memory goes with the last view either way."""

    def close(self) -> None:
        pass


class Landing:
    """Bytes of an answer of at most ``size`` bytes, taken into place as they arrive: one copy, never two.

    Chunks joined, or a ``bytearray`` made ``bytes``, hold an answer twice (a 32 MiB blob: 64 MiB). This writes
    into a ``BytesIO`` made ``size`` long at once, whose buffer :meth:`value` hands over (CPython's ``getvalue``
    shares it when no view is left). ``size`` is bounded by the caller.
    """

    def __init__(self, size: int) -> None:
        self._io = _Kept()
        if size:
            self._io.seek(size - 1)
            self._io.write(b"\0")
        self._view: memoryview | None = self._io.getbuffer()
        self.size = 0

    def room(self) -> memoryview:
        """The part not yet filled, to receive into (then :meth:`filled`)."""
        assert self._view is not None
        return self._view[self.size :]

    def filled(self, n: int) -> None:
        """``n`` more bytes were received into :meth:`room`."""
        self.size += n

    def take(self, chunk: bytes | memoryview) -> None:
        """Copy ``chunk`` in after what is there (a ``ValueError`` past ``size``)."""
        end = self.size + len(chunk)
        assert self._view is not None
        if end > len(self._view):
            raise ValueError(f"more than the {len(self._view)} bytes expected")
        self._view[self.size : end] = chunk
        self.size = end

    def value(self) -> bytes:
        """What was taken, as ``bytes`` (the landing is spent: no view of it may be held)."""
        if self._view is not None:
            self._view.release()
            self._view = None
            self._io.truncate(self.size)
        return self._io.getvalue()


def not_stored(where: str, answer: str, size: int, held: int | None, *, hint: str, other: bool = False) -> StoreFailure:
    """The failure of a put of ``size`` bytes answered ``answer``, where the store holds ``held`` bytes.

    ``hint``: what to ask of such a store. ``held``: None for no object at all, -1 for more than ``size`` (a read that
    stopped there). ``other``: as many bytes, but not those. Not an outage: the
    store answers, it only does not keep what it says it took.
    """
    if other:
        holds = f"other bytes than the {size:,} it was sent"
    elif held == -1:
        holds = f"more than the {size:,} bytes it was sent"
    elif held is not None and held > size:
        holds = f"{held:,} bytes, not the {size:,} it was sent"
    else:
        holds = f"{held or 0:,} of its {size:,} bytes"
    detail = f"the server answered {answer} but holds {holds}: {hint}"
    return StoreFailure(where, "not stored", detail, outage=False)


def limits_of(names: Sequence[str], limit: int | Sequence[int]) -> list[int]:
    """The limit of each of ``names`` (:meth:`Engine.get_many`'s ``limit``: one for all, or one each)."""
    if isinstance(limit, int):
        return [limit] * len(names)
    limits = list(limit)
    if len(limits) != len(names):
        raise ValueError(f"{len(limits)} limits for {len(names)} names")
    return limits


@dataclass(frozen=True)
class Abilities:
    """What one engine can do (the first six, each with its interface and accessor), and how its answers and
    writes behave: its ``can`` (module docstring). Every field is False unless an engine declares it."""

    #: :class:`Ranged`: part of an object, from an offset or from its end.
    ranges: bool = False
    #: Several ranges of one object in one request (HTTP's multipart answer).
    multi_range: bool = False
    #: :class:`ConditionalGet`: an object read only when it changed.
    conditional_get: bool = False
    #: :class:`Creates`: an object put only where there is none.
    conditional_create: bool = False
    #: :class:`Listing`: the names of a folder's objects.
    listing: bool = False
    #: :class:`Leases`: leases with a TTL; without them, per-node claims.
    leases: bool = False
    #: :meth:`Engine.put_many` is one transaction, all or none (Redis): then a reader never sees a
    #: manifest sent with its blob before the blob, whatever was read back.
    atomic_batch: bool = False
    #: A put that returns is itself the proof (a directory: this process wrote and renamed the file):
    #: nothing is read back, since a concurrent collector, not a lie, is all a read could meet.
    puts_proven: bool = False
    #: Each call is a request to a server (HTTP, Redis): the layout is read at the first lookup, not at
    #: open; a failing store is paused from RETRY_S doubling, said whenever it first fails; its key list
    #: is read. False (a directory, local or mounted): a check costs a few system calls, one bad file is
    #: not yet an outage (the layout is checked once before the store is paused).
    remote: bool = False
    #: Objects may go on their own (Redis evicts): no packs are kept there (an evicted pack takes many entries).
    evicts: bool = False
    #: A store without ``layout.json`` is an empty current one: Redis (it may have been evicted), an S3 prefix
    #: (a ``|write`` node fills it with no publish first).
    layout_optional: bool = False
    #: Answers are a web server's claims (HTTP): a body too large or a status that is no answer is a bad
    #: answer, not damage; ``layout.json`` is read once per process.
    server: bool = False


class Engine(Protocol):
    """One store's objects (see the module docstring for the rules)."""

    #: The store's address as it may be logged (no password, no token).
    shown: str
    #: What this engine can do besides get, put and remove (:class:`Abilities`).
    can: Abilities
    #: What to ask of a store that did not keep what it took, for the message ("is it a real WebDAV store?").
    lost_hint: str

    def get(self, name: str, *, limit: int, digest: str | None = None) -> bytes | None:
        """The whole object ``name``, or None when there is none; with ``digest``, the raw blob that hashes to it."""
        ...

    def get_many(self, names: Sequence[str], *, limit: int | Sequence[int]) -> list[bytes | None]:
        """:meth:`get` of each name, in as few round trips as the engine can (Redis: one pipeline; HTTP: parallel).

        ``limit``: one for every name, or one per name.
        """
        ...

    def put(self, name: str, data: bytes | IO[bytes]) -> str:
        """Store ``data`` (bytes, or a binary file read from its start) as ``name``, atomically; the store's answer."""
        ...

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """:meth:`put` of each item, in this order (a reader never sees a later one before an earlier one)."""
        ...

    def remove(self, name: str) -> None:
        """Remove ``name``; nothing when it is not there."""
        ...

    def size(self, name: str) -> int | None:
        """The size of ``name`` in bytes without reading it, or None when there is none."""
        ...

    def close(self) -> None:
        """Close connections; the next call opens new ones."""
        ...


class Ranged(Protocol):
    """Part of an object (``ranges``); a failed read of one is ``StoreFailure`` kind ``short`` (the object ends
    before, or the answer is other bytes) or ``no range`` (a server that sends the whole object), not an outage."""

    def get_range(
        self, name: str, offset: int, length: int, *, sink: Callable[[bytes], object] | None = None
    ) -> bytes | None:
        """Exactly ``length`` bytes of ``name`` from ``offset``, or None when there is no such object.

        With ``sink`` they go there as they arrive, none held, and ``b""`` is returned: a
        failure of ``sink`` ends the read and reaches the caller. Fewer (the object ends
        before) is a ``StoreFailure``, not a shorter answer.
        """
        ...

    def get_tail(self, name: str, length: int) -> tuple[bytes, int] | None:
        """The last ``length`` bytes of ``name`` (all of it when shorter) and its whole size; None when none."""
        ...

    def get_ranges(
        self, name: str, spans: Sequence[tuple[int, int]], tail: int = 0
    ) -> tuple[Mapping[int, memoryview], int] | None:
        """The bytes of each ``(offset, size)`` span (sorted, apart, each of at least one byte) by its offset, the last
        ``tail`` bytes at theirs, and the object's size; None when there is no such object.

        One request where the record has ``multi_range``, else one each, all at once. The
        bytes are views of one buffer per request, which holds what was asked, once.
        """
        ...


class ConditionalGet(Protocol):
    """An object read only when it changed (``conditional_get``)."""

    def get_changed(
        self, name: str, *, limit: int, tag: str | None
    ) -> tuple[bytes | bytearray | None, str | None] | None:
        """None when ``name`` is still what ``tag`` names; else ``(its bytes, or None when none, its tag)``."""
        ...


class Creates(Protocol):
    """An object put only where there is none (``conditional_create``)."""

    def create(self, name: str, data: bytes) -> bool:
        """Store ``data`` as ``name`` if there is no object ``name``: True; False (nothing written) when there is."""
        ...


class Listing(Protocol):
    """The names of a folder's objects (``listing``)."""

    def names(self, folder: str) -> list[str]:
        """The names of the objects directly in ``folder`` (``packs``), sorted; none when there is no such folder."""
        ...


class Leases(Protocol):
    """Leases with a TTL (``leases``)."""

    def lease(self, name: str, ttl_s: float, *, take: bool = True) -> str | None:
        """Take the lease ``name`` for ``ttl_s`` seconds: its token, or None when another holds it.

        :data:`LEASE_MARK` when its holder gave it up with that mark (:meth:`release`): compile now.
        ``take=False``: only look (a node that cannot publish): None, the mark, or "" when free.
        """
        ...

    def renew(self, name: str, token: str, ttl_s: float) -> bool:
        """Extend a lease this holder still holds; False when it was lost (expired, taken)."""
        ...

    def release(self, name: str, token: str, *, mark_s: float = 0.0) -> None:
        """Give a lease back, only if ``token`` still holds it; ``mark_s``: leave :data:`LEASE_MARK` that long."""
        ...


# The one accessor of each optional ability: the interface where the engine's record declares it, else None.


def ranged(engine: Engine) -> Ranged | None:
    return cast("Ranged", engine) if engine.can.ranges else None


def conditional(engine: Engine) -> ConditionalGet | None:
    return cast("ConditionalGet", engine) if engine.can.conditional_get else None


def creates(engine: Engine) -> Creates | None:
    return cast("Creates", engine) if engine.can.conditional_create else None


def listing(engine: Engine) -> Listing | None:
    return cast("Listing", engine) if engine.can.listing else None


def leases(engine: Engine) -> Leases | None:
    return cast("Leases", engine) if engine.can.leases else None
