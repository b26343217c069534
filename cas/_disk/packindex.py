"""A pack's whole index held in memory, for a reader that fetched it by ranges (HTTP, S3, a publisher over any engine).

The format is :mod:`.pack`'s; this is its index as two ranged reads bring it (the
trailer, then the index it points at), checked against the trailer's checksum, so
that a lookup costs no I/O until its blob; and one index entry read at the place a warm
set's line names (:func:`entry_at`).
"""

from __future__ import annotations

import struct

from blake3 import blake3

from .pack import (
    ENTRY_SIZE,
    FANOUT_SIZE,
    TRAILER_SIZE,
    PackEntry,
    PackError,
    entry_from,
    find_entry,
    index_length,
    parse_trailer,
    read_fanout,
    split_entries,
)

__all__ = ["PackIndex", "entry_at"]


class PackIndex:
    """A pack's whole index held in memory, for a reader that fetched it (HTTP): lookups without I/O.

    Made from the pack's size, its trailer and its index bytes, checked against
    the trailer's checksum: an index that is not the pack's is a :class:`PackError`.
    :meth:`to_bytes` gives back what :meth:`from_bytes` takes, to keep it on disk.
    """

    def __init__(self, name: str, size: int, trailer: bytes, index: bytes) -> None:
        checksum, index_offset, count = parse_trailer(trailer, size, name)
        if len(index) != index_length(count) or blake3(index).digest() != checksum:
            raise PackError(f"{name}: its index does not match its trailer's checksum")
        self.name = name
        self.size = size
        self.count = count
        self.index_offset = index_offset
        self._fanout = read_fanout(index, count, name)
        self._trailer = trailer
        self._index = index
        self._keys, self._entries = split_entries(index[FANOUT_SIZE:])

    @staticmethod
    def span(size: int, trailer: bytes, name: str, *, max_index: int | None = None) -> tuple[int, int]:
        """Where the index of a pack of ``size`` bytes with this trailer lies: ``(offset, length)``.

        ``size`` is what the server says the file's size is: the trailer must fit
        it exactly. With ``max_index``, an index longer than that is a
        :class:`PackError` too, before a byte of it is fetched (a trailer may
        claim 2**32 - 1 entries: a 412 GB index).
        """
        _checksum, index_offset, count = parse_trailer(trailer, size, name)
        length = index_length(count)
        if max_index is not None and length > max_index:
            raise PackError(f"{name}: its trailer claims {count} entries, a {length}-byte index (at most {max_index})")
        return index_offset, length

    @property
    def index_size(self) -> int:
        """Bytes of the index this holds in memory (its fan-out table and entries)."""
        return len(self._index)

    def find_key(self, key: bytes) -> PackEntry | None:
        """The entry of the key id ``key`` (32 raw bytes), or None."""
        first = key[0]
        lo, hi = (self._fanout[first - 1] if first else 0), self._fanout[first]
        base = self.index_offset + FANOUT_SIZE
        return find_entry(self._keys, self._entries, lo, hi, key, limit=self.index_offset, base=base)

    def key_ids(self) -> list[bytes]:
        return self._keys

    def to_bytes(self) -> bytes:
        return struct.pack("<Q", self.size) + self._trailer + self._index

    @classmethod
    def from_bytes(cls, name: str, data: bytes) -> PackIndex:
        """The index :meth:`to_bytes` gave; :class:`PackError` when ``data`` is not one of ``name``."""
        if len(data) < 8 + TRAILER_SIZE:
            raise PackError(f"{name}: a kept index too short")
        (size,) = struct.unpack_from("<Q", data)
        return cls(name, size, data[8 : 8 + TRAILER_SIZE], data[8 + TRAILER_SIZE :])


def entry_at(raw: bytes, at: int, trailer: bytes, size: int, name: str) -> PackEntry | None:
    """The index entry ``raw`` read at byte ``at`` of pack ``name`` (``size`` bytes, ending in ``trailer``).

    None unless ``at`` is the place of an entry of that pack's index (the trailer
    says where the index lies and how many it holds) and the entry is whole (its
    check) and names bytes among the pack's blobs. A warm set's line says where
    to look; what is found there is the pack's own word on the key.
    """
    try:
        _checksum, index_offset, count = parse_trailer(trailer, size, name)
    except PackError:
        return None
    first = index_offset + FANOUT_SIZE
    if len(raw) != ENTRY_SIZE or not first <= at < first + count * ENTRY_SIZE or (at - first) % ENTRY_SIZE:
        return None
    return entry_from(raw, index_offset, at)
