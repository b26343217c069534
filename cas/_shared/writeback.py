"""Write-back: a node's new entries copied to the stores named writable, in the background.

:meth:`WriteBack.submit` queues an entry and returns at once: a compile never waits for a
network. One worker thread per instance sends it as publish does (:func:`.upload.upload_entry`),
so a reader never finds a manifest before its blob; signed with ``$CUDA_PROGRAM_CAS_SIGNING_KEY``
where set (a key that cannot be used drops every upload rather than send what trusting nodes
would ignore). What is not sent (a full queue, a paused or failing store, still queued
:data:`EXIT_FLUSH_S` into exit, not stored locally) is counted in ``uploads_dropped``, said once,
never retried. Once the job is quiet (``QUIET_S``) and at exit, the keys sent go into each
store's key list and the warm set is sent. Hits copied in and node-local key ids are never sent.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from cuda_program_cas._base.config import say_once
from cuda_program_cas._base.engine import StoreFailure
from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._base.signing import Signer
from cuda_program_cas._local.stats import Counters
from cuda_program_cas.index import Manifest, is_local_id

from .keylist import compile_ms, merge_into, number
from .upload import put_checked, upload_entry
from .warmset import QUIET_S
from .warmset import parse as parse_set

if TYPE_CHECKING:
    from .tier import Tier

__all__ = ["EXIT_FLUSH_S", "WriteBack"]

_log = logging.getLogger("cuda_program_cas")

#: Entries waiting at most; one more is dropped. A node compiles a few per second at most.
MAX_QUEUED = 256
#: Bytes waiting at most (the entries' blobs); one more is dropped.
MAX_QUEUED_BYTES = 64 << 20
#: How long an exiting process waits for its queue to drain.
EXIT_FLUSH_S = 2.0

#: A worker with nothing to send this long ends.
_IDLE_S = 5.0

#: ``then(sent)``: called by the worker after an entry's uploads (``sent``: it reached every store).
Then = Callable[[bool], None]
#: ``make(tier)``: the warm set's object name and bytes to send to ``tier``, or None (nothing new there).
SetMaker = Callable[["Tier"], "tuple[str, bytes] | None"]
#: ``seconds(kid)``: the compile time the local usage ledger holds for an entry, or None.
Seconds = Callable[[str], "float | None"]
#: What the worker's next job is when it is the quiet send (the key lists, the warm set).
_SET: tuple[str, str, bytes, Then | None] = ("", "", b"", None)


class WriteBack:
    """The background uploads of one cache instance to ``tiers`` (its writable stores)."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        counters: Counters,
        *,
        signer: Signer | None = None,
        unusable: str | None = None,
        seconds: Seconds | None = None,
    ) -> None:
        self.tiers = tuple(tiers)
        self._seconds = seconds
        self._signer = signer
        self._unusable = unusable
        self._counters = counters
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[tuple[str, str, bytes, Then | None]] = deque()
        self._queued_bytes = 0
        self._busy = 0  # entries taken by the worker and not yet sent
        self._worker: threading.Thread | None = None
        self._closed = False
        self._set_maker: SetMaker | None = None
        self._set_due = False  # the set or the key lists are due: sent once the job is quiet
        self._set_wanted = False  # used entries the stores' set lacks
        self._set_at = 0.0  # when the set was last marked due
        self._flushing = 0  # flushes waiting: the quiet send does not wait for quiet
        #: Per store (by position): keys uploaded there and not yet merged into its key list.
        self._unlisted: list[list[str]] = [[] for _ in self.tiers]
        #: Per store (by position): whether its last upload failed.
        self._failing = [False] * len(self.tiers)
        #: Warm sets sent.
        self.sets_sent = 0
        after_fork(self)
        _instances.add(self)

    def _after_fork_in_child(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue = deque()
        self._queued_bytes = self._busy = 0
        self._worker = None
        self._set_due = self._set_wanted = False  # the child's own uses make it due again
        self._unlisted = [[] for _ in self.tiers]
        self._flushing = 0

    def keep_set(self, make: SetMaker) -> None:
        self._set_maker = make

    def set_changed(self) -> None:
        """The job used an entry its set lacks: send the set once the job is quiet."""
        if self._set_maker is None:
            return
        with self._cond:
            if self._closed:
                return
            self._set_wanted = True
            self._due()

    def _due(self) -> None:
        """The quiet send (the set, the key lists) is due ``QUIET_S`` from now (under the lock)."""
        self._set_due = True
        self._set_at = time.monotonic()
        self._start_worker()
        self._cond.notify()

    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="cuda-program-cas-writeback", daemon=True)
            self._worker.start()

    def not_stored(self, kid: str, why: str) -> None:
        """A new entry the local cache could not store: a drop for each store."""
        if not is_local_id(kid):
            self._refused(f"the local cache did not store it: {why}")

    def can_publish(self, tier: Tier) -> bool:
        """Whether an entry submitted now could reach ``tier`` (a node that cannot takes no lease)."""
        at = self.tiers.index(tier)
        return self._unusable is None and not tier.paused() and not self._failing[at]

    def submit(self, kid: str, digest: str, data: bytes, then: Then | None = None) -> bool:
        """Queue one new local entry for upload; False when dropped at once. ``then(sent)`` runs after."""
        if is_local_id(kid) or self._unusable is not None:
            return self._refused(self._unusable, then)
        paused = [t for t in self.tiers if t.paused()]
        for tier in paused:
            self._dropped(tier.root, f"the store is paused ({tier.why_not()})")
        if len(paused) == len(self.tiers):
            return self._refused(None, then)
        with self._cond:
            full = self._closed or len(self._queue) >= MAX_QUEUED or self._queued_bytes + len(data) > MAX_QUEUED_BYTES
            if not full:
                self._queue.append((kid, digest, data, then))
                self._queued_bytes += len(data)
                self._start_worker()
                self._cond.notify()
        if full:
            return self._refused(f"the upload queue is full ({MAX_QUEUED} entries or {MAX_QUEUED_BYTES} bytes)", then)
        return True

    def _refused(self, why: str | None, then: Then | None = None) -> bool:
        """An entry not queued: a drop for each store, said with ``why`` (None: not counted); ``then(False)``."""
        if why is not None:
            for tier in self.tiers:
                self._dropped(tier.root, why)
        if then is not None:
            then(False)
        return False

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._next()
                if job is None:
                    self._worker = None  # idle: the next upload starts another
                    return
                self._busy += 1
            try:
                if job is _SET:
                    self._send_set()
                else:
                    self._send_entry(*job)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def _next(self) -> tuple[str, str, bytes, Then | None] | None:
        """Under the lock: the next entry, or :data:`_SET` (the quiet send is due and the queue empty); None: idle."""
        while True:
            if self._queue:
                job = self._queue.popleft()
                self._queued_bytes -= len(job[2])
                return job
            if self._set_due:
                quiet = self._set_at + QUIET_S - time.monotonic()
                if quiet <= 0 or self._flushing:
                    self._set_due = False
                    return _SET
                self._cond.wait(quiet)
                continue
            self._cond.wait(_IDLE_S)
            if not self._queue and not self._set_due:
                return None

    def _send_entry(self, kid: str, digest: str, data: bytes, then: Then | None) -> None:
        sent = True
        try:
            for at, tier in enumerate(self.tiers):
                self._failing[at] = failed = not self._send(tier, kid, digest, data)
                if not failed:
                    if tier.keys is not None:
                        tier.keys.add([(number(kid), 0)])  # this node finds it there at once
                    with self._cond:
                        self._unlisted[at].append(kid)
                        self._due()
                else:
                    sent = False
        finally:
            if then is not None:
                try:
                    then(sent)
                except Exception:
                    _log.debug("cuda-program-cas: write-back callback failed", exc_info=True)

    def _send(self, tier: Tier, kid: str, digest: str, data: bytes) -> bool:
        if tier.paused():
            self._dropped(tier.root, f"the store is paused ({tier.why_not()})")
            return False
        line = Manifest(digest, len(data), kid).encode()
        if self._signer is not None:
            line += self._signer.sign(line)
        if not self._tried(tier, "", lambda: upload_entry(tier.engine, kid, digest, data, line)):
            return False
        self._counters.add("uploads")
        return True

    def _send_set(self) -> None:
        """The key lists, then the warm set, to each store (after the entries they name)."""
        with self._cond:
            unlisted, self._unlisted = self._unlisted, [[] for _ in self.tiers]
            wanted, self._set_wanted = self._set_wanted, False
        for tier, kids in zip(self.tiers, unlisted, strict=True):
            if kids and not tier.paused():
                self._send_keys(tier, kids)
        make = self._set_maker
        if make is None or not wanted:
            return
        for tier in self.tiers:
            if tier.paused():
                continue
            self._tried(tier, "the warm set: ", functools.partial(self._put_set, tier, make))

    def _put_set(self, tier: Tier, make: Callable[[Tier], tuple[str, bytes] | None]) -> None:
        made = make(tier)
        if made is not None:
            name, data = made
            # Read back as every upload is; another node's whole set stored meanwhile is as good.
            put_checked(tier.engine, name, data, whole=True, accept=lambda held: parse_set(held) is not None)
            self.sets_sent += 1

    def _send_keys(self, tier: Tier, kids: list[str]) -> None:
        seconds = self._seconds
        ours = {number(kid): compile_ms(seconds(kid) if seconds is not None else None) for kid in kids}
        self._tried(tier, "the key list: ", lambda: merge_into(tier.engine, ours))

    def _tried(self, tier: Tier, what: str, call: Callable[[], object]) -> bool:
        """``call()`` to ``tier``: True when it returned, else a drop said with ``what``."""
        try:
            call()
            return True
        except StoreFailure as exc:
            tier.failed(exc)
            self._dropped(tier.root, f"{what}{exc}")
        except Exception as exc:
            self._dropped(tier.root, f"{what}{type(exc).__name__}: {exc}")
        return False

    def _dropped(self, root: str, why: str) -> None:
        self._counters.add("uploads_dropped")
        if not say_once(
            ("write-back", root),
            "cuda-program-cas: uploads to shared store %s are dropped: %s; entries stay in the local cache "
            "(said once per process)",
            root,
            why,
        ):
            _log.debug("cuda-program-cas: upload to %s dropped: %s", root, why)

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._busy

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every queued upload to finish; True when none is left."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            # The set and the key lists go now, not after QUIET_S (uploads still queued make them due again).
            self._flushing += 1
            self._cond.notify_all()
            try:
                while self._queue or self._busy or (self._set_due and self._worker is not None):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
            finally:
                self._flushing -= 1
        return True

    def close(self, timeout_s: float = EXIT_FLUSH_S) -> None:
        """Send what can be sent within ``timeout_s``; what is left is dropped (counted)."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
        for _kid, _digest, _data, then in left:
            self._refused(f"the process exited with uploads queued after {timeout_s:g} s", then)


_instances: weakref.WeakSet[WriteBack] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """All instances share one :data:`EXIT_FLUSH_S` at exit."""
    deadline = time.monotonic() + EXIT_FLUSH_S
    for wb in list(_instances):
        wb.close(max(0.0, deadline - time.monotonic()))
