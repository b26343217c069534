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
- ``digest``: with one, ``get`` returns the object only when it hashes (blake3)
  to it, and raises ``StoreFailure`` kind ``damaged`` (``outage=False``) when it
  does not; an engine may hash a large object as it arrives and hold it on disk
  meanwhile (HTTP), rather than gather it in memory first. :func:`check_digest`
  is the check for an engine that has the whole object in hand.
- Every call has one overall deadline (the engine's timeout), covering connect
  and the whole answer.
- ``put`` is atomic: a reader sees the old object, none, or the whole new one.
  It returns what the store answered, as a message may quote it (``201 to PUT``):
  a claim, which an uploader reads back (:mod:`cuda_program_cas._shared.upload`).
- A password or token never appears in ``shown`` or in any message.

An engine may also answer a conditional read, ``get_changed(name, limit=, tag=)``
(:class:`ConditionalGet`: HTTP by ``If-None-Match``, Redis by a script that compares
a hash): None when the object is still the one ``tag`` names, else ``(bytes or None
when there is none, its new tag)``. An engine without it is read whole each time.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import IO, Protocol, TypeVar

from blake3 import blake3

from .errors import CacheError

__all__ = [
    "LEASE_MARK",
    "LOCAL",
    "ConditionalGet",
    "Engine",
    "Landing",
    "StoreFailure",
    "check_digest",
    "limits_of",
    "not_stored",
]

_Bytes = TypeVar("_Bytes", bound="bytes | memoryview")

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
    """A ``BytesIO`` whose finalizer does not close it.

    A landing given up part-filled (a failed answer) can be garbage in a cycle with a
    view of it (a frame of the failure's traceback holds :meth:`Landing.room`'s slice).
    The collector runs ``IOBase``'s finalizer, ``close()``, before it clears the view,
    and ``close()`` refuses a buffer with views: Python 3.13 reports that as an
    unraisable ``BufferError``. The memory goes with the last view either way.
    """

    def close(self) -> None:
        pass


class Landing:
    """Bytes of an answer of at most ``size`` bytes, taken into place as they arrive: one copy, never two.

    Gathering chunks and joining them holds an answer twice at the end (a 32 MiB
    blob: 64 MiB); a ``bytearray`` turned into ``bytes`` does too. This writes
    into the buffer of a ``BytesIO`` made ``size`` long at once, and
    :meth:`value` hands that buffer over as ``bytes`` (CPython's ``getvalue``
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

    def take(self, chunk: bytes) -> None:
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


def check_digest(where: str, data: _Bytes, digest: str | None) -> _Bytes:
    """``data``, when ``digest`` is None or ``data`` hashes to it; else ``StoreFailure`` kind ``damaged``."""
    if digest is not None and blake3(data).hexdigest() != digest:
        raise StoreFailure(where, "damaged", f"{len(data)} bytes that do not hash to {digest}", outage=False)
    return data


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


class Engine(Protocol):
    """One store's objects (see the module docstring for the rules)."""

    #: The store's address as it may be logged (no password, no token).
    shown: str
    #: Whether this engine can take leases (:meth:`lease`); False: per-node claims only.
    can_lease: bool
    #: Whether :meth:`put_many` is one transaction, all or none (Redis): then a reader never
    #: sees a manifest sent with its blob before the blob, whatever was read back.
    atomic_batch: bool
    #: What to ask of a store that did not keep what it took, for the message ("is it a real WebDAV store?").
    lost_hint: str
    #: Whether a put that returns is itself the proof (a directory: this process wrote and renamed the
    #: file): nothing is read back, since a concurrent collector, not a lie, is all a read could meet.
    puts_proven: bool

    def get(self, name: str, *, limit: int, digest: str | None = None) -> bytes | None:
        """The whole object ``name``, or None when there is none; with ``digest``, only bytes that hash to it."""
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

    def close(self) -> None:
        """Close connections; the next call opens new ones."""
        ...


class ConditionalGet(Protocol):
    """What an engine that can read an object only when it changed offers besides :class:`Engine` (module docstring)."""

    def get_changed(self, name: str, *, limit: int, tag: str | None) -> tuple[bytes | None, str | None] | None:
        """None when ``name`` is still what ``tag`` names; else ``(its bytes, or None when none, its tag)``."""
        ...
