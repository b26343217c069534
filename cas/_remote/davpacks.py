"""The packs of a store published over WebDAV: what publish reads of them, and how it adds one.

A store served over HTTP lists its packs in ``packs/list`` (no directory listing
over HTTP); each pack is immutable by name. Publish asks (see
:mod:`cuda_program_cas._verbs.publish`):

- :meth:`DavPacks.entries`: every packed entry, from the listing and each listed
  pack's trailer and index (two Range GETs a pack). A pack's index is bounded by
  the ceiling for any entry (``CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE``) before a byte
  of it is fetched, whatever the trailer and the server say.
- :meth:`DavPacks.written`: the entries of the packs this run wrote, from the
  pack built here (warm sets' lines are rewritten to them).
- :meth:`DavPacks.write`: one new pack, built in a temp file (one blob in memory
  at a time), PUT, read back by its size and its last bytes (one Range GET: the
  trailer a node reads first), then its name added to ``packs/list``, which is
  read again until it shows the name (another publisher may have written the
  listing at the same moment). A server that holds less than it was sent stops
  the run with a ``not stored`` failure naming the file.

The store's copies are not hashed here (that would download every pack):
``verify`` where the store's files are hashes them.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from typing import IO

from cuda_program_cas._base.config import env_max_entry_size
from cuda_program_cas._base.engine import StoreFailure, not_stored
from cuda_program_cas._base.errors import CacheError
from cuda_program_cas._base.urls import join, shown
from cuda_program_cas._disk.pack import TRAILER_SIZE, PackEntry, PackError, PackIndex, PackInput, pack_chunks, pack_name
from cuda_program_cas._disk.packset import LISTING, MAX_LISTING_BYTES, encode_listing, parse_listing
from cuda_program_cas._disk.packsummary import PackedEntry

from .client import HttpFailure
from .dav import fetch, fetch_range, fetch_tail, put
from .http import HttpEngine

__all__ = ["TAIL_BYTES", "DavPacks"]

_log = logging.getLogger("cuda_program_cas")

#: How often one publisher reads ``packs/list`` and writes it again to get its pack listed.
_LISTING_TRIES = 5
#: How many bytes from a pack's end its read-back compares.
TAIL_BYTES = 64


class DavPacks:
    """The packs of the store behind ``engine``, as a publisher reads and adds them (module docstring)."""

    def __init__(self, engine: HttpEngine) -> None:
        self.url = engine.root
        self.where = engine.shown
        self._written: dict[str, PackedEntry] = {}

    def _at(self, relative: str) -> str:
        return join(self.url, relative)

    def entries(self) -> dict[str, PackedEntry]:
        """The store's packed entries (key id -> entry): from the indexes of the packs ``packs/list`` names."""
        packed: dict[str, PackedEntry] = {}
        names, _etag = self._listing()
        for name in reversed(names):  # oldest first: a newer pack's entry of a key replaces an older one's
            index = self._pack_index(name)
            if index is None:
                continue
            for key in index.key_ids():
                entry = index.find_key(key)  # None for a damaged entry: absent
                if entry is not None:
                    packed[entry.key_id] = PackedEntry(name, entry)
        return packed

    def ok(self, packed: PackedEntry) -> bool:
        return True  # its index entry passed its check; the blob is not downloaded to be hashed

    def write(self, inputs: Sequence[PackInput], stats: dict[str, int]) -> str | None:
        """Upload one new pack of ``inputs``, read it back, then list it in ``packs/list``; its URL (None: none)."""
        name = pack_name()
        with tempfile.TemporaryFile(prefix="cpcas-pack-") as f:
            for chunk in pack_chunks(inputs, stats):
                f.write(chunk)
            if not stats.get("entries"):
                return None
            size = f.tell()
            f.flush()
            url = self._at(f"packs/{name}")
            _check_tail(url, f, size, put(url, f, root=self.url))  # before the listing names it
            written = _index_of(name, f, size)
        self._list_pack(name)
        self._written.update({e.key_id: PackedEntry(name, e) for e in written})
        return self._at(f"packs/{name}")

    def written(self) -> dict[str, PackedEntry]:
        """The entries of the packs this run wrote (read from the pack built here: no request)."""
        return self._written

    def finish(self, wrote: bool) -> None:
        return  # the listing was written with the pack; no packs/summary over HTTP (it is a directory's cache)

    def close(self) -> None:
        return

    def _listing(self, sent: tuple[bytes, int] | None = None) -> tuple[list[str], str | None]:
        """The pack names ``packs/list`` holds (none when it is absent), and its ETag.

        ``sent``: the bytes this run just uploaded there and the status the PUT got.
        What is read instead must be a valid listing (another publisher's, written
        since): nothing, or a part, is a server that did not store it.
        """
        url = self._at(f"packs/{LISTING}")
        got = fetch(url, limit=MAX_LISTING_BYTES)
        if sent is not None and (got is None or (got[0] != sent[0] and parse_listing(got[0]) is None)):
            body, status = sent
            held = None if got is None else len(got[0])
            raise _lost(url, status, len(body), held, other=held == len(body))
        if got is None:
            return [], None
        names = parse_listing(got[0])
        if names is None:
            raise CacheError(
                f"the store at {self.where} has a damaged packs/{LISTING}: write it again where the store's files "
                "are (cuda-program-cas repack STORE does)"
            )
        return names, got[1]

    def _pack_index(self, name: str) -> PackIndex | None:
        """The index of the pack ``name``: its trailer, then its index, each one Range GET; None when it is gone."""
        url = self._at(f"packs/{name}")
        tail = fetch_tail(url, TRAILER_SIZE)
        if tail is None:
            return None  # retired since the listing was written: its entries are in a newer pack
        trailer, size = tail
        try:
            # The trailer's count and the size the server gave decide nothing: an index
            # longer than any entry may be is refused before it is fetched.
            offset, length = PackIndex.span(size, trailer, name, max_index=env_max_entry_size())
            raw = fetch_range(url, offset, length)
            return None if raw is None else PackIndex(name, size, trailer, raw)
        except PackError as exc:
            # A pack nodes cannot read either: its entries count as absent, and are published again.
            _log.debug("cuda-program-cas: pack %s of %s is not usable: %s", name, self.where, exc)
            return None

    def _list_pack(self, name: str) -> None:
        """Add ``name`` to ``packs/list``, after the pack itself is stored.

        Read, add, write, read again: another publisher's write of the listing
        at the same moment may have dropped this name, so it is added again
        until a read shows it (a few tries). The write is conditional on the
        ETag read (``If-Match``; ``If-None-Match: *`` where there was none): a
        server that honours it (S3 does) refuses a write over a listing that
        changed meanwhile; nginx ignores it, and the read after catches most such races.
        """
        sent: tuple[bytes, int] | None = None
        for _ in range(_LISTING_TRIES):
            names, etag = self._listing(sent)
            if name in names:
                return
            cond = {"If-None-Match": "*"} if etag is None else {} if etag.startswith("W/") else {"If-Match": etag}
            body = encode_listing([*names, name])
            status = put(self._at(f"packs/{LISTING}"), body, root=self.url, headers=cond)
            sent = None if status == 412 else (body, status)  # 412: refused, another publisher's is newer
        names, _ = self._listing(sent)
        if name not in names:
            raise CacheError(
                f"{self.where}/packs/{LISTING}: other publishers kept replacing it; the pack {name} is stored but "
                "not listed: publish again, or run repack where the store's files are"
            )


