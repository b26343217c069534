"""The packs of a store directory, as a publisher reads them and adds one.

- :meth:`DirPacks.entries`: every packed entry of the store, from ``packs/summary``
  and the packs it does not cover (:mod:`.packsummary`), not from every pack.
- :meth:`DirPacks.ok`: whether a pack's copy of an entry's blob hashes right
  (once per entry per run), so an entry damaged in its pack is published again.
- :meth:`DirPacks.write`: one new pack through the store's writer (its modes; each
  pack fsynced when the run is), added to the summary.
- :meth:`DirPacks.written`: the entries of the packs this run wrote (warm sets' lines are rewritten to them).
- :meth:`DirPacks.finish`: after the last write, ``packs/summary`` for later
  publishers, and ``packs/list`` for readers over HTTP when a pack was written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .direngine import DirEngine
from .layout import Layout
from .pack import PackError, PackInput, PackReader, write_pack
from .packset import save_listing
from .packsummary import PackedEntry, PackSummary
from .writer import Writer

__all__ = ["DirPacks"]


class DirPacks:
    """The packs of the store directory behind ``engine`` (module docstring)."""

    def __init__(self, engine: DirEngine) -> None:
        self._engine = engine
        self._summary = PackSummary.load(engine.root)
        self._ok: dict[tuple[str, int], bool] = {}
        self._readers: dict[str, PackReader | None] = {}
        self._written: dict[str, PackedEntry] = {}

    def _writer(self) -> Writer:
        """The writer of packs and of ``packs/summary``: the store's modes, each file synced when the run is."""
        modes = self._engine.modes
        return self._engine.writer(fsync=modes is not None and modes.fsync)

    def entries(self) -> dict[str, PackedEntry]:
        return self._summary.entries()

    def ok(self, packed: PackedEntry) -> bool:
        """Whether the pack's copy of this entry's blob has the right bytes (hashed once per run)."""
        where = (packed.pack, packed.entry.offset)
        known = self._ok.get(where)
        if known is None:
            if packed.pack not in self._readers:
                try:
                    self._readers[packed.pack] = PackReader(packed.pack)
                except (OSError, PackError):
                    self._readers[packed.pack] = None
            reader = self._readers[packed.pack]
            try:
                known = reader is not None and reader.read(packed.entry) is not None
            except OSError:
                known = False
            self._ok[where] = known
        return known

    def write(self, inputs: Sequence[PackInput], stats: dict[str, int]) -> str | None:
        """Write one new pack of ``inputs``; its path."""
        path = write_pack(Layout(self._engine.root), inputs, self._writer().write_file, stats)
        self._summary.add(path)
        self._written.update({k: e for k, e in self._summary.entries().items() if e.pack == path})
        return path

    def written(self) -> dict[str, PackedEntry]:
        """The entries of the packs this run wrote (from the summary, which read each new pack's index)."""
        return self._written

    def finish(self, wrote: bool) -> None:
        """After the last write: ``packs/summary`` for later publishers, ``packs/list`` for HTTP readers."""
        if not self._summary.current and os.path.isdir(self._summary.packs_dir):
            self._summary.save(self._writer().write_file)  # publishers after this one read one file
        if wrote:
            save_listing(self._engine.root, self._writer().write_file)  # what HTTP readers list

    def close(self) -> None:
        for reader in self._readers.values():
            if reader is not None:
                reader.close()
        self._readers.clear()
