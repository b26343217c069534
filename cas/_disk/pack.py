"""Packs: immutable files that hold many entries of a shared store, opened once per process.

A loose shared store costs every node two opens per first hit and the store an inode per
blob and per manifest. A pack holds one publish generation. Nodes open each pack once, read
its 1 KiB fan-out table once, and answer a lookup with one ``pread`` of the index slice for
the key's first byte and one of the blob, verified by its digest. Nothing is memory-mapped:
a pack truncated or replaced under a reader makes short reads (misses), never a SIGBUS.

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
digest after. Version 1 (every blob raw; no released version wrote it) is refused at open,
with the command that moves it aside.

The trailer's checksum covers the index (``verify`` and ``repack`` check it); a lookup relies
on each entry's own check (a damaged entry is a miss, the rest of its pack still reads) and
the blob's digest. A pack is written to the store's ``tmp/``, synced, and renamed into
``packs/`` under a new name; it is never rewritten.
"""

from __future__ import annotations

import bisect
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from blake3 import blake3

from cuda_program_cas._base.config import env_max_entry_size
from cuda_program_cas._base.engine import StoreFailure
from cuda_program_cas._base.errors import CacheError
from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._base.frame import HEADER_SIZE, Inflow, encode, room, stated_size, verified

from .files import HASH_CHUNK, READ_FLAGS
from .layout import Layout
from .packfile import RETIRED, PackFile

__all__ = [
    "ENTRY_SIZE",
    "FANOUT_SIZE",
    "PACK_SUFFIX",
    "RETIRED",
    "STREAM_ABOVE",
    "TRAILER_SIZE",
    "PackBlobs",
    "PackEntry",
    "PackError",
    "PackInput",
    "PackReader",
    "RangeSource",
    "Stored",
    "entry_at",
    "index_span",
    "pack_chunks",
    "pack_name",
    "parse_trailer",
    "write_pack",
]

_log = logging.getLogger("cuda_program_cas")

VERSION = 2
_HEADER = b"cpcaspk" + bytes([VERSION])
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
    #: Where its index entry lies in the pack (a warm set's line names it, :func:`entry_at` checks it);
    #: -1: unknown.
    at: int = -1


def _entry_check(body: bytes) -> bytes:
    return blake3(body).digest()[:8]


def pack_name() -> str:
    """A new pack's file name: time-ordered (newest sorts last), never reused."""
    return f"pack-{time.time_ns():016x}-{secrets.token_hex(4)}{PACK_SUFFIX}"


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

    Each distinct blob is stored as :func:`~cuda_program_cas._base.frame.encode` makes it, a :class:`Stored` one
    as it is. A key id met twice keeps its first entry; a digest met twice is stored (and read) once. ``stats``
    receives ``entries``, ``blobs``, ``bytes`` (stored) and ``raw_bytes``.
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
    """Write a pack of ``entries`` into ``lay``'s ``packs/`` through ``write_file(target, chunks)`` (the store
    writer's :meth:`~cuda_program_cas._disk.writer.Writer.write_file`); the pack's path."""
    packs_dir = os.path.join(lay.root, "packs")
    target = os.path.join(packs_dir, pack_name())
    assert callable(write_file)
    if not write_file(target, pack_chunks(entries, stats)):
        raise OSError(f"the pack {target} could not be renamed into place (file busy)")
    return target


# -- reading --------------------------------------------------------------------------------

#: A pack index up to this size is read whole at open (a lookup then needs no descriptor
#: until it reads a blob): about 680 entries, what one publish of a CI run writes.
SMALL_INDEX = 64 * 1024
#: An entry larger than this is verified in chunks (:func:`.files.hashes_to`) before it is held whole.
STREAM_ABOVE = HASH_CHUNK
#: Failures of :mod:`.frame` (of a blob's bytes, not of the store): a damaged entry.
_REFUSED = frozenset(("damaged", "too large"))


