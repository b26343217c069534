"""Packs: immutable files that hold many entries of a shared store, opened once per process.

A loose shared store costs every node two opens per first hit and the store an
inode per blob and per manifest. A pack holds one publish generation: every blob
once, then a sorted index from key id to blob, then a trailer. Nodes open each
pack once, read the 1 KiB fan-out table once, and answer a lookup with one
``pread`` of the index slice for the key's first byte and one ``pread`` of the
blob, which is verified by its blake3 digest before its bytes are returned, as
a loose blob is. Nothing is memory-mapped: a pack truncated or replaced under a
reader makes short reads (misses), never a SIGBUS.

File format, version 2 (integers little-endian)::

    header     8 bytes   b"cpcaspk" + version byte (2)
    blobs      the blobs as the store holds them, each distinct blob once, back to back:
               zstd-framed (:mod:`cuda_program_cas._base.frame`) by the writer, or raw
               where framing would not make it smaller
    index      fan-out: 256 x u32, the number of entries whose key id's first
               byte is <= i (so entries of byte b are [fanout[b-1], fanout[b]))
               entries: count x 96 bytes, sorted by key id, each
                   key id (32 raw bytes) | digest (32: blake3 of the RAW bytes) |
                   offset u64 | size u64 (of the stored, framed or raw, object) |
                   time u64 (ns: when the entry was published; kept by repack,
                   for gc --max-age) | check (the first 8 bytes of blake3 of
                   the 88 bytes before it)
    trailer    56 bytes: blake3 of the whole index (32) | index offset u64 |
               count u32 | version u32 | b"cpcasidx"

An entry's object says whether it is framed (its header) and its raw size: a reader
bounds that by its own limit before it decompresses (:class:`.frame.Inflow`), checks the
digest after. Version 1 (every blob raw) reads as version 2 of raw entries; the bump makes
a reader that knows no frames refuse the pack at open, not count each entry as damage.

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

from cuda_program_cas._base.config import env_max_entry_size
from cuda_program_cas._base.engine import StoreFailure
from cuda_program_cas._base.errors import CacheError
from cuda_program_cas._base.fork import after_fork, after_fork_call
from cuda_program_cas._base.frame import HEADER_SIZE, Inflow, encode, stated_size, verified

from .files import HASH_CHUNK, READ_FLAGS
from .layout import Layout

__all__ = [
    "ENTRY_SIZE",
    "FANOUT_SIZE",
    "PACK_SUFFIX",
    "RETIRED",
    "STREAM_ABOVE",
    "TRAILER_SIZE",
    "TRANSIENT",
    "PackEntry",
    "PackError",
    "PackInput",
    "PackReader",
    "Stored",
    "entry_from",
    "find_entry",
    "index_length",
    "open_packs",
    "pack_chunks",
    "pack_name",
    "parse_trailer",
    "read_fanout",
    "split_entries",
    "write_pack",
]

_log = logging.getLogger("cuda_program_cas")

VERSION = 2
#: The versions read: 1 held every blob raw, which version 2 reads as it reads a raw entry.
_READ_VERSIONS = (1, VERSION)
_HEADER = b"cpcaspk" + bytes([VERSION])
_HEADERS = tuple(b"cpcaspk" + bytes([v]) for v in _READ_VERSIONS)
_TRAILER_MAGIC = b"cpcasidx"
_TRAILER = struct.Struct("<32sQII8s")
_ENTRY = struct.Struct("<32s32sQQQ8s")
_BODY = _ENTRY.size - 8
_FANOUT = struct.Struct("<256I")
#: A pack index's fan-out table: its first bytes.
FANOUT_SIZE = _FANOUT.size
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
    #: Where its index entry lies in the pack (a warm set's line names it, :func:`.packindex.entry_at` checks it);
    #: -1: unknown.
    at: int = -1


def _entry_check(body: bytes) -> bytes:
    return blake3(body).digest()[:8]


def pack_name() -> str:
    """A new pack's file name: time-ordered (newest sorts last), never reused."""
    return f"pack-{time.time_ns():016x}-{secrets.token_hex(4)}{PACK_SUFFIX}"


#: Where a repack moves the packs it replaced, under ``packs/`` (they wait out the shared grace period).
RETIRED = "retired"
# -- writing --------------------------------------------------------------------------------


