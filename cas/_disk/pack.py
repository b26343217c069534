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
import errno
import logging
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from blake3 import blake3

from cuda_program_cas._base.errors import CacheError
from cuda_program_cas._base.fork import after_fork, after_fork_call

from .files import HASH_CHUNK, READ_FLAGS, hashes_to
from .layout import Layout

__all__ = [
    "ENTRY_SIZE",
    "PACK_SUFFIX",
    "RETIRED",
    "STREAM_ABOVE",
    "TRAILER_SIZE",
    "TRANSIENT",
    "PackEntry",
    "PackError",
    "PackIndex",
    "PackInput",
    "PackReader",
    "entry_at",
    "index_length",
    "open_packs",
    "pack_chunks",
    "pack_name",
    "parse_trailer",
    "write_pack",
]

_log = logging.getLogger("cuda_program_cas")

VERSION = 1
_HEADER = b"cpcaspk" + bytes([VERSION])
_TRAILER_MAGIC = b"cpcasidx"
_TRAILER = struct.Struct("<32sQII8s")
_ENTRY = struct.Struct("<32s32sQQQ8s")
_BODY = _ENTRY.size - 8
_FANOUT = struct.Struct("<256I")
PACK_SUFFIX = ".cpk"
#: A pack's trailer: its last bytes.
TRAILER_SIZE = _TRAILER.size


class PackError(CacheError, ValueError):
    """A pack file that is not a valid pack (truncated, garbled, of another version).

    A :class:`cuda_program_cas.CacheError` like every error the library raises on purpose;
    a ``ValueError`` too, as it always was (a bad file is a bad value).
    """


@dataclass(frozen=True, slots=True)
class PackEntry:
    """One index entry: a key id, its blob's digest, and where the blob lies in the pack."""

    key_id: str
    digest: str
    offset: int
    size: int
    #: When the entry was published (ns since the epoch).
    time_ns: int
    #: Where its index entry lies in the pack (a warm set's line names it, :func:`entry_at` checks it); -1: unknown.
    at: int = -1


def _entry_check(body: bytes) -> bytes:
    return blake3(body).digest()[:8]


def pack_name() -> str:
    """A new pack's file name: time-ordered (newest sorts last), never reused."""
    return f"pack-{time.time_ns():016x}-{secrets.token_hex(4)}{PACK_SUFFIX}"


