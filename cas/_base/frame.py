"""A blob as a shared store holds it: zstd-compressed in a self-describing frame, or raw.

A shared store moves and keeps compressed bytes (a cubin compresses 7 to 10 times);
a node's local cache keeps the raw binary, which ``cuobjdump`` reads. The writer
compresses once (:func:`encode`), each reader decodes (:func:`decode`) before it
verifies: a blob's name stays the blake3 digest of its raw bytes.

A framed object is::

    MAGIC (8 bytes) | raw size (u64, little-endian) | one zstd frame stating the same content size

``MAGIC`` starts with ``0x89``, which none of the objects a store holds starts with:
a cubin is ELF (``0x7f``), PTX and records are text, LTO-IR is LLVM bitcode
(``BC``) or its wrapper (``0xde``), a fatbinary starts ``0x50``, a manifest
``cpcas``. A reader knows a framed object by its header, never by guessing: an
object that does not start with ``MAGIC`` is raw and passed through, so a store
may mix both, and the writer frames any blob that does start with it, compressed
or not. A blob that compression would not make smaller is stored raw.

What :func:`decode` refuses (a :class:`~cuda_program_cas._base.engine.StoreFailure`
of kind ``damaged``, not an outage: one bad object, a miss counted in ``corrupt``):
a stated raw size over the reader's limit (before anything is decompressed; a
raw object longer than the limit too), a
zstd frame that states another size or none, a frame cut short, more data than
one frame, a frame that decompresses to more or less than it states. zstd is
given the stated size as the most it may write, so a bomb never takes more memory
than the limit the reader allows an entry anyway.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from blake3 import blake3

from .engine import StoreFailure, check_digest

if TYPE_CHECKING:
    from .engine import Engine

__all__ = [
    "HEADER_SIZE",
    "LEVEL",
    "MAGIC",
    "decode",
    "encode",
    "for_store",
    "get_verified",
    "is_framed",
    "stated_size",
    "verified",
]

#: The first bytes of a framed object (PNG's trick: a high byte, then a name, then CR LF, ^Z, LF).
MAGIC = b"\x89cpz\r\n\x1a\n"
_HEADER = struct.Struct("<8sQ")
#: The bytes before the zstd frame.
HEADER_SIZE = _HEADER.size
#: zstd's level. Over the demo's 19 blobs (247 KB, each compressed alone) on the 2-core VM: 19 gave 0.217x at
#: 3.9 MB/s, 9 gave 0.241x at 61 MB/s, 3 gave 0.257x at 319 MB/s; each decompressed at about 1.1 GB/s. A writer
#: compresses once, in the background, for every node that reads: the slow level pays (a 136 KB CUB kernel:
#: about 35 ms of a write-back thread, zstd releasing the GIL).
LEVEL = 19


def is_framed(stored: bytes | memoryview) -> bool:
    """Whether ``stored`` starts as a framed object does (else it is raw)."""
    return bytes(stored[: len(MAGIC)]) == MAGIC


def encode(raw: bytes, *, level: int = LEVEL) -> bytes:
    """``raw`` as a shared store is to hold it: framed and compressed, or ``raw`` itself when that is not larger."""
    import zstandard  # only where a shared store's blob is written or read

    framed = _HEADER.pack(MAGIC, len(raw)) + zstandard.ZstdCompressor(level=level).compress(raw)
    if len(framed) < len(raw) or is_framed(raw):
        return framed
    return raw


def for_store(engine: Engine, raw: bytes) -> bytes:
    """``raw`` as ``engine``'s store is to hold it: :func:`encode` d, unless the engine keeps blobs raw.

    A directory store, and a web server's, keep them raw (no ``compresses`` in ``engine.can``): their engines verify
    a blob as it arrives (hashed in chunks before a large one is read whole; staged on disk over HTTP),
    which a framed one fails, to be read again (:func:`get_verified`). Every reader, gc, verify, stats,
    repack and publish take framed ones there all the same. Redis reads an object whole anyway.
    """
    return encode(raw) if engine.can.compresses else raw


def decode(stored: bytes | memoryview, limit: int, where: str = "") -> bytes | memoryview:
    """The raw bytes of ``stored`` (at most ``limit`` of them), or ``stored`` itself when it is raw.

    Refuses (module docstring) with a :class:`StoreFailure` naming ``where``.
    """

    def refused(detail: str) -> StoreFailure:
        return StoreFailure(where, "damaged", f"a compressed object that {detail}", outage=False)

    if not is_framed(stored):
        if len(stored) > limit:
            raise StoreFailure(where, "damaged", f"{len(stored):,} bytes, over the {limit:,} allowed", outage=False)
        return stored

    if len(stored) < HEADER_SIZE:
        raise refused(f"is cut short: {len(stored)} bytes, its header alone is {HEADER_SIZE}")
    _magic, size = _HEADER.unpack_from(stored)
    if size > limit:
        raise refused(f"states {size:,} raw bytes, more than the {limit:,} allowed: not decompressed")
    import zstandard

    body = memoryview(stored)[HEADER_SIZE:]
    try:
        stated = zstandard.frame_content_size(body)
    except zstandard.ZstdError:
        raise refused("is cut short or garbled: no zstd frame header") from None
    if stated != size:
        said = "no size" if stated == -1 else f"{stated:,} bytes"
        raise refused(f"states {size:,} raw bytes but its zstd frame {said}: not decompressed")
    try:
        raw = zstandard.ZstdDecompressor().decompress(body, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise refused(f"states {size:,} raw bytes and does not decompress to them ({exc})") from None
    if len(raw) != size:
        raise refused(f"states {size:,} raw bytes and decompresses to {len(raw):,}")
    return raw


def stated_size(head: bytes | memoryview) -> int | None:
    """The raw size the header ``head`` (a blob's first :data:`HEADER_SIZE` bytes or more) states; None: not framed."""
    if len(head) < HEADER_SIZE or not is_framed(head):
        return None
    size: int = _HEADER.unpack_from(head)[1]
    return size


def get_verified(engine: Engine, name: str, digest: str, size: int) -> bytes | None:
    """The raw bytes of blob ``name`` of ``engine``, verified against ``digest``, or None when there is none.

    Stored compressed or raw, never larger than the raw ``size``. Where writers keep blobs raw
    (no ``compresses`` in ``engine.can``: a directory, a web server) the engine verifies as the bytes arrive
    (staged on disk above 1 MiB over HTTP); only an object that failed that is read again, to be
    decoded if it is framed. Elsewhere (Redis) it is read whole, then decoded and verified. A
    :class:`StoreFailure` of kind ``damaged`` for what is neither.
    """
    where = f"{engine.shown.rstrip('/')}/{name}"
    if engine.can.compresses:
        stored = engine.get(name, limit=size)
    else:
        try:
            return engine.get(name, limit=size, digest=digest)
        except StoreFailure as exc:
            if exc.kind != "damaged":
                raise
            # A framed object is smaller than the raw size: only such a one is read again (a lying manifest
            # over a large file is never read whole), and any trouble on the way is the damage first found.
            try:
                held = engine.size(name)
                stored = engine.get(name, limit=held) if held is not None and 0 < held < size else None
            except StoreFailure:
                stored = None
            if stored is None or not is_framed(stored):
                raise
    return None if stored is None else bytes(verified(where, stored, digest, size))


def verified(where: str, stored: bytes | memoryview, digest: str, limit: int) -> bytes | memoryview:
    """The raw bytes of ``stored`` when they hash to ``digest``; else a :class:`StoreFailure` kind ``damaged``.

    A framed-looking object that does not decode to them may be a raw blob that starts with
    :data:`MAGIC` in a store written before blobs were compressed: its own digest decides.
    """
    try:
        return check_digest(where, decode(stored, limit, where), digest)
    except StoreFailure:
        if not is_framed(stored) or len(stored) > limit or blake3(stored).hexdigest() != digest:
            raise
        return stored
