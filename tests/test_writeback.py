"""Write-back to a directory store named writable (``ADDRESS|write``): real compiles, real processes, real mounts.

A node's new entries reach the writable store blob first; hits copied in from a
store are not sent back; a store not named writable is never written; a store
that fails drops uploads, counted and said once; an exiting process sends what
it queued.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import SAXPY, compile_program, is_root, run_python
from test_cluster import SCALE, listing

from cuda_program_cas import CacheStore, ContentAddressedProgramCache, digest_of
from cuda_program_cas._base import frame
from cuda_program_cas._disk.layout import url_path
from cuda_program_cas.index import key_id, parse_manifest


def _new_store(path: Path) -> Path:
    CacheStore(path).close()  # laid out: layout.json, index/, blobs/, tmp/
    return path


def _entries(root: Path) -> dict[str, bytes]:
    """Key id -> the bytes its manifest names in the directory store ``root`` (verified)."""
    out = {}
    for shard in (root / "index").iterdir():
        for f in shard.iterdir():
            kid = shard.name + f.name
            m = parse_manifest(f.read_bytes(), kid)
            assert m is not None, f"a damaged manifest was uploaded: {f}"
            stored = (root / url_path("blobs", m.digest)).read_bytes()
            assert frame.is_framed(stored) or len(stored) == m.size  # written compressed, unless that is no smaller
            blob = bytes(frame.decode(stored, m.size))
            assert digest_of(blob) == m.digest
            out[kid] = blob
    return out


def test_new_entries_reach_the_writable_store_and_serve_another_node(tmp_path: Path, compiles) -> None:
    shared = _new_store(tmp_path / "shared")
    with ContentAddressedProgramCache(tmp_path / "a", shared=[f"{shared}|write"]) as cache:
        code = bytes(compile_program(SAXPY, cache=cache).code)
        code2 = bytes(compile_program(SCALE, cache=cache).code)
        cache.close()
        counts = cache.stats()
    assert compiles.count == 2
    assert (counts.uploads, counts.uploads_dropped) == (2, 0)
    assert sorted(_entries(shared).values()) == sorted([code, code2])
    # A second node, its local cache empty, reading the store only: no compile.
    with ContentAddressedProgramCache(tmp_path / "b", shared=[shared]) as other:
        assert bytes(compile_program(SAXPY, cache=other).code) == code
        assert other.stats().shared_hits == 1
    assert compiles.count == 2


def test_a_store_not_named_writable_is_never_written_and_copy_ins_are_not_sent(tmp_path: Path, compiles) -> None:
    ro = _new_store(tmp_path / "ro")
    with ContentAddressedProgramCache(ro) as seed:
        code = bytes(compile_program(SAXPY, cache=seed).code)
    before = listing(ro)
    rw = _new_store(tmp_path / "rw")
    rw_before = listing(rw)
    with ContentAddressedProgramCache(tmp_path / "node", shared=[ro, f"{rw}|write"]) as cache:
        assert bytes(compile_program(SAXPY, cache=cache).code) == code  # a hit in ro, copied in
        cache.close()
        assert cache.stats().uploads == 0
    assert compiles.count == 1
    assert listing(ro) == before
    assert listing(rw) == rw_before  # the copy-in came from a store: not sent back


def test_a_read_only_local_cache_sends_nothing(tmp_path: Path) -> None:
    local = _new_store(tmp_path / "local")
    shared = _new_store(tmp_path / "shared")
    before = listing(shared)
    store = CacheStore(local, read_only=True, shared=[f"{shared}|write"])
    store.put("k", b"x" * 100)
    store.close()
    assert store.counters()["uploads"] == 0
    assert listing(shared) == before


@pytest.mark.mount
def test_a_full_store_drops_uploads_counted_and_said_once(tmp_path: Path, caplog) -> None:
    if not is_root():
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=64", "tmpfs", str(mnt)], check=True)
    try:
        shared = _new_store(mnt / "store")
        store = CacheStore(tmp_path / "local", shared=[f"{shared}|write"])
        caplog.set_level(logging.WARNING, logger="cuda_program_cas")
        for i in range(8):  # 8 x 40 KB: the first fits, the rest cannot
            store.put(f"k{i}", os.urandom(40_000))
        store.close()
        counts = store.counters()
        assert counts["writes"] == 8  # the local cache has every entry
        assert counts["uploads"] >= 1 and counts["uploads_dropped"] >= 1
        assert counts["uploads"] + counts["uploads_dropped"] == 8
        warnings = [r for r in caplog.records if "uploads to shared store" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        # What reached the store is whole: every manifest there names a blob that is there.
        assert len(_entries(shared)) == counts["uploads"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.mount
def test_a_full_local_disk_counts_what_it_cannot_upload(tmp_path: Path, caplog, mounts) -> None:
    """Only new local entries are sent: one the full local disk could not store is an upload dropped, said once."""
    if not is_root():
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(disk)], check=True)
    mounts.append(disk)
    shared = _new_store(tmp_path / "shared")
    store = CacheStore(disk / "local", shared=[f"{shared}|write"])
    caplog.set_level(logging.WARNING, logger="cuda_program_cas")
    results = [store.put(f"k{i}", os.urandom(40_000)) for i in range(6)]  # 6 x 40 KB on 128 KB: some cannot land
    store.close()
    counts = store.counters()
    assert 1 <= counts["writes"] < 6 and counts["dropped_writes"] == 6 - counts["writes"]
    assert sum(not r for r in results) == counts["dropped_writes"]
    assert counts["uploads"] == counts["writes"]
    assert counts["uploads_dropped"] == counts["dropped_writes"]  # every entry is either sent or counted
    warnings = [r.getMessage() for r in caplog.records if "uploads to shared store" in r.getMessage()]
    assert len(warnings) == 1 and "the local cache did not store it" in warnings[0], warnings


def test_an_exiting_process_sends_what_it_queued(tmp_path: Path) -> None:
    shared = _new_store(tmp_path / "shared")
    code = textwrap.dedent(
        f"""
        from cuda_program_cas import CacheStore
        store = CacheStore({str(tmp_path / "local")!r}, shared=[{f"{shared}|write"!r}])
        for i in range(50):
            store.put(f"k{{i}}", b"%d" % i * 1000)
        # no close(): the interpreter's exit sends the queue
        """
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    got = _entries(shared)
    assert got == {key_id(f"k{i}"): b"%d" % i * 1000 for i in range(50)}


def test_a_forked_child_uploads_its_own_entries(tmp_path: Path) -> None:
    shared = _new_store(tmp_path / "shared")
    store = CacheStore(tmp_path / "local", shared=[f"{shared}|write"])
    store.put("parent", b"p" * 10)
    pid = os.fork()
    if pid == 0:  # the child: its own worker, its own queue
        try:
            store.put("child", b"c" * 10)
            store.close()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    store.close()
    assert _entries(shared) == {key_id("parent"): b"p" * 10, key_id("child"): b"c" * 10}


@pytest.mark.skipif(not is_root(), reason="reading as another user needs root to become one")
def test_write_back_into_a_directory_leaves_files_other_users_can_read(tmp_path: Path, compiles) -> None:
    """A shared directory is read by other users' nodes: write-back writes it as publish does (0644 less
    the umask), not with a local cache's private modes. A real child process as ``nobody`` reads it."""
    top = Path(tempfile.mkdtemp(prefix="cpcas-wb-"))  # pytest's own base folder is private to root
    os.chmod(top, 0o755)
    old = os.umask(0o022)
    try:
        shared = _new_store(top / "shared")
        with ContentAddressedProgramCache(tmp_path / "a", shared=[f"{shared}|write"]) as cache:
            compile_program(SAXPY, cache=cache)
            cache.close()
            assert cache.stats().uploads == 1
        written = [p for p in (shared / "index").rglob("*") if p.is_file()]
        written += [p for p in (shared / "blobs").rglob("*") if p.is_file()]
        assert len(written) == 2
        pid = os.fork()
        if pid == 0:  # the child: another user, who must read every file uploaded
            try:
                os.setgid(65534)
                os.setuid(65534)
                for p in written:
                    p.read_bytes()
                os._exit(0)
            except BaseException:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, [oct(p.stat().st_mode) for p in written]
    finally:
        os.umask(old)
        shutil.rmtree(top)


def test_publish_init_lays_out_an_empty_directory_store_and_without_a_source_nothing(tmp_path: Path, capsys) -> None:
    from cuda_program_cas import publish
    from cuda_program_cas._cli.main import main

    store = tmp_path / "nfs" / "store"
    assert main(["publish", str(store)]) == 2  # a forgotten SRC is bad usage, not an empty store
    assert "--init" in capsys.readouterr().err and not store.exists()
    with pytest.raises(ValueError, match="init=True"):
        publish([], store)
    assert main(["publish", "--init", str(store)]) == 0
    assert capsys.readouterr().out == f"created an empty store at {store}\n"
    assert (store / "layout.json").is_file() and (store / "CACHEDIR.TAG").is_file()
    writer = CacheStore(tmp_path / "node", shared=[f"{store}|write"])
    assert writer.get("k") is None
    writer.put("k", b"z" * 50)
    writer.close()
    assert (writer.counters()["uploads"], writer.counters()["uploads_dropped"]) == (1, 0)
    assert list(_entries(store).values()) == [b"z" * 50]
    report = publish([], store, init=True)
    assert not report.created and report.problem_count == 0