#: Where a repack moves the packs it replaced, under ``packs/`` (they wait out the shared grace period).
RETIRED = "retired"
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

    ``write_file`` is the store writer's :meth:`cuda_program_cas._disk.writer.Writer.write_file`
    (temp file in ``tmp/``, final mode, fsync, rename). Returns the pack's path.
    """
    packs_dir = os.path.join(lay.root, "packs")
    target = os.path.join(packs_dir, pack_name())
    assert callable(write_file)
    if not write_file(target, pack_chunks(entries, stats)):
        raise OSError(f"the pack {target} could not be renamed into place (file busy)")
    return target


# -- reading --------------------------------------------------------------------------------

#: At most this many pack files are open in one process, whatever the number of packs
#: in its shared stores (1,100 packs open at once made every open past the soft limit
#: of 1024 fail with EMFILE). Reopening an evicted pack costs one ``open``; see docs/nfs.md.
MAX_OPEN_PACKS = 32
#: A pack index up to this size is read whole at open (a lookup then needs no descriptor
#: until it reads a blob): about 680 entries, what one publish of a CI run writes.
SMALL_INDEX = 64 * 1024
#: An entry larger than this is verified in chunks (:func:`.files.hashes_to`) before it is read whole.
STREAM_ABOVE = HASH_CHUNK
#: Errors that say the process is short of descriptors or memory, not that the pack is bad.
TRANSIENT = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOMEM))


class _DescriptorPool:
    """The open descriptors of every pack of this process, least recently used first.

    A descriptor in use (pinned by :meth:`pin`) is never closed under its reader: a
    thread reading through it would otherwise read a number the kernel gave to
    another file. Past :data:`MAX_OPEN_PACKS`, unpinned ones close, oldest first.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lru: OrderedDict[PackReader, None] = OrderedDict()

    def add(self, reader: PackReader) -> None:
        """Take in a reader whose descriptor was just opened (unpinned)."""
        with self._lock:
            self._lru[reader] = None
            self._shrink()

    def pin(self, reader: PackReader) -> int:
        """The reader's descriptor, opened again if it was closed, kept open until :meth:`unpin`."""
        with self._lock:
            if reader._fd >= 0:
                reader._pins += 1
                self._lru.move_to_end(reader)
                return reader._fd
            if reader._closed:
                raise FileNotFoundError(errno.ENOENT, "the pack was closed", reader.path)
        fd = reader._reopen()  # outside the lock: an open on a slow server holds up no other pack
        with self._lock:
            if reader._fd >= 0 or reader._closed:  # another thread opened (or closed) it meanwhile
                os.close(fd)
                if reader._closed:
                    raise FileNotFoundError(errno.ENOENT, "the pack was closed", reader.path)
            else:
                reader._fd = fd
                self._lru[reader] = None
            reader._pins += 1
            self._lru.move_to_end(reader)
            self._shrink()
            return reader._fd

    def unpin(self, reader: PackReader) -> None:
        with self._lock:
            reader._pins -= 1
            if reader._closed and reader._pins == 0:
                self._drop(reader)

    def close(self, reader: PackReader) -> None:
        """Close the reader for good (now, or when its last user unpins it)."""
        with self._lock:
            reader._closed = True
            if reader._pins == 0:
                self._drop(reader)

    def open_count(self) -> int:
        with self._lock:
            return len(self._lru)

    def _shrink(self) -> None:
        over = len(self._lru) - MAX_OPEN_PACKS
        if over <= 0:
            return
        victims = []
        for reader in self._lru:  # oldest first; usually the first one will do
            if reader._pins == 0:
                victims.append(reader)
                if len(victims) == over:
                    break
        for reader in victims:
            self._drop(reader)

    def _drop(self, reader: PackReader) -> None:
        if reader in self._lru:
            del self._lru[reader]
            fd, reader._fd = reader._fd, -1
            os.close(fd)

    def after_fork_in_child(self) -> None:
        # Threads that pinned descriptors do not exist in the child; its lock may have been held.
        self._lock = threading.Lock()
        for reader in self._lru:
            reader._pins = 0


_POOL = _DescriptorPool()
after_fork_call(_POOL.after_fork_in_child)


def open_packs() -> int:
    """How many pack files this process holds open now (at most :data:`MAX_OPEN_PACKS` plus those in use)."""
    return _POOL.open_count()


def _split(raw: bytes) -> tuple[list[bytes], list[bytes]]:
    """Raw index entries cut apart: their key ids and the entries themselves."""
    entries = [raw[i : i + _ENTRY.size] for i in range(0, len(raw) - _ENTRY.size + 1, _ENTRY.size)]
    return [e[:32] for e in entries], entries


def parse_trailer(raw: bytes, size: int, name: str) -> tuple[bytes, int, int]:
    """Checksum, index offset and count from the trailer (the last :data:`TRAILER_SIZE` bytes) of a pack of ``size``.

    Raises :class:`PackError` naming ``name`` for a trailer that is not one, or
    that does not fit the size.
    """
    if size < len(_HEADER) + _FANOUT.size + _TRAILER.size or len(raw) != _TRAILER.size:
        raise PackError(f"{name}: too short to be a pack ({size} bytes)")
    checksum, index_offset, count, version, magic = _TRAILER.unpack(raw)
    if magic != _TRAILER_MAGIC or version != VERSION:
        raise PackError(f"{name}: bad trailer")
    if index_offset < len(_HEADER) or index_offset + _FANOUT.size + count * _ENTRY.size + _TRAILER.size != size:
        raise PackError(f"{name}: the trailer does not match the file's size")
    return checksum, index_offset, count


def index_length(count: int) -> int:
    """Bytes of the index of a pack of ``count`` entries: the fan-out table and the entries."""
    return _FANOUT.size + count * _ENTRY.size


def _fanout(head: bytes, count: int, name: str) -> tuple[int, ...]:
    fanout: tuple[int, ...] = _FANOUT.unpack(head[: _FANOUT.size])
    if list(fanout) != sorted(fanout) or fanout[-1] != count:
        raise PackError(f"{name}: garbled fan-out table")
    return fanout


