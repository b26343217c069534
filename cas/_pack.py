"""Packs: immutable files that hold many entries of a shared store, opened once per process.

A loose shared store costs every node two opens per first hit and the store an
inode per blob and per manifest. A pack holds one publish generation: every blob
once, then a sorted index from key id to blob, then a trailer. Nodes open each
pack once, read the 1 KiB fan-out table once, and answer a lookup with one
``pread`` of the index slice for the key's first byte and one ``pread`` of the
blob, which is verified by its blake3 digest before its bytes are returned, as
a loose blob is. Nothing is memory-mapped: a pack truncated or replaced under a
reader makes short reads (misses), never a SIGBUS.

File format, version 1 (integers little-endian)::

    header     8 bytes   b"cpcaspk" + version byte (1)
    blobs      the blobs' bytes, each distinct blob once, back to back
    index      fan-out: 256 x u32, the number of entries whose key id's first
               byte is <= i (so entries of byte b are [fanout[b-1], fanout[b]))
               entries: count x 96 bytes, sorted by key id, each
                   key id (32 raw bytes) | digest (32) | offset u64 | size u64 |
                   time u64 (ns: when the entry was published; kept by repack,
                   for gc --max-age) | check (the first 8 bytes of blake3 of
                   the 88 bytes before it)
    trailer    56 bytes: blake3 of the whole index (32) | index offset u64 |
               count u32 | version u32 | b"cpcasidx"

The trailer's checksum covers the index: ``verify`` and ``repack`` check it; a
lookup does not read the whole index, and relies instead on each entry's own
check (a damaged entry is a miss, the rest of its pack still reads) and on the
blob's digest. A pack becomes visible only complete: it is written to the
store's ``tmp/``, synced, and renamed into ``packs/`` under a new name; it is
never rewritten.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from blake3 import blake3

from ._files import READ_FLAGS
from ._fork import after_fork
from ._layout import Layout

__all__ = [
    "PACK_SUFFIX",
    "PackEntry",
    "PackError",
    "PackInput",
    "PackReader",
    "PackSet",
    "list_packs",
    "pack_chunks",
    "packed_entries",
    "write_pack",
]

_log = logging.getLogger("cas")

VERSION = 1
_HEADER = b"cpcaspk" + bytes([VERSION])
_TRAILER_MAGIC = b"cpcasidx"
_TRAILER = struct.Struct("<32sQII8s")
_ENTRY = struct.Struct("<32s32sQQQ8s")
_BODY = _ENTRY.size - 8
_FANOUT = struct.Struct("<256I")
PACK_SUFFIX = ".cpk"
#: How long a process trusts its listing of ``packs/`` before listing again.
RELIST_S = 2.0


class PackError(ValueError):
    """A pack file that is not a valid pack (truncated, garbled, of another version)."""


@dataclass(frozen=True, slots=True)
class PackEntry:
    """One index entry: a key id, its blob's digest, and where the blob lies in the pack."""

    key_id: str
    digest: str
    offset: int
    size: int
    #: When the entry was published (ns since the epoch).
    time_ns: int


def _entry_check(body: bytes) -> bytes:
    return blake3(body).digest()[:8]


def pack_name() -> str:
    """A new pack's file name: time-ordered (newest sorts last), never reused."""
    return f"pack-{time.time_ns():016x}-{secrets.token_hex(4)}{PACK_SUFFIX}"


def list_packs(packs_dir: str) -> list[str]:
    """The pack files of a store, newest first."""
    try:
        names = [n for n in os.listdir(packs_dir) if n.startswith("pack-") and n.endswith(PACK_SUFFIX)]
    except OSError:
        return []
    return [os.path.join(packs_dir, n) for n in sorted(names, reverse=True)]


# -- writing --------------------------------------------------------------------------------


#: What a pack is written from: key id, digest, the verified bytes (or a callable giving them,
#: or None when they can no longer be had: the entry is left out), time (ns).
PackInput = tuple[str, str, "bytes | Callable[[], bytes | None]", int]


