"""Claims where locks behave as they do over NFS (docs/nfs.md, measured with the NFS harness).

A "non-blocking" try that does not return for a minute (NFSv3 with no ``rpc.statd``:
61 s in the harness), a claim file that the server removed while a waiter had it open
(``ESTALE`` on NFSv3), a waiter whose claimant let go on another node while this one
still caches the entry's absence, and how often a waiter asks for the lock (each try
is a round trip to the server). The lock is the kernel's, on a local file; where NFS
behaves otherwise, the test puts that behaviour at the ``flock`` seam and nothing else.
"""

from __future__ import annotations

import errno
import fcntl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cuda_program_cas import CacheStore
from cuda_program_cas._disk.layout import Layout
from cuda_program_cas._local import claims, flocks, lifetime
from cuda_program_cas.index import key_id

pytestmark = pytest.mark.skipif(claims.fcntl is None, reason="claims need flock")


class Seam:
    """``fcntl`` as claims see it: the real ``flock``, unless a test arms one of its faults."""

    LOCK_EX, LOCK_NB, LOCK_UN = fcntl.LOCK_EX, fcntl.LOCK_NB, fcntl.LOCK_UN

    def __init__(self) -> None:
        self.block = threading.Event()  # set: the next try blocks until `unblock` is set
        self.unblock = threading.Event()
        self.stale = threading.Event()  # set: the next try fails with ESTALE
        self.tries = 0

    def flock(self, fd: int, how: int) -> None:
        if how & fcntl.LOCK_NB:
            self.tries += 1
            if self.stale.is_set():
                self.stale.clear()
                raise OSError(errno.ESTALE, "Stale file handle")
            if self.block.is_set():
                self.block.clear()
                assert self.unblock.wait(60), "the test never let the try return"
        fcntl.flock(fd, how)


@pytest.fixture(autouse=True)
def no_try_left_out() -> Iterator[None]:
    """After each test, every abandoned try has come back: a try still out on this file system would
    make the next test's first claim give up at once (one stuck try per file system, by design)."""
    yield
    deadline = time.monotonic() + 30
    while flocks._STUCK.devs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not flocks._STUCK.devs, "a try the test abandoned never came back"


@pytest.fixture
def seam(monkeypatch: pytest.MonkeyPatch) -> Seam:
    fake = Seam()
    seen = SimpleNamespace(LOCK_EX=fake.LOCK_EX, LOCK_NB=fake.LOCK_NB, LOCK_UN=fake.LOCK_UN, flock=fake.flock)
    # Every try, the claims' and the lifetime counters', is made by flocks.try_lock; the modules'
    # own names too, so that a version of them that tries itself meets the same lock.
    for module in (flocks, claims, lifetime):
        monkeypatch.setattr(module, "fcntl", seen)
    # The seam stands for NFS: tries go through the bounded thread, as they do there (a local
    # file system's try is made in the caller's thread: it cannot block).
    monkeypatch.setattr(flocks, "_local", lambda fd: False)
    return fake


@pytest.fixture
def waiting(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set when a claim first waits for another's."""
    event = threading.Event()
    real_wait = claims._wait

    def said(fd: int, deadline: float) -> bool:
        event.set()
        return real_wait(fd, deadline)

    monkeypatch.setattr(claims, "_wait", said)
    return event


def in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(fn()), daemon=True)
    thread.start()
    return thread, got


