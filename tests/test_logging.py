"""What the ``cuda_program_cas`` logger says: one DEBUG record per lookup (with why a miss missed), per write,
eviction and collection; one WARNING per process for a shared store that cannot be used; nothing
at all, not even a clock reading, with logging off; ``CUDA_PROGRAM_CAS_LOG`` in a real process.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
from conftest import SAXPY, MovableClock, is_root, run_python
from test_degrade import tmpfs

import cuda_program_cas._local.local as local_mod
import cuda_program_cas._shared.tier as shared_mod
import cuda_program_cas._store.store as store_mod
from cuda_program_cas import CacheStore, collect, digest_of
from cuda_program_cas.index import key_id


def records(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "cas_event", None) == event]


def lookups(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "cas_event", None) in ("hit", "miss")]


def test_one_record_per_lookup_hit_or_miss_with_the_reason(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    store = CacheStore(tmp_path / "cas")
    for key in ("good", "damaged", "misplaced", "blob gone", "bad blob"):
        store.put(key, f"bytes of {key}".encode())
    lay = store.inner.layout
    Path(lay.manifest_path(key_id("damaged"))).write_bytes(b"cpcas2 garbage\n")
    shutil.copy(lay.manifest_path(key_id("good")), lay.manifest_path(key_id("misplaced")))
    os.unlink(lay.blob_path(digest_of(b"bytes of blob gone")))
    Path(lay.blob_path(digest_of(b"bytes of bad blob"))).write_bytes(b"bytes of bad blOb")
    caplog.clear()

    expected = {
        "good": None,
        "never stored": "local: no entry",
        "damaged": "local: damaged manifest",
        "misplaced": "local: misplaced manifest (another key's)",
        "blob gone": "local: blob missing",
        "bad blob": "local: damaged blob",
    }
    for key, reason in expected.items():
        caplog.clear()
        found = store.get(key)
        assert (found is None) == (reason is not None), key
        (record,) = lookups(caplog)
        assert record.levelno == logging.DEBUG and record.name == "cuda_program_cas"
        assert record.cas_key == key_id(key)[:12]  # type: ignore[attr-defined]
        assert isinstance(record.cas_us, int) and record.cas_us >= 0  # type: ignore[attr-defined]
        message = record.getMessage()
        assert key_id(key)[:12] in message and str(tmp_path / "cas") in message
        if reason is None:
            assert record.cas_event == "hit" and record.cas_store == "local"  # type: ignore[attr-defined]
            assert " hit local key " in message
        else:
            assert record.cas_event == "miss" and record.cas_reason == reason, key  # type: ignore[attr-defined]
            assert f"({reason})" in message


def test_a_shared_store_hit_or_miss_names_the_store(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "shared"
    CacheStore(shared).put("k", b"shared bytes")
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    gone = tmp_path / "gone"
    store = CacheStore(tmp_path / "local", shared=[gone, shared], copy_shared_hits=False)
    caplog.clear()
    assert store.get("k") == b"shared bytes"
    (hit,) = lookups(caplog)
    assert hit.cas_event == "hit" and hit.cas_store == f"shared {shared}"  # type: ignore[attr-defined]
    caplog.clear()
    assert store.get("other") is None
    (miss,) = lookups(caplog)
    reason = miss.cas_reason  # type: ignore[attr-defined]
    assert reason.startswith(f"local: no entry; shared {gone}: store not usable: ")
    assert "missing" in reason and reason.endswith(f"; shared {shared}: no entry")


def test_writes_evictions_and_collections_get_a_record(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    store = CacheStore(tmp_path / "cas", max_size_bytes=4000)
    store.put("a", b"x" * 1000)
    store.put("b", b"x" * 1000)
    store.put("huge", b"y" * 5000)
    written = [(r.cas_event, r.cas_key, r.cas_bytes) for r in caplog.records if hasattr(r, "cas_bytes")]  # type: ignore[attr-defined]
    assert written == [
        ("stored", key_id("a")[:12], 1000),
        ("deduplicated", key_id("b")[:12], 1000),
        ("dropped", key_id("huge")[:12], 5000),
    ]
    assert "larger than max_size_bytes=4000" in records(caplog, "dropped")[0].getMessage()
    for i in range(6):
        store.put(f"new {i}", os.urandom(900))
    (evict, *_) = records(caplog, "evict")
    assert evict.cas_entries >= 1 and evict.cas_bytes > 0  # type: ignore[attr-defined]
    assert "evicted" in evict.getMessage() and "freed" in evict.getMessage()
    caplog.clear()
    report = collect(tmp_path / "cas", grace_s=0)
    (gc_record,) = records(caplog, "gc")
    assert gc_record.cas_entries == report.entries_removed  # type: ignore[attr-defined]
    assert gc_record.cas_bytes == report.bytes_freed  # type: ignore[attr-defined]
    assert "gc removed" in gc_record.getMessage()


def test_with_logging_off_there_is_no_record_and_no_clock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="cuda_program_cas")

    def no_clock() -> int:
        raise AssertionError("the clock was read with DEBUG off")

    monkeypatch.setattr(store_mod, "_perf_ns", no_clock)
    monkeypatch.setattr(local_mod, "_perf_ns", no_clock)
    store = CacheStore(tmp_path / "cas", shared=[tmp_path / "cas"])
    store.put("k", b"v")
    assert store.get("k") == b"v" and store.get("nothing") is None
    assert [r for r in caplog.records if r.levelno < logging.WARNING] == []


# -- loud misconfiguration ----------------------------------------------------------------------


def test_a_mistyped_shared_path_warns_once_per_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = MovableClock()
    monkeypatch.setattr(shared_mod, "time", clock)
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    typo = tmp_path / "shraed"
    first = CacheStore(tmp_path / "one", shared=[typo])
    for _ in range(3):  # each past the retry interval: the store is checked again, and fails again
        clock.ahead += shared_mod.RETRY_S
        assert first.get("k") is None
    assert first.counters()["errors"] == 4
    second = CacheStore(tmp_path / "two", shared=[typo])  # another cache, the same process
    assert second.get("k") is None
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    message = warned[0].getMessage()
    assert str(typo) in message and "unusable: missing" in message and "once per process" in message
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r is not warned[0])


def test_a_store_of_a_newer_layout_or_not_a_cache_warns_naming_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    newer = tmp_path / "newer"
    CacheStore(newer)
    (newer / "layout.json").write_text('{"layout": "cuda-program-cas", "version": 99}')
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a cache")
    caplog.set_level(logging.WARNING, logger="cuda_program_cas")
    CacheStore(tmp_path / "local", shared=[newer, foreign])
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert str(newer) in messages[0] and "layout version 99" in messages[0]
    assert str(foreign) in messages[1] and "not a cuda-program-cas cache" in messages[1]


def test_a_store_that_goes_away_later_is_not_a_warning_on_any_retry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    CacheStore(shared).put("k", b"v")
    clock = MovableClock()
    monkeypatch.setattr(shared_mod, "time", clock)
    caplog.set_level(logging.DEBUG, logger="cuda_program_cas")
    store = CacheStore(tmp_path / "local", shared=[shared], copy_shared_hits=False)
    assert store.get("k") == b"v"
    shared.rename(tmp_path / "away")  # unmounted, say
    for _ in range(5):
        clock.ahead += shared_mod.RETRY_S
        assert store.get("k") is None
    (tmp_path / "away").rename(shared)
    clock.ahead += shared_mod.RETRY_S
    assert store.get("k") == b"v"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


# -- CUDA_PROGRAM_CAS_LOG ---------------------------------------------------------------------


def test_the_log_variable_appends_the_records_to_a_file(tmp_path: Path) -> None:
    log = tmp_path / "cas.log"
    code = (
        "import sys\nfrom cas import CacheStore\n"
        f"c = CacheStore({str(tmp_path / 'cas')!r}, shared=[{str(tmp_path / 'nowhere')!r}])\n"
        "c.put('k', b'value')\n"
        "assert c.get('k') == b'value' and c.get('other') is None\n"
    )
    for _ in range(2):
        proc = run_python(code, env={"CUDA_PROGRAM_CAS_LOG": str(log)})
        assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()
    kid = key_id("k")[:12]
    # Once per process each: the warning (and in each, its own first write of the key).
    assert sum("WARNING cuda-program-cas: shared store" in line for line in lines) == 2, lines
    for what in (" stored key " + kid, " deduplicated key " + kid):
        assert sum(what in line for line in lines) == 1, (what, lines)
    assert sum(f" hit local key {kid} in " in line for line in lines) == 2
    assert sum(" miss key " in line and "(local: no entry; shared " in line for line in lines) == 2
    pids = {line.split()[2] for line in lines}
    assert len(pids) == 2  # two processes appended to one file
    # The warning of the first process also went to stderr (Python's last resort); no DEBUG did.
    assert "DEBUG" not in proc.stderr


#: 200 lookups, one write and a shared store that is missing: a record each, and a WARNING. Then the
#: logger's level and how many handlers it has.
_LOOKUPS = (
    "import logging, sys\nfrom cuda_program_cas import CacheStore\n"
    "c = CacheStore(sys.argv[1], shared=[sys.argv[1] + '-nowhere'])\n"
    "c.put('k', b'value')\n"
    "for i in range(200):\n    c.get(f'key {i}')\n"
    "logger = logging.getLogger('cuda_program_cas')\n"
    "print('done', logger.level, len(logger.handlers))\n"
)


def log_to(path: os.PathLike[str] | str, cache: Path, *, cwd: Path | None = None, used: bool = False) -> list[str]:
    """Run the 200 lookups with ``CUDA_PROGRAM_CAS_LOG=path`` (10 s at most: a hang fails); the log's stderr lines.

    ``used``: the log is still written at the end (the logger at DEBUG with one handler);
    else nothing is (the logger as it was, without a handler).
    """
    code = _LOOKUPS if cwd is None else f"import os\nos.chdir({str(cwd)!r})\n{_LOOKUPS}"
    proc = run_python(code, str(cache), env={"CUDA_PROGRAM_CAS_LOG": str(path)}, timeout=10)
    assert proc.returncode == 0 and proc.stdout == ("done 10 1\n" if used else "done 0 0\n"), proc.stderr
    assert "Logging error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    return [line for line in proc.stderr.splitlines() if "CUDA_PROGRAM_CAS_LOG" in line]


def refused(lines: list[str], path: os.PathLike[str] | str, why: str) -> None:
    """One WARNING line: the path is not used, and why."""
    assert len(lines) == 1, lines
    assert f"CUDA_PROGRAM_CAS_LOG={path} is not used ({why}" in lines[0], lines[0]
    assert lines[0].endswith("nothing is logged there"), lines[0]


def test_a_log_that_is_a_fifo_is_refused_without_waiting_for_a_reader(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused(log_to(fifo, tmp_path / "cas"), fifo, "it is a FIFO, not a regular file")
    # With a reader waiting, the open would succeed: the FIFO is refused all the same, and nothing is sent.
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        refused(log_to(fifo, tmp_path / "cas"), fifo, "it is a FIFO, not a regular file")
        assert os.read(reader, 4096) == b""  # nothing was sent
    finally:
        os.close(reader)


def test_a_log_fifo_under_the_switch_does_not_hold_the_first_compile(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = (
        "from cuda.core import Program, ProgramOptions\n"
        f"Program({SAXPY!r}, 'c++', options=ProgramOptions(arch='sm_80')).compile('cubin')\nprint('done')\n"
    )
    env = {"CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "cas"), "CUDA_PROGRAM_CAS_LOG": str(fifo)}
    proc = run_python(code, env=env, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr
    refused([line for line in proc.stderr.splitlines() if "CUDA_PROGRAM_CAS_LOG" in line], fifo, "it is a FIFO")


def test_a_log_that_is_a_directory_a_device_or_a_symlink_is_refused(tmp_path: Path) -> None:
    refused(log_to(tmp_path, tmp_path / "cas"), tmp_path, "it is a directory, not a regular file")
    if os.path.exists("/dev/full"):
        refused(log_to("/dev/full", tmp_path / "cas"), "/dev/full", "it is a character device, not a regular file")
    target = tmp_path / "target.log"
    target.write_text("someone's file\n")
    link = tmp_path / "cas.log"
    link.symlink_to(target)
    refused(log_to(link, tmp_path / "cas"), link, "it is a symlink, and a symlink there is never followed")
    assert target.read_text() == "someone's file\n"
    dangling = tmp_path / "dangling.log"
    dangling.symlink_to(tmp_path / "created-through-the-link")
    refused(log_to(dangling, tmp_path / "cas"), dangling, "it is a symlink")
    assert not (tmp_path / "created-through-the-link").exists()


def test_a_log_that_cannot_be_opened_is_one_warning(tmp_path: Path) -> None:
    missing = tmp_path / "no such folder" / "cas.log"
    refused(log_to(missing, tmp_path / "cas"), missing, "it cannot be opened: No such file or directory")


def test_a_new_log_file_is_the_user_s_alone(tmp_path: Path) -> None:
    log = tmp_path / "cas.log"
    code = f"import os\nos.umask(0)\nexec({_LOOKUPS!r})"
    proc = run_python(code, str(tmp_path / "cas"), env={"CUDA_PROGRAM_CAS_LOG": str(log)}, timeout=10)
    assert proc.returncode == 0 and proc.stdout == "done 10 1\n", proc.stderr
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert sum(" miss key " in line for line in log.read_text().splitlines()) == 200


@pytest.mark.mount
@pytest.mark.skipif(not is_root(), reason="mounting needs root")
def test_a_log_on_a_full_disk_is_one_warning_then_dropped(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", size="16k") as disk:
        log = disk / "cas.log"
        lines = log_to(log, tmp_path / "cas")
        assert len(lines) == 1, lines
        assert f"CUDA_PROGRAM_CAS_LOG={log}: a write failed (No space left on device)" in lines[0]
        assert lines[0].endswith("nothing more is logged there")
        written = log.read_bytes()
        assert 0 < len(written) <= 16 << 10 and b" miss key " in written  # what fitted was written


@pytest.mark.skipif(not is_root(), reason="planting another user's files needs root")
def test_a_log_path_through_another_user_s_entry_in_a_shared_folder_is_refused(tmp_path: Path) -> None:
    """A shared folder (like /tmp: every user can write, sticky): what another user made there is not trusted."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.mkdir()
    planted_link = shared / "logs"
    planted_link.symlink_to(victim)
    os.lchown(planted_link, 65534, 65534)
    cas = tmp_path / "cas"
    why = f"{planted_link} belongs to uid 65534, in {shared}, which every user can write"
    refused(log_to(planted_link / "cas.log", cas), planted_link / "cas.log", why)
    # The same plant reached through a symlink of the user's own, and through '..' from a folder of theirs.
    own = tmp_path / "mine"
    own.symlink_to(planted_link)
    refused(log_to(own / "cas.log", cas), own / "cas.log", why)
    (shared / "work").mkdir()
    refused(log_to("../logs/cas.log", cas, cwd=shared / "work"), "../logs/cas.log", why)
    assert list(victim.iterdir()) == []
    # A folder another user made there: they could swap the file in it at any moment.
    planted_dir = shared / "theirs"
    planted_dir.mkdir()
    os.chown(planted_dir, 65534, 65534)
    refused(log_to(planted_dir / "cas.log", cas), planted_dir / "cas.log", f"{planted_dir} belongs to uid 65534")
    # A file another user made there, writable by all: it would receive this job's log.
    planted_file = shared / "cas.log"
    planted_file.write_text("")
    planted_file.chmod(0o666)
    os.chown(planted_file, 65534, 65534)
    refused(log_to(planted_file, cas), planted_file, "it belongs to uid 65534, in a folder that every user can write")
    assert planted_file.read_text() == ""
    # A folder every user can write that is not sticky: anyone can rename anything in it.
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    refused(log_to(loose / "cas.log", cas), loose / "cas.log", f"the way to it passes through {loose}, which every")
    # The user's own folder and file in the shared folder are used.
    (shared / "work" / "cas.log").write_text("")
    assert log_to(shared / "work" / "cas.log", cas, used=True) == []
    assert " miss key " in (shared / "work" / "cas.log").read_text()