class RangeSource:
    """A pack's bytes through ``get_range(offset, length, sink=None)`` (an engine's :class:`~.engine.Ranged`).

    A source (this, or a :class:`.packfile.PackFile`) gives ``read(offset, length)``: the bytes (fewer where
    the pack ends), or None where it had none (and said why); ``stream(offset, length, sink)``: them into
    ``sink`` in chunks, and how many; ``rereads``: whether a second read costs no more than the first (a file).
    """

    rereads = False

    def __init__(self, get_range: Callable[..., bytes | None]) -> None:
        self._get = get_range

    def read(self, offset: int, length: int) -> bytes | None:
        return self._get(offset, length)

    def stream(self, offset: int, length: int, sink: Callable[[bytes], object]) -> int | None:
        return None if self._get(offset, length, sink=sink) is None else length

    def close(self) -> None:
        return


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
    if magic == _TRAILER_MAGIC and 0 < version < VERSION:
        raise PackError(
            f"{name}: a pack of format {version}, which no released version wrote, is not read: move it aside with "
            "`cuda-program-cas verify --repair STORE` where the store's files are, then publish again"
        )
    if magic != _TRAILER_MAGIC or version != VERSION:
        raise PackError(f"{name}: bad trailer")
    if index_offset < len(_HEADER) or index_offset + _FANOUT.size + count * _ENTRY.size + _TRAILER.size != size:
        raise PackError(f"{name}: the trailer does not match the file's size")
    return checksum, index_offset, count


def index_length(count: int) -> int:
    """Bytes of the index of a pack of ``count`` entries: the fan-out table and the entries."""
    return _FANOUT.size + count * _ENTRY.size


def index_span(size: int, trailer: bytes, name: str, *, max_index: int | None = None) -> tuple[int, int]:
    """Where the index of a pack of ``size`` bytes with this trailer lies: ``(offset, length)``.

    ``size`` is what the store says the file's size is: the trailer must fit it
    exactly. With ``max_index``, an index longer than that is a :class:`PackError`
    too, before a byte of it is fetched (a trailer may claim 2**32 - 1 entries: a 412 GB index).
    """
    _checksum, index_offset, count = parse_trailer(trailer, size, name)
    length = index_length(count)
    if max_index is not None and length > max_index:
        raise PackError(f"{name}: its trailer claims {count} entries, a {length}-byte index (at most {max_index})")
    return index_offset, length


def entry_from(raw: bytes, limit: int, at: int) -> PackEntry | None:
    """The index entry ``raw`` (found at ``at``), or None when it is damaged or names bytes past ``limit``."""
    if _entry_check(raw[:_BODY]) != raw[_BODY:]:
        return None  # a damaged entry: a miss; the rest of the pack still reads
    kid, digest, offset, size, time_ns, _check = _ENTRY.unpack(raw)
    if offset < len(_HEADER) or offset + size > limit:
        return None
    return PackEntry(kid.hex(), digest.hex(), offset, size, time_ns, at)


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
    return entry_from(raw, index_offset, at)


#: Bytes of one index entry (what a warm set's line asks at its ``at``).
ENTRY_SIZE = _ENTRY.size