def _find(
    keys: list[bytes], entries: list[bytes], lo: int, hi: int, key: bytes, *, limit: int, base: int
) -> PackEntry | None:
    """The entry of ``key`` among ``keys[lo:hi]`` (sorted), or None; ``limit``: where the blobs end;
    ``base``: where ``entries[0]`` lies in the pack."""
    i = bisect.bisect_left(keys, key, lo, hi)
    if i == hi or keys[i] != key:
        return None
    return _entry(entries[i], limit, base + i * _ENTRY.size)


def _entry(raw: bytes, limit: int, at: int) -> PackEntry | None:
    """The index entry ``raw`` (found at ``at``), or None when it is damaged or names bytes past ``limit``."""
    if _entry_check(raw[:_BODY]) != raw[_BODY:]:
        return None  # a damaged entry: a miss; the rest of the pack still reads
    kid, digest, offset, size, time_ns, _check = _ENTRY.unpack(raw)
    if offset < len(_HEADER) or offset + size > limit:
        return None
    return PackEntry(kid.hex(), digest.hex(), offset, size, time_ns, at)


#: Bytes of one index entry (what a warm set's line asks at its ``at``).
ENTRY_SIZE = _ENTRY.size


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
    first = index_offset + _FANOUT.size
    if len(raw) != _ENTRY.size or not first <= at < first + count * _ENTRY.size or (at - first) % _ENTRY.size:
        return None
    return _entry(raw, index_offset, at)


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
        self._fanout = _fanout(index, count, name)
        self._trailer = trailer
        self._index = index
        self._keys, self._entries = _split(index[_FANOUT.size :])

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
        base = self.index_offset + _FANOUT.size
        return _find(self._keys, self._entries, lo, hi, key, limit=self.index_offset, base=base)

    def key_ids(self) -> list[bytes]:
        return self._keys

    def to_bytes(self) -> bytes:
        return struct.pack("<Q", self.size) + self._trailer + self._index

    @classmethod
    def from_bytes(cls, name: str, data: bytes) -> PackIndex:
        """The index :meth:`to_bytes` gave; :class:`PackError` when ``data`` is not one of ``name``."""
        if len(data) < 8 + _TRAILER.size:
            raise PackError(f"{name}: a kept index too short")
        (size,) = struct.unpack_from("<Q", data)
        return cls(name, size, data[8 : 8 + _TRAILER.size], data[8 + _TRAILER.size :])