def _index_of(name: str, data: IO[bytes], size: int) -> list[PackEntry]:
    """The entries of the pack ``name``, whose ``size`` bytes ``data`` holds (built here: the index uploaded)."""
    data.seek(size - TRAILER_SIZE)
    trailer = data.read(TRAILER_SIZE)
    offset, length = PackIndex.span(size, trailer, name)
    data.seek(offset)
    index = PackIndex(name, size, trailer, data.read(length))
    return [e for e in map(index.find_key, index.key_ids()) if e is not None]


def _lost(url: str, status: int, size: int, held: int | None, *, other: bool = False) -> StoreFailure:
    return not_stored(shown(url), f"{status} to PUT", size, held, hint=HttpEngine.lost_hint, other=other)


def _check_tail(url: str, data: IO[bytes], size: int, status: int) -> None:
    """Raise ``not stored`` unless the file at ``url`` has ``size`` bytes and ends with the last bytes of ``data``."""
    length = min(TAIL_BYTES, size)
    data.seek(size - length)
    tail = data.read(length)
    try:
        got = fetch_tail(url, length)
    except HttpFailure as exc:
        if exc.kind != "HTTP 416":
            raise
        got = (b"", 0)  # no byte to give from its end: an empty file
    if got is None:
        raise _lost(url, status, size, None)
    held, total = got
    if total != size:
        raise _lost(url, status, size, total)
    if held != tail:
        raise _lost(url, status, size, total, other=True)
