"""Fork safety: a child forked while another thread of its parent was inside the cache works.

``os.fork`` copies one thread. Each test stops a real thread of the parent inside a
critical section (a one-shot hook at a real call point, or the real lock held the
way the operation holds it), forks, lets the parent's thread finish, then has the
child do the same operation. The child reports through its exit status; a hang ends
it with SIGALRM, and the parent waits for it with a timeout.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import select
import signal
import threading
import traceback
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import cuda_program_cas
import cuda_program_cas._base.fork
import cuda_program_cas._local.lifetime
import cuda_program_cas._local.touch
from cuda_program_cas import CacheStore, publish
from cuda_program_cas._local.lifetime import read_counters
from cuda_program_cas.index import key_id

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

#: How long a child may take before it counts as hung (it has seconds of work at most).
HANG_S = 10

_LockType = type(threading.Lock())


class Pause:
    """A one-shot hook: the first call stops inside, with what its caller holds, until released."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.go = threading.Event()
        self._armed = True

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            if self._armed:
                self._armed = False  # before the fork: the child's calls go straight through
                self.inside.set()
                self.go.wait(HANG_S)
            return fn(*args, **kwargs)

        return hooked

    def hold(self, *locks: Any) -> Callable[[], None]:
        """An operation that holds ``locks`` (real ones, as the operation they stand for takes them) until released."""

        def operation() -> None:
            for lock in locks:
                lock.acquire()
            try:
                self.inside.set()
                self.go.wait(HANG_S)
            finally:
                for lock in reversed(locks):
                    lock.release()

        return operation


def wait_exit(pid: int, timeout: float) -> int:
    """The child's exit code (negative: the signal that ended it); kills it after ``timeout``."""
    if hasattr(os, "pidfd_open"):
        pidfd = os.pidfd_open(pid)
        try:
            ready, _, _ = select.select([pidfd], [], [], timeout)
        finally:
            os.close(pidfd)
        if not ready:
            os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def fork_while(pause: Pause, operation: Callable[[], object], child: Callable[[], bool]) -> None:
    """Run ``operation`` in a thread, fork while it is stopped at ``pause``, then run ``child`` in the child.

    The child starts only once the parent's thread has finished (it waits on a pipe):
    what it meets is what the fork left it, not a race with its parent.
    """
    failed: list[BaseException] = []

    def run() -> None:
        try:
            operation()
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert pause.inside.wait(HANG_S), "the operation never reached its hook"
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: fork in a process with threads
        pid = os.fork()
    if pid == 0:
        code = 2
        try:
            os.close(w)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(HANG_S)  # a hang ends the child
            os.read(r, 1)
            code = 0 if child() else 1
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(r)
    pause.go.set()
    thread.join(HANG_S)
    assert not thread.is_alive() and not failed, failed
    os.write(w, b"g")
    os.close(w)
    code = wait_exit(pid, HANG_S + 10)
    assert code == 0, {-signal.SIGALRM: "the child hung", 1: "the child got a wrong result"}.get(code, code)


