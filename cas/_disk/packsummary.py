"""What a store's packs hold, in one file: ``packs/summary``, so publish need not read every pack.

A publisher reads it, lists ``packs/`` and reads only the packs it does not cover; entries
of packs no longer listed are dropped. It is a cache of what the packs say, never the
truth: one missing, damaged or stale costs reading the packs it lacks. ``publish --pack``
and ``repack`` rewrite it after each pack (:class:`cuda_program_cas._disk.packpublish.StorePacks`).
Nodes never read it.

File format, version 2 (integers little-endian; another version is not read, so its packs are)::

    header   b"cpcassum" | version u32 | pack count u32 | entry count u32
    packs    per pack: name length u16 | name (UTF-8), in the listing's order
    entries  per entry: pack number u32 | key id (32) | digest (32) | offset u64 | size u64 | time u64 |
             where its index entry lies in the pack u64 (a warm set's line names it; 0: unknown)
    trailer  blake3 of everything before (32)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from blake3 import blake3

from .pack import PackEntry

__all__ = ["MAX_SUMMARY_BYTES", "SUMMARY", "PackedEntry", "encode_summary", "parse_summary"]

SUMMARY = "summary"
_MAGIC = b"cpcassum"
_VERSION = 2
_HEAD = struct.Struct("<8sIII")
_NAME = struct.Struct("<H")
_ENTRY = struct.Struct("<I32s32sQQQQ")
#: A summary larger than this is not read (1.8 M entries): a damaged size cannot ask for all memory.
MAX_SUMMARY_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class PackedEntry:
    """A packed entry and the pack (its name) that holds it."""

    pack: str
    entry: PackEntry


def encode_summary(by_pack: dict[str, list[PackEntry]]) -> bytes:
    names = [name.encode() for name in by_pack]
    parts = [_HEAD.pack(_MAGIC, _VERSION, len(names), sum(len(e) for e in by_pack.values()))]
    parts += [_NAME.pack(len(n)) + n for n in names]
    for number, entries in enumerate(by_pack.values()):
        for e in entries:
            kid, digest = bytes.fromhex(e.key_id), bytes.fromhex(e.digest)
            parts.append(_ENTRY.pack(number, kid, digest, e.offset, e.size, e.time_ns, max(e.at, 0)))
    body = b"".join(parts)
    return body + blake3(body).digest()


def parse_summary(data: bytes) -> dict[str, list[PackEntry]]:
    """Pack name -> entries, from the bytes of a summary; empty when they are not one."""
    body = data[:-32]
    if len(data) < _HEAD.size + 32 or blake3(body).digest() != data[-32:]:
        return {}
    magic, version, pack_count, entry_count = _HEAD.unpack_from(body)
    if magic != _MAGIC or version != _VERSION:
        return {}
    at = _HEAD.size
    names = []
    try:
        for _ in range(pack_count):
            (length,) = _NAME.unpack_from(body, at)
            names.append(body[at + _NAME.size : at + _NAME.size + length].decode())
            at += _NAME.size + length
        if len(body) - at != entry_count * _ENTRY.size:
            return {}
        out: dict[str, list[PackEntry]] = {name: [] for name in names}
        for number, kid, digest, offset, size, time_ns, place in _ENTRY.iter_unpack(body[at:]):
            out[names[number]].append(PackEntry(kid.hex(), digest.hex(), offset, size, time_ns, place or -1))
    except (struct.error, UnicodeDecodeError, IndexError):
        return {}
    return out
