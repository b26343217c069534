"""Blobs verified in this boot (issue 31, item 1): a fresh process skips the hash only of a file provably unchanged.

Every lookup here runs in a fresh interpreter against real files; the record is the
real one in the cache root. A record that vouches wrongly would make a lookup return
bytes that are not the blob's: the tests tamper with a blob (and, to show they can
fail, forge the record to match it) and check what a fresh process returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import is_root, run_python

from cuda_program_cas import CacheStore, digest_of
from cuda_program_cas._disk import bootrecord
from cuda_program_cas._disk.bootrecord import BootRecord
from cuda_program_cas._disk.files import file_id
from cuda_program_cas._disk.fskind import CTIME_RELIABLE, fs_type

#: One lookup in a fresh process: ``root key boot_file min_age_ns``; prints what it got and what the record says now.
_LOOKUP = r"""
import json, os, sys
from cuda_program_cas._disk import bootrecord
root, key, boot_file, min_age = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if boot_file:
    bootrecord.BOOT_ID_FILE = boot_file
bootrecord.MIN_AGE_NS = min_age
from cuda_program_cas import CacheStore
from cuda_program_cas._disk.files import file_id
store = CacheStore(root)
value = store.get(key)
digest = sys.argv[5]
lay = store.inner.layout
record = bootrecord.BootRecord(lay.root, lay.blobs, lay.tmp, writable=False)
try:
    identity = file_id(os.stat(lay.blob_path(digest)))
    vouched = record.vouches(digest, identity)
except FileNotFoundError:
    vouched = None