class PackBlobs:
    """The blobs of the pack ``path`` read verified through ``source``, their entries known (:class:`PackReader` has
    its index; a publisher checking a packed blob has the entry from a summary)."""

    def __init__(self, path: str, source: PackFile | RangeSource) -> None:
        self.path = path
        self._source = source

    def close(self) -> None:
        self._source.close()

    def _bytes(self, size: int, offset: int) -> bytes:
        return self._source.read(offset, size) or b""  # cut short: the entries it lacks are misses

    def raw_size(self, entry: PackEntry) -> int:
        """The raw size ``entry``'s object states (its frame's header; a raw one's own size); unverified."""
        size = stated_size(self._bytes(min(HEADER_SIZE, entry.size), entry.offset))
        return entry.size if size is None else size

    def read(
        self,
        entry: PackEntry,
        limit: int | None = None,
        *,
        fits: Callable[[int], bool] | None = None,
        staging: str | None = None,
        keep_stored: bool = False,
    ) -> bytes | None:
        """The verified raw bytes of ``entry``'s blob, at most ``limit`` (default ``CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE``).

        A :class:`PackError` naming the pack and key for bytes cut short, a frame refused or the wrong bytes: the
        rest of the pack still reads. None where the source had no bytes (it said why), or ``fits`` refused the
        raw size the object states (judged from its header).

        An entry over :data:`STREAM_ABOVE`, stored or stated raw, is decoded and hashed as it is read. From a file
        it is then read whole and verified again (the file may change between the reads), so a lying pack costs
        a chunk of memory, not the entry; from ranges it is read once (:func:`.intake.verified_intake`, past a
        MiB in ``staging``). ``keep_stored``: the bytes as the pack holds them (:class:`Stored`: a repack's copy).
        """
        limit = env_max_entry_size() if limit is None else limit
        where = f"{self.path}: the blob of {entry.key_id}"
        large = entry.size > STREAM_ABOVE
        if entry.size > room(limit):  # framed, an entry may take more than its raw bytes, never more than their room
            if fits is None:
                raise PackError(f"{where}: it claims {entry.size:,} bytes, over {limit:,}")
            if not fits(entry.size):
                return None
        try:
            if large and not self._source.rereads and not keep_stored:
                return self._taken(where, entry, limit, fits, staging)
            if large and not self._hashed(where, entry, limit):
                return None
            data = self._source.read(entry.offset, entry.size)
            if data is None:
                return None
            if len(data) != entry.size:
                raise PackError(f"{where}: {len(data):,} of its {entry.size:,} bytes (the pack is cut short)")
            stated = stated_size(data)
            if fits is not None and not fits(entry.size if stated is None else stated):
                return None
            if not large and (stated or 0) > STREAM_ABOVE:
                self._hashed(where, entry, limit, data)  # small stored, large stated: hashed before held whole
            raw = verified(where, data, entry.digest, limit)
        except StoreFailure as exc:
            if exc.outage or exc.kind not in _REFUSED:
                raise
            raise PackError(f"{where}: {exc.detail}") from None
        return Stored(data, len(raw)) if keep_stored else bytes(raw)  # (bytes of bytes is no copy)

    def read_stored(self, entry: PackEntry, limit: int | None = None) -> Stored:
        """:meth:`read` with ``keep_stored`` (of a pack file: never None)."""
        got = self.read(entry, limit, keep_stored=True)
        assert isinstance(got, Stored)
        return got

    def _hashed(self, where: str, entry: PackEntry, limit: int, held: bytes | None = None) -> bool:
        """Decode ``entry``'s object (``held``, else read in chunks) hashing what comes out, never holding it: True
        when it is the entry's, False when the source had none, else :class:`PackError`."""
        digest = blake3()
        inflow = Inflow(where, limit, digest.update)
        if held is not None:
            inflow.take(held)
        elif not self._streamed(where, entry, inflow.take):
            return False
        inflow.finish()
        if digest.hexdigest() != entry.digest:
            raise PackError(f"{where}: its bytes do not hash to its digest {entry.digest}")
        return True

    def _taken(
        self, where: str, entry: PackEntry, limit: int, fits: Callable[[int], bool] | None, staging: str | None
    ) -> bytes | None:
        """Read ``entry``'s object once, decoded as it comes, its raw bytes hashed and held (an :class:`.Intake`)."""
        from .intake import verified_intake

        def feed(take: Callable[[bytes], object]) -> bool:
            try:
                return self._streamed(where, entry, take if fits is None else _Judged(entry.size, fits, take).take)
            except _NotFetched:
                return False

        return verified_intake(where, entry.digest, limit, staging, feed)

    def _streamed(self, where: str, entry: PackEntry, sink: Callable[[bytes], object]) -> bool:
        n = self._source.stream(entry.offset, entry.size, sink)
        if n is not None and n != entry.size:
            raise PackError(f"{where}: {n:,} of its {entry.size:,} bytes (the pack is cut short)")
        return n is not None