def until(condition: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_try_that_does_not_return_is_given_up_at_the_bound(cache_dir: Path, seam: Seam) -> None:
    """A try that blocks (NFSv3 without rpc.statd: 61 s) costs the caller its bound, never more: no
    claim, compile. The try, when it returns, lets go of the lock it got and closes its file."""
    store = CacheStore(cache_dir)
    kid = key_id("k")

    def claim_with(wait_s: float) -> tuple[claims.Claim, float]:
        t0 = time.monotonic()
        with store.inner.claim(kid, wait_s=wait_s) as got:
            return got, time.monotonic() - t0

    for wait_s, least in ((0.2, 1.0), (1.5, 1.5)):  # the first try may take 1 s (claims._FIRST_TRY_S)
        seam.block.set()
        seam.unblock.clear()
        thread, got = in_thread(lambda w=wait_s: claim_with(w))
        thread.join(least + 5)
        assert not thread.is_alive(), f"a claim bounded by {wait_s} s still waits for its try"
        claim, took = got[0]
        assert (claim.held, claim.waited, claim.timed_out) == (False, False, False)
        assert least - 0.05 <= took < least + 1.0
        seam.unblock.set()  # the try returns now, with the lock: its thread lets go of it
        assert until(lambda: not flocks.OPEN_LOCKS), "the given-up try's file is still open"
        with store.inner.claim(kid, wait_s=0) as again:
            assert again.held and not again.waited


def test_a_try_that_outlasts_a_wait_ends_the_wait_at_its_bound(cache_dir: Path, seam: Seam) -> None:
    """While waiting for another's claim, a try that blocks is given up when the bound passes."""
    store = CacheStore(cache_dir)
    kid = key_id("k")
    with store.inner.claim(kid) as mine:
        assert mine.held
        real_wait = claims._wait

        def wait_then_block(fd: int, deadline: float) -> bool:
            seam.block.set()  # the next try, inside the wait, does not return
            return real_wait(fd, deadline)

        claims._wait = wait_then_block  # type: ignore[assignment]
        try:
            thread, got = in_thread(lambda: _timed(store, kid, 0.5))
            thread.join(10)
        finally:
            claims._wait = real_wait  # type: ignore[assignment]
            seam.unblock.set()
        assert not thread.is_alive()
        claim, took = got[0]
        assert (claim.held, claim.waited, claim.timed_out) == (False, True, True)
        assert took < 0.5 + 0.5


def _timed(store: CacheStore, kid: str, wait_s: float) -> tuple[claims.Claim, float]:
    t0 = time.monotonic()
    with store.inner.claim(kid, wait_s=wait_s) as got:
        return got, time.monotonic() - t0


def test_a_waiter_whose_claimant_let_go_takes_the_claim_afresh(cache_dir: Path, waiting: threading.Event) -> None:
    """The claimant let go (its file gone from the name): the waiter holds a new claim while it
    looks the key up, so that if it still misses (an NFS client caching the entry's absence) its
    compile is the node's one, and the node's other waiters wait for it."""
    store = CacheStore(cache_dir)
    kid = key_id("k")
    with store.inner.claim(kid) as first:
        assert first.held
        holding, let_go = threading.Event(), threading.Event()

        def second() -> claims.Claim:
            with store.inner.claim(kid, wait_s=60) as got:
                holding.set()
                assert let_go.wait(60)
                return got

        thread, got = in_thread(second)
        assert waiting.wait(60)
    assert holding.wait(60)  # the first let go: the second holds the claim now
    with store.inner.claim(kid, wait_s=0) as third:
        assert third.timed_out and not third.held  # it waits for the second, as for the first
    let_go.set()
    thread.join(60)
    assert got[0].held and got[0].waited
    assert sorted(p.name for p in (cache_dir / "tmp").iterdir() if p.name.endswith(".claim")) == []
    assert store.counters()["claim_waits"] == 2


def test_a_claim_file_the_server_removed_under_a_waiter_is_a_claimant_that_let_go(
    cache_dir: Path, seam: Seam, waiting: threading.Event
) -> None:
    """NFSv3: the claimant's node removed the file while this waiter had it open; the waiter's next
    try gets ESTALE. It takes the claim afresh, as when it finds the file gone from its name."""
    store = CacheStore(cache_dir)
    kid = key_id("k")
    with store.inner.claim(kid) as first:
        assert first.held
        thread, got = in_thread(lambda: _timed(store, kid, 60))
        assert waiting.wait(60)
        seam.stale.set()  # the waiter's next try: the file is gone on the server
        assert until(lambda: not seam.stale.is_set())
    thread.join(60)
    claim, _took = got[0]
    assert claim.held and claim.waited


def test_counters_whose_lock_does_not_answer_cost_a_flush_its_bound(cache_dir: Path, seam: Seam) -> None:
    """NFSv3, the server's lock manager gone from its rpcbind (the NFS harness): ``put`` flushed the
    lifetime counters under their lock, whose first try never returned, and ``put`` with it (and every
    ``close`` and interpreter exit). Now a flush gives up at its bound and keeps the counts; while the
    try is still out, later flushes give up at once (one stuck thread, not one per flush)."""
    store = CacheStore(cache_dir)
    store.put("k", b"v" * 100)
    seam.block.set()
    seam.unblock.clear()
    thread, got = in_thread(lambda: _timed_call(store.flush))
    thread.join(10)
    assert not thread.is_alive(), "a flush still waits for a lock call that does not return"
    recorded, took = got[0]
    assert recorded is False and took < lifetime._WAIT_LAST_S + 0.5
    tries = seam.tries
    recorded, took = _timed_call(store.flush)
    assert recorded is False and took < 0.1 and seam.tries == tries  # no second thread on that file system
    seam.unblock.set()  # the lock manager answers again
    assert until(lambda: not flocks._STUCK.devs)
    assert store.flush()  # the counts kept meanwhile are recorded now
    assert dict(lifetime.read_counters(Layout(str(cache_dir))).counters)["writes"] == 1
    store.close()


def test_a_flush_where_no_thread_can_start_still_records(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.12.1 starts no thread at interpreter shutdown, where the last flush runs: every exit
    lost its counts ("can't create new thread at interpreter shutdown"), and a direct flush raised.
    Where no thread starts, the try is made in the caller's thread, as before tries were bounded."""
    store = CacheStore(cache_dir)
    store.put("k", b"v" * 100)

    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refused)
    assert store.flush()
    with store.inner.claim(key_id("k"), wait_s=0) as got:  # a claim too
        assert got.held
    monkeypatch.undo()
    assert dict(lifetime.read_counters(Layout(str(cache_dir))).counters)["writes"] == 1
    store.close()


def _timed_call(fn: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    return fn(), time.monotonic() - t0


@pytest.mark.slow
def test_a_long_wait_asks_for_the_lock_less_and_less_often(cache_dir: Path, seam: Seam) -> None:
    """Each try over NFS is a LOCK call to the server: polling every 50 ms, a waiter sent 17 to 18 a
    second in the harness. Past its first second it asks every twentieth of the time waited."""
    store = CacheStore(cache_dir)
    kid = key_id("k")
    with store.inner.claim(kid) as mine:
        assert mine.held
        seam.tries = 0
        claim, took = _timed(store, kid, 6.0)
    assert claim.timed_out and 6.0 <= took < 6.5
    # Every 50 ms: about 126 tries in 6 s. Now about 25 in the first second and 20 * ln 6 = 36 after.
    assert seam.tries <= 80, seam.tries


@given(pause=st.floats(0.001, 1.0), waited=st.floats(0.0, 3600.0))
def test_the_pause_grows_and_a_release_is_seen_soon(pause: float, waited: float) -> None:
    after = claims._next_pause(pause, waited)
    assert after <= claims._LONGEST_PAUSE_S  # at least a try a second, however long the wait
    assert after >= min(2 * pause, claims._FAST_PAUSE_S)  # doubling at first, up to 50 ms
    assert after >= min(claims._PAUSE_SHARE * waited, claims._LONGEST_PAUSE_S)  # then a share of the wait
    # A release is seen within 50 ms or a twentieth of the time waited.
    assert after <= max(claims._FAST_PAUSE_S, claims._PAUSE_SHARE * waited)


def test_a_try_on_a_local_file_system_is_made_in_the_callers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread where a try cannot block: a thread costs 1-3 ms with cuda.core loaded, and every job's
    exit flushes its counters and ledger under two of these locks."""
    import os

    from cuda_program_cas._disk.fskind import STAT_RELIABLE, fs_type

    if fs_type(str(tmp_path)) not in STAT_RELIABLE:
        pytest.skip("the temp directory is not on a local file system")
    started: list[str] = []
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    path = tmp_path / "lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    other = os.open(path, os.O_RDWR)  # another open file description: flock tells them apart
    try:
        assert flocks.try_lock(fd, time.monotonic() + 1, os.close) is True
        assert flocks.try_lock(other, time.monotonic() + 1, os.close) is False
    finally:
        os.close(fd)
        os.close(other)
    assert started == []
    # On NFS (here: a file system taken for one) the bounded thread makes the try.
    monkeypatch.setattr(flocks, "_local", lambda fd: False)
    fd = os.open(path, os.O_RDWR)
    try:
        assert flocks.try_lock(fd, time.monotonic() + 1, os.close) is True
    finally:
        os.close(fd)
    assert started == ["cuda-program-cas flock"]