print(json.dumps({"value": None if value is None else value.hex(), "vouched": vouched}))
"""

BOOT_A = "0f0e0d0c-0b0a-4908-8706-050403020100"
BOOT_B = "1f1e1d1c-1b1a-4918-9716-151413121110"
DATA = bytes(range(256)) * 128  # 32 KiB: read with an fstat, so the record can be asked
TAMPERED = b"\xff" + DATA[1:]


def lookup(root: Path, boot_file: Path | None = None, *, min_age_ns: int = 0) -> tuple[bytes | None, bool | None]:
    done = run_python(_LOOKUP, str(root), "k", str(boot_file or ""), str(min_age_ns), digest_of(DATA))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return (None if out["value"] is None else bytes.fromhex(out["value"])), out["vouched"]


@pytest.fixture
def boots(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "boot-a", tmp_path / "boot-b"
    a.write_text(BOOT_A + "\n")
    b.write_text(BOOT_B + "\n")
    return a, b


@pytest.fixture
def root(tmp_path: Path) -> Path:
    if fs_type(str(tmp_path)) not in CTIME_RELIABLE:
        pytest.skip("the temp directory is not on a local file system")
    where = tmp_path / "cache"
    CacheStore(where).put("k", DATA)
    return where


def blob(root: Path) -> Path:
    return root / "blobs" / digest_of(DATA)[:2] / digest_of(DATA)[2:]


def rewrite_in_place(path: Path) -> None:
    """Same size, same mtime: only the ctime (and the bytes) tell."""
    before = path.stat()
    os.chmod(path, 0o644)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, TAMPERED[:1], 0)
    finally:
        os.close(fd)
    os.chmod(path, before.st_mode & 0o7777)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


def forge(root: Path, boot_file: Path) -> None:
    """Enter the blob as its file is now (tampered): what a record that vouched wrongly would say."""
    bootrecord.BOOT_ID_FILE = str(boot_file)
    bootrecord._boot.clear()
    try:
        record = BootRecord(str(root), str(root / "blobs"), str(root / "tmp"), writable=True)
        record.enter(digest_of(DATA), file_id(blob(root).stat()), time.time_ns() + bootrecord.MIN_AGE_NS)
        assert record.vouches(digest_of(DATA), file_id(blob(root).stat()))
    finally:
        bootrecord.BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
        bootrecord._boot.clear()


def test_a_fresh_process_finds_what_another_verified_this_boot(root: Path, boots: tuple[Path, Path]) -> None:
    assert lookup(root, boots[0]) == (DATA, True)
    assert lookup(root, boots[0]) == (DATA, True)
    assert os.stat(root / "verified").st_mode & 0o777 == 0o600


def test_a_rewrite_in_place_with_its_mtime_restored_is_caught_by_ctime(root: Path, boots: tuple[Path, Path]) -> None:
    assert lookup(root, boots[0]) == (DATA, True)
    rewrite_in_place(blob(root))
    assert lookup(root, boots[0]) == (None, None)  # hashed: a damaged blob, moved aside, never returned


def test_a_record_of_another_boot_is_not_believed(root: Path, boots: tuple[Path, Path]) -> None:
    assert lookup(root, boots[0]) == (DATA, True)
    rewrite_in_place(blob(root))
    forge(root, boots[0])
    assert lookup(root, boots[0]) == (TAMPERED, True)  # the forged record is believed in its own boot...
    assert lookup(root, boots[1]) == (None, None)  # ...and not in another: hashed, caught


@pytest.mark.parametrize("damage", ["check", "truncated", "owner", "group-writable", "garbage"])
def test_a_damaged_or_foreign_record_is_ignored(root: Path, boots: tuple[Path, Path], damage: str) -> None:
    assert lookup(root, boots[0]) == (DATA, True)
    rewrite_in_place(blob(root))
    forge(root, boots[0])
    record = root / "verified"
    raw = bytearray(record.read_bytes())
    if damage == "check":
        at = raw.find(bytes.fromhex(digest_of(DATA)), 64)
        raw[at + 79] ^= 1  # the last byte of the slot's check
        record.write_bytes(bytes(raw))
    elif damage == "truncated":
        record.write_bytes(bytes(raw[: len(raw) // 2]))
    elif damage == "owner":
        if not is_root():
            pytest.skip("chown needs root")
        os.chown(record, 12345, 12345)
    elif damage == "group-writable":
        os.chmod(record, 0o620)
    else:
        record.write_bytes(os.urandom(len(raw)))
    assert lookup(root, boots[0]) == (None, None)


def test_a_file_younger_than_the_minimum_age_is_not_entered(tmp_path: Path, boots: tuple[Path, Path]) -> None:
    if fs_type(str(tmp_path)) not in CTIME_RELIABLE:
        pytest.skip("the temp directory is not on a local file system")
    root = tmp_path / "cache"
    CacheStore(root).put("k", DATA)
    # Still within one tick of its last change it could change again unseen: hashed, never entered.
    assert lookup(root, boots[0], min_age_ns=bootrecord.MIN_AGE_NS) == (DATA, False)
    assert time.time_ns() - blob(root).stat().st_ctime_ns < bootrecord.MIN_AGE_NS  # it was young throughout


@pytest.mark.skipif(not is_root(), reason="mounts need root")
@pytest.mark.parametrize("kind", ["tmpfs", "overlay"])
def test_only_a_local_file_system_keeps_a_record(tmp_path: Path, boots: tuple[Path, Path], mounts, kind: str) -> None:
    where = tmp_path / "mnt"
    where.mkdir()
    if kind == "tmpfs":
        argv = ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)]
    else:
        for d in ("lower", "upper", "work"):
            (tmp_path / d).mkdir()
        options = f"lowerdir={tmp_path / 'lower'},upperdir={tmp_path / 'upper'},workdir={tmp_path / 'work'}"
        argv = ["mount", "-t", "overlay", "overlay", "-o", options, str(where)]
    if subprocess.run(argv, check=False, capture_output=True).returncode != 0:
        pytest.skip(f"cannot mount {kind} here")
    mounts.append(where)
    root = where / "cache"
    CacheStore(root).put("k", DATA)
    assert lookup(root, boots[0]) == (DATA, kind == "tmpfs")
    assert (root / "verified").exists() == (kind == "tmpfs")


#: Three hits of one key in one process, with no memory for verified bytes; prints how many hashed the blob.
_HASHES = r"""
import sys
from cuda_program_cas._disk import bootrecord
import cuda_program_cas._local.reader as reader
bootrecord.MIN_AGE_NS = int(sys.argv[2])
reader._HOLD_MAX_BYTES = 0
hashed = []
real = reader._hexdigest
reader._hexdigest = lambda data: hashed.append(1) or real(data)
from cuda_program_cas import CacheStore
store = CacheStore(sys.argv[1])
assert all(store.get("k") is not None for _ in range(3))
print(len(hashed))
"""


@pytest.mark.parametrize(("min_age_ns", "hashes"), [(bootrecord.MIN_AGE_NS, 3), (0, 1)])
def test_a_process_remembers_only_blobs_old_when_hashed(root: Path, min_age_ns: int, hashes: int) -> None:
    # The identity is taken after the read: a young file may have changed between the two,
    # so its hash proves nothing of the identity, in this process's memory as in the record.
    assert time.time_ns() - blob(root).stat().st_ctime_ns < bootrecord.MIN_AGE_NS
    done = run_python(_HASHES, str(root), str(min_age_ns))
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip().splitlines()[-1]) == hashes


#: Hits of the first ``n`` of 40 small keys in one process; prints how many hashed and whether blake3 got loaded.
_SMALL = r"""
import json, sys
from cuda_program_cas._disk import bootrecord
import cuda_program_cas._local.reader as reader
bootrecord.MIN_AGE_NS = 0
hashed = []
real = reader._hexdigest
reader._hexdigest = lambda data: hashed.append(1) or real(data)
from cuda_program_cas import CacheStore
store = CacheStore(sys.argv[1])
assert all(store.get(f"k{i}") == bytes([i]) * 4096 for i in range(int(sys.argv[2])))
print(json.dumps([len(hashed), "blake3" in sys.modules]))
"""


def test_a_small_kernels_blob_is_vouched_for_too_so_a_small_job_loads_no_hasher(tmp_path: Path) -> None:
    # Below 16 KB hashing is cheaper than an fstat and the record, but not than loading blake3's
    # extension: a process asks the record for its first 32 small blobs, and enters those it hashed.
    if fs_type(str(tmp_path)) not in CTIME_RELIABLE:
        pytest.skip("the temp directory is not on a local file system")
    root = tmp_path / "cache"
    store = CacheStore(root)
    for i in range(40):
        store.put(f"k{i}", bytes([i]) * 4096)

    def hits(n: int) -> list[object]:
        done = run_python(_SMALL, str(root), str(n))
        assert done.returncode == 0, done.stderr
        return list(json.loads(done.stdout.strip().splitlines()[-1]))

    assert hits(5) == [5, True]  # none in the record yet: each hashed, and entered
    assert hits(5) == [0, False]  # a job of those five: nothing hashed, no hasher loaded
    assert hits(40) == [35, True]  # 27 more entered; past the first 32 small ones, hashed without asking
    assert hits(40) == [8, True]
