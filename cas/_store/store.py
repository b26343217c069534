"""The cache itself, bytes in and bytes out, with no CUDA dependency.

:class:`CacheStore` composes the pieces of one cache root: the reader (the hot
path), the writer (the one write protocol), the remover, the size cap, and the
shared stores looked up (read-only) after the local one.
``ContentAddressedProgramCache`` is a thin ``cuda.core`` adapter over it.

What is not bad input never raises into the caller: a lookup is a hit or a miss,
a write lands or is dropped and counted. A directory this process cannot write
is opened read-only, one it cannot create is uncached (every lookup a miss), each
with one WARNING per process; ``del`` and ``clear`` there raise
:class:`cuda_program_cas.ReadOnlyCacheError`.

It counts what it does in memory (:meth:`CacheStore.counters`, no I/O) and, when
writable, records the counts in the cache's lifetime counters
(:mod:`cuda_program_cas._local.lifetime`); every lookup and write gets a DEBUG record on the ``cuda_program_cas``
logger (:mod:`cuda_program_cas._base.events`), built only when DEBUG is on.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import math
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING

from cuda_program_cas._base.config import NOT_GIVEN, validate_max_size, warn_once
from cuda_program_cas._base.errors import LayoutError, ReadOnlyCacheError
from cuda_program_cas._base.events import lookup_hit, lookup_missed, open_log_file, wrote
from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._base.log import DEBUG as _DEBUG
from cuda_program_cas._base.log import LOGGER as _log
from cuda_program_cas._disk.files import FileId, ShardGuard, digest_of
from cuda_program_cas._disk.layout import (
    LAYOUT_VERSION,
    Layout,
    LayoutState,
    LayoutVersion,
    check_layout,
    create_layout,
    damaged_layout_error,
    unwritable_reason,
)
from cuda_program_cas._local.lifetime import FLUSH_INTERVAL_S, Recorder
from cuda_program_cas._local.reader import Reader, Uncached
from cuda_program_cas._local.stats import Counters
from cuda_program_cas._local.touch import apply_pending, ensure_thread
from cuda_program_cas.index import LONGEST_MANIFEST, key_id, manifest_length

if TYPE_CHECKING:
    from cuda_program_cas._disk.blobs import BlobStore
    from cuda_program_cas._disk.remove import RemovalResult, Remover
    from cuda_program_cas._disk.scan import Snapshot
    from cuda_program_cas._disk.writer import Writer, WriteResult
    from cuda_program_cas._local.cachestats import CacheStats
    from cuda_program_cas._local.cap import SizeCap
    from cuda_program_cas._local.claims import Claim
    from cuda_program_cas._shared.lease import Lease
    from cuda_program_cas._shared.tier import Tier
    from cuda_program_cas._shared.warmset import Used, WarmFetch
    from cuda_program_cas._shared.writeback import WriteBack

# What a hit needs is imported above; the writer, the remover, the cap, scans, claims, leases, the shared
# stores and uploads are imported when first used (issue 31: a job that only hits pays for none of them).

__all__ = ["CacheStore", "Inner"]

_sha256 = hashlib.sha256
_perf_ns = time.perf_counter_ns
_monotonic = time.monotonic
#: Errors of a cache that cannot be laid out for want of space: opened uncached, like an unwritable one.
_FULL_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None)
#: What to do about a write dropped for these reasons (said once, with the first such drop).
_DROP_HINTS = {
    errno.EXDEV: "; blobs/, index/ or tmp/ is on another file system than tmp/: keep tmp/ on the same disk",
    errno.EROFS: "; the file system is read-only: writes are dropped until it is writable again",
    errno.EACCES: "; this process may not write there: writes are dropped",
}


def _warn_once(root: str, what: str) -> None:
    """One WARNING per cache directory per process: it cannot be written."""
    warn_once(
        ("unwritable", root),
        "cuda-program-cas: cache directory %s %s; writes are dropped (said once per process)",
        root,
        what,
    )


class CacheStore:
    """A content-addressed cache directory, optionally layered over shared stores.

    Parameters are those of :class:`cuda_program_cas.ContentAddressedProgramCache`, except that
    this class stores ``bytes`` only and reads no environment variables: a
    ``max_size_bytes`` not given is the cap stored in the cache (``cuda-program-cas
    config``), if any. One instance is safe to share between threads.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_size_bytes: int | None = NOT_GIVEN,
        read_only: bool = False,
        shared: Iterable[str | os.PathLike[str]] = (),
        copy_shared_hits: bool = True,
    ) -> None:
        from_cache = max_size_bytes is NOT_GIVEN
        self._max = None if from_cache else validate_max_size(max_size_bytes)
        root = os.fspath(path)
        if not isinstance(root, str) or root == "":
            raise ValueError(f"cache path must be a non-empty path, got {path!r}")
        if isinstance(shared, (str, bytes, os.PathLike)):
            raise TypeError(f"shared must be a sequence of paths, not a single path: {shared!r}")
        self.root = os.path.abspath(root)
        self.read_only = bool(read_only)
        self._copy_shared = bool(copy_shared_hits)
        open_log_file()
        self._layout = lay = Layout(self.root)
        self._counters = Counters()
        # Nothing this store hands its parts refers back to it: dropping the last
        # reference frees it at once, and that flushes its lifetime counters.
        problems = _Problems(self.root, self._counters)
        self._note = problems.note
        self._guard = ShardGuard(problems.strange_shard)
        #: Why a writable open became read-only ("" when it did not).
        self._why_read_only = ""
        usable = True
        if self.read_only:
            state = check_layout(self.root)
            if state is LayoutState.MISSING:
                raise LayoutError(f"read-only cache {self.root!r} does not exist (a read-only cache is never created)")
            if state is LayoutState.DAMAGED:
                raise damaged_layout_error(self.root)
        else:
            usable = self._open_writable(lay)
        #: The cap stored in the cache, read when first needed (a write, or max_size_bytes).
        self._max_from_cache = from_cache and usable
        #: The writer and the remover, made when first needed (a hit needs neither); the cap likewise.
        self._parts = _Parts(lay, self._guard)
        self._cap_made: SizeCap | None = None
        kind = Reader if usable else Uncached
        version = LayoutVersion(self.root)  # raised by the upgrade below: it asks again
        remover = None if self.read_only else self._parts.remover
        self._reader = kind(lay, self._counters, self._guard, remover, version=version, note=self._note)
        if self._reader.touches is not None:
            weakref.finalize(self, self._reader.touches.apply)  # reads made, recorded when this goes
        if not self.read_only and version.now() < LAYOUT_VERSION:
            from cuda_program_cas._disk.upgrade import upgrade_if_needed

            upgrade_if_needed(lay, self._parts.writer())
        self._clear_lock = threading.Lock()
        after_fork(self)
        #: The keys shared entries must be signed by ($CUDA_PROGRAM_CAS_TRUSTED_KEYS), or None: any verified entry.
        self._trust = None
        if shared:
            from cuda_program_cas._base.signing import env_trust

            self._trust = env_trust()
        self._shared: tuple[Tier, ...] = tuple(self._shared_store(p) for p in shared)
        #: Uploads of this instance's new entries to the stores named writable (none on a read-only cache).
        self._writeback: WriteBack | None = None
        targets = [s for s in self._shared if s.writable]
        #: The writable store that gives leases (one compile per key per cluster), if any; and the leases held.
        self._lease_tier: Tier | None = None
        self._leases: dict[str, Lease] = {}
        #: ``on`` in a thread inside a lease's block (waited for, taken, or found free): its lookups go past the
        #: key lists, whose copies may predate another node's uploads (the front door's result, not only the key).
        self._past_list = threading.local()
        if targets and not self.read_only:
            from cuda_program_cas._base.signing import env_signer
            from cuda_program_cas._shared.writeback import WriteBack

            try:
                signer, unusable = env_signer(), None
            except ValueError as exc:
                signer, unusable = None, f"{exc} ($CUDA_PROGRAM_CAS_SIGNING_KEY)"
            if unusable is None and self._trust is not None:
                from cuda_program_cas._base.signing import untrusted_signer

                unusable = untrusted_signer(signer, self._trust)  # what this node's peers would all refuse
            from cuda_program_cas._local.usage import compile_seconds_of

            seconds = functools.partial(compile_seconds_of, lay)  # the key lists' compile times
            self._writeback = WriteBack(targets, self._counters, signer=signer, unusable=unusable, seconds=seconds)
            self._lease_tier = next((t for t in targets if t.engine.can_lease), None)
        #: The job's warm set (:mod:`cuda_program_cas._shared.warmset`): what this process used, and its fetch.
        self._used: Used | None = None
        self._warm: WarmFetch | None = None
        if self._shared and not self.read_only and self._copy_shared:
            from cuda_program_cas._shared.warmset import job_name, set_name

            job = job_name()
            if job is not None:
                self._start_warm_set(set_name(job))
        # Lifetime counters: read-only caches (and shared stores) are never written.
        self._lifetime: Recorder | None = None
        self._flush_at = math.inf
        #: Hits per key id since the last flush, whose compile time the flush adds to ``saved_us``.
        self._hits_by_key: dict[str, int] | None = None
        if not self.read_only:
            local, theirs = self._counters, tuple(s.counters for s in self._shared)
            tally: dict[str, int] = {}
            self._hits_by_key = tally

            def source(lock: bool) -> dict[str, int]:
                if lock and tally:  # not in a forked child's first look, which only notes where it starts
                    from cuda_program_cas._local.usage import (
                        settle_hits,  # imported by the first flush with hits, not by a lookup
                    )

                    settle_hits(lay, tally, local)
                return _merged(local, theirs, lock)

            self._lifetime = Recorder(lay, source)
            self._lifetime.attach(self)
            self._flush_at = _monotonic() + FLUSH_INTERVAL_S

    # -- the parts a hit does not need, made on first use --------------------------------

    @property
    def inner(self) -> Inner:
        """What the CUDA layer asks of this store beyond its public API (:class:`Inner`).

        A new object each time, which the store does not keep: a caller that asks on
        every compile keeps the one it got.
        """

        return Inner(self)

    @functools.cached_property
    def _blobs(self) -> BlobStore:
        """The blob store of this cache: blobs by digest, read verified (made on first use)."""
        from cuda_program_cas._disk.blobs import BlobStore

        return BlobStore(self._layout.blobs)

    @property
    def _writer(self) -> Writer | None:
        return None if self.read_only else self._parts.writer()

    @property
    def _remover(self) -> Remover | None:
        return None if self.read_only else self._parts.remover()

    @property
    def _cap(self) -> SizeCap | None:
        """The cap's accounting and eviction (uncapped stores keep one too, for explicit evictions: evict_to)."""
        if self.read_only:
            return None
        made = self._cap_made
        if made is None:
            from cuda_program_cas._local.cap import SizeCap

            with self._parts.lock:
                if self._cap_made is None:
                    reader = self._reader
                    self._cap_made = SizeCap(
                        self.max_size_bytes,
                        self._layout,
                        self._parts.remover(),
                        self._counters,
                        recency=lambda: reader.recent,
                        note=self._note,
                    )
                made = self._cap_made
        return made

    def _shared_store(self, where: str | os.PathLike[str]) -> Tier:
        """The reader of one shared store (:mod:`cuda_program_cas._shared.tiers`); pack indexes kept in this cache."""
        from cuda_program_cas._shared.tiers import open_tier

        reader, me = self._reader, weakref.ref(self)  # weak: the store's parts never keep it alive

        def memo_get(kid: str) -> bytes | None:
            found = reader.lookup(kid)
            return None if found is None else found[0]

        def memo_put(kid: str, data: bytes) -> None:
            store = me()
            if store is not None and store._writer is not None:
                store._copy_in(kid, data, digest_of(data))

        # A hit must fit the cap to be copied in; a large body waits in this cache's tmp/ while it is verified.
        cap = self.max_size_bytes
        room = None if cap is None else cap - LONGEST_MANIFEST
        tmp = None if self.read_only else self._layout.tmp
        return open_tier(
            os.fspath(where), memo_get=memo_get, memo_put=memo_put, trust=self._trust, max_entry=room, staging=tmp
        )

    def _start_warm_set(self, name: str) -> None:
        """Record what this process uses (where it writes back); fetch what the job's set lists, in the background."""
        from cuda_program_cas._shared.warmset import MAX_SET_BYTES, Used, WarmFetch, updated

        reader, me = self._reader, weakref.ref(self)  # weak: the store's parts never keep it alive
        used = self._used = Used() if self._writeback is not None else None

        def is_local(kid: str, digest: str) -> bool:
            return reader.current_digest(kid) == digest

        def keep(kid: str, data: bytes | memoryview, digest: str) -> None:
            store = me()
            if store is not None:
                store._copy_in(kid, data, digest)

        warm = self._warm = WarmFetch(
            self._shared,
            name,
            is_local=is_local,
            keep=keep,
            room=self.max_size_bytes,
            used=used,
            per_entry=LONGEST_MANIFEST,
        )
        if used is not None and self._writeback is not None:

            def make(tier: Tier) -> tuple[str, bytes] | None:
                ours = used.entries(getattr(tier.packs, "where", None))
                held = tier.engine.get(name, limit=MAX_SET_BYTES)
                data = updated(held, ours, warm.gone if warm.source is tier else None)
                return None if data is None else (name, data)

            used.changed = self._writeback.set_changed
            self._writeback.keep_set(make)
        # The fetch starts at the first local miss (warm.wait in _find_shared), not here.

    def _after_fork_in_child(self) -> None:
        self._clear_lock = threading.Lock()  # a thread of the parent may have been clearing
        if self._hits_by_key is not None:
            self._hits_by_key.clear()  # the parent's hits, which the parent records

    def _open_writable(self, lay: Layout) -> bool:
        """Lay the cache out if needed; one this process cannot write is opened read-only instead.

        Returns False when there is no cache to read either (it could not be
        created, or its ``layout.json`` is damaged and cannot be rewritten): the
        store is then uncached, a read-only store whose every lookup misses. Either
        way one WARNING per process names the directory and the reason.
        """
        try:
            create_layout(self.root)
        except OSError as exc:
            from cuda_program_cas._disk.writer import UNWRITABLE_ERRNOS

            if exc.errno not in UNWRITABLE_ERRNOS and exc.errno not in _FULL_ERRNOS:
                raise
            why = f"{exc.strerror or exc}: {exc.filename or self.root}"
            self.read_only = True
            self._why_read_only = f"could not be created ({why})"
            _warn_once(self.root, f"cannot be created or laid out ({why}); running uncached: every lookup is a miss")
            return False
        why_not = unwritable_reason(lay)
        if why_not is not None:
            self.read_only = True
            self._why_read_only = f"cannot be written ({why_not})"
            _warn_once(self.root, f"cannot be written ({why_not}); opened read-only: hits are served")
        return True

    # -- lookups -----------------------------------------------------------------

    def get(self, key: object) -> bytes | None:
        """The bytes stored under ``key`` (here or in a shared store), verified; None on a miss."""
        # bytes keys (what Program.compile uses) hashed inline: this is the hot path.
        kid = _sha256(key).hexdigest() if type(key) is bytes else key_id(key)
        t0 = _perf_ns() if _log.isEnabledFor(_DEBUG) else 0
        found = self._reader.lookup(kid)
        if found is not None:
            self._counters.hit()
            tally = self._hits_by_key
            if tally is not None:
                tally[kid] = tally.get(kid, 0) + 1
            if self._used is not None:
                self._used.add(kid, found[1], len(found[0]))
            if t0:
                lookup_hit(self.root, kid, "local", t0)
            if _monotonic() >= self._flush_at:
                self._flush_on_the_way()
            return found[0]
        return self._get_shared(kid, t0)

    def _get_shared(self, kid: str, t0: int) -> bytes | None:
        """After a local miss: the shared stores in order, then the miss (``t0``: a record is due)."""
        reasons = [("local", self._reader.miss_reason())] if t0 else None
        found = self._find_shared(kid, reasons)
        if found is not None:
            self._note_hit(kid, found[1], t0_ns=t0)
            return found[0]
        self._counters.add("misses")
        if reasons is not None:
            lookup_missed(self.root, kid, t0, reasons)
        if _monotonic() >= self._flush_at:
            self._flush_on_the_way()
        return None

    def _find_shared(
        self, kid: str, reasons: list[tuple[str, str]] | None, *, unlisted: bool = False
    ) -> tuple[bytes, str] | None:
        """``(bytes, store root)`` from the first shared store holding ``kid`` (copied in), else None.

        While the job's warm set is being fetched, an entry on the way is waited for
        (copied in by the fetch: found locally then), not asked for again.
        """
        warm = self._warm
        if warm is not None:
            came_from = warm.wait(kid)
            if came_from is not None:
                local = self._reader.lookup(kid)
                if local is not None:
                    if self._used is not None:
                        self._used.add(kid, local[1], len(local[0]))
                    return local[0], came_from
        unlisted = unlisted or getattr(self._past_list, "on", False)
        for store in self._shared:
            found = store.lookup(kid, unlisted=unlisted)
            if found is not None:
                data, digest = found
                if self._used is not None:
                    self._used.add(kid, digest, len(data))
                if self._copy_shared and not self.read_only:
                    self._copy_in(kid, data, digest)
                return data, store.root
            if reasons is not None:
                reasons.append((f"shared {store.root}", store.miss_reason()))
        return None

    # -- lookups for callers that count their own ------------------------------------

    def _find(self, kid: str) -> tuple[bytes, str | None] | None:
        """The verified bytes under key id ``kid``, and where: None for local, else a shared store's root.

        Counts neither a hit nor a miss and logs no lookup record. It serves a
        caller that answers one request from several entries (the front door's
        record and result) and reports that request once, with :meth:`_note_hit`
        or :meth:`_note_miss`.
        """
        found = self._reader.lookup(kid)
        if found is not None:
            if self._used is not None:
                self._used.add(kid, found[1], len(found[0]))
            return found[0], None
        return self._find_shared(kid, None)

    def _note_hit(self, kid: str, shared: str | None, *, t0_ns: int = 0, waited: bool = False) -> None:
        """Count one hit that the caller assembled with :meth:`_find` (``shared``: where it came from).

        ``waited``: found after waiting for another's :meth:`_claim` (counted in ``claim_hits`` too).
        """
        self._counters.hit()
        tally = self._hits_by_key
        if tally is not None:
            tally[kid] = tally.get(kid, 0) + 1
        if shared is not None:
            self._counters.add("shared_hits")
        if waited:
            self._counters.add("claim_hits")
        if _log.isEnabledFor(_DEBUG):
            lookup_hit(self.root, kid, "local" if shared is None else f"shared {shared}", t0_ns or _perf_ns())
        if _monotonic() >= self._flush_at:
            self._flush_on_the_way()

    def _note_miss(self, kid: str, reason: str, *, t0_ns: int = 0) -> None:
        """Count one miss that the caller decided itself, and record it with ``reason``.

        For the front door: new inputs, or a header changed since the entry was
        stored. ``t0_ns`` is when its lookup began (``time.perf_counter_ns``).
        """
        self._counters.add("misses")
        if _log.isEnabledFor(_DEBUG):
            lookup_missed(self.root, kid, t0_ns or _perf_ns(), [("local", reason)])
        if _monotonic() >= self._flush_at:
            self._flush_on_the_way()

    def _claim(self, kid: str, *, wait_s: float | None = None) -> AbstractContextManager[Claim]:
        """Single flight for key id ``kid`` on this node: ``with store.inner.claim(kid) as c:`` around a compile.

        The first process (or thread) to claim a key holds it (``c.held``) until its
        block ends; the others wait for that (``c.waited``), then look the key up
        again and compile only if it is still missing. A claim dies with its
        process. The wait is bounded by ``wait_s``, by default
        ``$CUDA_PROGRAM_CAS_CLAIM_WAIT`` or 5 minutes. A read-only or uncached store,
        or one where no lock can be taken, yields a claim neither held nor waited
        for, at once: compile. Never raises for what it meets on disk. See
        :mod:`cuda_program_cas._local.claims`.
        """
        from cuda_program_cas._base.config import env_claim_wait
        from cuda_program_cas._local.claims import Claim, claim

        if self.read_only:
            return nullcontext(Claim())
        bound = env_claim_wait() if wait_s is None else wait_s
        if self._lease_tier is None:
            return claim(self._layout.tmp, kid, bound, self._counters)
        return self._claim_in_cluster(kid, bound)

    @contextmanager
    def _claim_in_cluster(self, kid: str, bound: float) -> Iterator[Claim]:
        """The node's claim, then the cluster's lease on ``kid`` (:mod:`cuda_program_cas._shared.lease`)."""
        from cuda_program_cas._base.config import env_lease_ttl
        from cuda_program_cas._local.claims import Claim, claim
        from cuda_program_cas._shared.lease import lease

        tier = self._lease_tier
        assert tier is not None
        with claim(self._layout.tmp, kid, bound, self._counters) as mine:
            if mine.waited:
                yield mine  # another process of this node compiled it: the caller looks again
                return

            def probe() -> tuple[bytes, str] | None:
                # Copied in: the caller's next look is local. Unlisted: the other node's key list may lag its upload.
                return self._find_shared(kid, None, unlisted=True)

            wb = self._writeback
            can = wb is not None and wb.can_publish(tier)  # a node that cannot publish holds no lease
            with lease(
                tier, kid, ttl_s=env_lease_ttl(), wait_s=bound, probe=probe, counters=self._counters, take=can
            ) as got:
                if got.held:
                    self._leases[kid] = got
                if (got.held or not (can or got.waited)) and self._find_shared(kid, None, unlisted=True) is not None:
                    # Asked once more, past the key list: a node that let the lease go just now may have stored
                    # it, its key list not yet merged. Found: copied in, the caller's next look is local.
                    got.done(mark=False)  # there: given back plainly (others' lookups find it too)
                # The caller's lookups too (the front door's result, not only this key): past the key list.
                past, self._past_list.on = getattr(self._past_list, "on", False), True
                try:
                    yield Claim(held=mine.held or got.held, waited=got.waited, timed_out=got.waited and not got.held)
                finally:
                    self._past_list.on = past
                    self._leases.pop(kid, None)

    def _find_or_claim(
        self, kid: str, claims: ExitStack, *, reason: str = "not stored"
    ) -> tuple[bytes, str | None] | None:
        """:meth:`_find`, for a caller that compiles on a miss; one hit or one miss is counted.

        On a miss the node's :meth:`_claim` on ``kid`` is entered into ``claims``, so it
        is held until the caller closes that stack (its compile stored, or failed); when
        another held it, ``kid`` is looked up again, and found then it is a hit (and a
        claim hit). ``reason``: what the miss's record says.
        """
        t0 = _perf_ns()
        found = self._find(kid)
        if found is None:
            claim = claims.enter_context(self._claim(kid))
            if claim.held or claim.waited:
                found = self._find(kid)  # stored meanwhile, by the claimant waited for
                if found is not None:
                    self._note_hit(kid, found[1], t0_ns=t0, waited=claim.waited)
                    return found
            self._note_miss(kid, reason, t0_ns=t0)
            return None
        self._note_hit(kid, found[1], t0_ns=t0)
        return found

    def _note_compiled(
        self, kid: str, seconds: float, via: str, inputs: dict[str, object], why: str | None = None
    ) -> None:
        """Record that the entry ``kid`` just stored took ``seconds`` to compile, from ``inputs``.

        Its compile time goes to the usage ledger (:mod:`cuda_program_cas._local.usage`: what its hits
        will save) and its inputs, with ``why`` its lookup missed when the caller knows
        (a :class:`cuda_program_cas._local.journal.Why`), to the miss journal
        (:mod:`cuda_program_cas._local.journal`: what ``explain`` compares). Never raises;
        nothing is written on a read-only cache.
        """
        if self.read_only:
            return
        from cuda_program_cas._local.journal import record_miss
        from cuda_program_cas._local.usage import record_compile

        record_compile(self._layout, kid, seconds)
        record_miss(self._layout, kid, seconds, via, inputs, why=why)

    def compile_seconds(self, kid: str) -> float | None:
        """How long the entry under key id ``kid`` took to compile, as recorded when it was stored; None if unknown.

        What a caller weighs against the cost of asking a remote store. Known for
        entries this cache compiled and stored itself (a plain key's id is
        ``key_id(key)``; a ``cache.compile`` entry's is its record's id), not for
        ones copied from a shared store or imported. One ``stat`` of the ledger
        when it is unchanged since this process last read it.
        """
        from cuda_program_cas._local.usage import compile_us_of, key_number

        us = compile_us_of(self._layout, [key_number(kid)])
        return None if not us else next(iter(us.values())) / 1e6

    def _note_switched(self) -> None:
        """Count one compile or link that the switch sent through this cache (before its lookup)."""
        self._counters.add("switched")

    def _note_dropped(self, kid: str | None, reason: str) -> None:
        """Count a write the caller decided not to make (the front door: inputs it cannot key soundly)."""
        self._counters.add("dropped_writes")
        if _log.isEnabledFor(_DEBUG):
            wrote(self.root, kid or "-" * 12, "dropped", 0, _perf_ns(), reason=reason)

    def _copy_in(self, kid: str, data: bytes | memoryview, digest: str) -> None:
        """Keep a verified shared hit locally, so later reads stay local. Best effort."""
        try:
            self._commit(kid, data, digest)
        except OSError as exc:
            self._counters.add("dropped_writes")
            self._note("copy from shared store failed", exc.errno or 0, str(exc))

    # -- writes ------------------------------------------------------------------

    def _refuse(self, what: str) -> ReadOnlyCacheError:
        how = self._why_read_only or "was opened read-only"
        return ReadOnlyCacheError(f"cannot {what}: cache {self.root!r} {how}")

    def put(self, key: object, data: bytes) -> WriteResult:
        """Store ``data`` under ``key``; :class:`cuda_program_cas.WriteResult` says how (``DROPPED``: not stored).

        A write that cannot land is dropped and counted in ``dropped_writes``: on a
        read-only cache, a full disk, a directory this process may not write or
        that went read-only, a ``blobs/`` or ``tmp/`` moved to another disk. Raises
        ``TypeError`` for a key that is not ``str``/``bytes`` or data that is not
        ``bytes``.
        """
        return self._put_id(key_id(key), data)

    def _put_id(self, kid: str, data: bytes) -> WriteResult:
        """:meth:`put` under a key id the caller derived itself (the front door's grouped ids)."""
        if not isinstance(data, bytes):
            raise TypeError(
                f"CacheStore stores bytes, got {type(data).__name__} (other bytes-like values or ObjectCode "
                "go through ContentAddressedProgramCache)"
            )
        from cuda_program_cas._disk.writer import WriteResult

        t0 = _perf_ns() if _log.isEnabledFor(_DEBUG) else 0
        why: str | None
        if self.read_only:
            # As ccache and sccache in their read-only modes: the caller keeps its program.
            self._counters.add("dropped_writes")
            result, why = WriteResult.DROPPED, "read-only cache"
        else:
            digest = digest_of(data)
            result, why = self._store(kid, data, digest)
            if result and self._used is not None:
                self._used.add(kid, digest, len(data))
            if result and self._writeback is not None:
                held = self._leases.pop(kid, None) if self._leases else None
                # A lease held for this key is given back once the result is uploaded, so waiters find it.
                self._writeback.submit(kid, digest, data, then=None if held is None else held.pass_on())
            elif self._writeback is not None:
                self._writeback.not_stored(kid, why or "dropped")  # only new local entries are sent: counted
        if t0:
            wrote(self.root, kid, result.value, len(data), t0, reason=why)
        if _monotonic() >= self._flush_at:
            self._flush_on_the_way()
        return result

    def _store(self, kid: str, data: bytes, digest: str) -> tuple[WriteResult, str | None]:
        """Store one entry and count it; with ``DROPPED``, why."""
        from cuda_program_cas._disk.writer import DROP_ERRNOS, UNWRITABLE_ERRNOS, WriteResult

        most = self.max_size_bytes
        if most is not None and len(data) + LONGEST_MANIFEST > most:
            # It could never fit: storing it would only evict everything else, then itself.
            self._counters.add("dropped_writes")
            self._note("value larger than the cap", 0, f"{len(data)} bytes > max_size_bytes={most}")
            return WriteResult.DROPPED, f"larger than max_size_bytes={most}"
        try:
            result = self._commit(kid, data, digest)
        except OSError as exc:
            if exc.errno not in DROP_ERRNOS and exc.errno not in UNWRITABLE_ERRNOS:
                raise
            self._counters.add("dropped_writes")
            self._note("write dropped", exc.errno or 0, f"{exc}{_DROP_HINTS.get(exc.errno or 0, '')}")
            return WriteResult.DROPPED, str(exc)
        if not result:
            self._counters.add("dropped_writes")
            return result, "a shard is not a directory, or a file stayed locked"
        self._counters.add("writes")
        if result is WriteResult.DEDUPLICATED:
            self._counters.add("dedup_writes")
        return result, None

    def _commit(self, kid: str, data: bytes | memoryview, digest: str) -> WriteResult:
        """The write protocol for one entry, then the cap's accounting; retires the blob it replaced."""
        from cuda_program_cas._disk.writer import WriteResult

        assert not self.read_only
        writer, remover = self._parts.writer(), self._parts.remover()
        before = self._reader.current_digest(kid)
        result = writer.commit(kid, data, digest)
        if not result:
            return result
        if before is not None and before != digest:
            remover.retire(before)
        if self.max_size_bytes is not None and (cap := self._cap) is not None:  # an uncapped write makes no cap
            added = manifest_length(len(data)) + (len(data) if result is WriteResult.STORED else 0)
            cap.account(added, written=kid)
        return result

    # -- the size cap --------------------------------------------------------------

    def _enforce_cap(self, *, budget: int | None = NOT_GIVEN) -> RemovalResult | None:
        """Bring the stored bytes under the cap if over it (see :meth:`cuda_program_cas._local.cap.SizeCap.enforce`).

        ``budget`` not given: :data:`cuda_program_cas._local.cap.EVICT_STEP`.
        """
        from cuda_program_cas._local.cap import EVICT_STEP

        if self._cap is None or self.max_size_bytes is None:
            return None
        return self._cap.enforce(budget=EVICT_STEP if budget is NOT_GIVEN else budget)

    def _evict_to(self, snap: Snapshot, target_bytes: int, *, orphan_grace_s: float = NOT_GIVEN) -> RemovalResult:
        """Reference-aware LRU down to ``target_bytes`` from a snapshot, all at once (the caller holds the lock).

        ``orphan_grace_s`` not given: :data:`cuda_program_cas._local.cap.ORPHAN_GRACE_S`.
        """
        from cuda_program_cas._local.cap import ORPHAN_GRACE_S

        if self._cap is None:
            raise self._refuse("evict")
        grace = ORPHAN_GRACE_S if orphan_grace_s is NOT_GIVEN else orphan_grace_s
        return self._cap.evict_to(snap, target_bytes, orphan_grace_s=grace)

    # -- deletion ----------------------------------------------------------------

    def delete(self, key: object) -> None:
        """Remove ``key``; ``KeyError`` if absent. A blob no other key names goes at the next collection."""
        if not self._delete_id(key_id(key)):
            raise KeyError(key)

    def _delete_id(self, kid: str) -> bool:
        """:meth:`delete` by key id; False when there was no such entry."""
        if self.read_only:
            raise self._refuse("delete a key")
        if not self._guard.ok(self._layout.index, kid):
            return False
        remover = self._parts.remover()
        before = self._reader.current_digest(kid)
        if not remover.manifest(kid):
            return False
        if before is not None:
            remover.retire(before)
        return True

    def clear(self) -> None:
        """Remove every entry and blob, keeping whatever a concurrent writer adds meanwhile."""
        from cuda_program_cas._disk.remove import RemovalPlan, removable_orphans
        from cuda_program_cas._disk.scan import take_snapshot
        from cuda_program_cas._local.cap import ORPHAN_GRACE_S

        if self.read_only:
            raise self._refuse("clear")
        remover = self._parts.remover()
        with self._clear_lock:
            retired: dict[str, FileId] = {}
            # Two passes of one plan: the second takes the blobs the first retired
            # (too young to remove with their last manifest) if still untouched.
            for _ in range(2):
                snap = take_snapshot(self._layout.index, self._layout.blobs, clock_dir=self._layout.tmp)
                plan = RemovalPlan(
                    snap,
                    manifests=list(snap.manifests),
                    orphans=removable_orphans(snap, int(ORPHAN_GRACE_S * 1e9), retired),
                )
                retired = remover.execute(plan).retired
                if not retired:
                    break
            remover.sweep_temp()
            self._reader.forget()
            if self._cap_made is not None:  # a cap not made yet has nothing to forget
                self._cap_made.reset()

    # -- inspection ----------------------------------------------------------------

    def __len__(self) -> int:
        from cuda_program_cas._disk.scan import take_snapshot

        return len(take_snapshot(self._layout.index, self._layout.blobs, read_manifests=False).manifests)

    @property
    def max_size_bytes(self) -> int | None:
        if self._max_from_cache:
            from cuda_program_cas._disk.settings import stored_max_size

            self._max = stored_max_size(self.root)
            self._max_from_cache = False
        return self._max

    def _snapshot(self) -> Snapshot:
        """A scan of the local cache, as an eviction plans from (this process's queued touches land first)."""
        from cuda_program_cas._disk.scan import take_snapshot

        if not self.read_only:
            apply_pending()
        return take_snapshot(
            self._layout.index, self._layout.blobs, clock_dir=None if self.read_only else self._layout.tmp
        )

    def counters(self) -> dict[str, int]:
        """This instance's counters (and its shared stores' errors), without scanning the disk."""
        return _merged(self._counters, tuple(s.counters for s in self._shared))

    # -- lifetime counters -----------------------------------------------------------

    def _flush_on_the_way(self) -> None:
        """Record the counts in the lifetime counters, at most once per interval (a lookup or write is due)."""
        self._flush_at = _monotonic() + FLUSH_INTERVAL_S
        touches = self._reader.touches
        if touches is not None:
            touches.apply()
            ensure_thread()  # from now on a thread lands touches even while the process is idle
        if self._lifetime is not None:
            self._lifetime.flush()

    def flush(self) -> bool:
        """Apply the recency touches of this instance's hits and record its counts in the lifetime counters now.

        Returns False when the counts could not be recorded (they wait for the next
        flush). A no-op on a read-only cache. Both happen anyway: touches within
        about a second (:mod:`cuda_program_cas._local.touch`), counts at most once a second, and both
        at ``close()``, at garbage collection and at exit.
        """
        if self._reader.touches is not None:
            self._reader.touches.apply()
        return self._lifetime is None or self._lifetime.flush(last=True)

    def close(self) -> None:
        """Apply touches and record counts (see :meth:`flush`), and send queued uploads to writable stores.

        The uploads get at most :data:`cuda_program_cas._shared.writeback.EXIT_FLUSH_S`; what is left then
        is dropped and counted. Nothing else is held open; the store stays usable.
        """
        if self._writeback is not None:
            from cuda_program_cas._shared.writeback import EXIT_FLUSH_S

            self._writeback.flush(EXIT_FLUSH_S)
        self.flush()
        if self._shared:
            from cuda_program_cas._shared.tier import say_untrusted

            say_untrusted(self._shared_paths())

    def stats(self) -> CacheStats:
        """What the local cache holds now (a scan) and this instance's counters."""
        from cuda_program_cas._disk.scan import take_snapshot
        from cuda_program_cas._local.cachestats import CacheStats

        snap = take_snapshot(self._layout.index, self._layout.blobs)
        return CacheStats(
            entries=len(snap.manifests),
            blobs=len(snap.blobs),
            logical_bytes=snap.logical_bytes,
            stored_bytes=snap.stored_bytes,
            blob_bytes=snap.blob_bytes,
            max_size_bytes=self.max_size_bytes,
            **self.counters(),
        )

    def _shared_paths(self) -> Sequence[str]:
        return tuple(s.root for s in self._shared)


