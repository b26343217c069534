"""Never break the caller: a cache that cannot read or write degrades to a miss or a dropped write.

Each test reproduces one finding of issue 21 (items 1-3 and 7) with the real thing:
read-only bind mounts and remounts, tmpfs mounts with ``nr_inodes=``, a FIFO, a
symlink onto another file system, an unprivileged child process. Tests that need
to mount skip, saying why, where that is impossible.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import compile_program, is_root, run_python

from cuda_program_cas import CacheStore, ContentAddressedProgramCache, ReadOnlyCacheError, WriteResult, digest_of

_OTHER = r"""
extern "C" __global__ void scale(float a, float *x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = a * x[i];
}
"""


# -- mounts ------------------------------------------------------------------------------------


def _mount(*argv: str) -> str | None:
    """Run ``mount argv``; None when it worked, else why not."""
    if not is_root():
        return "mounting needs root"
    proc = subprocess.run(["mount", *argv], capture_output=True, text=True, check=False)
    return None if proc.returncode == 0 else f"mount {' '.join(argv)} failed: {proc.stderr.strip()}"


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@contextlib.contextmanager
def tmpfs(path: Path, *, size: str = "8m", nr_inodes: int | None = None) -> Iterator[Path]:
    """A small tmpfs mounted at ``path`` for the duration (the test skips where that is impossible)."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size},mode=0755" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
    why = _mount("-t", "tmpfs", "-o", opts, "tmpfs", str(path))
    if why:
        pytest.skip(why)
    try:
        yield path
    finally:
        _umount(path)


@contextlib.contextmanager
def bind(src: Path, dst: Path) -> Iterator[Path]:
    """``src`` bind-mounted at ``dst`` (writable until :func:`remount_ro`)."""
    dst.mkdir(parents=True, exist_ok=True)
    why = _mount("--bind", str(src), str(dst))
    if why:
        pytest.skip(why)
    try:
        yield dst
    finally:
        _umount(dst)


def remount_ro(path: Path) -> None:
    why = _mount("-o", "remount,bind,ro", str(path))
    if why:
        pytest.skip(why)


def cas_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cuda_program_cas" and r.levelno == logging.WARNING]


def corrupt_in_place(store: CacheStore, data: bytes) -> Path:
    """Flip the first byte of the blob of ``data`` in place (same size, same inode: no inode needed)."""
    path = Path(store.inner.layout.blob_path(digest_of(data)))
    with open(path, "r+b") as fh:
        first = fh.read(1)
        fh.seek(0)
        fh.write(bytes([first[0] ^ 0xFF]))
    return path


# -- 1. read-only never loses a compile ----------------------------------------------------------


def test_a_read_only_cache_drops_writes_and_counts_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "cas"
    CacheStore(root).put("a", b"alpha")
    before = sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*"))
    ro = CacheStore(root, read_only=True)
    with caplog.at_level(logging.DEBUG, logger="cuda_program_cas"):
        assert ro.put("new", b"data") is WriteResult.DROPPED
        assert ro.put("a", b"alpha") is WriteResult.DROPPED  # even one that would deduplicate
    assert ro.counters()["dropped_writes"] == 2 and ro.counters()["writes"] == 0
    assert ro.get("a") == b"alpha" and ro.get("new") is None
    assert [r.levelno for r in caplog.records if r.name == "cuda_program_cas" and "dropped" in r.getMessage()] == [
        logging.DEBUG,
        logging.DEBUG,
    ]
    for refused in (lambda: ro.delete("a"), ro.clear):
        with pytest.raises(ReadOnlyCacheError, match="read-only"):
            refused()
    assert sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*")) == before


def test_program_compile_on_a_read_only_cache_returns_the_program(tmp_path: Path) -> None:
    root = tmp_path / "cas"
    stored = compile_program(cache=ContentAddressedProgramCache(root))
    ro = ContentAddressedProgramCache(root, read_only=True)
    missed = compile_program(_OTHER, cache=ro)  # a miss: NVRTC runs, the program comes back
    assert bytes(missed.code) == bytes(compile_program(_OTHER).code)
    assert ro.counters()["dropped_writes"] == 1
    hit = compile_program(cache=ro)
    assert bytes(hit.code) == bytes(stored.code) and ro.counters()["hits"] == 1
    ro["k"] = b"value"  # the mapping interface drops too
    assert ro.get("k") is None and ro.counters()["dropped_writes"] == 2
    with pytest.raises(ReadOnlyCacheError):
        del ro["k"]
    with pytest.raises(ReadOnlyCacheError):
        ro.clear()


