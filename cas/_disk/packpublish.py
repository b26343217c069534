"""The packs of a store as a publisher reads and adds them: one class over the engine interface, every engine.

It needs an engine that reads ranges (:class:`~cuda_program_cas._base.engine.Ranged`); what else the
engine's record declares decides the rest. Where the engine lists (a directory), the packs are its
listing of ``packs/``, ``packs/summary`` (:mod:`.packsummary`) stands for those it covers, and
``packs/list`` is written at :meth:`StorePacks.finish`; elsewhere ``packs/list`` is the listing, and a
new pack's name is added to it at once. Each index is read through :class:`.pack.PackReader` (two
ranged reads), bounded by the ceiling for an entry (``CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE``) before a byte
of it is read. A store that holds less than it was sent stops the run with a ``not stored`` failure
naming the object.
"""

from __future__ import annotations

import functools
import io
import logging
import tempfile
from collections.abc import Iterable, Sequence
from typing import IO, Any, cast

from cuda_program_cas._base.config import env_max_entry_size
from cuda_program_cas._base.engine import Engine, Ranged, StoreFailure, creates, listing, not_stored, ranged
from cuda_program_cas._base.errors import CacheError

from .pack import (
    TRAILER_SIZE,
    PackBlobs,
    PackEntry,
    PackError,
    PackInput,
    PackReader,
    RangeSource,
    index_span,
    pack_chunks,
    pack_name,
)
from .packset import LISTING, MAX_LISTING_BYTES, encode_listing, is_pack_name, parse_listing
from .packsummary import MAX_SUMMARY_BYTES, SUMMARY, PackedEntry, encode_summary, parse_summary

__all__ = ["TAIL_BYTES", "StorePacks"]

_log = logging.getLogger("cuda_program_cas")

#: How often one publisher reads ``packs/list`` and writes it again to get its pack listed.
_LISTING_TRIES = 5
#: How many bytes from a pack's end its read-back compares.
TAIL_BYTES = 64