class Inner:
    """What the CUDA layer asks of a :class:`CacheStore` beyond its public API: ``store.inner`` makes one.

    Lookups that count their own hit or miss
    (the front door's record and result, a link), claims around a compile, writes and
    removals by key id, what a compile recorded, the cap's eviction, and the store's
    parts (its layout, its shared stores, its warm set, its blobs), which tests and tools
    inspect. The public API is what docs/python-api.md lists; nothing here is part of it.

    Its methods are the store's own, bound when it is made: a call through it is the
    call it names, with nothing in between (the front door's hit makes three). The store
    keeps no reference to it, so that dropping the store's last reference still frees it
    at once (and that flushes its counters); a caller that asks on every compile keeps
    the one it got.
    """

    __slots__ = (
        "claim",
        "delete_id",
        "enforce_cap",
        "evict_to",
        "find",
        "find_or_claim",
        "layout",
        "note_compiled",
        "note_dropped",
        "note_hit",
        "note_miss",
        "note_switched",
        "put_id",
        "shared",
        "shared_paths",
        "snapshot",
        "store",
        "warm",
    )

    def __init__(self, store: CacheStore) -> None:
        #: The store itself, for its public API (``read_only``, ``root``...).
        self.store = store
        self.layout = store._layout
        #: The shared stores, in the order looked up (:class:`cuda_program_cas._shared.tier.Tier`).
        self.shared = store._shared
        #: The job's warm set fetch (:mod:`cuda_program_cas._shared.warmset`), or None.
        self.warm = store._warm
        self.find = store._find
        self.note_hit = store._note_hit
        self.note_miss = store._note_miss
        self.claim = store._claim
        self.find_or_claim = store._find_or_claim
        self.note_compiled = store._note_compiled
        self.note_switched = store._note_switched
        self.note_dropped = store._note_dropped
        self.put_id = store._put_id
        self.delete_id = store._delete_id
        self.enforce_cap = store._enforce_cap
        self.evict_to = store._evict_to
        self.snapshot = store._snapshot
        self.shared_paths = store._shared_paths

    @property
    def blobs(self) -> BlobStore:
        """The blob store of the local cache (made on first use)."""
        return self.store._blobs


