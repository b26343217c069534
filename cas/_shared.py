"""The shared-store reader: a read-only cache directory that a whole cluster reads.

Nothing here writes, locks or touches: no ``tmp/``, no mtime, no counters on disk.
A store that is missing, unmounted, not a cache, of a newer layout, slow, stale
(ESTALE) or partially collected is a miss, never an exception: one that cannot
be opened is tried again after :data:`RETRY_S`, and a read error that may mean
the whole store is unreachable (EIO, ETIMEDOUT) re-checks it once, so a dead
server costs one timeout per :data:`RETRY_S`, not one per lookup.
"""

from __future__ import annotations

import errno
import logging
import os
import time

from ._errors import LayoutError
from ._files import ShardGuard
from ._layout import Layout, LayoutState, check_layout
from ._reader import Reader
from ._stats import Counters

__all__ = ["RETRY_S", "SharedStore"]

_log = logging.getLogger("cas")

#: A shared store that could not be opened is tried again after this long.
RETRY_S = 5.0
#: Read errors of a shared store that may mean the whole store is unreachable.
_OUTAGE_ERRNOS = frozenset(
    e for e in (errno.EIO, errno.ETIMEDOUT, errno.ENOTCONN, getattr(errno, "EHOSTDOWN", None)) if e is not None
)


class SharedStore:
    """Lookups in one shared store, read-only; problems are logged at DEBUG once per kind."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(path))
        self.counters = Counters()
        self._lay = Layout(self.root)
        self._warned: set[tuple[str, int]] = set()
        self._usable_at = 0.0  # when to try opening again; 0 = usable
        self._reader = Reader(self._lay, self.counters, ShardGuard(), None, note=self._note, on_error=self._read_error)
        self._open()

    def lookup(self, kid: str) -> tuple[bytes, str] | None:
        """The verified bytes of ``kid`` here and their digest, or None."""
        if self._usable_at and (time.monotonic() < self._usable_at or not self._open()):
            return None
        return self._reader.lookup(kid)

    def _open(self) -> bool:
        """Check the store's layout (reading only); False while it is unusable."""
        try:
            state = check_layout(self.root)
        except (OSError, LayoutError) as exc:
            self._unusable(f"{exc}")
            return False
        if state is not LayoutState.OK:
            self._unusable(f"shared store {self.root!r} is {state.value}")
            return False
        self._usable_at = 0.0
        return True

    def _unusable(self, why: str) -> None:
        self._usable_at = time.monotonic() + RETRY_S
        self.counters.add("errors")
        self._note("unusable", 0, why)

    def _read_error(self, exc: OSError, path: str) -> None:
        if exc.errno in _OUTAGE_ERRNOS:
            # The server may be gone (a soft mount's EIO comes after its whole
            # timeout): check the layout once; if that fails too, the store is
            # skipped for RETRY_S instead of costing a timeout per lookup.
            self._open()

    def _note(self, what: str, code: int, message: str) -> None:
        if (what, code) in self._warned:
            return
        self._warned.add((what, code))
        _log.debug("cuda-program-cas: shared store %s (%s): %s", self.root, what, message)