def test_front_door_compile_on_a_read_only_cache_returns_the_program(tmp_path: Path) -> None:
    from cuda.core import ProgramOptions

    root = tmp_path / "cas"
    ContentAddressedProgramCache(root)
    ro = ContentAddressedProgramCache(root, read_only=True)
    obj = ro.compile(_OTHER, "c++", ProgramOptions(arch="sm_80"), "cubin")
    assert bytes(obj.code) == bytes(compile_program(_OTHER).code)
    assert len(ro) == 0
    assert ro.counters()["dropped_writes"] == 1 and ro.counters()["misses"] == 1


@pytest.mark.mount
def test_an_unwritable_directory_opens_read_only_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = tmp_path / "cas"
    compile_program(cache=ContentAddressedProgramCache(src))
    with bind(src, tmp_path / "ro") as ro_path:
        remount_ro(ro_path)
        with caplog.at_level(logging.DEBUG, logger="cuda_program_cas"):
            caches = [ContentAddressedProgramCache(ro_path) for _ in range(3)]
        warned = cas_warnings(caplog)
        assert len(warned) == 1, warned
        assert str(ro_path) in warned[0] and "read-only filesystem" in warned[0]
        first = caches[0]
        assert first.store.read_only
        assert bytes(compile_program(cache=first).code)  # a hit
        missed = compile_program(_OTHER, cache=first)  # a miss: compiled, not stored
        assert bytes(missed.code) == bytes(compile_program(_OTHER).code)
        assert first.counters()["hits"] == 1 and first.counters()["dropped_writes"] == 1
        with pytest.raises(ReadOnlyCacheError, match="read-only"):
            first.clear()


