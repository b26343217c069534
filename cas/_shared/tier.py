"""A shared store: lookups over its engine, verified; a failure is a miss, never an exception.

One class for every engine (a directory, a web server, Redis, S3):

- **The layout.** ``layout.json`` is read at the first lookup and checked as the local
  cache's is. An engine that evicts on its own (Redis) needs none: empty is current.
- **A lookup.** The packs first, then the loose manifest, checked against the key, then its
  blob, read with the manifest's size as the limit (at most :func:`ceiling`) and verified. A
  missing object is a plain miss; a damaged one a miss counted in ``corrupt``.
- **Failures.** An outage pauses the store: :data:`RETRY_S`, doubling per failure in a row up
  to :data:`RETRY_MAX_S` (threads meeting one outage together are one failure); any answer
  resets it. While paused, lookups miss at once: a dead server costs about one timeout. On a
  directory one bad file is not yet an outage: the layout is checked once more first. An
  unusable store (missing, not a store, a newer layout) is paused the same way.
- **A server's answers** (HTTP). A body longer than asked, or a status that is no answer, is
  counted in ``errors``; an entry larger than this node reads is a miss said once, with no
  request for its blob. ``layout.json`` is read once per process.
- **This node's trouble.** No memory or no staging disk for an answer: ``errors``, no pause.
- **The key list** (remote engines, where a request is costly; :mod:`.keylist`). A key it
  does not list is a miss with no request (``listed_misses``). ``unlisted=True`` (the lease
  probe: another node's upload may not be listed yet) asks regardless.
- **Never slower than compiling.** The least of the last :data:`RTT_SAMPLES` small reads is
  the round trip. A lookup whose requests (packed 1, loose 2) cost more than the entry's
  compile time, as its key list records it, is a miss with no request (``skipped_lookups``).
- **Saying so.** The first time a store is found unusable, down or denied: one WARNING;
  after that, and every bad answer about one object, DEBUG once per kind.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from time import perf_counter as _perf
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

from cuda_program_cas._base.config import ENV_MAX_ENTRY_SIZE, env_max_entry_size, first_time, say_once
from cuda_program_cas._base.engine import LOCAL, Engine, StoreFailure
from cuda_program_cas._base.errors import LayoutError
from cuda_program_cas._base.fork import ForkSafeLock
from cuda_program_cas._base.frame import verified
from cuda_program_cas._base.signing import Trust
from cuda_program_cas._disk.layout import (
    BLOBS,
    INDEX,
    LAYOUT_FILE,
    LAYOUT_VERSION,
    check_layout_data,
    parse_layout,
    url_path,
)
from cuda_program_cas._local.stats import Counters
from cuda_program_cas.index import MAX_MANIFEST_BYTES, parse_fields

if TYPE_CHECKING:
    from .fetchbatch import Keep, RangedPacks, Wanted
    from .keylist import KeyView

__all__ = [
    "RETRY_MAX_S",
    "RETRY_S",
    "RTT_SAMPLES",
    "PackSource",
    "Tier",
    "ceiling",
    "refused_untrusted",
    "say_untrusted",
]

_log = logging.getLogger("cuda_program_cas")
_T = TypeVar("_T")

# Entries refused as untrusted, per store: one WARNING per store at its close (say_untrusted) or at exit.
_untrusted_lock = ForkSafeLock()
_untrusted: dict[str, int] = {}
_at_exit = False  # the report at exit arranged
os.register_at_fork(after_in_child=_untrusted.clear)  # a child says what it refused, not its parent's

#: The first pause after a store failed; it doubles with each failure in a row.
RETRY_S = 5.0
#: The longest pause.
RETRY_MAX_S = 300.0
#: The largest ``layout.json`` read (a real one is about 100 bytes).
MAX_LAYOUT_BYTES = 4096
#: Small reads timed; the least of them is the round trip (a new connection's handshake, a queue behind
#: other threads' requests, only make one longer).
RTT_SAMPLES = 8
#: Requests of a loose lookup (its manifest, then its blob: the second names what the first says).
LOOSE_REQUESTS = 2
#: Requests of a packed lookup whose pack's index is in hand (one Range request).
PACKED_REQUESTS = 1


def ceiling(max_entry: int | None) -> int:
    """The most bytes one entry may take: the ceiling (``CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE``), or less for the cap."""
    limit = env_max_entry_size()
    return limit if max_entry is None else min(limit, max_entry)


class PackSource(Protocol):
    """A store's packs as one process sees them: ``lookup`` gives verified bytes and their digest, or None."""

    def lookup(self, kid: str) -> tuple[bytes, str] | None: ...