def value(i: int, size: int = 1000) -> bytes:
    return i.to_bytes(4, "big") * (size // 4)


def test_a_child_forked_during_clear_can_clear(cache_dir: Path) -> None:
    store = CacheStore(cache_dir)
    for i in range(5):
        store.put(f"k{i}", value(i))
    pause = Pause()
    assert store._local.remover is not None
    store._local.remover.execute = pause.wrap(store._local.remover.execute)  # type: ignore[method-assign]

    def child() -> bool:
        store.put("mine", b"child")
        store.clear()
        return len(store) == 0 and store.get("mine") is None

    fork_while(pause, store.clear, child)
    assert len(store) == 0


def test_a_child_forked_during_an_eviction_keeps_its_cap(cache_dir: Path) -> None:
    cap = 10_000
    store = CacheStore(cache_dir, max_size_bytes=cap)
    for i in range(8):
        store.put(f"k{i}", value(i))
    pause = Pause()
    assert store._local.remover is not None
    store._local.remover.execute = pause.wrap(store._local.remover.execute)  # type: ignore[method-assign]

    def child() -> bool:
        for i in range(40):
            store.put(f"child{i}", value(100 + i))
        return store.inner.snapshot().stored_bytes <= cap and store.get("child39") == value(139)

    # The write that goes over the cap stops inside its eviction (it holds the
    # instance's evictor lock and evict.lock).
    fork_while(pause, lambda: [store.put(f"more{i}", value(50 + i)) for i in range(4)], child)
    assert store.inner.snapshot().stored_bytes <= cap


def test_a_child_forked_during_a_write_can_write(cache_dir: Path) -> None:
    store = CacheStore(cache_dir, max_size_bytes=1 << 20)
    store.put("k", b"v")
    assert store._local.cap is not None
    pause = Pause()

    def child() -> bool:
        results = [store.put(f"child{i}", value(i)) for i in range(3)]
        return all(results) and store.get("child2") == value(2) and store.counters()["writes"] == 4

    # A write counts itself under the cap's count lock and the counters' lock.
    fork_while(pause, pause.hold(store._local.cap._count_lock, store._local.counters._lock), child)


def test_a_child_forked_during_a_lookup_can_read_and_clear(cache_dir: Path) -> None:
    store = CacheStore(cache_dir)
    big = value(7, 64 << 10)  # past the size from which verified bytes are held in memory
    store.put("k", big)
    pause = Pause()

    def child() -> bool:
        ok = all(store.get("k") == big for _ in range(4))
        store.clear()  # forgets what the reader holds
        return ok and store.get("k") is None

    fork_while(pause, pause.hold(store._local.reader._held_lock), child)


def test_a_child_forked_during_a_counters_flush_records_its_counts(cache_dir: Path) -> None:
    store = CacheStore(cache_dir)
    store.put("k", b"v")
    assert store.get("k") == b"v"
    pause = Pause()
    real_append = cuda_program_cas._local.lifetime.append_line
    cuda_program_cas._local.lifetime.append_line = pause.wrap(real_append)  # type: ignore[attr-defined]
    try:

        def child() -> bool:
            hits = [store.get("k") == b"v" for _ in range(3)]
            return all(hits) and store.flush()

        # The flush stops while it holds the recorder's lock and counters.lock (an flock).
        fork_while(pause, store.flush, child)
    finally:
        cuda_program_cas._local.lifetime.append_line = real_append  # type: ignore[attr-defined]
    # The parent records after its child, and nothing is counted twice.
    assert store.get("k") == b"v"
    assert store.flush()
    counts = read_counters(store.inner.layout).counters
    assert (counts["writes"], counts["hits"]) == (1, 1 + 3 + 1)


def test_a_child_forked_during_touches_lands_its_own_reads(cache_dir: Path) -> None:
    store = CacheStore(cache_dir)
    store.put("k", b"v")
    manifest = Path(store.inner.layout.manifest_path(key_id("k")))
    os.utime(manifest, ns=(0, 0))
    cuda_program_cas._local.touch.ensure_thread()  # the parent has its touch thread
    pause = Pause()

    def child() -> bool:
        other = CacheStore(cache_dir)  # registers its touch queue with the process's one thread
        ok = other.get("k") == b"v" and store.get("k") == b"v"
        cuda_program_cas._local.touch.apply_pending()  # what an eviction does before it plans
        return ok and manifest.stat().st_mtime_ns > 0

    # The touch thread's registry lock, as a cache opening in another thread holds it.
    fork_while(pause, pause.hold(cuda_program_cas._local.touch._FLUSHER._lock), child)


def _locks(root: object, seen: set[int] | None = None, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """Every ``threading.Lock`` reachable from ``root`` through this package's objects (name, lock)."""
    seen = set() if seen is None else seen
    if id(root) in seen or depth > 8:
        return
    seen.add(id(root))
    if isinstance(root, _LockType):
        yield type(root).__name__, root
        return
    if isinstance(root, dict):
        children: list[tuple[str, object]] = [(repr(k)[:40], v) for k, v in list(root.items())]
    elif isinstance(root, (list, tuple, set, frozenset)):
        children = [(str(i), v) for i, v in enumerate(list(root))]
    elif isinstance(root, types.ModuleType):
        if not root.__name__.startswith("cuda_program_cas"):
            return
        children = [(n, v) for n, v in vars(root).items() if not n.startswith("__")]
    elif type(root).__module__.startswith("cuda_program_cas"):
        names = list(getattr(root, "__dict__", {}))
        for klass in type(root).__mro__:
            names += [s for s in getattr(klass, "__slots__", ()) if isinstance(s, str)]
        children = [(n, getattr(root, n, None)) for n in names if not n.startswith("__")]
    elif isinstance(root, weakref.WeakSet):
        children = [(str(i), v) for i, v in enumerate(list(root))]  # type: ignore[call-overload]
    else:
        return
    for name, child in children:
        for path, lock in _locks(child, seen, depth + 1):
            yield f"{name}.{path}", lock


def _everything(tmp_path: Path) -> list[object]:
    """A capped store over a loose and a packed shared store, with every module of the package."""
    src = CacheStore(tmp_path / "src")
    src.put("s", b"shared")
    publish([tmp_path / "src"], tmp_path / "loose")
    publish([tmp_path / "src"], tmp_path / "packed", pack=True)
    store = CacheStore(tmp_path / "cas", max_size_bytes=1 << 20, shared=[tmp_path / "loose", tmp_path / "packed"])
    store.put("k", b"v")
    assert store.get("k") == b"v" and store.get("s") == b"shared"
    for shared in store.inner.shared:
        assert shared.lookup(key_id("s")) is not None
    modules = [
        importlib.import_module(m.name)
        for m in pkgutil.walk_packages(cuda_program_cas.__path__, "cuda_program_cas.")
        if not m.name.endswith("__main__")
    ]
    from cuda_program_cas._cuda.frontdoor import FrontDoor

    return [store, FrontDoor(store), *modules]


def test_every_lock_of_the_package_is_free_in_a_forked_child(tmp_path: Path) -> None:
    # Whatever a new lock guards, a child forked while another thread holds it must not
    # inherit it held.
    roots = _everything(tmp_path)
    held = [lock for _, lock in _locks(roots)]
    assert len(held) >= 10  # the store's, its shared stores', the modules'
    pause = Pause()

    def child() -> bool:
        stuck = [name for name, lock in _locks(roots) if lock.locked()]
        if stuck:
            print("held in the child:", stuck)
        return not stuck

    fork_while(pause, pause.hold(*held), child)


class _Broken:
    """An owner whose reset fails (a bug in one owner)."""

    def _after_fork_in_child(self) -> None:
        raise RuntimeError("this reset fails")


def test_one_failing_reset_leaves_the_others_to_run(cache_dir: Path) -> None:
    broken = _Broken()
    cuda_program_cas._base.fork.after_fork(broken)
    cuda_program_cas._base.fork.after_fork_call(
        broken._after_fork_in_child
    )  # a module reset: those run before every owner's
    try:
        store = CacheStore(cache_dir)
        store.put("k", b"v")
        pause = Pause()

        def child() -> bool:
            store.clear()
            return len(store) == 0

        fork_while(pause, pause.hold(store._local.clear_lock), child)
    finally:
        cuda_program_cas._base.fork._calls.remove(broken._after_fork_in_child)
