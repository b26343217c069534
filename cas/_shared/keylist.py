"""A store's key list: which keys it holds and what each took to compile, so that a miss costs no request.

The object ``keys``: :data:`HEADER`, then one 12-byte record per key, sorted and unique (the key
id's first 8 bytes big-endian, the compile time in ms as u32, 0 unknown), :data:`MAX_BYTES` at
most. A node reads it at its first loose lookup, then conditionally every :data:`REFRESH_S`. It
only turns a hit into a miss; one that is not a whole sorted list is ignored. Publish and
write-back add to it after the entries, by one read-merge-write of :data:`MERGE_TRIES` rounds at
most (:func:`merge_into`). A node lists its own uploads at once; the lease probe, lookups under a
lease and the warm set's fetch do not consult it, and a key the probe finds that the copy lacks
makes lookups ask until a copy lists it.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import tee
from operator import lt

from cuda_program_cas._base.config import VAR_KEYS_REFRESH
from cuda_program_cas._base.engine import Engine, StoreFailure, conditional
from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._local.usage import key_number as number

from .upload import put_checked

__all__ = [
    "KEYS",
    "MAX_BYTES",
    "REFRESH_S",
    "KeyView",
    "compile_ms",
    "encode",
    "list_published",
    "merge_into",
    "number",
    "parse",
    "view",
]

_log = logging.getLogger("cuda_program_cas")

#: The store-relative name of the key list.
KEYS = "keys"
HEADER = b"cuda-program-cas keys 1\n"
_RECORD = struct.Struct(">QI")
_KEY = struct.Struct(">Q")
#: The largest key list written or read: about 1.4 million keys.
MAX_BYTES = 16 << 20
#: How long a reader trusts its copy before asking again (``$CUDA_PROGRAM_CAS_KEYS_REFRESH`` sets another).
REFRESH_S = 30.0
#: Read-merge-write rounds at most, when other writers' lists replace ours meanwhile.
MERGE_TRIES = 4
_MS_MAX = (1 << 32) - 1


def encode(records: Mapping[int, int]) -> bytes:
    """The key list of ``records`` (key number -> compile ms), sorted."""
    body = b"".join(_RECORD.pack(k, min(max(ms, 0), _MS_MAX)) for k, ms in sorted(records.items()))
    return HEADER + body


class Listed(Mapping[int, int]):
    """A key list's records as its own bytes, binary-searched: a dict of 1.4 million keys took 180 MiB."""

    __slots__ = ("_body", "_n")

    def __init__(self, body: memoryview) -> None:
        self._body = body
        self._n = len(body) // _RECORD.size

    def _find(self, key: object) -> int:
        if not isinstance(key, int):
            return -1
        body, size, unpack = self._body, _RECORD.size, _KEY.unpack_from
        lo, hi = 0, self._n
        while lo < hi:
            mid = (lo + hi) >> 1
            if unpack(body, mid * size)[0] < key:
                lo = mid + 1
            else:
                hi = mid
        return lo * size if lo < self._n and unpack(body, lo * size)[0] == key else -1

    def __getitem__(self, key: int) -> int:
        at = self._find(key)
        if at < 0:
            raise KeyError(key)
        return int(_RECORD.unpack_from(self._body, at)[1])

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        return (k for k, _ms in _RECORD.iter_unpack(self._body))

    def items_dict(self) -> dict[int, int]:
        return dict(_RECORD.iter_unpack(self._body))


def view(data: bytes | bytearray | None) -> Listed | None:
    """The records of a key list's bytes, kept in them (checked in constant memory); None when not one."""
    if data is None or len(data) > MAX_BYTES or not data.startswith(HEADER):
        return None
    body = memoryview(data)[len(HEADER) :]
    if len(body) % _RECORD.size:
        return None
    keys, after = tee(k for k, _ms in _RECORD.iter_unpack(body))
    next(after, None)
    if not all(map(lt, keys, after)):
        return None  # a repeated or an unsorted record: not a list this package wrote
    return Listed(body)


def parse(data: bytes | None) -> dict[int, int] | None:
    """The records of a key list's bytes as a dict; None when they are not one."""
    listed = view(data)
    return None if listed is None else listed.items_dict()


def compile_ms(seconds: float | None) -> int:
    """A compile time as a record holds it: milliseconds, at least 1 for a known time (0 is unknown)."""
    if seconds is None or seconds <= 0:
        return 0
    return min(max(1, round(seconds * 1000)), _MS_MAX)


def _holds(records: Mapping[int, int] | None, ours: Mapping[int, int]) -> bool:
    return records is not None and all(k in records and (not ms or records[k] == ms) for k, ms in ours.items())