class PackReader:
    """One pack. Lookups ``pread``; nothing here raises for a damaged file (``PackError`` at open).

    Its descriptor comes from a process-wide pool (:data:`MAX_OPEN_PACKS`); one that
    was closed to stay under the bound is opened again when needed, and must be the
    same file (device, inode, size), else the pack is gone (``FileNotFoundError``).
    A pack retired by ``repack`` meanwhile is found in ``packs/retired/``.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self._pins = 0
        self._closed = False
        fd = os.open(path, READ_FLAGS)
        try:
            st = os.fstat(fd)
            size = st.st_size
            if size < len(_HEADER) + _FANOUT.size + _TRAILER.size:
                raise PackError(f"{path}: too short to be a pack ({size} bytes)")
            if os.pread(fd, len(_HEADER), 0) != _HEADER:
                raise PackError(f"{path}: not a pack of version {VERSION}")
            checksum, index_offset, count = parse_trailer(os.pread(fd, _TRAILER.size, size - _TRAILER.size), size, path)
            index_len = _FANOUT.size + count * _ENTRY.size
            want = index_len if index_len <= SMALL_INDEX else _FANOUT.size
            head = os.pread(fd, want, index_offset)
            if len(head) != want:
                raise PackError(f"{path}: truncated while being read")
            fanout = _fanout(head, count, path)
        except BaseException:
            os.close(fd)
            raise
        self.size = size
        self._identity = (st.st_dev, st.st_ino, size)
        #: When the pack was written (its file's mtime).
        self.mtime = st.st_mtime
        self.count = count
        self.checksum = checksum
        self._index_offset = index_offset
        self._fanout = fanout
        #: A small pack's whole index, read at open: its sorted key ids and raw entries.
        self._whole = _split(head[_FANOUT.size :]) if len(head) == index_len else None
        #: A large pack's slices read so far: first byte -> key ids and raw entries (a pack never changes).
        self._buckets: dict[int, tuple[list[bytes], list[bytes]]] = {}
        self._lock = threading.Lock()
        self._fd = fd
        _POOL.add(self)
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # see cuda_program_cas._base.fork; the descriptor pool resets its own

    def _reopen(self) -> int:
        """A descriptor of this very pack again: at its path, or in ``retired/`` if repack moved it."""
        head, name = os.path.split(self.path)
        for candidate in (self.path, os.path.join(head, RETIRED, name)):
            try:
                fd = os.open(candidate, READ_FLAGS)
            except FileNotFoundError:
                continue
            try:
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
            if (st.st_dev, st.st_ino, st.st_size) == self._identity:
                return fd
            os.close(fd)
        raise FileNotFoundError(errno.ENOENT, "the pack is gone", self.path)

    def close(self) -> None:
        _POOL.close(self)

    def loaded_keys(self) -> list[bytes] | None:
        """Every key id of a small pack (its index was read whole at open); None for a large one."""
        return None if self._whole is None else self._whole[0]

    def _pread(self, size: int, offset: int) -> bytes:
        fd = _POOL.pin(self)
        try:
            return os.pread(fd, size, offset)
        finally:
            _POOL.unpin(self)

    def _span(self, first: int) -> tuple[int, int]:
        """The entries whose key id starts with byte ``first``: ``[lo, hi)``."""
        return (self._fanout[first - 1] if first else 0), self._fanout[first]

    def _bucket(self, first: int) -> tuple[list[bytes], list[bytes], int, int]:
        """Key ids and raw entries holding those that start with byte ``first``, and their ``[lo, hi)`` there."""
        lo, hi = self._span(first)
        if self._whole is not None:
            return self._whole[0], self._whole[1], lo, hi
        bucket = self._buckets.get(first)
        if bucket is None:
            start = self._index_offset + _FANOUT.size + lo * _ENTRY.size
            bucket = _split(self._pread((hi - lo) * _ENTRY.size, start) if hi > lo else b"")
            with self._lock:
                self._buckets[first] = bucket
        return bucket[0], bucket[1], 0, len(bucket[0])

    def find(self, kid: str) -> PackEntry | None:
        """The entry of ``kid``, or None when the pack has none (or its entry is damaged)."""
        return self.find_key(bytes.fromhex(kid))

    def find_key(self, key: bytes) -> PackEntry | None:
        """:meth:`find` for a key id given as its 32 raw bytes."""
        keys, entries, lo, hi = self._bucket(key[0])
        return _find(keys, entries, lo, hi, key, limit=self._index_offset, base=self._base(key[0]))

    def _base(self, first: int) -> int:
        """Where the first raw entry :meth:`_bucket` gives for ``first`` lies in the pack."""
        start = self._index_offset + _FANOUT.size
        return start if self._whole is not None else start + self._span(first)[0] * _ENTRY.size

    def read(self, entry: PackEntry) -> bytes | None:
        """The verified bytes of ``entry``'s blob, or None when they are short or do not hash to its digest.

        An entry over :data:`STREAM_ABOVE` is hashed in chunks first and read whole only
        if it verifies (then hashed again: the file may change between the reads), so
        a pack that lies about an entry costs a node a chunk of memory, not the entry.
        """
        if entry.size > STREAM_ABOVE:
            at = entry.offset

            def read(n: int) -> bytes:
                nonlocal at
                chunk = self._pread(n, at)
                at += len(chunk)
                return chunk

            if not hashes_to(read, entry.digest, entry.size):
                return None
        data = self._pread(entry.size, entry.offset)
        if len(data) != entry.size or blake3(data).hexdigest() != entry.digest:
            return None
        return data

    def entries(self) -> Iterator[PackEntry]:
        """Every entry, in key order (damaged ones skipped)."""
        for first in range(256):
            _keys, raws, lo, hi = self._bucket(first)
            base = self._base(first)
            for i in range(lo, hi):
                raw = raws[i]
                if _entry_check(raw[:_BODY]) == raw[_BODY:]:
                    kid, digest, offset, size, time_ns, _check = _ENTRY.unpack(raw)
                    yield PackEntry(kid.hex(), digest.hex(), offset, size, time_ns, base + i * _ENTRY.size)

    def index_ok(self) -> bool:
        """True when the whole index matches the trailer's checksum (reads the whole index)."""
        raw = self._pread(_FANOUT.size + self.count * _ENTRY.size, self._index_offset)
        return bool(blake3(raw).digest() == self.checksum)
