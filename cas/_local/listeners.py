"""What a cache does, told to whoever listens: its counters, the usage ledger, the miss journal, the log.

Events: ``hit(kid)`` (``CacheStore.get``'s local hit does its listeners' work in place),
``counted(name)``, ``looked(kid, where, t0_ns, reasons)`` (``where`` None: a miss),
``wrote(kid, outcome, size, t0_ns, why)`` and ``compiled(kid, seconds, via, inputs, why)``.
Records (``looked``, ``wrote``) are due only when the logger is on at DEBUG.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from cuda_program_cas._base.events import lookup_hit, lookup_missed, wrote

from .stats import Counters

__all__ = ["Listeners", "count_into", "log_into"]


class Listeners:
    """Who hears each event of one store (a tuple per event, in the order added)."""

    __slots__ = ("compiled", "counted", "hit", "looked", "wrote")

    def __init__(self) -> None:
        self.hit: tuple[Callable[[str], object], ...] = ()
        self.counted: tuple[Callable[[str], object], ...] = ()
        self.looked: tuple[Callable[[str, str | None, int, Sequence[tuple[str, str]]], object], ...] = ()
        self.wrote: tuple[Callable[[str, str, int, int, str | None], object], ...] = ()
        self.compiled: tuple[Callable[[str, float, str, dict[str, object], Any], object], ...] = ()

    def listen(self, **heard: Callable[..., object]) -> None:
        """Add one listener per named event: ``listen(hit=f, counted=g)``."""
        for event, listener in heard.items():
            setattr(self, event, (*getattr(self, event), listener))

    def count(self, name: str) -> None:
        for heard in self.counted:
            heard(name)

    def hit_of(self, kid: str) -> None:
        for heard in self.hit:
            heard(kid)

    def look(self, kid: str, where: str | None, t0_ns: int, reasons: Sequence[tuple[str, str]] = ()) -> None:
        for heard in self.looked:
            heard(kid, where, t0_ns, reasons)

    def write(self, kid: str, outcome: str, size: int, t0_ns: int, why: str | None = None) -> None:
        for heard in self.wrote:
            heard(kid, outcome, size, t0_ns, why)

    def compile(self, kid: str, seconds: float, via: str, inputs: dict[str, object], why: object = None) -> None:
        for heard in self.compiled:
            heard(kid, seconds, via, inputs, why)


def count_into(listeners: Listeners, counters: Counters) -> None:
    """Make ``counters`` hear what it counts: every hit, and every other count by name."""
    # next(count, kid): the count's next step, a listener that takes the key id and runs in C.
    listeners.listen(hit=functools.partial(next, counters.counter_of_hits()), counted=counters.add)


def log_into(listeners: Listeners, root: str) -> None:
    """Make the ``cuda_program_cas`` logger's records hear ``root``'s store."""

    def looked(kid: str, where: str | None, t0_ns: int, reasons: Sequence[tuple[str, str]]) -> None:
        if where is None:
            lookup_missed(root, kid, t0_ns, reasons)
        else:
            lookup_hit(root, kid, where, t0_ns)

    def wrote_one(kid: str, outcome: str, size: int, t0_ns: int, why: str | None) -> None:
        wrote(root, kid, outcome, size, t0_ns, reason=why)

    listeners.listen(looked=looked, wrote=wrote_one)
