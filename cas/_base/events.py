"""The ``cuda_program_cas`` logger's records of what a cache does, and ``CUDA_PROGRAM_CAS_LOG``.

One DEBUG record per lookup (hit or miss, where, the key id's first 12 characters, how long,
and for a miss why), per write, per eviction step and per collection, its fields also as
attributes (``cas_event``, ``cas_key``, ``cas_us``...) for handlers. Callers check
``LOGGER.isEnabledFor(DEBUG)`` once and take the clock only when it is on.

``CUDA_PROGRAM_CAS_LOG=PATH`` (as ccache's ``log_file``): a handler appending every record to
PATH, added once per process when the first cache is opened (:mod:`cuda_program_cas._base.logfile`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from .config import ENV_LOG, VAR_LOG
from .fork import ForkSafeLock
from .log import DEBUG as _DEBUG
from .log import LOGGER

__all__ = ["LOGGER", "collected", "evicted", "lookup_hit", "lookup_missed", "open_log_file", "wrote"]

_perf_ns = time.perf_counter_ns
_FORMAT = "%(asctime)s %(process)d %(levelname)s %(message)s"

_opened = threading.Event()
_open_lock = ForkSafeLock()


def _us(t0_ns: int) -> int:
    return (_perf_ns() - t0_ns) // 1000


def lookup_hit(root: str, kid: str, store: str, t0_ns: int) -> None:
    """A hit of key id ``kid`` in ``store`` (``local``, or ``shared <path>``), started at ``t0_ns``."""
    us = _us(t0_ns)
    extra = {"cas_event": "hit", "cas_store": store, "cas_key": kid[:12], "cas_us": us, "cas_reason": None}
    LOGGER.debug("cuda-program-cas: %s: hit %s key %s in %d us", root, store, kid[:12], us, extra=extra)


def lookup_missed(root: str, kid: str, t0_ns: int, reasons: Sequence[tuple[str, str]]) -> None:
    """A miss of key id ``kid``; ``reasons``: ``(store, why)`` for each store looked in, local first."""
    us = _us(t0_ns)
    why = "; ".join(f"{store}: {reason}" for store, reason in reasons)
    extra = {"cas_event": "miss", "cas_store": None, "cas_key": kid[:12], "cas_us": us, "cas_reason": why}
    LOGGER.debug("cuda-program-cas: %s: miss key %s in %d us (%s)", root, kid[:12], us, why, extra=extra)


def wrote(root: str, kid: str, outcome: str, size: int, t0_ns: int, *, reason: str | None = None) -> None:
    """A write of ``size`` bytes under ``kid``: ``outcome`` is ``stored``, ``deduplicated`` or ``dropped``."""
    us = _us(t0_ns)
    extra = {"cas_event": outcome, "cas_key": kid[:12], "cas_us": us, "cas_bytes": size, "cas_reason": reason}
    said = f" ({reason})" if reason else ""
    LOGGER.debug(
        "cuda-program-cas: %s: %s key %s, %d bytes in %d us%s", root, outcome, kid[:12], size, us, said, extra=extra
    )


def evicted(root: str, entries: int, blobs: int, freed: int, t0_ns: int) -> None:
    us = _us(t0_ns)
    extra = {"cas_event": "evict", "cas_entries": entries, "cas_blobs": blobs, "cas_bytes": freed, "cas_us": us}
    message = "cuda-program-cas: %s: evicted %d entries and %d blobs, freed %d bytes in %d us"
    LOGGER.debug(message, root, entries, blobs, freed, us, extra=extra)


def collected(root: str, *, dry_run: bool, entries: int, blobs: int, freed: int, elapsed_s: float) -> None:
    """A garbage collection (``dry_run``: what it would have removed)."""
    extra = {"cas_event": "gc", "cas_entries": entries, "cas_blobs": blobs, "cas_bytes": freed, "cas_dry_run": dry_run}
    verbs = ("would remove", "freeing") if dry_run else ("removed", "freed")
    message = "cuda-program-cas: %s: gc %s %d entries and %d blobs, %s %d bytes in %.3f s"
    LOGGER.debug(message, root, verbs[0], entries, blobs, verbs[1], freed, elapsed_s, extra=extra)


def open_log_file() -> None:
    """Honour ``CUDA_PROGRAM_CAS_LOG`` (once per process: later calls return at once)."""
    if _opened.is_set():
        return
    with _open_lock:
        if _opened.is_set():
            return
        _opened.set()
        path = VAR_LOG.value()
        if not path:
            return
        import logging

        from .logfile import open_log

        handler = open_log(path, ENV_LOG, LOGGER.real())
        if isinstance(handler, str):
            LOGGER.warning("cuda-program-cas: %s=%s is not used (%s); nothing is logged there", ENV_LOG, path, handler)
            return
        handler.setLevel(_DEBUG)
        handler.setFormatter(logging.Formatter(_FORMAT))
        if LOGGER.getEffectiveLevel() > _DEBUG:
            handler.level_before = LOGGER.level
            LOGGER.setLevel(_DEBUG)
        LOGGER.addHandler(handler)
