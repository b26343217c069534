"""The local cache of one root: blobs, manifests, the cap and its counters; it knows nothing of shared stores.

:class:`LocalStore` holds the reader, the writer, the remover and the size cap, and tells its
listeners (:class:`Listeners`: counters, the usage ledger, the miss journal, the log's records)
what it does. A directory this process cannot write is opened read-only, one it cannot create
is unusable (every lookup a miss), each said once per process.
"""

from __future__ import annotations

import errno
import functools
import math
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from cuda_program_cas._base.config import NOT_GIVEN, say_once, validate_max_size
from cuda_program_cas._base.errors import LayoutError, ReadOnlyCacheError
from cuda_program_cas._base.events import lookup_hit, lookup_missed, open_log_file, wrote
from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._base.log import DEBUG as _DEBUG
from cuda_program_cas._base.log import LOGGER as _log
from cuda_program_cas._disk.files import FileId, ShardGuard, digest_of
from cuda_program_cas._disk.layout import (
    Layout,
    LayoutState,
    check_layout,
    create_layout,
    damaged_layout_error,
    unwritable_reason,
)
from cuda_program_cas.index import LONGEST_MANIFEST, manifest_length

from .lifetime import FLUSH_INTERVAL_S, Recorder
from .reader import Reader
from .stats import Counters, merged
from .touch import apply_pending, ensure_thread

if TYPE_CHECKING:
    from cuda_program_cas._disk.blobs import BlobStore
    from cuda_program_cas._disk.remove import RemovalResult, Remover
    from cuda_program_cas._disk.scan import Snapshot
    from cuda_program_cas._disk.writer import Writer, WriteResult

    from .cachestats import CacheStats
    from .cap import SizeCap
    from .claims import Claim

__all__ = ["LocalStore"]

_perf_ns = time.perf_counter_ns
_monotonic = time.monotonic
#: Errors of a cache that cannot be laid out for want of space: opened unusable, like an unwritable one.
_FULL_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None)
#: What to do about a write dropped for these reasons (said once, with the first such drop).
_DROP_HINTS = {
    errno.EXDEV: "; blobs/, index/ or tmp/ is on another file system than tmp/: keep tmp/ on the same disk",
    errno.EROFS: "; the file system is read-only: writes are dropped until it is writable again",
    errno.EACCES: "; this process may not write there: writes are dropped",
}


#: Said once per process and directory: what is wrong with it, what the cache does instead.
_UNWRITABLE = "cuda-program-cas: cache directory %s %s; writes are dropped (said once per process)"


class Listeners:
    """Who hears each event of one store (a tuple per event, in the order added).

    ``hit(kid)`` (``CacheStore.get``'s local hit does its listeners' work in place), ``counted(name)``,
    ``looked(kid, where, t0_ns, reasons)`` (``where`` None: a miss), ``wrote(kid, outcome, size, t0_ns,
    why)``, ``compiled(kid, seconds, via, inputs, why)``; records only when the logger is on at DEBUG.
    """

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