class Stored(bytes):
    """A blob's bytes as a pack holds them (framed, or raw by the writer's choice), verified, and their raw size:
    a repack's copy of a pack entry, put into the new pack as it is, not decompressed and compressed again."""

    raw_size: int

    def __new__(cls, data: bytes | memoryview, raw_size: int) -> Stored:
        out = super().__new__(cls, data)
        out.raw_size = raw_size
        return out


#: What a pack is written from: key id, digest, the verified RAW bytes (or their :class:`Stored` form, or a
#: callable giving either, or None when they can no longer be had: the entry is left out), time (ns).
PackInput = tuple[str, str, "bytes | Callable[[], bytes | None]", int]


def pack_chunks(entries: Iterable[PackInput], stats: dict[str, int] | None = None) -> Iterator[bytes]:
    """The bytes of a pack holding ``entries``, produced as they are read.

    Each distinct blob is stored as :func:`cuda_program_cas._base.frame.encode` makes it
    (compressed once, here, by the writer), a :class:`Stored` one as it is. A key id met
    twice keeps its first entry; a digest met twice is stored once (and, given as a
    callable, read once; a callable that gives None leaves its entry out). ``stats``,
    when given, receives ``entries``, ``blobs``, ``bytes`` (stored) and ``raw_bytes``.
    """
    yield _HEADER
    offset = len(_HEADER)
    raw_bytes = 0
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
            if isinstance(blob, Stored):
                raw_bytes += blob.raw_size
            else:
                raw_bytes += len(blob)
                blob = encode(blob)
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
        stats.update(entries=len(body), blobs=len(placed), bytes=offset - len(_HEADER), raw_bytes=raw_bytes)
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


def split_entries(raw: bytes) -> tuple[list[bytes], list[bytes]]:
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
    if magic != _TRAILER_MAGIC or version not in _READ_VERSIONS:
        raise PackError(f"{name}: bad trailer")
    if index_offset < len(_HEADER) or index_offset + _FANOUT.size + count * _ENTRY.size + _TRAILER.size != size:
        raise PackError(f"{name}: the trailer does not match the file's size")
    return checksum, index_offset, count


def index_length(count: int) -> int:
    """Bytes of the index of a pack of ``count`` entries: the fan-out table and the entries."""
    return _FANOUT.size + count * _ENTRY.size


def read_fanout(head: bytes, count: int, name: str) -> tuple[int, ...]:
    fanout: tuple[int, ...] = _FANOUT.unpack(head[: _FANOUT.size])
    if list(fanout) != sorted(fanout) or fanout[-1] != count:
        raise PackError(f"{name}: garbled fan-out table")
    return fanout


def find_entry(
    keys: list[bytes], entries: list[bytes], lo: int, hi: int, key: bytes, *, limit: int, base: int
) -> PackEntry | None:
    """The entry of ``key`` among ``keys[lo:hi]`` (sorted), or None; ``limit``: where the blobs end;
    ``base``: where ``entries[0]`` lies in the pack."""
    i = bisect.bisect_left(keys, key, lo, hi)
    if i == hi or keys[i] != key:
        return None
    return entry_from(entries[i], limit, base + i * _ENTRY.size)


def entry_from(raw: bytes, limit: int, at: int) -> PackEntry | None:
    """The index entry ``raw`` (found at ``at``), or None when it is damaged or names bytes past ``limit``."""
    if _entry_check(raw[:_BODY]) != raw[_BODY:]:
        return None  # a damaged entry: a miss; the rest of the pack still reads
    kid, digest, offset, size, time_ns, _check = _ENTRY.unpack(raw)
    if offset < len(_HEADER) or offset + size > limit:
        return None
    return PackEntry(kid.hex(), digest.hex(), offset, size, time_ns, at)


