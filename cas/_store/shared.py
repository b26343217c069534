"""The shared-store reader: a read-only cache directory that a whole cluster reads.

Nothing here writes, locks or touches: no ``tmp/``, no mtime, no counters on disk.
A store that is missing, unmounted, not a cache, of a newer layout, slow, stale
(ESTALE) or partially collected is a miss, never an exception: one that cannot
be opened is tried again after :data:`RETRY_S`, and a read error that may mean
the whole store is unreachable (EIO, ETIMEDOUT) re-checks it once, so a dead
server costs one timeout per :data:`RETRY_S`, not one per lookup.

Misconfiguration is loud, once: a store that cannot be used the first time this
process looks at it (missing, not a cache, a newer or damaged layout, permission
denied), or whose files this process is first denied permission to read, gets one
WARNING per process naming the path and the reason. Everything else, and every
later failure of the same path (a store that is slow, stale or away for a while,
retried every :data:`RETRY_S`), is logged at DEBUG, once per kind per instance.
"""

from __future__ import annotations

import errno
import logging
import os
import time

from cuda_program_cas._base.errors import LayoutError
from cuda_program_cas._base.fork import ForkSafeLock
from cuda_program_cas._disk.files import ShardGuard
from cuda_program_cas._disk.layout import Layout, LayoutState, LayoutVersion, check_layout
from cuda_program_cas._disk.pack import PackSet

from .reader import Reader
from .stats import Counters

__all__ = ["RETRY_S", "SharedStore", "warn_once_for"]

_log = logging.getLogger("cuda_program_cas")

#: A shared store that could not be opened is tried again after this long.
RETRY_S = 5.0
#: Read errors of a shared store that may mean the whole store is unreachable.
_OUTAGE_ERRNOS = frozenset(
    e for e in (errno.EIO, errno.ETIMEDOUT, errno.ENOTCONN, getattr(errno, "EHOSTDOWN", None)) if e is not None
)
_DENIED_ERRNOS = frozenset((errno.EACCES, errno.EPERM))

#: Shared stores this process has looked at, and those it has warned about (by path).
_seen: set[str] = set()
_warned: set[str] = set()
_seen_lock = ForkSafeLock()


def _first_look(root: str) -> bool:
    """True the first time this process looks at the store ``root``."""
    with _seen_lock:
        first = root not in _seen
        _seen.add(root)
        return first


def warn_once_for(root: str) -> bool:
    """True the first time this process is to warn about ``root``."""
    with _seen_lock:
        if root in _warned:
            return False
        _warned.add(root)
        return True


class SharedStore:
    """Lookups in one shared store, read-only; problems are logged at DEBUG once per kind.

    The first failure of a path this process meets at its first look gets a WARNING
    instead (see the module docstring).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(path))
        self.counters = Counters()
        self._lay = Layout(self.root)
        self._warned: set[tuple[str, int]] = set()
        self._usable_at = 0.0  # when to try opening again; 0 = usable
        self._why_not = ""  # why it is not usable now
        self._reader = Reader(
            self._lay,
            self.counters,
            ShardGuard(),
            None,
            version=LayoutVersion(self.root),
            note=self._note,
            on_error=self._read_error,
        )
        #: The store's packs (publish --pack), asked before its loose entries: a pack hit costs no lookup of a path.
        self._packs = PackSet(self.root, on_damage=self._pack_damaged)
        self._open(first=_first_look(self.root))

    def lookup(self, kid: str) -> tuple[bytes, str] | None:
        """The verified bytes of ``kid`` here and their digest, or None."""
        if self._usable_at and (time.monotonic() < self._usable_at or not self._open()):
            self._reader.missed(f"store not usable: {self._why_not}")
            return None
        found = self._packs.lookup(kid)
        if found is not None:
            return found
        return self._reader.lookup(kid)

    def _pack_damaged(self, path: str) -> None:
        self.counters.add("corrupt")
        self._note("damaged pack", 0, f"{path}: an entry's blob is damaged or unreadable; it is a miss")

    def miss_reason(self) -> str:
        """Why this thread's last lookup here missed."""
        return self._reader.miss_reason()

    def _open(self, *, first: bool = False) -> bool:
        """Check the store's layout (reading only); False while it is unusable."""
        try:
            state = check_layout(self.root)
        except (OSError, LayoutError) as exc:
            self._unusable(f"{exc}", first)
            return False
        if state is not LayoutState.OK:
            what = "not a cache (no layout.json)" if state is LayoutState.MISSING else "damaged (its layout.json)"
            if state is LayoutState.MISSING and not os.path.isdir(self.root):
                what = "missing"
            self._unusable(what, first)
            return False
        self._usable_at = 0.0
        return True

    def _unusable(self, why: str, first: bool) -> None:
        self._usable_at = time.monotonic() + RETRY_S
        self._why_not = why
        self.counters.add("errors")
        if first and warn_once_for(self.root):
            self._warned.add(("unusable", 0))
            _log.warning(
                "cuda-program-cas: shared store %s is unusable: %s; its lookups are misses (checked again every "
                "%g s; said once per process)",
                self.root,
                why,
                RETRY_S,
            )
            return
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
        if code in _DENIED_ERRNOS and warn_once_for(self.root):
            # Permission denied is misconfiguration, not an outage: say it once, loudly.
            _log.warning(
                "cuda-program-cas: shared store %s cannot be read: %s; such lookups are misses (said once per process)",
                self.root,
                message,
            )
            return
        _log.debug("cuda-program-cas: shared store %s (%s): %s", self.root, what, message)