def merge_into(engine: Engine, ours: Mapping[int, int], *, rebuild: bool = False) -> bool:
    """Add ``ours`` (key number -> compile ms) to the store's key list; True when it holds them after.

    ``rebuild``: ``ours`` is the store's whole index, so a damaged list is replaced. An outage raises.
    """
    if not ours:
        return True
    for _ in range(MERGE_TRIES):
        try:
            raw = engine.get(KEYS, limit=MAX_BYTES)
        except StoreFailure as exc:
            if exc.outage:
                raise
            raw = b"" if rebuild else None  # too large, or not a file: rebuilt, or left alone
            if raw is None:
                _log.debug("cuda-program-cas: %s: its key list cannot be read (%s); left alone", engine.shown, exc)
                return False
        theirs = parse(raw) if raw is not None and raw != b"" else {}
        if theirs is None:
            if not rebuild:  # never replaced by a partial list
                _log.debug("cuda-program-cas: %s: its key list is damaged; left alone", engine.shown)
                return False
            theirs = {}
        if _holds(theirs, ours):
            return True
        data = encode({**theirs, **{k: ms for k, ms in ours.items() if ms or k not in theirs}})
        if len(data) > MAX_BYTES:
            # A list that cannot hold every key would make the rest false misses: none at all, readers ask.
            _log.debug("cuda-program-cas: %s: more keys than a key list holds; removed", engine.shown)
            engine.remove(KEYS)
            return False
        try:
            put_checked(engine, KEYS, data, whole=True, accept=lambda held: _holds(parse(held), ours))
        except StoreFailure as exc:
            if exc.outage or exc.kind != "not stored":
                raise
            continue  # another writer's list, without ours, renamed over it: merge again
        if not engine.can.puts_proven:
            return True
        # A directory's put is proven, but another writer may rename its list over ours just after.
        if _holds(parse(engine.get(KEYS, limit=MAX_BYTES)), ours):
            return True
    _log.debug("cuda-program-cas: %s: other writers' key lists replaced ours %d times", engine.shown, MERGE_TRIES)
    return False


#: ``note(what, message)``: said once at DEBUG by the store that reads the list.
Note = Callable[[str, str], None]


class KeyView:
    """One process's copy of a store's key list (thread-safe), fetched at the first loose lookup.

    Refreshed conditionally where the engine can, every :data:`REFRESH_S`, by one thread while the
    others use the copy they have. ``timed(call)`` runs each request.
    """

    def __init__(self, engine: Engine, *, note: Note, timed: Callable[[Callable[[], object]], object]) -> None:
        self.engine = engine
        self._note = note
        self._timed = timed
        self._records: Mapping[int, int] | None = None  # a Listed: the list's bytes as fetched
        self._tag: str | None = None
        self._at = float("-inf")
        self._lock = threading.Lock()
        self._refresh_s: float | None = VAR_KEYS_REFRESH.value()
        #: Keys this process wrote back itself: listed at once.
        self._ours: dict[int, int] = {}
        #: Keys found in the store that the copy does not list: while it lacks any, lookups ask.
        self._lagging: set[int] = set()
        #: Requests made for the list, and unchanged answers among them.
        self.fetches = 0
        self.unchanged = 0
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def add(self, records: Iterable[tuple[int, int]]) -> None:
        for k, ms in records:
            self._ours[k] = ms

    def found(self, key: int) -> None:
        """``key`` was found in the store: where the copy lacks it, trust no absence until a copy lists it."""
        records = self._records
        # Before any copy too: one fetched later may predate this key's upload as well.
        if (records is None or key not in records) and key not in self._ours:
            self._lagging.add(key)

    def held(self) -> tuple[Mapping[int, int], dict[int, int]] | None:
        """What :meth:`records` gives, as fetched so far: no request."""
        records = self._records
        if records is None:
            return None
        if self._lagging:
            if not all(k in records for k in self._lagging):
                return None  # behind another node's uploads: ask, as without a list
            self._lagging = set()
        return records, self._ours

    def records(self) -> tuple[Mapping[int, int], dict[int, int]] | None:
        """``(the store's records, this node's own)``, refreshed as due; None: no usable key list. An outage raises."""
        every = REFRESH_S if self._refresh_s is None else self._refresh_s
        if time.monotonic() - self._at >= every:
            first = self._at == float("-inf")
            if self._lock.acquire(blocking=first):  # the first fetch is waited for; a refresh is one thread's
                try:
                    if time.monotonic() - self._at >= every:
                        self._refresh()
                finally:
                    self._lock.release()
        return self.held()

    def _refresh(self) -> None:
        changed = conditional(self.engine)
        self.fetches += 1
        try:
            if changed is not None:
                got = self._timed(lambda: changed.get_changed(KEYS, limit=MAX_BYTES, tag=self._tag))
            else:
                got = (self._timed(lambda: self.engine.get(KEYS, limit=MAX_BYTES)), None)
        except StoreFailure as exc:
            if exc.outage:
                raise
            self._ignored(f"{exc.kind}: {exc.detail}")
            got = (None, None)
        self._at = time.monotonic()
        if got is None:
            self.unchanged += 1
            return
        assert isinstance(got, tuple)
        data, tag = got
        records = None if data is None else view(data)  # none: ask, as always
        if data is not None and records is None:
            self._ignored(f"{len(data)} bytes that are not a key list")
        self._records, self._tag = records, None if records is None else tag

    def _ignored(self, why: str) -> None:
        self._note("bad key list", f"{KEYS}: {why}; ignored, lookups ask as without one")


def list_published(engine: Engine, held: Mapping[str, Iterable[str]], *, index_dir: str | None = None) -> bool:
    """After a publish: list the keys it found in or sent to the store (``held``: source -> key ids).

    ``index_dir``: the store's ``index/``, so every key it holds is listed (a damaged list rebuilt).
    True when the key list holds them after.
    """
    from cuda_program_cas._disk.files import scan_sharded
    from cuda_program_cas._disk.layout import Layout
    from cuda_program_cas._local.usage import compile_us_of

    ours: dict[int, int] = {}
    unreadable: list[str] = []
    if index_dir is not None:
        for kid, _path, _st in scan_sharded(index_dir, unreadable):
            ours.setdefault(number(kid), 0)
    whole = index_dir is not None and not unreadable  # a shard not listed: its keys are unknown, not absent
    for src, kids in held.items():
        numbers = [number(kid) for kid in kids]
        times = compile_us_of(Layout(src), numbers)
        for n in numbers:
            ms = compile_ms(times[n] / 1e6 if n in times else None)
            if ms or n not in ours:
                ours[n] = ms
    return merge_into(engine, ours, rebuild=whole)
