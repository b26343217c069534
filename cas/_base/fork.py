"""What a forked child resets: the one registry of this package's at-fork handlers.

``os.fork`` copies the memory of the whole process but only the thread that called
it. A lock that another thread held at that moment stays held in the child, and no
thread there will ever release it: the child's next ``clear()``, eviction or write
would wait forever, or give up for good. Per-process state would be shared with the
parent too: temp-file names, queued touches, lock files held open.

So every owner of a lock or of per-process state registers its reset here, once:
a module with :func:`after_fork_call`, an instance with :func:`after_fork` (held
weakly: registering keeps nothing alive). In the child, before any other code of
ours runs, the module functions run in the order they were registered, then each
live instance's ``_after_fork_in_child``. A reset replaces its locks with new ones
(never releases the old: the state they guarded may be half-updated, and each
owner says what it keeps) and must not raise; one that does is logged at DEBUG and
the others still run.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

from .log import LOGGER

__all__ = ["ForkAware", "ForkSafeLock", "after_fork", "after_fork_call"]


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
    """A lock that a forked child gets anew, for a module's state (``with lock:``).

    Instances on a hot path keep a plain ``threading.Lock`` and reset it themselves:
    this wrapper costs a method call per use.
    """

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
        except Exception as exc:  # one owner's failure leaves the others' resets to run
            LOGGER.debug("cuda-program-cas: reset after fork failed: %r", exc)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