class PackReader(PackBlobs):
    """One pack: its index, and its blobs read verified, through a source (:class:`RangeSource`); ``PackError`` at
    open for a damaged pack, and from :meth:`read` for a damaged entry. ``PackReader(path)`` opens a pack file
    (header, trailer and index: three ``pread``); :meth:`over` takes a trailer and whole index fetched by ranges.
    """

    #: When the pack was written (its file's mtime; 0 for one read by ranges).
    mtime = 0.0

    def __init__(self, path: str) -> None:
        fd = os.open(path, READ_FLAGS)
        try:
            st = os.fstat(fd)
            size = st.st_size
            trailer = os.pread(fd, _TRAILER.size, max(0, size - _TRAILER.size))
            index_offset, index_len = index_span(size, trailer, path)  # too short, or an older format: told here
            if os.pread(fd, len(_HEADER), 0) != _HEADER:
                raise PackError(f"{path}: not a pack of version {VERSION}")
            want = index_len if index_len <= SMALL_INDEX else _FANOUT.size
            head = os.pread(fd, want, index_offset)
            if len(head) != want:
                raise PackError(f"{path}: truncated while being read")
        except BaseException:
            os.close(fd)
            raise
        self.mtime = st.st_mtime
        self._setup(path, PackFile(path, fd, st), size, trailer, head)

    @classmethod
    def over(cls, path: str, source: PackFile | RangeSource, size: int, trailer: bytes, index: bytes) -> PackReader:
        """The pack ``path`` of ``size`` bytes read through ``source``, from its trailer and whole index, which
        must match the trailer's checksum (:class:`PackError`)."""
        reader = cls.__new__(cls)
        reader._setup(path, source, size, trailer, index)
        if reader._whole is None or blake3(index).digest() != reader.checksum:
            raise PackError(f"{path}: its index does not match its trailer's checksum")
        return reader

    def _setup(self, path: str, source: PackFile | RangeSource, size: int, trailer: bytes, head: bytes) -> None:
        self.checksum, self._index_offset, self.count = parse_trailer(trailer, size, path)
        fanout: tuple[int, ...] = _FANOUT.unpack(head[: _FANOUT.size]) if len(head) >= _FANOUT.size else ()
        if list(fanout) != sorted(fanout) or not fanout or fanout[-1] != self.count:
            raise PackError(f"{path}: garbled fan-out table")
        super().__init__(path, source)
        self.name = os.path.basename(path)
        self.size = size
        self._fanout = fanout
        #: A small pack's whole index, read at open: its sorted key ids and raw entries.
        self._whole = split_entries(head[_FANOUT.size :]) if len(head) == index_length(self.count) else None
        #: A large pack's slices read so far: first byte -> key ids and raw entries (a pack never changes).
        self._buckets: dict[int, tuple[list[bytes], list[bytes]]] = {}
        self._lock = threading.Lock()
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # see cuda_program_cas._base.fork; the descriptor pool resets its own

    @property
    def index_size(self) -> int:
        """Bytes of the pack's index (its fan-out table and entries)."""
        return index_length(self.count)

    def loaded_keys(self) -> list[bytes] | None:
        """Every key id of a pack whose index is held whole (a small one, one read by ranges); None for a large one."""
        return None if self._whole is None else self._whole[0]

    def _bucket(self, first: int) -> tuple[list[bytes], list[bytes], int, int, int]:
        """Key ids and raw entries holding those that start with byte ``first``, their ``[lo, hi)`` there, and
        where the first of those raw entries lies in the pack."""
        lo, hi = (self._fanout[first - 1] if first else 0), self._fanout[first]
        start = self._index_offset + _FANOUT.size
        if self._whole is not None:
            return self._whole[0], self._whole[1], lo, hi, start
        bucket = self._buckets.get(first)
        if bucket is None:
            at = start + lo * _ENTRY.size
            bucket = split_entries(self._bytes((hi - lo) * _ENTRY.size, at) if hi > lo else b"")
            with self._lock:
                self._buckets[first] = bucket
        return bucket[0], bucket[1], 0, len(bucket[0]), start + lo * _ENTRY.size

    def find(self, kid: str) -> PackEntry | None:
        """The entry of ``kid``, or None when the pack has none (or its entry is damaged)."""
        return self.find_key(bytes.fromhex(kid))

    def find_key(self, key: bytes) -> PackEntry | None:
        """:meth:`find` for a key id given as its 32 raw bytes."""
        keys, entries, lo, hi, base = self._bucket(key[0])
        i = bisect.bisect_left(keys, key, lo, hi)
        if i == hi or keys[i] != key:
            return None
        return entry_from(entries[i], self._index_offset, base + i * _ENTRY.size)

    def entries(self) -> Iterator[PackEntry]:
        """Every entry, in key order (damaged ones skipped)."""
        for first in range(256):
            _keys, raws, lo, hi, base = self._bucket(first)
            for i in range(lo, hi):
                entry = entry_from(raws[i], self._index_offset, base + i * _ENTRY.size)
                if entry is not None:
                    yield entry

    def index_ok(self) -> bool:
        """True when the whole index matches the trailer's checksum (reads the whole index)."""
        raw = self._source.read(self._index_offset, index_length(self.count))
        return raw is not None and blake3(raw).digest() == self.checksum


class _NotFetched(Exception):
    """A packed entry's frame states more raw bytes than ``fits`` allows: its read ends there."""


class _Judged:
    """A blob's stored bytes on their way to ``sink``, its raw size judged by ``fits`` first: the index says how
    many bytes are stored, not how many they stand for; a frame's header (its first bytes) does."""

    def __init__(self, stored: int, fits: Callable[[int], bool], sink: Callable[[bytes], object]) -> None:
        self._stored = stored
        self._fits = fits
        self._sink = sink
        self._head: bytes | None = b""  # None once judged

    def take(self, chunk: bytes) -> None:
        if self._head is not None:
            self._head += chunk[: HEADER_SIZE - len(self._head)]
            if len(self._head) >= HEADER_SIZE:
                stated = stated_size(self._head)
                if not self._fits(self._stored if stated is None else stated):
                    raise _NotFetched
                self._head = None
        self._sink(chunk)