@pytest.mark.mount
def test_a_default_directory_that_cannot_be_created_runs_uncached(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with tmpfs(tmp_path / "home") as home:
        remount_ro(home)
        monkeypatch.setenv("CUDA_PROGRAM_CAS_DIR", str(home / ".cache" / "cuda-python" / "program-cas"))
        with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
            cache = ContentAddressedProgramCache()
            ContentAddressedProgramCache()
        warned = cas_warnings(caplog)
        assert len(warned) == 1 and str(home) in warned[0] and "uncached" in warned[0], warned
        for _ in range(2):
            obj = compile_program(cache=cache)
            assert bytes(obj.code) == bytes(compile_program().code)
        assert cache.counters()["misses"] == 2 and cache.counters()["dropped_writes"] == 2
        assert cache.store.put("k", b"v") is WriteResult.DROPPED
        assert len(cache) == 0 and cache.stats().entries == 0
        assert not (home / ".cache").exists()


_AS_NOBODY = textwrap.dedent(
    """
    import json, logging, os, sys
    import cuda_program_cas
    from cuda_program_cas import CacheStore, WriteResult
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))
    logging.getLogger("cuda_program_cas").addHandler(Keep())
    # The library imports blake3 on first hash; the interpreter's packages may sit where uid
    # 65534 cannot read them (CI's venvs are under a root-only mktemp -d), as in a service that
    # drops privileges after its imports.
    import blake3
    os.setgid(65534); os.setuid(65534)
    out = {}
    for name in sys.argv[1:]:
        store = CacheStore(name)
        out[name] = {
            "read_only": store.read_only,
            "get": store.get("a"),
            "put": store.put("b", b"beta").value,
            "counters": store.counters(),
        }
        for k in out[name]:
            if isinstance(out[name][k], bytes):
                out[name][k] = out[name][k].decode()
    out["warnings"] = [m for level, m in records if level == "WARNING"]
    out["created"] = [os.path.exists(os.path.join(sys.argv[2], "blobs")), os.path.exists(sys.argv[3])]
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(not is_root(), reason="handing directories to an unprivileged user (uid 65534) needs root")
def test_unwritable_directories_for_an_unprivileged_user(tmp_path: Path) -> None:
    """A cache, an empty directory and a missing one under a directory uid 65534 cannot write: no exception."""
    # Under /tmp itself: pytest's own directories are private to root.
    base = Path(tempfile.mkdtemp(prefix="degrade-nobody-", dir="/tmp"))
    try:
        CacheStore(base / "cache").put("a", b"alpha")
        (base / "empty").mkdir()
        for p in [base, *base.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        names = [str(base / "cache"), str(base / "empty"), str(base / "missing" / "cas")]
        out = run_python(_AS_NOBODY, *names)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got[names[0]]["read_only"] and got[names[0]]["get"] == "alpha"
    for name in names:
        assert got[name]["put"] == "dropped" and got[name]["counters"]["dropped_writes"] == 1, got[name]
    for name in names[1:]:
        assert got[name]["read_only"] and got[name]["get"] is None
    assert len(got["warnings"]) == 3, got["warnings"]
    assert all("permission denied" in w.lower() for w in got["warnings"]), got["warnings"]
    assert got["created"] == [False, False], got


@pytest.mark.mount
def test_a_file_system_that_goes_read_only_under_an_open_cache(tmp_path: Path) -> None:
    from cuda.core import ProgramOptions

    src = tmp_path / "cas"
    src.mkdir()
    with bind(src, tmp_path / "mnt") as mnt:
        cache = ContentAddressedProgramCache(mnt)
        compile_program(cache=cache)
        remount_ro(mnt)  # as ext4 does with errors=remount-ro
        missed = compile_program(_OTHER, cache=cache)
        assert bytes(missed.code) == bytes(compile_program(_OTHER).code)
        assert cache.counters()["dropped_writes"] == 1
        assert cache.store.put("k", b"v") is WriteResult.DROPPED
        assert bytes(compile_program(cache=cache).code)  # hits go on
        assert cache.counters()["hits"] == 1
        front = cache.compile(_OTHER, "c++", ProgramOptions(arch="sm_80"), "cubin")  # the front door too
        assert bytes(front.code) == bytes(missed.code)
        assert cache.counters()["dropped_writes"] > 2
        cache.close()


# -- 2. lookups never raise ----------------------------------------------------------------------


def _bad_blob_is_a_miss(store: CacheStore, data: bytes, blob: Path) -> None:
    """Eight lookups of a key whose blob is damaged: misses, never exceptions; the bad blob never served."""
    for _ in range(8):
        assert store.get("k") is None
    assert store.counters()["corrupt"] >= 1
    assert not blob.exists() or digest_of(blob.read_bytes()) != digest_of(data)


@pytest.mark.mount
def test_a_damaged_blob_with_no_inode_left_for_quarantine(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with tmpfs(tmp_path / "small", nr_inodes=64) as mnt:
        store = CacheStore(mnt / "cas")
        data = b"payload" * 100
        store.put("k", data)
        blob = corrupt_in_place(store, data)
        filler = mnt / "filler"
        filler.mkdir()
        with pytest.raises(OSError):
            for n in range(1000):
                (filler / str(n)).touch()
        with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
            _bad_blob_is_a_miss(store, data, blob)
        assert not blob.exists()
        assert any("removed" in w for w in cas_warnings(caplog)), cas_warnings(caplog)


def test_a_damaged_blob_when_quarantine_is_a_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CacheStore(tmp_path / "cas")
    data = b"payload" * 100
    store.put("k", data)
    (tmp_path / "cas" / "quarantine").write_bytes(b"not a directory")
    blob = corrupt_in_place(store, data)
    with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
        _bad_blob_is_a_miss(store, data, blob)
    assert not blob.exists()
    assert (tmp_path / "cas" / "quarantine").read_bytes() == b"not a directory"
    assert store.put("k", data) is WriteResult.STORED and store.get("k") == data


@pytest.mark.mount
def test_a_damaged_blob_when_quarantine_is_another_file_system(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "cas")
    data = b"payload" * 100
    store.put("k", data)
    blob = corrupt_in_place(store, data)
    with tmpfs(tmp_path / "cas" / "quarantine"):
        _bad_blob_is_a_miss(store, data, blob)
    assert store.put("k", data) and store.get("k") == data


@pytest.mark.mount
def test_damage_found_after_the_file_system_went_read_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "cas"
    src.mkdir()
    with bind(src, tmp_path / "mnt") as mnt:
        store = CacheStore(mnt)
        good, bad, gone = b"good" * 100, b"bad" * 100, b"gone" * 100
        for key, data in (("good", good), ("k", bad), ("gone", gone)):
            store.put(key, data)
        blob = corrupt_in_place(store, bad)
        os.unlink(store.inner.layout.blob_path(digest_of(gone)))  # its manifest now dangles
        remount_ro(mnt)
        with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
            _bad_blob_is_a_miss(store, bad, blob)
            for _ in range(3):
                assert store.get("gone") is None
                assert store.get("good") == good
        warned = cas_warnings(caplog)
        assert len(warned) == len(set(warned)) and any("read-only" in w.lower() for w in warned), warned
        store.close()


def _layout_cases(root: Path, kind: str) -> None:
    """Make ``root`` a cache whose layout.json is damaged as ``kind`` says."""
    CacheStore(root).put("a", b"alpha")
    layout = root / "layout.json"
    layout.unlink()
    if kind == "fifo":
        os.mkfifo(layout)
    elif kind == "deep":
        layout.write_text("[" * 4000)
    else:
        layout.mkdir()


_LAYOUT_CHILD = textwrap.dedent(
    """
    import json, sys
    import cuda_program_cas
    from cuda_program_cas import CacheStore, LayoutError
    from cuda_program_cas._cli.main import main
    kind, root, local = sys.argv[1:4]
    out = {}
    def attempt(name, fn):
        try:
            out[name] = repr(fn())
        except LayoutError as exc:
            out[name] = "LayoutError: " + str(exc)
        except BaseException as exc:
            out[name] = "RAISED " + type(exc).__name__ + ": " + str(exc)[:200]
    layered = CacheStore(local, shared=[root])
    attempt("shared get", lambda: layered.get("a"))
    for verb in ("stats", "verify", "gc"):
        attempt(verb, lambda: main([verb, root]))
    attempt("read_only", lambda: CacheStore(root, read_only=True).get("a"))
    attempt("writable", lambda: CacheStore(root).get("a"))
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("kind", ["fifo", "deep", "directory"])
def test_a_damaged_layout_file_never_hangs_nor_raises_anything_but_layout_error(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "cas"
    _layout_cases(root, kind)
    try:
        out = run_python(_LAYOUT_CHILD, kind, str(root), str(tmp_path / "local"), timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a layout.json that is a {kind} hangs an open")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["shared get"] == "None"  # a miss, never an exception
    assert not any(v.startswith("RAISED") for v in got.values()), got
    assert got["read_only"].startswith("LayoutError")
    # gc refuses a damaged layout (exit 2); stats reports on it and verify finds it (exit 1),
    # except a directory, which nothing can repair in place (exit 2).
    expected = ("2", "2") if kind == "directory" else ("0", "1")
    assert (got["stats"], got["verify"], got["gc"]) == (*expected, "2"), got
    if kind == "directory":
        assert got["writable"].startswith("LayoutError") and "directory" in got["writable"]
    else:
        assert got["writable"] == "b'alpha'"  # rewritten by a writable open, as any damaged layout.json is


# -- 3. a write lands or is dropped and counted ---------------------------------------------------


@pytest.mark.mount
@pytest.mark.parametrize("moved", ["blobs", "tmp"])
def test_a_directory_moved_to_another_disk_never_fails_a_write(
    tmp_path: Path, moved: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "cas"
    ContentAddressedProgramCache(root).store.put("old", b"old bytes")
    with tmpfs(tmp_path / "bigger") as disk:
        target = disk / moved
        subprocess.run(["cp", "-a", str(root / moved), str(target)], check=True)
        subprocess.run(["rm", "-rf", str(root / moved)], check=True)
        (root / moved).symlink_to(target)
        cache = ContentAddressedProgramCache(root)
        with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
            obj = compile_program(cache=cache)
            result = cache.store.put("k", b"new bytes")
        assert bytes(obj.code) == bytes(compile_program().code)
        assert cache.get("old") == b"old bytes"
        # Dropped and counted: staging temp files on the other disk would leave some where no sweep looks.
        assert result is WriteResult.DROPPED and cache.counters()["dropped_writes"] == 2
        warned = cas_warnings(caplog)
        assert len(warned) == 1 and "another file system" in warned[0], warned
        assert not any(disk.rglob("*.tmp")) and not any((root / "tmp").iterdir())


def test_a_tmp_that_is_a_file_heals_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "cas"
    CacheStore(root)
    tmp = root / "tmp"
    tmp.rmdir()
    tmp.write_bytes(b"someone's file")
    with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
        stores = [CacheStore(root) for _ in range(2)]
        for n, store in enumerate(stores * 2):
            assert store.put(f"k{n}", f"v{n}".encode()) is WriteResult.STORED
    assert tmp.is_dir()
    warned = cas_warnings(caplog)
    assert len(warned) == 1 and str(tmp) in warned[0], warned
    assert all(s.counters()["dropped_writes"] == 0 for s in stores)
    assert CacheStore(root).get("k3") == b"v3"


def test_a_tmp_that_is_a_file_in_a_fresh_process(tmp_path: Path) -> None:
    root = tmp_path / "cas"
    CacheStore(root)
    (root / "tmp").rmdir()
    (root / "tmp").write_bytes(b"x")
    code = (
        "import sys; from cuda_program_cas import CacheStore; k = sys.argv[2]; "
        "print(CacheStore(sys.argv[1]).put(k, k.encode()).value)"
    )
    for n in range(2):
        out = run_python(code, str(root), f"k{n}")  # a new key and value each time: stored, not deduplicated
        assert out.returncode == 0 and out.stdout.split() == ["stored"], out.stderr
    assert (root / "tmp").is_dir()