def pack_chunks(entries: Iterable[PackInput], stats: dict[str, int] | None = None) -> Iterator[bytes]:
    """The bytes of a pack holding ``entries``, produced as they are read.

    A key id met twice keeps its first entry; a digest met twice is stored once
    (and, given as a callable, read once; a callable that gives None leaves its
    entry out). ``stats``, when given, receives ``entries``, ``blobs`` and ``bytes``.
    """
    yield _HEADER
    offset = len(_HEADER)
    placed: dict[str, tuple[int, int]] = {}
    index: dict[str, tuple[str, int, int, int]] = {}
    for kid, digest, data, time_ns in entries:
        if kid in index:
            continue
        where = placed.get(digest)
        if where is None:
            blob = data() if callable(data) else data
            if blob is None:
                continue
            where = placed[digest] = (offset, len(blob))
            yield blob
            offset += len(blob)
        index[kid] = (digest, *where, time_ns)
    counts = [0] * 256
    body = []
    for kid in sorted(index):
        digest, off, size, time_ns = index[kid]
        raw = _ENTRY.pack(bytes.fromhex(kid), bytes.fromhex(digest), off, size, time_ns, b"")[:_BODY]
        body.append(raw + _entry_check(raw))
        counts[int(kid[:2], 16)] += 1
    fanout = []
    total = 0
    for c in counts:
        total += c
        fanout.append(total)
    index_bytes = _FANOUT.pack(*fanout) + b"".join(body)
    if stats is not None:
        stats.update(entries=len(body), blobs=len(placed), bytes=offset - len(_HEADER))
    yield index_bytes
    yield _TRAILER.pack(blake3(index_bytes).digest(), offset, len(body), VERSION, _TRAILER_MAGIC)


def write_pack(
    lay: Layout, entries: Iterable[PackInput], write_file: object, stats: dict[str, int] | None = None
) -> str:
    """Write a pack of ``entries`` into ``lay``'s ``packs/`` through ``write_file(target, chunks)``.

    ``write_file`` is the store writer's :meth:`cas._writer.Writer.write_file`
    (temp file in ``tmp/``, final mode, fsync, rename). Returns the pack's path.
    """
    packs_dir = os.path.join(lay.root, "packs")
    target = os.path.join(packs_dir, pack_name())
    assert callable(write_file)
    if not write_file(target, pack_chunks(entries, stats)):
        raise OSError(f"the pack {target} could not be renamed into place (file busy)")
    return target


def packed_entries(root: str) -> dict[str, PackEntry]:
    """Key id -> entry of every pack of the store at ``root`` (newest pack first wins); unusable packs skipped."""
    found: dict[str, PackEntry] = {}
    for path in list_packs(os.path.join(root, "packs")):
        try:
            reader = PackReader(path)
        except (OSError, PackError):
            continue
        try:
            for entry in reader.entries():
                found.setdefault(entry.key_id, entry)
        finally:
            reader.close()
    return found


# -- reading --------------------------------------------------------------------------------


