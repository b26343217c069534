"""The packs of one store: their names, its listing ``packs/list``, and the set a process has open.

A directory store's packs are the files ``packs/pack-*.cpk`` (:mod:`cuda_program_cas._disk.pack`
is their format, their writer and their reader); a store read over HTTP cannot list a
directory, so whoever adds, retires or moves aside a pack rewrites ``packs/list``
(:meth:`.packpublish.StorePacks.finish`). :class:`PackSet` is what one process has open of one store's packs.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable

from cuda_program_cas._base.fork import after_fork

from .pack import PACK_SUFFIX, PackError, PackReader
from .packfile import TRANSIENT

__all__ = [
    "LISTING",
    "MAX_LISTING_BYTES",
    "RELIST_S",
    "PackSet",
    "encode_listing",
    "is_pack_name",
    "list_packs",
    "parse_listing",
]

_log = logging.getLogger("cuda_program_cas")

#: How long a process trusts its listing of ``packs/`` before listing again.
RELIST_S = 2.0

#: ``packs/list``: the pack names of a store, for readers that cannot list a directory (HTTP).
LISTING = "list"
#: The largest ``packs/list`` a reader fetches: 4 MiB, about 140,000 pack names.
MAX_LISTING_BYTES = 4 << 20
_LISTING_HEAD = b"cpcas-packs 1\n"
_NAME_RE = re.compile(r"pack-[0-9a-f]{16}-[0-9a-f]{8}\.cpk")


def is_pack_name(name: str) -> bool:
    """True when ``name`` is a pack's file name (``pack-<16 hex>-<8 hex>.cpk``): safe to build a path or URL from."""
    return _NAME_RE.fullmatch(name) is not None


def encode_listing(names: Iterable[str]) -> bytes:
    """``packs/list``'s bytes: a header line, one pack name per line newest first, and ``end N``.

    The last line makes a listing cut short (a truncated download) a bad one, not a shorter one.
    """
    ordered = sorted(set(names), reverse=True)
    return _LISTING_HEAD + b"".join(n.encode() + b"\n" for n in ordered) + b"end %d\n" % len(ordered)


def parse_listing(data: bytes | bytearray) -> list[str] | None:
    """The pack names of a ``packs/list``, newest first; None when ``data`` is not a whole listing."""
    if not data.startswith(_LISTING_HEAD) or not data.endswith(b"\n"):
        return None
    lines = data[len(_LISTING_HEAD) : -1].decode("ascii", "replace").split("\n")
    last = lines.pop()
    names = [n for n in lines if _NAME_RE.fullmatch(n)]
    if last != f"end {len(lines)}" or len(names) != len(lines):
        return None
    return sorted(set(names), reverse=True)


def list_packs(packs_dir: str) -> list[str]:
    """The pack files of a store, newest first."""
    try:
        names = [n for n in os.listdir(packs_dir) if n.startswith("pack-") and n.endswith(PACK_SUFFIX)]
    except OSError:
        return []
    return [os.path.join(packs_dir, n) for n in sorted(names, reverse=True)]


