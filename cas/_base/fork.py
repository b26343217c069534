"""What a forked child resets: the one registry of this package's at-fork handlers.

A lock that another thread held at ``os.fork`` stays held in the child forever, and
per-process state (temp-file names, queued touches, lock files held open) would be shared
with the parent. In the child the module functions registered run in order, then each live
instance's ``_after_fork_in_child``. A reset replaces its locks (never releases the old: what
they guarded may be half-updated); one that raises is logged at DEBUG, the others still run.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

from .log import LOGGER

__all__ = ["ForkSafeLock", "after_fork", "after_fork_call"]


class ForkAware(Protocol):
    def _after_fork_in_child(self) -> None: ...


_calls: list[Callable[[], None]] = []
_objects: weakref.WeakSet[ForkAware] = weakref.WeakSet()


def after_fork_call(reset: Callable[[], None]) -> Callable[[], None]:
    """Run ``reset()`` in every child forked from now on (for a module's state); returns ``reset``."""
    _calls.append(reset)
    return reset


def after_fork(owner: ForkAware) -> None:
    """Run ``owner._after_fork_in_child()`` in every child forked while ``owner`` is alive."""
    _objects.add(owner)


class ForkSafeLock:
    """A lock that a forked child gets anew, for a module's state (``with lock:``)."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _in_child() -> None:
    for reset in [*_calls, *(o._after_fork_in_child for o in list(_objects))]:
        try:
            reset()
        except Exception as exc:
            LOGGER.debug("cuda-program-cas: reset after fork failed: %r", exc)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