class PackReader:
    """One open pack. Lookups ``pread``; nothing here raises for a damaged file (``PackError`` at open)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, READ_FLAGS)
        try:
            st = os.fstat(self._fd)
            size = st.st_size
            if size < len(_HEADER) + _FANOUT.size + _TRAILER.size:
                raise PackError(f"{path}: too short to be a pack ({size} bytes)")
            if os.pread(self._fd, len(_HEADER), 0) != _HEADER:
                raise PackError(f"{path}: not a pack of version {VERSION}")
            checksum, index_offset, count, version, magic = _TRAILER.unpack(
                os.pread(self._fd, _TRAILER.size, size - _TRAILER.size)
            )
            if magic != _TRAILER_MAGIC or version != VERSION:
                raise PackError(f"{path}: bad trailer")
            if index_offset + _FANOUT.size + count * _ENTRY.size + _TRAILER.size != size:
                raise PackError(f"{path}: the trailer does not match the file's size")
            fanout = _FANOUT.unpack(os.pread(self._fd, _FANOUT.size, index_offset))
            if any(a > b for a, b in itertools.pairwise(fanout)) or fanout[-1] != count:
                raise PackError(f"{path}: garbled fan-out table")
        except BaseException:
            os.close(self._fd)
            raise
        self.size = size
        #: When the pack was written (its file's mtime).
        self.mtime = st.st_mtime
        self.count = count
        self.checksum = checksum
        self._index_offset = index_offset
        self._fanout = fanout
        #: First byte -> the sorted key ids of that slice and their raw entries (a pack never changes).
        self._buckets: dict[int, tuple[list[bytes], list[bytes]]] = {}
        self._lock = threading.Lock()
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # see cas._fork

    def close(self) -> None:
        os.close(self._fd)

    def _bucket(self, first: int) -> tuple[list[bytes], list[bytes]]:
        bucket = self._buckets.get(first)
        if bucket is not None:
            return bucket
        lo = self._fanout[first - 1] if first else 0
        hi = self._fanout[first]
        start = self._index_offset + _FANOUT.size + lo * _ENTRY.size
        raw = os.pread(self._fd, (hi - lo) * _ENTRY.size, start)
        entries = [raw[i : i + _ENTRY.size] for i in range(0, len(raw) - _ENTRY.size + 1, _ENTRY.size)]
        bucket = ([e[:32] for e in entries], entries)
        with self._lock:
            self._buckets[first] = bucket
        return bucket

    def find(self, kid: str) -> PackEntry | None:
        """The entry of ``kid``, or None when the pack has none (or its entry is damaged)."""
        key = bytes.fromhex(kid)
        keys, entries = self._bucket(key[0])
        i = bisect.bisect_left(keys, key)
        if i == len(keys) or keys[i] != key:
            return None
        raw = entries[i]
        if _entry_check(raw[:_BODY]) != raw[_BODY:]:
            return None  # a damaged entry: a miss; the rest of the pack still reads
        _kid, digest, offset, size, time_ns, _check = _ENTRY.unpack(raw)
        if offset + size > self._index_offset:
            return None
        return PackEntry(kid, digest.hex(), offset, size, time_ns)

    def read(self, entry: PackEntry) -> bytes | None:
        """The verified bytes of ``entry``'s blob, or None when they are short or do not hash to its digest."""
        data = os.pread(self._fd, entry.size, entry.offset)
        if len(data) != entry.size or blake3(data).hexdigest() != entry.digest:
            return None
        return data

    def entries(self) -> Iterator[PackEntry]:
        """Every entry, in key order (damaged ones skipped)."""
        for first in range(256):
            for raw in self._bucket(first)[1]:
                if _entry_check(raw[:_BODY]) == raw[_BODY:]:
                    kid, digest, offset, size, time_ns, _check = _ENTRY.unpack(raw)
                    yield PackEntry(kid.hex(), digest.hex(), offset, size, time_ns)

    def index_ok(self) -> bool:
        """True when the whole index matches the trailer's checksum (reads the whole index)."""
        raw = os.pread(self._fd, _FANOUT.size + self.count * _ENTRY.size, self._index_offset)
        return bool(blake3(raw).digest() == self.checksum)


class PackSet:
    """The packs of one store as one process sees them: each opened once, the directory re-listed every few s."""

    def __init__(self, root: str, on_damage: Callable[[str], None] | None = None) -> None:
        self.packs_dir = os.path.join(root, "packs")
        self._on_damage = on_damage
        self._open: dict[str, PackReader] = {}
        self._bad: set[str] = set()
        self._order: list[PackReader] = []
        self._listed_at = float("-inf")
        self._lock = threading.Lock()
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # see cas._fork

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._listed_at < RELIST_S:
            return
        with self._lock:
            if now - self._listed_at < RELIST_S:
                return
            paths = list_packs(self.packs_dir)
            for path in paths:
                if path in self._open or path in self._bad:
                    continue
                try:
                    self._open[path] = PackReader(path)
                except FileNotFoundError:
                    continue  # retired between the listing and the open: its entries are elsewhere
                except (OSError, PackError) as exc:
                    self._bad.add(path)
                    _log.debug("cuda-program-cas: unusable pack %s: %s", path, exc)
            # A pack that left the listing stays open (its file may be retired, still readable
            # through our descriptor) but is no longer asked first.
            self._order = [self._open[p] for p in paths if p in self._open]
            self._listed_at = now

    def lookup(self, kid: str) -> tuple[bytes, str] | None:
        """``(bytes, digest)`` from the newest pack that has a good copy; None when none has.

        A pack whose copy is damaged or unreadable is reported to ``on_damage(path)``
        and the next pack is asked.
        """
        self._refresh()
        for pack in self._order:
            try:
                entry = pack.find(kid)
                if entry is None:
                    continue
                data = pack.read(entry)
            except OSError:
                data = entry = None
            if data is None or entry is None:
                if self._on_damage is not None:
                    self._on_damage(pack.path)
                continue
            return data, entry.digest
        return None
