"""What a store's packs hold, in one file: ``packs/summary``, so publish need not read every pack.

``publish`` must know every packed entry of the store (a key already packed is
not published again). Reading each pack's index cost a publish 15 ms at 1 pack
and 0.65-1.06 s at 1,100 (one per CI run for three years). The summary lists the
packs it covers and their entries; a publisher reads it (one file), lists
``packs/`` (one directory read) and reads only the packs the summary does not
cover. Entries of packs no longer listed (retired, moved aside) are dropped.

It is a cache of what the packs say, never the truth: a summary that is missing,
damaged or stale costs reading the packs it lacks, nothing else. ``publish
--pack`` and ``repack`` write a new one after each pack they write (through the
one writer: temp file, rename); two publishers at once may each replace the
other's, and the pack left out is read directly until the next one is written.
Nodes never read it: their listing of ``packs/`` is what they serve.

File format, version 2 (integers little-endian; a version 1 summary is not read, so its packs are)::

    header   b"cpcassum" | version u32 | pack count u32 | entry count u32
    packs    per pack: name length u16 | name (UTF-8), in the listing's order
    entries  per entry: pack number u32 | key id (32) | digest (32) | offset u64 | size u64 | time u64 |
             where its index entry lies in the pack u64 (a warm set's line names it; 0: unknown)
    trailer  blake3 of everything before (32)
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from blake3 import blake3

from .files import READ_FLAGS
from .pack import PackEntry, PackError, PackReader
from .packset import list_packs

__all__ = ["SUMMARY", "PackSummary", "PackedEntry"]

_log = logging.getLogger("cuda_program_cas")
#: The summary's file name, under ``packs/`` (never listed as a pack: no ``pack-`` prefix).
SUMMARY = "summary"
_MAGIC = b"cpcassum"
_VERSION = 2
_HEAD = struct.Struct("<8sIII")
_NAME = struct.Struct("<H")
_ENTRY = struct.Struct("<I32s32sQQQQ")
#: A summary larger than this is not read (1.8 M entries): a damaged size cannot ask for all memory.
_MAX_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class PackedEntry:
    """A packed entry and the pack (its path) that holds it."""

    pack: str
    entry: PackEntry


class PackSummary:
    """The packed entries of one store: from ``packs/summary`` where it is current, from the packs elsewhere."""

    def __init__(self, root: str) -> None:
        self.packs_dir = os.path.join(root, "packs")
        #: Pack path -> its entries, for every pack listed now (newest first).
        self._by_pack: dict[str, list[PackEntry]] = {}
        #: Packs read directly (the summary did not cover them), and whether the summary was current.
        self.read_directly = 0
        self.current = False
        #: Problems met while reading packs (a pack that cannot be opened), one line each.
        self.problems: list[str] = []

    @classmethod
    def load(cls, root: str) -> PackSummary:
        """List ``packs/``, read the summary, and read every listed pack it does not cover."""
        self = cls(root)
        listed = list_packs(self.packs_dir)
        covered = _read_summary(os.path.join(self.packs_dir, SUMMARY))
        cut = len(self.packs_dir) + 1  # a listed path is packs_dir/name
        for path in listed:
            entries = covered.pop(path[cut:], None)
            if entries is None:
                entries = self._read_pack(path)
                self.read_directly += 1
            if entries is not None:
                self._by_pack[path] = entries
        self.current = self.read_directly == 0 and not covered  # nothing left of packs gone since
        return self

    def _read_pack(self, path: str) -> list[PackEntry] | None:
        try:
            reader = PackReader(path)
        except FileNotFoundError:
            return None  # retired between the listing and the open
        except (OSError, PackError) as exc:
            self.problems.append(f"pack {path} cannot be read: {exc}")
            return None
        try:
            return list(reader.entries())
        finally:
            reader.close()

    def add(self, path: str) -> None:
        """Take in a pack just written (the newest)."""
        entries = self._read_pack(path)
        if entries is not None:
            self._by_pack = {path: entries, **self._by_pack}
            self.current = False

    def entries(self) -> dict[str, PackedEntry]:
        """Key id -> its entry in the newest pack that holds it."""
        found: dict[str, PackedEntry] = {}
        for path, entries in self._by_pack.items():
            for entry in entries:
                if entry.key_id not in found:
                    found[entry.key_id] = PackedEntry(path, entry)
        return found

    def save(self, write_file: Callable[[str, Iterable[bytes]], bool]) -> None:
        """Write ``packs/summary`` for the packs held now (``write_file``: the store writer's).

        A summary that cannot be written (a directory in its place, a full disk) is
        logged at DEBUG and left: it only saves the next publisher reading packs.
        """
        if self.current:
            return
        path = os.path.join(self.packs_dir, SUMMARY)
        try:
            self.current = write_file(path, [_encode(self._by_pack)])
        except OSError as exc:
            _log.debug("cuda-program-cas: %s not written: %s", path, exc)


def _encode(by_pack: dict[str, list[PackEntry]]) -> bytes:
    names = [os.path.basename(p).encode() for p in by_pack]
    parts = [_HEAD.pack(_MAGIC, _VERSION, len(names), sum(len(e) for e in by_pack.values()))]
    parts += [_NAME.pack(len(n)) + n for n in names]
    for number, entries in enumerate(by_pack.values()):
        for e in entries:
            kid, digest = bytes.fromhex(e.key_id), bytes.fromhex(e.digest)
            parts.append(_ENTRY.pack(number, kid, digest, e.offset, e.size, e.time_ns, max(e.at, 0)))
    body = b"".join(parts)
    return body + blake3(body).digest()


def _read_summary(path: str) -> dict[str, list[PackEntry]]:
    """Pack name -> entries, from the summary at ``path``; empty when it is missing or damaged."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError:
        return {}
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0) if size <= _MAX_BYTES else b""
    except OSError:
        return {}
    finally:
        os.close(fd)
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