class LocalStore:
    """One cache directory; ``max_size_bytes`` not given: the cap stored in the cache, if any. Thread-safe.

    Nothing it hands its parts refers back to it: dropping the last reference frees it at once,
    and that flushes its lifetime counters.
    """

    def __init__(self, root: str, *, max_size_bytes: int | None = NOT_GIVEN, read_only: bool = False) -> None:
        from_cache = max_size_bytes is NOT_GIVEN
        self._max = None if from_cache else validate_max_size(max_size_bytes)
        self.root = root
        self.read_only = bool(read_only)
        open_log_file()
        self.layout = lay = Layout(root)
        self.counters = counters = Counters()
        self.heard = heard = Listeners()
        # next(count, kid): the count's next step, a listener that takes the key id and runs in C.
        heard.listen(hit=functools.partial(next, counters.counter_of_hits()), counted=counters.add)

        def looked(kid: str, where: str | None, t0_ns: int, reasons: Sequence[tuple[str, str]]) -> None:
            if where is None:
                lookup_missed(root, kid, t0_ns, reasons)
            else:
                lookup_hit(root, kid, where, t0_ns)

        def wrote_one(kid: str, outcome: str, size: int, t0_ns: int, why: str | None) -> None:
            wrote(root, kid, outcome, size, t0_ns, reason=why)

        heard.listen(looked=looked, wrote=wrote_one)
        warned: set[Hashable] = set()

        def note(what: str, code: int, message: str) -> None:
            say_once((what, code), "cuda-program-cas: %s (%s): %s", root, what, message, seen=warned)

        def strange_shard(shard: str) -> None:
            heard.count("corrupt")
            note("shard is not a directory", 0, f"{shard} is a symlink or a file; its keys are misses")

        self.note = note
        self.guard = ShardGuard(strange_shard)
        #: Why a writable open became read-only ("" when it did not).
        self.why_read_only = ""
        usable = True
        if self.read_only:
            state = check_layout(root)
            if state is LayoutState.MISSING:
                raise LayoutError(f"read-only cache {root!r} does not exist (a read-only cache is never created)")
            if state is LayoutState.DAMAGED:
                raise damaged_layout_error(root)
        else:
            usable = self._open_writable(lay)
        self._max_from_cache = from_cache and usable
        self._parts = _Parts(lay, self.guard)
        self._cap_made: SizeCap | None = None
        remover = None if self.read_only else self._parts.remover
        self.reader = reader = Reader(lay, counters, self.guard, remover, note=self.note)
        #: The hot path: ``(bytes, digest)`` of a verified local entry, or None (always, when unusable).
        self.lookup: Callable[[str], tuple[bytes, str] | None] = reader.lookup if usable else reader.unusable
        if self.reader.touches is not None:
            weakref.finalize(self, self.reader.touches.apply)  # reads made, recorded when this goes
        self.clear_lock = threading.Lock()
        after_fork(self)
        self._lifetime: Recorder | None = None
        #: When the counts are next recorded: a lookup or a write at or after it records them.
        self.flush_at = math.inf
        #: The counters of the stores this one reads through (set by the shared layer).
        self._theirs: list[tuple[Counters, ...]] = [()]
        #: The usage ledger's hits per key id since the last flush (None when read-only), for CacheStore.get.
        self.tally: dict[str, int] | None = None
        if not self.read_only:
            self._listen_to_ledgers(lay, heard)
            self.flush_at = _monotonic() + FLUSH_INTERVAL_S

    def _listen_to_ledgers(self, lay: Layout, heard: Listeners) -> None:
        """The usage ledger and the miss journal hear hits and compiles; the lifetime counters record counts."""
        counters, theirs = self.counters, self._theirs
        tally: dict[str, int] = {}
        self.tally = tally
        get = tally.get

        def hit(kid: str) -> None:  # a closure, not a method: a hit pays for no attribute lookup
            tally[kid] = get(kid, 0) + 1

        def ledger(kid: str, seconds: float, via: str, inputs: dict[str, object], why: object) -> None:
            from .usage import record_compile

            record_compile(lay, kid, seconds)

        def journal(kid: str, seconds: float, via: str, inputs: dict[str, object], why: object) -> None:
            from .journal import record_miss

            record_miss(lay, kid, seconds, via, inputs, why=why)  # type: ignore[arg-type]

        heard.listen(hit=hit, compiled=ledger)
        heard.listen(compiled=journal)

        def source(lock: bool) -> dict[str, int]:
            if lock and tally:  # not in a forked child's first look, which only notes where it starts
                from .usage import settle_hits  # imported by the first flush with hits, not by a lookup

                settle_hits(lay, tally, counters)
            return merged(counters, theirs[0], lock)

        self._lifetime = Recorder(lay, source)
        self._lifetime.attach(self)

    def read_through(self, theirs: tuple[Counters, ...]) -> None:
        """Count the errors of the stores this one reads through as its own."""
        self._theirs[0] = theirs

    def counts(self) -> dict[str, int]:
        return merged(self.counters, self._theirs[0])

    @functools.cached_property
    def blobs(self) -> BlobStore:
        from cuda_program_cas._disk.blobs import BlobStore

        return BlobStore(self.layout.blobs)

    @property
    def remover(self) -> Remover | None:
        return None if self.read_only else self._parts.remover()

    @property
    def cap(self) -> SizeCap | None:
        """The cap's accounting and eviction (uncapped stores keep one too, for evict_to)."""
        if self.read_only:
            return None
        made = self._cap_made
        if made is None:
            from .cap import SizeCap

            with self._parts.lock:
                if self._cap_made is None:
                    reader = self.reader
                    self._cap_made = SizeCap(
                        self.max_size_bytes,
                        self.layout,
                        self._parts.remover(),
                        self.counters,
                        recency=lambda: reader.recent,
                        note=self.note,
                    )
                made = self._cap_made
        return made

    @property
    def max_size_bytes(self) -> int | None:
        if self._max_from_cache:
            from cuda_program_cas._disk.settings import stored_max_size

            self._max = stored_max_size(self.root)
            self._max_from_cache = False
        return self._max

    def _after_fork_in_child(self) -> None:
        self.clear_lock = threading.Lock()  # a thread of the parent may have been clearing
        if self.tally is not None:
            self.tally.clear()  # the parent's hits, which the parent records

    def _open_writable(self, lay: Layout) -> bool:
        """Lay the cache out if needed, else open it read-only; False when it cannot even be read (unusable)."""
        try:
            create_layout(self.root)
        except OSError as exc:
            from cuda_program_cas._disk.writer import UNWRITABLE_ERRNOS

            if exc.errno not in UNWRITABLE_ERRNOS and exc.errno not in _FULL_ERRNOS:
                raise
            why = f"{exc.strerror or exc}: {exc.filename or self.root}"
            self.read_only = True
            self.why_read_only = f"could not be created ({why})"
            what = f"cannot be created or laid out ({why}); running uncached: every lookup is a miss"
            say_once(("unwritable", self.root), _UNWRITABLE, self.root, what)
            return False
        why_not = unwritable_reason(lay)
        if why_not is not None:
            self.read_only = True
            self.why_read_only = f"cannot be written ({why_not})"
            say_once(
                ("unwritable", self.root),
                _UNWRITABLE,
                self.root,
                f"cannot be written ({why_not}); opened read-only: hits are served",
            )
        return True

    def note_hit(self, kid: str, shared: str | None, *, t0_ns: int = 0, waited: bool = False) -> None:
        """Count a hit the caller assembled (``shared``: its store, None for local; ``waited``: a claim hit too)."""
        heard = self.heard
        heard.hit_of(kid)
        if shared is not None:
            heard.count("shared_hits")
        if waited:
            heard.count("claim_hits")
        if _log.isEnabledFor(_DEBUG):
            heard.look(kid, "local" if shared is None else f"shared {shared}", t0_ns or _perf_ns())
        if _monotonic() >= self.flush_at:
            self.flush_on_the_way()

    def note_miss(self, kid: str, reason: str | list[tuple[str, str]], *, t0_ns: int = 0) -> None:
        """Count a miss, recorded with ``reason`` (local's, or each store's) (``t0_ns``: when its lookup began)."""
        self.heard.count("misses")
        if _log.isEnabledFor(_DEBUG):
            self.heard.look(kid, None, t0_ns or _perf_ns(), [("local", reason)] if isinstance(reason, str) else reason)
        if _monotonic() >= self.flush_at:
            self.flush_on_the_way()

    def note_compiled(self, kid: str, seconds: float, via: str, inputs: dict[str, object], why: object = None) -> None:
        """Tell the ledger and the journal ``kid`` took ``seconds`` from ``inputs`` (``why``: its miss's ``Why``)."""
        self.heard.compile(kid, seconds, via, inputs, why)

    def note_switched(self) -> None:
        self.heard.count("switched")

    def note_dropped(self, kid: str | None, reason: str) -> None:
        """Count a write the caller decided not to make (inputs it cannot key soundly)."""
        self.heard.count("dropped_writes")
        if _log.isEnabledFor(_DEBUG):
            self.heard.write(kid or "-" * 12, "dropped", 0, _perf_ns(), reason)

    def claim(self, kid: str, bound: float) -> AbstractContextManager[Claim]:
        """Single flight for ``kid`` on this node, waiting at most ``bound`` s."""
        from .claims import Claim, claim

        if self.read_only:
            return nullcontext(Claim())
        return claim(self.layout.tmp, kid, bound, self.counters)

    def refuse(self, what: str) -> ReadOnlyCacheError:
        how = self.why_read_only or "was opened read-only"
        return ReadOnlyCacheError(f"cannot {what}: cache {self.root!r} {how}")

    def store(self, kid: str, data: bytes, digest: str) -> tuple[WriteResult, str | None]:
        """Store one entry and count it; with ``DROPPED``, why."""
        from cuda_program_cas._disk.writer import DROP_ERRNOS, UNWRITABLE_ERRNOS, WriteResult

        if self.read_only:
            # As ccache and sccache in their read-only modes: the caller keeps its program.
            self.heard.count("dropped_writes")
            return WriteResult.DROPPED, "read-only cache"
        most = self.max_size_bytes
        if most is not None and len(data) + LONGEST_MANIFEST > most:
            # It could never fit: storing it would only evict everything else, then itself.
            self.heard.count("dropped_writes")
            self.note("value larger than the cap", 0, f"{len(data)} bytes > max_size_bytes={most}")
            return WriteResult.DROPPED, f"larger than max_size_bytes={most}"
        try:
            result = self.commit(kid, data, digest)
        except OSError as exc:
            if exc.errno not in DROP_ERRNOS and exc.errno not in UNWRITABLE_ERRNOS:
                raise
            self.heard.count("dropped_writes")
            self.note("write dropped", exc.errno or 0, f"{exc}{_DROP_HINTS.get(exc.errno or 0, '')}")
            return WriteResult.DROPPED, str(exc)
        if not result:
            self.heard.count("dropped_writes")
            return result, "a shard is not a directory, or a file stayed locked"
        self.heard.count("writes")
        if result is WriteResult.DEDUPLICATED:
            self.heard.count("dedup_writes")
        return result, None

    def commit(self, kid: str, data: bytes | memoryview, digest: str) -> WriteResult:
        """The write protocol for one entry, then the cap's accounting; retires the blob it replaced."""
        from cuda_program_cas._disk.writer import WriteResult

        assert not self.read_only
        writer, remover = self._parts.writer(), self._parts.remover()
        before = self.reader.current_digest(kid)
        result = writer.commit(kid, data, digest)
        if not result:
            return result
        if before is not None and before != digest:
            remover.retire(before)
        if self.max_size_bytes is not None and (cap := self.cap) is not None:  # an uncapped write makes no cap
            added = manifest_length(len(data)) + (len(data) if result is WriteResult.STORED else 0)
            cap.account(added, written=kid)
        return result

    def copy_in(self, kid: str, data: bytes | memoryview, digest: str | None = None) -> None:
        """Keep a verified entry from a shared store locally. Best effort."""
        if self.read_only:
            return
        try:
            self.commit(kid, data, digest_of(data) if digest is None else digest)
        except OSError as exc:
            self.heard.count("dropped_writes")
            self.note("copy from shared store failed", exc.errno or 0, str(exc))

    def enforce_cap(self) -> RemovalResult | None:
        """Bring the stored bytes under the cap if over it, then a step toward the low watermark."""
        if self.cap is None or self.max_size_bytes is None:
            return None
        return self.cap.enforce()

    def evict_to(self, snap: Snapshot, target_bytes: int) -> RemovalResult:
        """Reference-aware LRU down to ``target_bytes`` from a snapshot (the caller holds the lock)."""
        if self.cap is None:
            raise self.refuse("evict")
        return self.cap.evict_to(snap, target_bytes)

    def delete_id(self, kid: str) -> bool:
        """Remove the entry under key id ``kid``; False when there was no such entry."""
        if self.read_only:
            raise self.refuse("delete a key")
        if not self.guard.ok(self.layout.index, kid):
            return False
        remover = self._parts.remover()
        before = self.reader.current_digest(kid)
        if not remover.manifest(kid):
            return False
        if before is not None:
            remover.retire(before)
        return True

    def clear(self) -> None:
        from cuda_program_cas._disk.remove import RemovalPlan, removable_orphans
        from cuda_program_cas._disk.scan import take_snapshot

        from .cap import ORPHAN_GRACE_S

        if self.read_only:
            raise self.refuse("clear")
        remover = self._parts.remover()
        with self.clear_lock:
            retired: dict[str, FileId] = {}
            # The second pass takes the blobs the first retired (too young then) if still untouched.
            for _ in range(2):
                snap = take_snapshot(self.layout.index, self.layout.blobs, clock_dir=self.layout.tmp)
                plan = RemovalPlan(
                    snap,
                    manifests=list(snap.manifests),
                    orphans=removable_orphans(snap, int(ORPHAN_GRACE_S * 1e9), retired),
                )
                retired = remover.execute(plan).retired
                if not retired:
                    break
            remover.sweep_temp()
            self.reader.forget()
            if self._cap_made is not None:
                self._cap_made.reset()

    def snapshot(self, *, read_manifests: bool = True) -> Snapshot:
        """A scan of the local cache (this process's queued touches land first)."""
        from cuda_program_cas._disk.scan import take_snapshot

        if not read_manifests:
            return take_snapshot(self.layout.index, self.layout.blobs, read_manifests=False)
        if not self.read_only:
            apply_pending()
        clock = None if self.read_only else self.layout.tmp
        return take_snapshot(self.layout.index, self.layout.blobs, clock_dir=clock)

    def stats(self, counts: dict[str, int]) -> CacheStats:
        """What the local cache holds now (a scan), with ``counts``."""
        from cuda_program_cas._disk.scan import take_snapshot

        from .cachestats import CacheStats

        snap = take_snapshot(self.layout.index, self.layout.blobs)
        return CacheStats(
            entries=len(snap.manifests),
            blobs=len(snap.blobs),
            logical_bytes=snap.logical_bytes,
            stored_bytes=snap.stored_bytes,
            blob_bytes=snap.blob_bytes,
            max_size_bytes=self.max_size_bytes,
            **counts,
        )

    def flush_on_the_way(self) -> None:
        """Record the counts in the lifetime counters (a lookup or write found it due)."""
        self.flush_at = _monotonic() + FLUSH_INTERVAL_S
        touches = self.reader.touches
        if touches is not None:
            touches.apply()
            ensure_thread()  # lands touches even while the process is idle
        if self._lifetime is not None:
            self._lifetime.flush()

    def flush(self) -> bool:
        if self.reader.touches is not None:
            self.reader.touches.apply()
        return self._lifetime is None or self._lifetime.flush(last=True)


class _Parts:
    """The writer and the remover of a writable store, each made on first use (the writer sweeps ``tmp/`` first)."""

    def __init__(self, lay: Layout, guard: ShardGuard) -> None:
        self._lay = lay
        self._guard = guard
        self._writer: Writer | None = None
        self._remover: Remover | None = None
        self.lock = threading.RLock()
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self.lock = threading.RLock()  # a thread of the parent may have been making one

    def remover(self) -> Remover:
        made = self._remover
        if made is None:
            from cuda_program_cas._disk.remove import Remover

            with self.lock:
                if self._remover is None:
                    self._remover = Remover(self._lay)
                made = self._remover
        return made

    def writer(self) -> Writer:
        made = self._writer
        if made is None:
            from cuda_program_cas._disk.writer import Writer

            with self.lock:
                if self._writer is None:
                    self.remover().sweep_temp()
                    self._writer = Writer(self._lay, guard=self._guard)
                made = self._writer
        return made