class Tier:
    """Lookups in one shared store over ``engine``, read-only (module docstring); ``engine.can`` says how.

    ``packs``: asked before loose entries (None: none). ``missing()``: why a store without
    ``layout.json`` is not one. ``trust``: the keys an entry must be signed by (else a miss
    counted in ``untrusted``; packs, unsigned, are not read). ``max_entry``: what the local cap
    can hold. ``damaged``, ``missed``, ``say_once``, ``fits`` and ``ceiling`` serve the packs too.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        packs: PackSource | None = None,
        writable: bool = False,
        missing: Callable[[], str] | None = None,
        trust: Trust | None = None,
        max_entry: int | None = None,
    ) -> None:
        can = engine.can
        self.engine = engine
        self.root = engine.shown
        self.writable = writable
        self.packs = packs
        self.counters = Counters()
        self.trust = trust
        self._max_entry = max_entry
        self._missing = missing
        self._remote = can.remote
        self._version = 0  # 0: not opened yet
        self._fail_lock = ForkSafeLock()
        self._paused_until = 0.0
        self._failures = 0
        self._why_not = ""
        self._noted: set[Hashable] = set()
        self._why = threading.local()
        # A directory's check is a few system calls: made at once, retried every RETRY_S; one that worked and
        # is gone later (unmounted) is no WARNING. A remote one's is a request: made at the first lookup.
        self._retry_max_s = RETRY_MAX_S if can.remote else RETRY_S
        self._looked = False
        self._server = can.server
        self._rtts: deque[float] = deque(maxlen=RTT_SAMPLES)
        self.keys: KeyView | None = None
        if can.remote:  # a request is costly there; a directory's stat is cheaper than a list
            from .keylist import KeyView

            self.keys = KeyView(engine, note=self._note, timed=self._timed)
        else:
            try:
                self._open()
            except StoreFailure as exc:
                self.failed(exc)

    def lookup(self, kid: str, *, unlisted: bool = False) -> tuple[bytes, str] | None:
        """The verified bytes of ``kid`` here and their digest, or None; ``unlisted``: past the key list and the RTT."""
        if self.paused():
            self._why.reason = f"store not usable: {self._why_not}"
            return None
        return self._asked(lambda: self._find(kid, unlisted), None)

    def _find(self, kid: str, unlisted: bool = False) -> tuple[bytes, str] | None:
        # Packs carry no signatures yet: a node that trusts keys reads loose, signed entries only.
        found = None
        if self.packs is not None and self.trust is None:
            ranged = self.ranged_packs()
            packed = not unlisted and ranged is not None and ranged.where(kid) is not None
            if packed and self._too_slow(PACKED_REQUESTS, self._listed_ms(kid, fetch=False)):
                return None
            found = self.packs.lookup(kid)
            self._failures = 0  # they were answered (after a pause they list again)
        if found is not None:
            return found
        if self.keys is not None and not unlisted:
            ms = self._listed_ms(kid, fetch=True)
            if ms == -1:
                self.counters.add("listed_misses")
                self._why.reason = "not in the store's key list"
                return None
            if self._too_slow(LOOSE_REQUESTS, ms):
                return None
        found = self._loose(kid)
        if found is not None and unlisted and self.keys is not None:
            from .keylist import number

            self.keys.found(number(kid))  # another node's upload not listed yet: the copy lags behind
        return found

    def _listed_ms(self, kid: str, *, fetch: bool) -> int | None:
        """``kid``'s compile ms in the key list (0: unknown), -1 when not listed; None: no key list (or not fetched)."""
        if self.keys is None:
            return None
        got = self.keys.records() if fetch else self.keys.held()
        if got is None:
            return None
        from .keylist import number

        theirs, ours = got
        n = number(kid)
        return max(theirs.get(n, -1), ours.get(n, -1))

    def _timed(self, call: Callable[[], _T]) -> _T:
        """``call()`` (one small read), its time kept as a sample of the round trip when it was answered."""
        t0 = _perf()
        result = call()
        self._rtts.append(_perf() - t0)
        return result

    def rtt(self) -> float | None:
        """The round trip to the store in seconds as measured here (the least recent sample), or None before any."""
        samples = tuple(self._rtts)
        return min(samples) if samples else None

    def _too_slow(self, requests: int, ms: int | None) -> bool:
        """True (a miss, counted and said) when ``requests`` round trips cost more than a compile of ``ms``."""
        rtt = self.rtt()
        if not ms or ms < 0 or rtt is None or rtt * requests * 1000 <= ms:
            return False
        why = f"skipped: {requests} requests x {rtt * 1000:.0f} ms > {ms} ms compile"
        self.counters.add("skipped_lookups")
        self._why.reason = why
        say_once(
            ("shared store", self.root, "skipped"),
            "cuda-program-cas: shared store %s: lookup %s: compiling is faster (said once per process)",
            self.root,
            why,
            level=logging.DEBUG,
        )
        return True

    def _asked(self, call: Callable[[], _T], failed: _T) -> _T:
        """``call()`` on the opened store; an outage or a bad answer is handled (module docstring), then ``failed``."""
        try:
            if not self._version and not self._open():
                return failed
            result = call()
        except StoreFailure as exc:
            self.failed(exc)
            return failed
        except MemoryError:
            self.failed(StoreFailure(self.root, LOCAL, "MemoryError", outage=False))
            return failed
        self._failures = 0  # an answer: the next outage pauses for RETRY_S again
        self._looked = True
        return result

    def paused(self) -> bool:
        """Whether the store is paused now (after an outage, or unusable): its lookups and uploads are skipped."""
        return bool(self._paused_until) and time.monotonic() < self._paused_until

    def why_not(self) -> str:
        """Why the store was last paused ("" if never)."""
        return self._why_not

    def miss_reason(self) -> str:
        """Why this thread's last lookup here missed."""
        reason: str = getattr(self._why, "reason", "unknown")
        return reason

    def ranged_packs(self) -> RangedPacks | None:
        """The store's packs, where its engine is remote and reads ranges (their indexes held here); else None."""
        can = self.engine.can
        return cast("RangedPacks", self.packs) if self.packs is not None and can.remote and can.ranges else None

    def ceiling(self) -> int:
        """The largest entry read here: the ceiling, or less where the local cap says so."""
        return ceiling(self._max_entry)

    def fits(self, size: int, kid: str) -> bool:
        """True when an entry of ``size`` bytes may be read; else a miss, with no request for its blob."""
        most = self.ceiling()
        if size <= most:
            return True
        if not self._server:
            self.damaged("entry too large", f"the manifest of {kid} names {size} bytes, more than {most} allowed")
            return False
        self._why.reason = f"too large: {size} bytes, more than {most}"
        self.say_once(
            "too large",
            f"the entry of {kid} is {size} bytes, more than the {most} this node reads "
            f"({ENV_MAX_ENTRY_SIZE}, or the local cache's cap): not fetched; entries that large are misses",
        )
        return False

    def missed(self, reason: str) -> None:
        """Say why this thread's lookup missed."""
        self._why.reason = reason

    def _loose(self, kid: str) -> tuple[bytes, str] | None:
        data = self._timed(lambda: self.engine.get(url_path(INDEX, kid), limit=MAX_MANIFEST_BYTES))
        self._failures = 0  # an answer, whatever the blob's: a store that keeps answering is paused for RETRY_S
        if data is None:
            self._why.reason = "no entry"
            return None
        named = self.judge(kid, data)
        if named is None:
            return None
        digest, size = named
        try:
            blob = self.engine.get(url_path(BLOBS, digest), limit=size, digest=digest)  # decoded, verified
        except StoreFailure as exc:
            if exc.kind != "damaged":
                raise
            self.damaged("damaged blob", f"blob {digest}: {exc}")
            return None
        if blob is None:
            self._why.reason = "blob missing"
            return None
        return blob, digest

    def judge(self, kid: str, data: bytes) -> tuple[str, int] | None:
        """``(digest, size)`` the manifest ``data`` of ``kid`` names, if this node may use it (else counted, said)."""
        fields = parse_fields(data)
        if fields is None or fields[0] != kid:
            why = "damaged manifest" if fields is None else "misplaced manifest (another key's)"
            self.damaged(why, f"the manifest of {kid}: {len(data)} bytes that are not its manifest")
            return None
        if self.trust is not None and not self.trust.verify(data):
            self.counters.add("untrusted")
            refused_untrusted(self.root)
            self._why.reason = "untrusted (not signed by a trusted key)"
            self._note("untrusted", f"the manifest of {kid} is not signed by a key in $CUDA_PROGRAM_CAS_TRUSTED_KEYS")
            return None
        _found, digest, size = fields
        if not self.fits(size, kid):
            return None
        return digest, size

    def get_object(self, name: str, limit: int) -> bytes | None:
        """Object ``name`` (a warm set), or None: none there, the store paused or failing (handled as a lookup's)."""
        if self.paused():
            return None
        return self._asked(lambda: self.engine.get(name, limit=limit), None)

    def fetch_entries(self, entries: Sequence[Wanted], keep: Keep) -> None:
        """Fetch a warm set's ``entries`` in batches (:mod:`.fetchbatch`), ``keep(kid, bytes, digest)`` each verified.

        What cannot be had so is left out: lookups find it the ordinary way.
        """
        from .fetchbatch import fetch

        if self.paused() or not entries:
            return
        self._asked(lambda: fetch(self, entries, keep), None)

    def raw_of(self, e: Wanted, data: bytes | memoryview) -> bytes | memoryview | None:
        """The raw bytes of ``data`` (what a warm set's line ``e`` asked, stored compressed or raw) when they hash
        to its digest; else None, damage counted (a bomb, a cut frame, wrong bytes)."""
        try:
            return verified(self.root, data, e.digest, self.ceiling())
        except StoreFailure as exc:
            self.damaged("damaged blob", f"the blob of {e.kid} (a warm set's): {exc}")
            return None

    def _open(self) -> bool:
        """Read and check ``layout.json``; False (the store paused) when it is not usable."""
        try:
            raw = self._timed(lambda: self.engine.get(LAYOUT_FILE, limit=MAX_LAYOUT_BYTES))
        except StoreFailure as exc:
            if exc.outage or exc.kind not in ("too large", "damaged"):
                raise
            # Hundreds of MB of "layout", or a status that is not an answer: not a store.
            return self._unusable(f"not a store: its layout.json: {exc.kind}: {exc.detail}")
        if raw is None:
            if self.engine.can.layout_optional:
                self._version = LAYOUT_VERSION
                return True
            return self._unusable(self._missing() if self._missing is not None else "not a store: no layout.json")
        data = parse_layout(raw)
        if data is None:
            return self._unusable("not a store: its layout.json is damaged")
        try:
            self._version = check_layout_data(self.root, data)
        except LayoutError as exc:
            return self._unusable(str(exc))
        self._looked = True
        self._failures = 0
        return True

    def _unusable(self, why: str) -> bool:
        self._version = 0
        self._pause(StoreFailure(self.root, "unusable", why))
        return False

    def failed(self, exc: StoreFailure) -> None:
        """Count and handle a failure (a lookup's, or write-back's and leases' over :attr:`engine`)."""
        if not exc.outage:
            if exc.kind == LOCAL:
                self.counters.add("errors")
                self._why.reason = f"{LOCAL}: {exc.detail}"
                self.say_once(f"local {exc.detail}", f"an answer could not be taken in: {exc}")
                return
            damage = ("damaged", "not a regular file", "not a directory") + (() if self._server else ("too large",))
            if exc.kind in damage:
                self.damaged(exc.kind, str(exc))
                return
            self.counters.add("errors")
            if self._server:
                self._why.reason = f"bad answer: {exc.kind}"
            else:
                self._why.reason = f"cannot read ({exc.kind})" if exc.kind != "denied" else "access denied"
            if exc.kind == "denied" and say_once(
                ("shared store", self.root),
                "cuda-program-cas: shared store %s cannot be read: %s; such lookups are misses (said once per process)",
                self.root,
                exc,
            ):
                return
            self._note(f"read error {exc.kind}", f"read error: {exc}")
            return
        if not self._remote:
            # One file failing is not yet an outage of a directory: its layout is read once more.
            self.counters.add("errors")
            self._why.reason = f"cannot read ({exc.kind})"
            self._note(f"read error {exc.kind}", f"read error: {exc}")
            try:
                if self._open():
                    return
            except StoreFailure as again:
                self._pause(again)
            return
        self._pause(exc)

    def _pause(self, exc: StoreFailure) -> None:
        self.counters.add("errors")
        with self._fail_lock:
            if time.monotonic() < self._paused_until:
                # Another thread met the same outage first: one outage is one step of the pause.
                self._why.reason = f"store not usable: {self._why_not}"
                return
            self._failures += 1
            pause = min(self._retry_max_s, RETRY_S * 2 ** (self._failures - 1))
            self._paused_until = time.monotonic() + pause
            self._why_not = f"{exc.kind}: {exc.detail}" if exc.kind != "unusable" else exc.detail
            if not self._server or exc.kind == "unusable":  # a server's layout.json is read once per process
                self._version = 0  # asked again when the pause ends
        self._why.reason = f"store not usable: {self._why_not}"
        first_look, self._looked = not self._looked, True
        warned = (first_look or self._remote) and say_once(
            ("shared store", self.root),
            "cuda-program-cas: shared store %s is unusable: %s; its lookups are misses, asked again in %g s%s "
            "(said once per process)",
            self.root,
            self._why_not,
            pause,
            ", then less often" if self._retry_max_s > RETRY_S else "",
        )
        if not warned:
            _log.debug("cuda-program-cas: shared store %s: %s; paused for %g s", self.root, self._why_not, pause)

    def damaged(self, why: str, message: str) -> None:
        """A bad answer about one object: a miss counted in ``corrupt``, noted once (DEBUG) per ``why``."""
        self.counters.add("corrupt")
        self._why.reason = why
        self._note(why, message)

    def _note(self, what: str, message: str) -> None:
        """DEBUG, once per instance and ``what``."""
        text = "cuda-program-cas: shared store %s (%s): %s"
        say_once(what, text, self.root, what, message, level=logging.DEBUG, seen=self._noted)

    def say_once(self, what: str, message: str) -> None:
        """A WARNING the first time this process meets ``what`` at this store; DEBUG once per instance after."""
        if first_time(what, self._noted):
            level = logging.WARNING if first_time(("shared store", self.root, what)) else logging.DEBUG
            _log.log(level, "cuda-program-cas: shared store %s: %s", self.root, message)


def refused_untrusted(root: str) -> None:
    """Count one entry of ``root`` refused as untrusted; the first of the process arranges the report at exit."""
    global _at_exit
    with _untrusted_lock:
        first, _at_exit = not _at_exit, True
        _untrusted[root] = _untrusted.get(root, 0) + 1
    if first:
        import atexit

        atexit.register(say_untrusted)


def say_untrusted(roots: Sequence[str] | None = None) -> None:
    """One WARNING per store (of ``roots``; None: every one) whose entries this process refused as untrusted."""
    with _untrusted_lock:
        counts = {r: _untrusted.pop(r) for r in (list(_untrusted) if roots is None else roots) if r in _untrusted}
    for root, n in counts.items():
        _log.warning(
            "cuda-program-cas: shared store %s: %d %s refused in this process: not signed by a key in "
            "$CUDA_PROGRAM_CAS_TRUSTED_KEYS (each a miss, counted in untrusted); a node writing there without the "
            "site's signing key overwrites signed entries",
            root,
            n,
            "entry" if n == 1 else "entries",
        )
