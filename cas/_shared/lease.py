"""Leases: one compile per key per cluster, where a writable store gives them (Redis ``SET NX PX``, S3 a
conditional create).

The process holding its node's claim (:mod:`cuda_program_cas._local.claims`) asks for the key's
lease. Taken: this node compiles; a thread renews it every third of its time to live, and it is
given back once write-back uploaded the result, or, with no result, with a mark
(``LEASE_MARK``): waiters look once more, then compile. Held by another: wait, looking the key
up in the shared stores and asking again (20 ms at first, 0.5 s at most), bounded as a claim's
wait. A node that cannot publish (``take=False``) never holds one others would wait on. No
answer: compile. A killed holder's lease ends within ``$CUDA_PROGRAM_CAS_LEASE_TTL``; at worst
two nodes compile a key, and store the same bytes. Nothing here raises into the caller.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from cuda_program_cas._base.engine import LEASE_MARK, Leases, StoreFailure, leases
from cuda_program_cas._local.stats import Counters

from .tier import Tier

__all__ = ["Lease", "lease"]

_log = logging.getLogger("cuda_program_cas")

#: The first wait between looks for another node's result; it grows by half each time.
POLL_FIRST_S = 0.02
#: The longest wait between looks.
POLL_MAX_S = 0.5
#: What :func:`_take` says of a lease another node holds (a token is 32 hex digits, the mark a word).
HELD = "held"


@dataclass
class Lease:
    """What :func:`lease` yields: ``held`` (compile, then :meth:`done`), or ``found`` (another node's result)."""

    held: bool = False
    waited: bool = False
    found: tuple[bytes, str] | None = None
    _release: Callable[[bool], None] | None = field(default=None, repr=False)

    def done(self, *, mark: bool = True) -> None:
        """Give the lease up now (idempotent): with the mark, no result to come from here; without, one is there."""
        release, self._release = self._release, None
        if release is not None:
            release(mark)

    def pass_on(self) -> Callable[[bool], None] | None:
        """The release as a write-back callback, taken from this lease; ``sent`` False leaves the mark."""
        release, self._release = self._release, None
        if release is None:
            return None
        return lambda sent: release(not sent)


def _leases(tier: Tier) -> Leases:
    got = leases(tier.engine)
    if got is None:
        raise StoreFailure(tier.root, "no leases", "this store's engine gives no leases", outage=False)
    return got


@contextmanager
def lease(
    tier: Tier,
    kid: str,
    *,
    ttl_s: float,
    wait_s: float,
    probe: Callable[[], tuple[bytes, str] | None],
    counters: Counters,
    take: bool = True,
) -> Iterator[Lease]:
    """The lease on ``kid`` in ``tier`` for the ``with`` block; ``probe()`` looks for a result."""
    got = _take(tier, kid, ttl_s, take)
    state = Lease()
    if got == HELD:  # another node holds it: wait for its result, or for the lease
        counters.add("claim_waits")
        state.waited = True
        deadline = time.monotonic() + wait_s
        pause = POLL_FIRST_S
        while True:
            state.found = probe()
            if state.found is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(pause, left))
            pause = min(POLL_MAX_S, pause * 1.5)
            got = _take(tier, kid, ttl_s, take)
            if got == LEASE_MARK:
                state.found = probe()  # its holder gave up: a last look (its upload may have reached this store)
            if got != HELD:
                break  # taken (freed without a result), free, marked, or no answer: compile
    if not got or got in (HELD, LEASE_MARK):  # not a token: not taken
        yield state
        return
    token = got
    state.held = True
    stop = threading.Event()
    renewer = threading.Thread(
        target=_renew, args=(tier, kid, token, ttl_s, stop), name="cuda-program-cas-lease", daemon=True
    )
    renewer.start()

    def release(mark: bool) -> None:
        stop.set()
        try:
            _leases(tier).release(kid, token, mark_s=ttl_s if mark else 0.0)
        except StoreFailure as exc:
            tier.failed(exc)  # it expires on its own

    state._release = release
    try:
        yield state
    finally:
        state.done()


def _take(tier: Tier, kid: str, ttl_s: float, take: bool) -> str | None:
    """A token (taken), :data:`HELD` (another holds it), the mark, "" (free, not taken), or None (no answer)."""
    if tier.paused():
        return None
    try:
        token = _leases(tier).lease(kid, ttl_s, take=take)
    except StoreFailure as exc:
        tier.failed(exc)
        return None
    except Exception as exc:  # an engine's bug: no lease, never the caller's exception
        _log.debug("cuda-program-cas: lease on %s in %s failed: %r", kid, tier.root, exc)
        return None
    return HELD if token is None else token


def _renew(tier: Tier, kid: str, token: str, ttl_s: float, stop: threading.Event) -> None:
    while not stop.wait(ttl_s / 3):
        try:
            if not _leases(tier).renew(kid, token, ttl_s):
                _log.debug("cuda-program-cas: lease on %s in %s was lost while compiling", kid, tier.root)
                return
        except StoreFailure as exc:
            tier.failed(exc)
            return