class PackSet:
    """The packs of one store as one process sees them: the directory re-listed every few s.

    Every key of a small pack (index read whole at open) is in one map to the packs holding it; the few large
    packs (a repack's) are searched each: a hit costs the same with 1 or 1,100 packs. Packs that leave the
    listing are closed; their entries are in the pack that replaced them.
    """

    def __init__(
        self,
        root: str,
        on_damage: Callable[[str, str], None] | None = None,
        *,
        max_entry: Callable[[], int] | None = None,
    ) -> None:
        self.packs_dir = os.path.join(root, "packs")
        self._on_damage = on_damage
        #: The largest entry read (the ceiling, for a store the cache does not own): an entry that claims more is
        #: damaged, and not one byte of it is read (a sparse file may claim terabytes that a pread would allocate).
        self._max_entry = max_entry
        self._open: dict[str, PackReader] = {}
        self._bad: set[str] = set()
        self._paths: list[str] = []
        #: Key id (raw) -> the small packs holding it; the large packs; each pack's place, newest first.
        self._where: dict[bytes, list[PackReader]] = {}
        self._large: list[PackReader] = []
        self._rank: dict[PackReader, int] = {}
        self._listed_at = float("-inf")
        self._lock = threading.Lock()
        self._map_lock = threading.Lock()
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        # See cuda_program_cas._base.fork. A thread of the parent may have been half way through an update of
        # the map: the child lists packs/ again and rebuilds it at its first lookup.
        self._lock = threading.Lock()
        self._map_lock = threading.Lock()
        self._open = {}
        self._paths = []
        self._where = {}
        self._large = []
        self._rank = {}
        self._listed_at = float("-inf")

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._listed_at < RELIST_S:
            return
        with self._lock:
            if now - self._listed_at < RELIST_S:
                return
            paths = list_packs(self.packs_dir)
            if paths != self._paths or len(self._open) != len(paths):
                self._update(paths)
            self._listed_at = now

    def _update(self, paths: list[str]) -> None:
        added = []
        for path in paths:
            if path in self._open or path in self._bad:
                continue
            try:
                self._open[path] = reader = PackReader(path)
            except FileNotFoundError:
                continue  # retired between the listing and the open: its entries are elsewhere
            except OSError as exc:
                if exc.errno not in TRANSIENT:  # out of descriptors: tried again at the next listing
                    self._bad.add(path)
                _log.debug("cuda-program-cas: pack %s cannot be opened: %s", path, exc)
                continue
            except PackError as exc:
                self._bad.add(path)
                _log.debug("cuda-program-cas: unusable pack %s: %s", path, exc)
                continue
            added.append(reader)
        listed = set(paths)
        gone = [self._open.pop(p) for p in list(self._open) if p not in listed]
        with self._map_lock:
            for reader in added:
                keys = reader.loaded_keys()
                if keys is None:
                    self._large.append(reader)
                for key in keys or ():
                    self._where.setdefault(key, []).append(reader)
            for reader in gone:
                keys = reader.loaded_keys()
                if keys is None:
                    self._large.remove(reader)
                for key in keys or ():
                    holders = self._where.get(key)
                    if holders is not None:  # a damaged index may name a key twice
                        holders[:] = [r for r in holders if r is not reader]
                        if not holders:
                            del self._where[key]
            self._rank = {self._open[p]: n for n, p in enumerate(paths) if p in self._open}
            self._large.sort(key=self._rank.__getitem__)
            self._paths = paths
        for reader in gone:
            reader.close()  # a thread reading it still may: the pool closes it after

    def _candidates(self, key: bytes) -> list[PackReader]:
        """The packs that may hold ``key``, newest first."""
        with self._map_lock:
            out = [*self._where.get(key, ()), *self._large]
            rank = self._rank
        return sorted(out, key=rank.__getitem__) if len(out) > 1 else out

    def lookup(self, kid: str) -> tuple[bytes, str] | None:
        """``(bytes, digest)`` from the newest pack that has a good copy; None when none has.

        A damaged or unreadable copy is reported to ``on_damage(path, why)`` (one line) and the next pack asked;
        a pack gone (removed, not retired) makes the next lookup list the directory again.
        """
        self._refresh()
        key = bytes.fromhex(kid)
        for pack in self._candidates(key):
            try:
                entry = pack.find_key(key)
                if entry is None:
                    continue
                data = pack.read(entry, None if self._max_entry is None else self._max_entry())
                if data is not None:  # (a file is never None: it raises)
                    return data, entry.digest
                continue
            except FileNotFoundError:
                self._listed_at = float("-inf")
                continue
            except OSError as exc:
                if exc.errno in TRANSIENT:
                    continue  # out of descriptors for a moment: a miss, not a damaged pack
                why = f"{pack.path}: unreadable: {exc.strerror or exc}"
            except PackError as exc:
                why = str(exc)
            if self._on_damage is not None:
                self._on_damage(pack.path, why)
        return None
