"""A blob as a shared store holds it: zstd-compressed in a self-describing frame, or raw.

Every shared store moves and keeps compressed bytes (a cubin compresses 7 to 10 times);
a node's local cache keeps the raw binary, which ``cuobjdump`` reads. The writer
(publish, write-back) compresses once (:func:`encode`); each reader decodes before it
verifies, through one :class:`Inflow`: a blob's name stays the blake3 digest of its raw bytes.

A framed object is::

    MAGIC (8 bytes) | raw size (u64, little-endian) | one zstd frame stating the same content size

``MAGIC`` starts with ``0x89``, which none of the objects a store holds starts with:
a cubin is ELF (``0x7f``), PTX and records are text, LTO-IR is LLVM bitcode
(``BC``) or its wrapper (``0xde``), a fatbinary starts ``0x50``, a manifest
``cpcas``. A reader knows a framed object by its header, never by guessing: an
object that does not start with ``MAGIC`` is raw and passed through, so a store
may mix both, and the writer frames any blob that does start with it, compressed
or not (nothing a compiler writes starts so; an arbitrary value put in a cache may).
A blob that compression would not make smaller is otherwise stored raw. So a stored
blob may be larger than its raw bytes, never more than :func:`room` of them: every
reader bounds the stored bytes of a blob by the room of the raw size its manifest
names, and the raw bytes by that size (a raw object larger than it is still damage).

What :class:`Inflow` refuses (a :class:`~cuda_program_cas._base.engine.StoreFailure` of kind
``damaged``, not an outage: a miss counted in ``corrupt``): a stated raw size over the reader's
limit (before anything is decompressed; a raw object longer than the limit too), a zstd frame
that states another size or none, a frame cut short, data after the frame that is not an empty
frame, a frame that decompresses to more or less than it states. zstd's output is cut off past
the stated size (at most 128 KiB, its buffer, past it), so a bomb costs a chunk, not its size.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import IO, Any, cast

from .engine import Landing, StoreFailure

__all__ = [
    "HEADER_SIZE",
    "LARGE",
    "LARGE_LEVEL",
    "LEVEL",
    "MAGIC",
    "PROBE",
    "Inflow",
    "decode",
    "encode",
    "is_framed",
    "room",
    "stated_size",
    "stored_limit",
    "verified",
]

#: The first bytes of a framed object (PNG's trick: a high byte, then a name, then CR LF, ^Z, LF).
MAGIC = b"\x89cpz\r\n\x1a\n"
_HEADER = struct.Struct("<8sQ")
#: The most bytes a zstd frame's header takes (RFC 8878): the first bytes of a frame that state its size.
_ZSTD_HEAD = 18
#: The bytes before the zstd frame.
HEADER_SIZE = _HEADER.size
#: zstd's largest block (128 KiB), in its compress bound.
_BLOCK = 128 << 10
#: zstd's level. Over the demo's 19 blobs (247 KB, each compressed alone) on the 2-core VM: 19 gave 0.217x at
#: 3.9 MB/s, 9 gave 0.241x at 61 MB/s, 3 gave 0.257x at 319 MB/s; each decompressed at about 1.1 GB/s. A writer
#: compresses once, in the background, for every node that reads: the slow level pays (a 136 KB CUB kernel:
#: about 35 ms of a write-back thread, zstd releasing the GIL).
LEVEL = 19
#: The bytes of a blob :func:`encode` tries at zstd's fastest level before it compresses the whole (about 20 us).
PROBE = 64 << 10
#: Above this many bytes a blob is compressed at :data:`LARGE_LEVEL` at most (61 MB/s against 19's 4).
LARGE = 4 << 20
LARGE_LEVEL = 9


def is_framed(stored: bytes | memoryview) -> bool:
    """Whether ``stored`` starts as a framed object does (else it is raw)."""
    return bytes(stored[: len(MAGIC)]) == MAGIC


def room(raw_limit: int) -> int:
    """The most stored bytes an object of at most ``raw_limit`` raw bytes takes, framed or raw.

    The header and zstd's own bound (``ZSTD_COMPRESSBOUND``): a blob that does not compress and starts with
    :data:`MAGIC` is framed, larger than itself. A reader bounds the stored bytes by this, the raw bytes by
    ``raw_limit``.
    """
    n = raw_limit
    return HEADER_SIZE + n + (n >> 8) + ((_BLOCK - n) >> 11 if n < _BLOCK else 0)


def stored_limit(limit: int, digest: str | None) -> int:
    """The most stored bytes an engine's ``get(name, limit=limit, digest=digest)`` takes in: ``limit`` for an object
    as it is stored, :func:`room` of it for a blob (a digest given), which framed may outgrow its raw bytes."""
    return limit if digest is None else room(limit)


def encode(raw: bytes, *, level: int = LEVEL) -> bytes:
    """``raw`` as a shared store is to hold it: framed and compressed, or ``raw`` itself when that is not larger.

    A blob whose first :data:`PROBE` bytes do not compress by a sixteenth at zstd's fastest level is kept raw
    uncompressed (level 19 takes about 250 ms a MiB of noise); one over :data:`LARGE` bytes is compressed at
    :data:`LARGE_LEVEL` at most (19 would take seconds of the write-back thread).
    """
    import zstandard  # only where a shared store's blob is written or read

    if len(raw) > PROBE:
        probe = zstandard.ZstdCompressor(level=1).compress(memoryview(raw)[:PROBE])
        if len(probe) > PROBE - PROBE // 16:
            if not is_framed(raw):
                return raw
            level = 1  # framed all the same, so that it is not read as a frame: quickly
        if len(raw) > LARGE:
            level = min(level, LARGE_LEVEL)
    framed = _HEADER.pack(MAGIC, len(raw)) + zstandard.ZstdCompressor(level=level).compress(raw)
    if len(framed) < len(raw) or is_framed(raw):
        return framed
    return raw


def decode(stored: bytes | memoryview, limit: int, where: str = "") -> bytes | memoryview:
    """The raw bytes of ``stored`` (at most ``limit`` of them), or ``stored`` itself when it is raw.

    Refuses (module docstring) with a :class:`StoreFailure` naming ``where``. The raw bytes land in one
    buffer of the stated size (within ``limit``), not in parts joined at the end: held once, not twice.
    """
    if not is_framed(stored):
        Inflow(where, limit, _drop).take(stored[: limit + 1]).finish()  # the one "over the limit" check
        return stored
    size = stated_size(stored)
    into = Landing(size if size is not None and size <= limit else 0)  # else refused before a byte comes out
    Inflow(where, limit, into.take).take(stored).finish()
    return into.value()


def _drop(chunk: bytes | memoryview) -> None:
    pass


class _Over(Exception):
    """Decompression went past the raw size its header states (raised through zstd's writer)."""


class _Bounded:
    """zstd's output, passed on to ``sink`` until it would exceed ``size`` bytes (then :class:`_Over`)."""

    def __init__(self, size: int, sink: Callable[[bytes | memoryview], object]) -> None:
        self.size = size
        self.written = 0
        self._sink = sink

    def write(self, chunk: bytes) -> int:
        self.written += len(chunk)
        if self.written > self.size:
            raise _Over
        self._sink(chunk)
        return len(chunk)


class Inflow:
    """One stored object as it arrives (:meth:`take`), its raw bytes passed to ``sink`` as they come out.

    The one decoder: a raw object's chunks pass through, a framed one's are decompressed, within ``limit``
    and what the header states; :meth:`finish` says whether it was whole. The raw digest is the caller's check.
    """

    def __init__(self, where: str, limit: int, sink: Callable[[bytes | memoryview], object]) -> None:
        self.where = where
        self.limit = limit
        self.raw_size = 0
        self._sink = sink
        self._head = b""  # the bytes that decide, until there are enough of them
        self._framed: bool | None = None
        self._size = 0
        self._out: _Bounded | None = None
        self._writer: Any = None

    def _refused(self, detail: str) -> StoreFailure:
        return StoreFailure(self.where, "damaged", f"a compressed object that {detail}", outage=False)

    def take(self, chunk: bytes | memoryview) -> Inflow:
        """The next bytes of the object (itself, so that a whole object is ``Inflow(...).take(it).finish()``)."""
        if self._framed is None:
            want = HEADER_SIZE + _ZSTD_HEAD - len(self._head)
            self._head += bytes(chunk[:want])  # only the bytes that decide are copied, never a whole answer
            if len(self._head) < HEADER_SIZE + _ZSTD_HEAD and self._head.startswith(MAGIC[: len(self._head)]):
                return self  # too few bytes yet to tell a frame, and its sizes, from a raw object
            head, self._head, chunk = self._head, b"", memoryview(chunk)[want:]  # a view: no copy of the rest
            self._start(head)  # a frame: zstd is fed what came after the header
            if not self._framed:
                self._pass(head)
            if not chunk:
                return self
        if self._framed:
            self._inflate(chunk)
        else:
            self._pass(chunk)
        return self

    def _pass(self, chunk: bytes | memoryview) -> None:
        """A raw object's bytes, passed through within the limit."""
        self.raw_size += len(chunk)
        if self.raw_size > self.limit:
            raise StoreFailure(self.where, "too large", f"more than the {self.limit:,} bytes allowed", outage=False)
        self._sink(chunk)

    def finish(self) -> int:
        """The object ended: its raw size, when it was whole (a frame that produced all it states)."""
        if self._framed is None:
            head, self._head = self._head, b""
            if is_framed(head):
                self._start(head)  # a frame cut short
            else:  # raw (shorter than MAGIC, though it starts like it: the digest decides)
                self._framed = False
                self.take(head)
        if self._framed:
            assert self._out is not None
            self.raw_size = self._out.written
            if self.raw_size != self._size:
                raise self._refused(
                    f"states {self._size:,} raw bytes and does not decompress to them "
                    f"(it ends after {self.raw_size:,}: cut short)"
                )
        return self.raw_size

    def _start(self, head: bytes | memoryview) -> None:
        """Tell a frame from a raw object by its first bytes, and check a frame's sizes before zstd sees it."""
        self._framed = is_framed(head)
        if not self._framed:
            return
        if len(head) < HEADER_SIZE:
            raise self._refused(f"is cut short: {len(head)} bytes, its header alone is {HEADER_SIZE}")
        _magic, size = _HEADER.unpack_from(head)
        if size > self.limit:
            raise self._refused(f"states {size:,} raw bytes, more than the {self.limit:,} allowed: not decompressed")
        import zstandard  # only where a shared store's blob is written or read

        try:
            stated = zstandard.frame_content_size(bytes(head[HEADER_SIZE:]))
        except zstandard.ZstdError:
            raise self._refused("is cut short or garbled: no zstd frame header") from None
        if stated != size:
            said = "no size" if stated == -1 else f"{stated:,} bytes"
            raise self._refused(f"states {size:,} raw bytes but its zstd frame {said}: not decompressed")
        self._size = size
        self._out = _Bounded(size, self._sink)
        self._writer = zstandard.ZstdDecompressor().stream_writer(
            cast("IO[bytes]", self._out), write_size=min(size + 1, 1 << 17), write_return_read=True
        )
        self._inflate(memoryview(head)[HEADER_SIZE:])

    def _inflate(self, chunk: bytes | memoryview) -> None:
        import zstandard

        try:
            self._writer.write(chunk)
        except _Over:
            raise self._refused(f"states {self._size:,} raw bytes and does not decompress to them (more)") from None
        except zstandard.ZstdError as exc:
            raise self._refused(f"states {self._size:,} raw bytes and does not decompress to them ({exc})") from None


def stated_size(head: bytes | memoryview) -> int | None:
    """The raw size the header ``head`` (a blob's first :data:`HEADER_SIZE` bytes or more) states; None: not framed."""
    if len(head) < HEADER_SIZE or not is_framed(head):
        return None
    size: int = _HEADER.unpack_from(head)[1]
    return size


def verified(where: str, stored: bytes | memoryview, digest: str, limit: int) -> bytes | memoryview:
    """The raw bytes of ``stored`` (at most ``limit``) when they hash to ``digest``; else a :class:`StoreFailure`.

    Of kind ``damaged``: a frame :func:`decode` refuses, or raw bytes that are not the blob's. An engine's
    ``get`` with a digest, for an object it has whole (Redis, a directory's file once hashed).
    """
    from blake3 import blake3

    raw = decode(stored, limit, where)
    if blake3(raw).hexdigest() != digest:
        raise StoreFailure(where, "damaged", f"{len(raw)} bytes that do not hash to {digest}", outage=False)
    return raw