class _Parts:
    """The writer and the remover of a writable store, each made on first use (it refers to no store or reader).

    Making the writer sweeps ``tmp/`` of stale temp files first: the leftovers of
    crashed writers go at the next process that writes, not at every open.
    """

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


class _Problems:
    """Logs the local cache's problems once per kind, at WARNING."""

    def __init__(self, root: str, counters: Counters) -> None:
        self._root = root
        self._counters = counters
        self._warned: set[tuple[str, int]] = set()

    def note(self, what: str, code: int, message: str) -> None:
        if (what, code) in self._warned:
            return
        self._warned.add((what, code))
        _log.warning("cuda-program-cas: %s (%s): %s", self._root, what, message)

    def strange_shard(self, shard: str) -> None:
        self._counters.add("corrupt")
        self.note("shard is not a directory", 0, f"{shard} is a symlink or a file; its keys are misses")


def _merged(local: Counters, shared: tuple[Counters, ...], lock: bool = True) -> dict[str, int]:
    """An instance's counts: its own, with its shared stores' errors, corrupt and untrusted entries, and misses
    their key lists answered or that were skipped as slower than compiling."""
    counts = local.as_dict(lock=lock)
    for tier_counts in shared:
        theirs = tier_counts.as_dict(lock=lock)
        counts["errors"] += theirs["errors"]
        counts["corrupt"] += theirs["corrupt"]
        counts["untrusted"] += theirs["untrusted"]
        counts["listed_misses"] += theirs["listed_misses"]
        counts["skipped_lookups"] += theirs["skipped_lookups"]
    return counts
