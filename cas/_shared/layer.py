"""The cluster layer over one local cache: shared stores, write-back, leases, warm sets.

:class:`SharedLayer` wraps a local store, which knows nothing of it: after a local miss it
asks the shared stores in order and copies what they give in; it uploads new local entries
(:mod:`.writeback`), takes the cluster's lease around a compile (:mod:`.lease`) and records
and fetches the job's warm set (:mod:`.warmset`).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

from cuda_program_cas.index import LONGEST_MANIFEST

if TYPE_CHECKING:
    from cuda_program_cas._disk.writer import WriteResult
    from cuda_program_cas._local.claims import Claim
    from cuda_program_cas._local.local import LocalStore

    from .lease import Lease
    from .tier import Tier
    from .warmset import Used, WarmFetch
    from .writeback import WriteBack

__all__ = ["SharedLayer"]


class SharedLayer:
    """The shared stores of one local cache, in the order looked up, and what is sent back to them.

    ``copy_hits``: keep what a shared store gives in the local cache (after verification).
    """

    def __init__(self, local: LocalStore, shared: Iterable[str | os.PathLike[str]], *, copy_hits: bool) -> None:
        from cuda_program_cas._base.signing import env_trust

        self._local = local
        self._copy = bool(copy_hits) and not local.read_only
        self._trust = env_trust()
        me = weakref.ref(local)  # weak: the store's parts never keep it alive

        def keep(kid: str, data: bytes | memoryview, digest: str | None = None) -> None:
            store = me()
            if store is not None:
                store.copy_in(kid, data, digest)

        self._keep = keep
        self.tiers: tuple[Tier, ...] = tuple(self._open(p) for p in shared)
        local.read_through(tuple(s.counters for s in self.tiers))
        self.writeback: WriteBack | None = None
        #: The writable store that gives leases, if any; and the leases held.
        self.lease_tier: Tier | None = None
        self._leases: dict[str, Lease] = {}
        #: ``on`` in a thread inside a lease's block: its lookups go past the key lists, whose copies
        #: may predate another node's uploads.
        self._past_list = threading.local()
        targets = [s for s in self.tiers if s.writable]
        if targets and not local.read_only:
            self._write_back_to(targets)
        self.used: Used | None = None
        self.warm: WarmFetch | None = None
        if self.tiers and self._copy:
            from .warmset import job_name, set_name

            job = job_name()
            if job is not None:
                self._start_warm_set(set_name(job))

    def _open(self, where: str | os.PathLike[str]) -> Tier:
        """The reader of one shared store; its pack indexes kept locally."""
        from .tiers import open_tier

        local = self._local
        lookup = local.lookup

        def memo_get(kid: str) -> bytes | None:
            found = lookup(kid)
            return None if found is None else found[0]

        # A hit must fit the cap to be copied in; a large body waits in this cache's tmp/ while it is verified.
        cap = local.max_size_bytes
        room = None if cap is None else cap - LONGEST_MANIFEST
        tmp = None if local.read_only else local.layout.tmp
        return open_tier(
            os.fspath(where), memo_get=memo_get, memo_put=self._keep, trust=self._trust, max_entry=room, staging=tmp
        )

    def _write_back_to(self, targets: list[Tier]) -> None:
        from cuda_program_cas._base.signing import env_signer, untrusted_signer
        from cuda_program_cas._local.usage import compile_seconds_of

        from .writeback import WriteBack

        try:
            signer, unusable = env_signer(), None
        except ValueError as exc:
            signer, unusable = None, f"{exc} ($CUDA_PROGRAM_CAS_SIGNING_KEY)"
        if unusable is None and self._trust is not None:
            unusable = untrusted_signer(signer, self._trust)  # what this node's peers would all refuse
        seconds = functools.partial(compile_seconds_of, self._local.layout)  # the key lists' compile times
        counters = self._local.counters
        self.writeback = WriteBack(targets, counters, signer=signer, unusable=unusable, seconds=seconds)
        self.lease_tier = next((t for t in targets if t.engine.can.leases), None)

    def _start_warm_set(self, name: str) -> None:
        from .warmset import MAX_SET_BYTES, Used, WarmFetch, updated

        local = self._local
        current = local.reader.current_digest
        used = self.used = Used() if self.writeback is not None else None

        def is_local(kid: str, digest: str) -> bool:
            return current(kid) == digest

        warm = self.warm = WarmFetch(
            self.tiers,
            name,
            is_local=is_local,
            keep=self._keep,
            room=local.max_size_bytes,
            used=used,
            per_entry=LONGEST_MANIFEST,
        )
        if used is not None and self.writeback is not None:

            def make(tier: Tier) -> tuple[str, bytes] | None:
                packs = tier.ranged_packs()
                ours = used.entries(None if packs is None else packs.where)
                held = tier.engine.get(name, limit=MAX_SET_BYTES)
                data = updated(held, ours, warm.gone if warm.source is tier else None)
                return None if data is None else (name, data)

            used.changed = self.writeback.set_changed
            self.writeback.keep_set(make)
        # The fetch starts at the first local miss (warm.wait in find), not here.

    def find(
        self, kid: str, reasons: list[tuple[str, str]] | None, *, unlisted: bool = False
    ) -> tuple[bytes, str] | None:
        """``(bytes, store root)`` from the first shared store holding ``kid`` (copied in), else None.

        An entry the warm set's fetch has on the way is waited for, not asked again. ``reasons``: each store's miss.
        """
        warm, used = self.warm, self.used
        if warm is not None:
            came_from = warm.wait(kid)
            if came_from is not None:
                local = self._local.lookup(kid)
                if local is not None:
                    if used is not None:
                        used.add(kid, local[1], len(local[0]))
                    return local[0], came_from
        unlisted = unlisted or getattr(self._past_list, "on", False)
        for store in self.tiers:
            found = store.lookup(kid, unlisted=unlisted)
            if found is not None:
                data, digest = found
                if used is not None:
                    used.add(kid, digest, len(data))
                if self._copy:
                    self._local.copy_in(kid, data, digest)
                return data, store.root
            if reasons is not None:
                reasons.append((f"shared {store.root}", store.miss_reason()))
        return None

    def paths(self) -> Sequence[str]:
        return tuple(s.root for s in self.tiers)

    def stored(self, kid: str, digest: str, data: bytes, result: WriteResult, why: str | None) -> None:
        """A local write of ``kid`` happened: a new entry is uploaded."""
        if result and self.used is not None:
            self.used.add(kid, digest, len(data))
        wb = self.writeback
        if wb is None:
            return
        if result:
            held = self._leases.pop(kid, None) if self._leases else None
            # A lease held for this key is given back once the result is uploaded, so waiters find it.
            wb.submit(kid, digest, data, then=None if held is None else held.pass_on())
        else:
            wb.not_stored(kid, why or "dropped")  # only new local entries are sent: counted

    def claim(self, kid: str, bound: float) -> AbstractContextManager[Claim]:
        """The node's claim on ``kid``, then, where a writable store gives leases, the cluster's."""
        if self.lease_tier is None or self._local.read_only:
            return self._local.claim(kid, bound)
        return self._claim_in_cluster(kid, bound)

    @contextmanager
    def _claim_in_cluster(self, kid: str, bound: float) -> Iterator[Claim]:
        from cuda_program_cas._base.config import env_lease_ttl
        from cuda_program_cas._local.claims import Claim

        from .lease import lease

        tier = self.lease_tier
        assert tier is not None
        with self._local.claim(kid, bound) as mine:
            if mine.waited:
                yield mine  # another process of this node compiled it: the caller looks again
                return
            # Copied in: the caller's next look is local. Unlisted: the other node's key list may lag its upload.
            probe = functools.partial(self.find, kid, None, unlisted=True)
            wb = self.writeback
            can = wb is not None and wb.can_publish(tier)  # a node that cannot publish holds no lease
            counters = self._local.counters
            with lease(tier, kid, ttl_s=env_lease_ttl(), wait_s=bound, probe=probe, counters=counters, take=can) as got:
                if got.held:
                    self._leases[kid] = got
                if (got.held or not (can or got.waited)) and probe() is not None:
                    # A node that let the lease go just now may have stored it, its key list not yet merged.
                    got.done(mark=False)
                past, self._past_list.on = getattr(self._past_list, "on", False), True
                try:
                    yield Claim(held=mine.held or got.held, waited=got.waited, timed_out=got.waited and not got.held)
                finally:
                    self._past_list.on = past
                    self._leases.pop(kid, None)

    def close(self) -> None:
        """Send queued uploads (``EXIT_FLUSH_S`` at most), and say which stores held entries no trusted key signed."""
        if self.writeback is not None:
            from .writeback import EXIT_FLUSH_S

            self.writeback.flush(EXIT_FLUSH_S)
        from .tier import say_untrusted

        say_untrusted(self.paths())
