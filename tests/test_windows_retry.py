"""Windows sharing violations, simulated: transient ones are retried, the rest propagate.

Nothing runs on Windows here, so the test sets ``cuda_program_cas._disk.files.IS_WINDOWS`` and
injects the fault where the OS would raise it: the ``os`` that the file-handling
modules call is replaced by a proxy that makes ``replace``/``unlink``/``open``
fail a given number of times with ``PermissionError(winerror=32)`` and otherwise
calls the real function.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

import cuda_program_cas._disk.atomic
import cuda_program_cas._disk.blobs
import cuda_program_cas._disk.files
import cuda_program_cas._disk.remove
import cuda_program_cas._disk.writer
import cuda_program_cas._local.reader
import cuda_program_cas._store.store
from cuda_program_cas import CacheStore, WriteResult
from cuda_program_cas._disk.atomic import atomic_write
from cuda_program_cas._disk.files import is_sharing_violation, read_regular, with_sharing_retry
from cuda_program_cas.index import key_id

ERROR_ACCESS_DENIED, ERROR_SHARING_VIOLATION, ERROR_LOCK_VIOLATION = 5, 32, 33
ALWAYS = 1 << 30


def win_error(winerror: int | None = ERROR_SHARING_VIOLATION, code: int = errno.EACCES) -> PermissionError:
    exc = PermissionError(code, "The process cannot access the file because it is being used by another process")
    if winerror is not None:
        exc.winerror = winerror  # type: ignore[attr-defined]
    return exc


class FlakyOS:
    """Stands in for ``os`` in one module: selected calls fail, everything else is real."""

    def __init__(self) -> None:
        self.plan: dict[str, tuple[int, Callable[[], BaseException], Callable[[str], bool]]] = {}
        self.attempts: dict[str, int] = {}

    def fail(
        self,
        name: str,
        times: int,
        exc: Callable[[], BaseException] = win_error,
        when: Callable[[str], bool] = lambda path: True,
    ) -> None:
        self.plan[name] = (times, exc, when)

    def _gate(self, name: str, path: object) -> None:
        if name not in self.plan:
            return
        times, exc, when = self.plan[name]
        if not isinstance(path, str) or not when(path):
            return
        self.attempts[name] = self.attempts.get(name, 0) + 1
        if times > 0:
            self.plan[name] = (times - 1, exc, when)
            raise exc()

    def replace(self, src, dst, **kwargs):
        self._gate("replace", dst)
        return os.replace(src, dst, **kwargs)

    def unlink(self, path, **kwargs):
        self._gate("unlink", path)
        return os.unlink(path, **kwargs)

    def open(self, path, flags, *args, **kwargs):
        self._gate("open", path)
        return os.open(path, flags, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(os, name)


#: Every module that touches cache files.
_FILE_MODULES = (
    cuda_program_cas._disk.files,
    cuda_program_cas._disk.atomic,
    cuda_program_cas._disk.writer,
    cuda_program_cas._disk.remove,
    cuda_program_cas._local.reader,
    cuda_program_cas._disk.blobs,
    cuda_program_cas._store.store,
)


@pytest.fixture
def windows(monkeypatch: pytest.MonkeyPatch) -> FlakyOS:
    """Simulated Windows with fault injection in every module that touches cache files."""
    flaky = FlakyOS()
    monkeypatch.setattr(cuda_program_cas._disk.files, "IS_WINDOWS", True)
    # As many attempts as the real budget, with shorter sleeps: exhausted budgets
    # are met many times here (the real budget is checked on its own above).
    monkeypatch.setattr(
        cuda_program_cas._disk.files, "_RETRY_DELAYS", tuple(d / 20 for d in cuda_program_cas._disk.files._RETRY_DELAYS)
    )
    for module in _FILE_MODULES:
        monkeypatch.setattr(module, "os", flaky)
    return flaky


@pytest.fixture
def posix(monkeypatch: pytest.MonkeyPatch) -> FlakyOS:
    flaky = FlakyOS()
    monkeypatch.setattr(cuda_program_cas._disk.files, "IS_WINDOWS", False)
    for module in _FILE_MODULES:
        monkeypatch.setattr(module, "os", flaky)
    return flaky


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def in_dir(directory: Path) -> Callable[[str], bool]:
    prefix = str(directory) + os.sep
    return lambda path: path.startswith(prefix)


# -- the predicate -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        pytest.param(win_error(ERROR_SHARING_VIOLATION), True, id="winerror-32"),
        pytest.param(win_error(ERROR_ACCESS_DENIED), True, id="winerror-5"),
        pytest.param(win_error(ERROR_LOCK_VIOLATION), True, id="winerror-33"),
        pytest.param(win_error(None, errno.EACCES), True, id="bare-EACCES"),
        pytest.param(win_error(None, errno.EPERM), False, id="bare-EPERM"),
        # The regression case: a non-sharing winerror that maps to EACCES is real.
        pytest.param(win_error(1920, errno.EACCES), False, id="other-winerror-with-EACCES"),
        pytest.param(win_error(2, errno.EACCES), False, id="winerror-2"),
        pytest.param(FileNotFoundError(errno.ENOENT, "gone"), False, id="not-a-PermissionError"),
        pytest.param(OSError(errno.EACCES, "plain OSError"), True, id="OSError-EACCES-is-PermissionError"),
    ],
)
def test_sharing_violation_predicate_on_windows(
    monkeypatch: pytest.MonkeyPatch, exc: BaseException, expected: bool
) -> None:
    monkeypatch.setattr(cuda_program_cas._disk.files, "IS_WINDOWS", True)
    assert is_sharing_violation(exc) is expected


def test_nothing_is_a_sharing_violation_off_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_program_cas._disk.files, "IS_WINDOWS", False)
    for winerror in (5, 32, 33, None):
        assert not is_sharing_violation(win_error(winerror))


def test_with_sharing_retry_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_program_cas._disk.files, "IS_WINDOWS", True)
    calls = []

    def busy_then(n: int):
        def op():
            calls.append(1)
            if len(calls) <= n:
                raise win_error()
            return "done"

        return op

    assert with_sharing_retry(busy_then(3)) == "done"
    assert len(calls) == 4
    calls.clear()
    with pytest.raises(PermissionError) as info:
        with_sharing_retry(busy_then(ALWAYS))
    assert info.value.winerror == ERROR_SHARING_VIOLATION  # type: ignore[attr-defined]
    budget = len(calls)
    assert 2 <= budget <= 20  # bounded: a busy file is given up on, not waited for
    calls.clear()
    with pytest.raises(PermissionError):
        with_sharing_retry(lambda: calls.append(1) or (_ for _ in ()).throw(win_error(1920)))
    assert len(calls) == 1  # a real permission problem is not retried


# -- writes ------------------------------------------------------------------------


@pytest.mark.parametrize("failures", [1, 3])
def test_write_succeeds_after_transient_replace_failures(cache_dir: Path, windows: FlakyOS, failures: int) -> None:
    store = CacheStore(cache_dir)
    windows.fail("replace", failures, when=in_dir(cache_dir / "index"))
    assert store.put("k", b"value") is WriteResult.STORED
    assert windows.plan["replace"][0] == 0  # every injected failure was met and retried
    assert windows.attempts["replace"] >= failures + 1
    assert store.get("k") == b"value"
    assert files_in(cache_dir / "tmp") == []
    assert store.stats().dropped_writes == 0


def test_exhausted_budget_drops_the_write_cleanly(cache_dir: Path, windows: FlakyOS) -> None:
    store = CacheStore(cache_dir)
    windows.fail("replace", ALWAYS)
    assert store.put("k", b"value") is WriteResult.DROPPED
    assert files_in(cache_dir / "tmp") == []  # no temp file left behind
    stats = store.stats()
    assert stats.dropped_writes == 1
    assert stats.writes == 0
    assert stats.entries == 0
    assert store.get("k") is None
    windows.plan.clear()
    assert store.put("k", b"value") is WriteResult.STORED  # the next attempt, once the file is free
    assert store.get("k") == b"value"


def test_exhausted_budget_on_the_manifest_alone(cache_dir: Path, windows: FlakyOS) -> None:
    store = CacheStore(cache_dir)
    store.put("k", b"old")
    windows.fail("replace", ALWAYS, when=in_dir(cache_dir / "index"))
    assert store.put("k", b"new") is WriteResult.DROPPED
    assert files_in(cache_dir / "tmp") == []
    assert store.get("k") == b"old"  # the previous entry is intact
    assert store.stats().dropped_writes == 1


def test_exhausted_budget_on_the_blob_is_not_reported_as_stored(cache_dir: Path, windows: FlakyOS) -> None:
    store = CacheStore(cache_dir)
    windows.fail("replace", ALWAYS, when=in_dir(cache_dir / "blobs"))
    stored = store.put("k", b"value")
    assert files_in(cache_dir / "tmp") == []
    assert store.get("k") is None  # a miss, never an exception
    assert stored is WriteResult.DROPPED
    assert store.stats().dropped_writes == 1
    assert store.stats().entries == 0  # no manifest naming a blob that is not there


def test_non_sharing_permission_error_is_not_retried_and_drops_the_write(cache_dir: Path, windows: FlakyOS) -> None:
    store = CacheStore(cache_dir)
    windows.fail("replace", ALWAYS, exc=lambda: win_error(1920))
    # Not a sharing violation: no retry. A cache that cannot be written drops the write and counts it.
    assert store.put("k", b"value") is WriteResult.DROPPED
    assert store.counters()["dropped_writes"] == 1
    assert windows.attempts["replace"] == 1
    assert files_in(cache_dir / "tmp") == []


def test_posix_permission_error_is_not_retried_and_drops_the_write(cache_dir: Path, posix: FlakyOS) -> None:
    store = CacheStore(cache_dir)
    posix.fail("replace", ALWAYS)  # even one carrying a sharing winerror
    assert store.put("k", b"value") is WriteResult.DROPPED
    assert store.counters()["dropped_writes"] == 1
    assert posix.attempts["replace"] == 1  # no retries off Windows
    assert files_in(cache_dir / "tmp") == []


def test_atomic_write_primitive(tmp_path: Path, windows: FlakyOS) -> None:
    target = tmp_path / "target"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    windows.fail("replace", 2)
    assert atomic_write(str(target), b"data", str(tmp)) is True
    assert target.read_bytes() == b"data"
    windows.fail("replace", ALWAYS)
    assert atomic_write(str(target), b"other", str(tmp)) is False
    assert target.read_bytes() == b"data"
    assert files_in(tmp) == []


# -- reads -------------------------------------------------------------------------


def test_read_succeeds_after_transient_open_failures(cache_dir: Path, windows: FlakyOS) -> None:
    store = CacheStore(cache_dir)
    store.put("k", b"value")
    reader = CacheStore(cache_dir)
    windows.fail("open", 2, when=in_dir(cache_dir / "blobs"))
    assert reader.get("k") == b"value"
    assert windows.attempts["open"] == 3
    windows.fail("open", 2, when=in_dir(cache_dir / "index"))
    assert CacheStore(cache_dir).get("k") == b"value"


def test_read_of_a_file_held_too_long_is_a_miss(cache_dir: Path, windows: FlakyOS) -> None:
    store = CacheStore(cache_dir)
    store.put("k", b"value")
    reader = CacheStore(cache_dir)
    windows.fail("open", ALWAYS, when=in_dir(cache_dir / "blobs"))
    assert reader.get("k") is None  # a miss, not an exception
    windows.plan.clear()
    kid = key_id("k")
    assert (cache_dir / "index" / kid[:2] / kid[2:]).exists()  # a busy blob is not a dangling one
    assert reader.get("k") == b"value"


def test_read_regular_maps_an_exhausted_budget_to_not_found(tmp_path: Path, windows: FlakyOS) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    windows.fail("open", ALWAYS)
    with pytest.raises(FileNotFoundError):
        read_regular(str(path))
    windows.fail("open", ALWAYS, exc=lambda: win_error(1920))
    with pytest.raises(PermissionError):
        read_regular(str(path))


# -- deletes and eviction ----------------------------------------------------------------


def test_delete_succeeds_after_transient_unlink_failures(cache_dir: Path, windows: FlakyOS) -> None:
    store = CacheStore(cache_dir)
    store.put("k", b"value")
    windows.fail("unlink", 3)
    store.delete("k")
    assert windows.attempts["unlink"] == 4
    assert store.get("k") is None


def test_eviction_does_not_crash_the_writer_on_a_held_file(cache_dir: Path, windows: FlakyOS) -> None:
    store = CacheStore(cache_dir, max_size_bytes=5000)
    windows.fail("unlink", ALWAYS, when=in_dir(cache_dir / "index"))
    for i in range(8):  # over the cap: eviction runs, every manifest unlink is refused
        assert store.put(f"k{i}", bytes([i]) * 1000) is WriteResult.STORED
    assert store.get("k7") == bytes([7]) * 1000
    windows.plan.clear()
    store.put("k8", bytes([8]) * 1000)
    assert store.stats().stored_bytes <= 5000  # once the files are free, the cap holds


def test_clear_skips_held_files(cache_dir: Path, windows: FlakyOS) -> None:
    store = CacheStore(cache_dir)
    for i in range(3):
        store.put(f"k{i}", bytes([i]) * 100)
    kid = key_id("k1")
    held = str(cache_dir / "index" / kid[:2] / kid[2:])
    windows.fail("unlink", ALWAYS, when=lambda path: path == held)
    store.clear()
    assert len(store) == 1
    assert store.get("k1") == bytes([1]) * 100