class StorePacks:
    """The packs of the store behind ``engine``, which reads ranges, as a publisher reads and adds them (module
    docstring)."""

    def __init__(self, engine: Engine) -> None:
        reads = ranged(engine)
        if reads is None:
            raise ValueError(f"{engine.shown}: its engine reads no ranges, so it keeps no packs")
        self.engine = engine
        self._reads: Ranged = reads
        self._lists = listing(engine)
        self._written: dict[str, PackedEntry] = {}
        self._ok: dict[tuple[str, int], bool] = {}
        #: Pack name -> its entries, newest first (where the engine lists: what ``packs/summary`` is written from).
        self._by_pack: dict[str, list[PackEntry]] | None = None
        self._summary_current = False

    def _at(self, name: str) -> str:
        return f"{self.engine.shown.rstrip('/')}/{name}"

    def entries(self) -> dict[str, PackedEntry]:
        """The store's packed entries (key id -> the entry in the newest pack that holds it)."""
        names = self._pack_names()
        covered = self._summary() if self._lists is not None else {}
        by_pack: dict[str, list[PackEntry]] = {}
        read = 0
        for name in names:  # newest first
            entries = covered.pop(name, None)
            if entries is None:
                read += 1
                index = self._pack_index(name)
                if index is None:
                    continue  # retired since the listing, or not a pack nodes can read: its entries are absent
                entries = list(index.entries())  # damaged ones skipped
            by_pack[name] = entries
        self._by_pack = by_pack
        self._summary_current = read == 0 and not covered  # nothing left of packs gone since
        packed: dict[str, PackedEntry] = {}
        for name, entries in by_pack.items():
            for entry in entries:
                packed.setdefault(entry.key_id, PackedEntry(name, entry))
        return packed

    def ok(self, packed: PackedEntry) -> bool:
        """Whether the pack's copy of this entry's blob is good: hashed once per run where the store is not remote."""
        if self.engine.can.remote:
            return True  # its index entry passed its check; the blob is not downloaded to be hashed
        where = (packed.pack, packed.entry.offset)
        known = self._ok.get(where)
        if known is None:
            try:
                relative = f"packs/{packed.pack}"
                known = PackBlobs(self._at(relative), self._source(relative)).read(packed.entry) is not None
            except (PackError, StoreFailure):
                known = False  # cut short, or a frame refused (a bomb, a wrong size), or the wrong bytes
            self._ok[where] = known
        return known

    def write(self, inputs: Sequence[PackInput], stats: dict[str, int], *, empty: bool = False) -> str | None:
        """Store one new pack of ``inputs`` (one blob in memory at a time) and list it; where it is (None: nothing).

        Where a put is its own proof (a directory) it is streamed in as it is made and its index read back;
        elsewhere built in a temp file, put, and read back by its size and last bytes (before it is listed).
        ``empty``: a pack of no entries is stored too (a repack that dropped every entry still replaces its packs).
        """
        name = pack_name()
        relative = f"packs/{name}"
        if self.engine.can.puts_proven:
            # Streamed as it is produced (a directory: into the store's tmp/, then renamed), its index read back.
            self.engine.put(relative, cast("IO[bytes]", _Produced(pack_chunks(inputs, stats))))
            index = self._pack_index(name, bound=False) if stats.get("entries") or empty else None
            if index is None:
                self.engine.remove(relative)  # nothing packed, or not readable back: never listed
                if stats.get("entries") or empty:
                    raise StoreFailure(self._at(relative), "damaged", "the pack just written reads back as none")
                return None
            written = list(index.entries())
        else:
            with tempfile.TemporaryFile(prefix="cpcas-pack-") as f:  # its size and tail, for the read-back
                for chunk in pack_chunks(inputs, stats):
                    f.write(chunk)
                if not stats.get("entries") and not empty:
                    return None
                size = f.tell()
                f.flush()
                f.seek(0)
                answer = self.engine.put(relative, f)
                self._check_tail(relative, f, size, answer)  # before anything lists it
                written = _index_of(name, f, size)
        if self._lists is None:
            self._list_pack(name)
        elif self._by_pack is not None:
            self._by_pack = {name: written, **self._by_pack}
            self._summary_current = False
        self._written.update({e.key_id: PackedEntry(name, e) for e in written})
        return self._at(f"packs/{name}")

    def written(self) -> dict[str, PackedEntry]:
        """The entries of the packs this run wrote (read from the pack built here: no request)."""
        return self._written

    def finish(self, wrote: bool) -> None:
        """After the last write, where the engine lists: ``packs/summary``, and ``packs/list`` when a pack was written.

        Neither is more than a cache of the listing: one that cannot be written is said
        at DEBUG and left (the next publisher reads the packs; the next pack change lists).
        """
        if self._lists is None:
            return  # each pack was listed as it was written
        try:
            if self._by_pack is not None and not self._summary_current and (self._by_pack or wrote):
                self.engine.put(f"packs/{SUMMARY}", encode_summary(self._by_pack))
                self._summary_current = True
            if wrote:
                self._save_listing()
        except StoreFailure as exc:
            _log.debug("cuda-program-cas: %s: packs/%s or packs/%s not written: %s", self.where, SUMMARY, LISTING, exc)

    @property
    def where(self) -> str:
        return self.engine.shown

    def close(self) -> None:
        return

    # -- the listing ------------------------------------------------------------------------

    def _pack_names(self) -> list[str]:
        """The store's packs, newest first: the engine's listing of ``packs/`` where it lists, else ``packs/list``."""
        if self._lists is not None:
            return sorted((n for n in self._lists.names("packs") if is_pack_name(n)), reverse=True)
        return self._listing()

    def _summary(self) -> dict[str, list[PackEntry]]:
        try:
            data = self.engine.get(f"packs/{SUMMARY}", limit=MAX_SUMMARY_BYTES)
        except StoreFailure as exc:
            if exc.outage:
                raise
            return {}  # too large, not a file: the packs are read
        return {} if data is None else parse_summary(data)

    def _listing(self, sent: tuple[bytes, str] | None = None) -> list[str]:
        """The pack names ``packs/list`` holds (none when it is absent).

        ``sent``: the bytes this run just put there and the store's answer. What is
        read instead must be a valid listing (another publisher's, written since):
        nothing, or a part, is a store that did not keep it.
        """
        name = f"packs/{LISTING}"
        got = self.engine.get(name, limit=MAX_LISTING_BYTES)
        if sent is not None and (got is None or (got != sent[0] and parse_listing(got) is None)):
            body, answer = sent
            held = None if got is None else len(got)
            hint = self.engine.lost_hint
            raise not_stored(self._at(name), answer, len(body), held, hint=hint, other=held == len(body))
        if got is None:
            return []
        names = parse_listing(got)
        if names is None:
            raise CacheError(
                f"the store at {self.where} has a damaged packs/{LISTING}: write it again where the store's files "
                "are (cuda-program-cas repack STORE does)"
            )
        return names

    def _list_pack(self, name: str) -> None:
        """Add ``name`` to ``packs/list``, after the pack itself is stored: read, add, write, read again, a few
        times (another publisher's write at the same moment may drop it). Where there was none and the engine
        creates conditionally, the first listing is created, not put: the second publisher reads the first's."""
        sent: tuple[bytes, str] | None = None
        maker = creates(self.engine)
        for _ in range(_LISTING_TRIES):
            names = self._listing(sent)
            if name in names:
                return
            body = encode_listing([*names, name])
            if not names and maker is not None:
                sent = (body, "created") if maker.create(f"packs/{LISTING}", body) else None
                continue
            sent = (body, self.engine.put(f"packs/{LISTING}", body))
        names = self._listing(sent)
        if name not in names:
            raise CacheError(
                f"{self.where}/packs/{LISTING}: other publishers kept replacing it; the pack {name} is stored but "
                "not listed: publish again, or run repack where the store's files are"
            )

    def _save_listing(self) -> None:
        """Write ``packs/list`` from the engine's listing of ``packs/`` (what readers over HTTP list).

        Two such writers at once could each list before the other's pack landed: the
        packs are listed again after it is written, and it is written again while they differ.
        """
        for _ in range(_LISTING_TRIES):
            names = self._pack_names()
            self.engine.put(f"packs/{LISTING}", encode_listing(names))
            if self._pack_names() == names:
                return

    # -- one pack ---------------------------------------------------------------------------

    def _source(self, relative: str) -> RangeSource:
        return RangeSource(functools.partial(self._reads.get_range, relative))

    def _pack_index(self, name: str, *, bound: bool = True) -> PackReader | None:
        """The index of the pack ``name``: its trailer, then its index, each one ranged read; None when it is gone.

        ``bound=False``: a pack this run wrote, whose index is not bounded by the ceiling for an entry.
        """
        relative = f"packs/{name}"
        tail = self._reads.get_tail(relative, TRAILER_SIZE)
        if tail is None:
            return None  # retired since the listing was read: its entries are in a newer pack
        trailer, size = tail
        try:
            # The trailer's count and the size the store gives decide nothing: an index
            # longer than any entry may be is refused before it is read.
            offset, length = index_span(size, trailer, name, max_index=env_max_entry_size() if bound else None)
            raw = self._reads.get_range(relative, offset, length)
            return None if raw is None else PackReader.over(name, self._source(relative), size, trailer, raw)
        except (PackError, StoreFailure) as exc:
            if isinstance(exc, StoreFailure) and exc.outage:
                raise
            # A pack nodes cannot read either: its entries count as absent, and are published again.
            _log.debug("cuda-program-cas: pack %s of %s is not usable: %s", name, self.where, exc)
            return None

    def _check_tail(self, relative: str, data: IO[bytes], size: int, answer: str) -> None:
        """Raise ``not stored`` unless ``relative`` has ``size`` bytes and ends with the last bytes of ``data``."""
        length = min(TAIL_BYTES, size)
        data.seek(size - length)
        tail = data.read(length)
        got = self._reads.get_tail(relative, length)
        hint = self.engine.lost_hint
        if got is None:
            raise not_stored(self._at(relative), answer, size, None, hint=hint)
        held, total = got
        if total != size:
            raise not_stored(self._at(relative), answer, size, total, hint=hint)
        if held != tail:
            raise not_stored(self._at(relative), answer, size, total, hint=hint, other=True)


class _Produced(io.RawIOBase):
    """Chunks as they are produced, read as a file from its start (a pack streamed into a directory's writer)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._left = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._left:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._left = memoryview(chunk)
        n = min(len(buffer), len(self._left))
        buffer[:n] = self._left[:n]
        self._left = self._left[n:]
        return n


def _index_of(name: str, data: IO[bytes], size: int) -> list[PackEntry]:
    """The entries of the pack ``name``, whose ``size`` bytes ``data`` holds (built here: the index put)."""

    def get_range(offset: int, length: int) -> bytes:
        data.seek(offset)
        return data.read(length)

    trailer = get_range(size - TRAILER_SIZE, TRAILER_SIZE)
    offset, length = index_span(size, trailer, name)
    return list(PackReader.over(name, RangeSource(get_range), size, trailer, get_range(offset, length)).entries())