#: Bytes of one index entry (what a warm set's line asks at its ``at``).
ENTRY_SIZE = _ENTRY.size


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
            if os.pread(fd, len(_HEADER), 0) not in _HEADERS:
                raise PackError(f"{path}: not a pack of version {' or '.join(map(str, _READ_VERSIONS))}")
            checksum, index_offset, count = parse_trailer(os.pread(fd, _TRAILER.size, size - _TRAILER.size), size, path)
            index_len = _FANOUT.size + count * _ENTRY.size
            want = index_len if index_len <= SMALL_INDEX else _FANOUT.size
            head = os.pread(fd, want, index_offset)
            if len(head) != want:
                raise PackError(f"{path}: truncated while being read")
            fanout = read_fanout(head, count, path)
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
        self._whole = split_entries(head[_FANOUT.size :]) if len(head) == index_len else None
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
            bucket = split_entries(self._pread((hi - lo) * _ENTRY.size, start) if hi > lo else b"")
            with self._lock:
                self._buckets[first] = bucket
        return bucket[0], bucket[1], 0, len(bucket[0])

    def find(self, kid: str) -> PackEntry | None:
        """The entry of ``kid``, or None when the pack has none (or its entry is damaged)."""
        return self.find_key(bytes.fromhex(kid))

    def find_key(self, key: bytes) -> PackEntry | None:
        """:meth:`find` for a key id given as its 32 raw bytes."""
        keys, entries, lo, hi = self._bucket(key[0])
        return find_entry(keys, entries, lo, hi, key, limit=self._index_offset, base=self._base(key[0]))

    def _base(self, first: int) -> int:
        """Where the first raw entry :meth:`_bucket` gives for ``first`` lies in the pack."""
        start = self._index_offset + _FANOUT.size
        return start if self._whole is not None else start + self._span(first)[0] * _ENTRY.size

    def read(self, entry: PackEntry, limit: int | None = None) -> bytes:
        """The verified raw bytes of ``entry``'s blob (stored framed or raw), at most ``limit`` of them.

        ``limit``: the largest entry the caller reads (default: the ceiling,
        ``CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE``). A :class:`PackError` naming the pack, the
        key and what is wrong for bytes cut short, a frame refused (a bomb, one cut
        short, a wrong stated size: :mod:`cuda_program_cas._base.frame`) or raw bytes
        that do not hash to the entry's digest: the rest of the pack still reads.
        An entry over :data:`STREAM_ABOVE`, stored or stated raw, is decoded and hashed in
        chunks first, and held whole only if it verifies (then decoded and hashed again:
        the file may change between the reads), so a pack that lies about an entry costs
        a node a chunk of memory, not the entry.
        """
        return self._read(entry, limit, keep_stored=False)

    def read_stored(self, entry: PackEntry, limit: int | None = None) -> Stored:
        """:meth:`read`, verified the same way, but the bytes as the pack holds them (a repack copies them)."""
        got = self._read(entry, limit, keep_stored=True)
        assert isinstance(got, Stored)
        return got

    def raw_size(self, entry: PackEntry) -> int:
        """The raw size ``entry``'s object states (its frame's header; a raw one's own size); unverified."""
        size = stated_size(self._pread(min(HEADER_SIZE, entry.size), entry.offset))
        return entry.size if size is None else size

    def _read(self, entry: PackEntry, limit: int | None, *, keep_stored: bool) -> bytes:
        limit = env_max_entry_size() if limit is None else limit
        where = f"{self.path}: the blob of {entry.key_id}"
        try:
            if entry.size > STREAM_ABOVE:
                self._hash_chunks(where, entry, limit)
            data = self._pread(entry.size, entry.offset)
            if len(data) != entry.size:
                raise PackError(f"{where}: {len(data):,} of its {entry.size:,} bytes (the pack is cut short)")
            if entry.size <= STREAM_ABOVE and (stated_size(data) or 0) > STREAM_ABOVE:
                self._hash_chunks(where, entry, limit, data)  # small stored, large stated: hashed before held whole
            raw = verified(where, data, entry.digest, limit)
        except StoreFailure as exc:
            raise PackError(f"{where}: {exc.detail}") from None
        return Stored(data, len(raw)) if keep_stored else bytes(raw)  # (bytes of bytes is no copy)

    def _hash_chunks(self, where: str, entry: PackEntry, limit: int, held: bytes | None = None) -> None:
        """Decode ``entry``'s object (``held``, else read in chunks) hashing what comes out; PackError unless its
        digest: the raw bytes pass a chunk at a time (zstd's, at most 128 KiB), never whole."""
        digest = blake3()
        inflow = Inflow(where, limit, digest.update).take(held or b"")
        at, end = entry.offset, entry.offset + entry.size
        while held is None and at < end:
            chunk = self._pread(min(HASH_CHUNK, end - at), at)
            if not chunk:
                raise PackError(f"{where}: {at - entry.offset:,} of its {entry.size:,} bytes (the pack is cut short)")
            inflow.take(chunk)
            at += len(chunk)
        inflow.finish()
        if digest.hexdigest() != entry.digest:
            raise PackError(f"{where}: its bytes do not hash to its digest {entry.digest}")

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
