"""Shared stores: read-only, layered after the local cache, never written, never an exception.

A store populated by real NVRTC compiles is bind-mounted read-only (root only)
and used as ``shared`` under a writable local cache, and opened directly with
``read_only=True``; the same checks also run on a plain writable directory,
where a stray write would succeed and so would be seen. A full listing of the
store (inode, size, mode, mtime, ctime of every entry) must not change.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import SAXPY, Compiles, MovableClock, compile_program, is_root

import cuda_program_cas._shared.tier as shared_mod
from cuda_program_cas import CacheStore, ContentAddressedProgramCache, ReadOnlyCacheError, digest_of, publish
from cuda_program_cas._shared.tier import RETRY_S as _SHARED_RETRY_S
from cuda_program_cas.index import Manifest, key_id

#: A second kernel, so the shared store holds more than one distinct binary.
SCALE = r"""
extern "C" __global__ void scale(float a, float *x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
"""

Listing = dict[str, tuple[int, int, int, int, int]]


def listing(root: Path) -> Listing:
    """Every entry under ``root`` (the root included): inode, mode, size, mtime and ctime."""
    out: Listing = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return out


def age(root: Path, seconds: float = 3600) -> None:
    """Set every file's mtime back, so that a reader that touched on a hit would show up."""
    past = time.time() - seconds
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            os.utime(os.path.join(dirpath, name), (past, past))


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """A store holding SAXPY and SCALE (cubin, sm_80), compiled once per test module."""
    root = tmp_path_factory.mktemp("populated") / "store"
    with ContentAddressedProgramCache(root) as cache:
        codes = {
            "saxpy": bytes(compile_program(SAXPY, cache=cache).code),
            "scale": bytes(compile_program(SCALE, cache=cache).code),
        }
    return root, codes


@pytest.fixture
def mounts() -> Iterator[Callable[[Path, Path], Path]]:
    """``bind_ro(src, dst)``: a read-only bind mount of ``src`` on ``dst``, unmounted at teardown."""
    done: list[Path] = []

    def bind_ro(src: Path, dst: Path) -> Path:
        if not is_root():
            pytest.skip("bind mounts need root")
        dst.mkdir(parents=True, exist_ok=True)
        for cmd in (["mount", "--bind", str(src), str(dst)], ["mount", "-o", "remount,bind,ro", str(dst)]):
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                if cmd[1] == "-o":
                    done.append(dst)
                pytest.skip(f"`{' '.join(cmd)}` failed here: {proc.stderr.strip()}")
        done.append(dst)
        return dst

    bind_ro.done = done  # type: ignore[attr-defined]
    try:
        yield bind_ro
    finally:
        for dst in reversed(done):
            umount(dst)


def umount(dst: Path) -> None:
    proc = subprocess.run(["umount", str(dst)], capture_output=True, check=False)
    if proc.returncode != 0:
        subprocess.run(["umount", "-l", str(dst)], capture_output=True, check=False)


def shared_copy(populated: tuple[Path, dict[str, bytes]], tmp_path: Path, how: str, mounts) -> Path:
    """The populated store as a test sees it: a read-only bind mount, or a plain (writable) copy."""
    src = tmp_path / "store"
    shutil.copytree(populated[0], src)
    age(src)
    if how == "plain":
        return src
    mounted = mounts(src, tmp_path / "mnt")
    with pytest.raises(OSError):  # the mount really is read-only: the test proves something
        (mounted / "probe").write_bytes(b"x")
    return mounted


@pytest.mark.mount
@pytest.mark.parametrize("how", ["ro-mount", "plain"])
def test_shared_store_hits_misses_and_no_writes(
    populated: tuple[Path, dict[str, bytes]], tmp_path: Path, how: str, mounts, compiles: Compiles
) -> None:
    shared = shared_copy(populated, tmp_path, how, mounts)
    before = listing(shared)
    local = tmp_path / "local"
    with ContentAddressedProgramCache(local, shared=[shared]) as cache:
        # Program.compile end to end: served by the shared store, no NVRTC.
        assert bytes(compile_program(SAXPY, cache=cache).code) == populated[1]["saxpy"]
        assert compiles.count == 0
        stats = cache.stats()
        assert (stats.hits, stats.shared_hits, stats.misses) == (1, 1, 0)
        assert stats.entries == 1  # the verified hit was copied into the local cache
        # A miss compiles and stores locally.
        sm90 = bytes(compile_program(SAXPY, cache=cache, arch="sm_90").code)
        assert compiles.count == 1
        assert cache.stats().writes == 1
        cache["mapping-key"] = b"local bytes"
        assert cache.get("mapping-key") == b"local bytes"
        assert bytes(compile_program(SCALE, cache=cache).code) == populated[1]["scale"]
        assert compiles.count == 1
    # Both copied hits and the compiled miss now live in the local cache alone.
    with ContentAddressedProgramCache(local, shared=[]) as alone:
        assert bytes(compile_program(SAXPY, cache=alone).code) == populated[1]["saxpy"]
        assert bytes(compile_program(SAXPY, cache=alone, arch="sm_90").code) == sm90
        assert bytes(compile_program(SCALE, cache=alone).code) == populated[1]["scale"]
        assert compiles.count == 1
        assert alone.stats().entries == 4
    # Repeated hits (the path that remembers identities and holds bytes), not copied in: still no writes.
    with ContentAddressedProgramCache(tmp_path / "local2", shared=[shared], copy_shared_hits=False) as no_copy:
        for _ in range(3):
            assert bytes(compile_program(SAXPY, cache=no_copy).code) == populated[1]["saxpy"]
            assert bytes(compile_program(SCALE, cache=no_copy).code) == populated[1]["scale"]
        stats = no_copy.stats()
        assert (stats.shared_hits, stats.entries, compiles.count) == (6, 0, 1)
    assert listing(shared) == before


@pytest.mark.mount
@pytest.mark.parametrize("how", ["ro-mount", "plain"])
def test_read_only_cache_drops_every_write_and_refuses_removal(
    populated: tuple[Path, dict[str, bytes]], tmp_path: Path, how: str, mounts, compiles: Compiles
) -> None:
    store = shared_copy(populated, tmp_path, how, mounts)
    before = listing(store)
    with ContentAddressedProgramCache(store, read_only=True) as cache:
        for _ in range(2):  # the second round takes the repeated-hit path
            assert bytes(compile_program(SAXPY, cache=cache).code) == populated[1]["saxpy"]
            assert bytes(compile_program(SCALE, cache=cache).code) == populated[1]["scale"]
        assert compiles.count == 0
        # A miss: compiled and returned, the write dropped and counted (as ccache's and
        # sccache's read-only modes do); to keep such compiles, layer the store with shared=.
        missed = compile_program(SAXPY, cache=cache, arch="sm_90")
        assert bytes(missed.code) == bytes(compile_program(SAXPY, arch="sm_90").code)
        assert compiles.count == 2
        cache["k"] = b"v"
        assert cache.get("k") is None
        stats = cache.stats()
        assert stats.dropped_writes == 2 and stats.writes == 0
        assert (stats.hits, stats.entries) == (4, 2)
        with pytest.raises(ReadOnlyCacheError, match="read-only"):
            del cache["k"]
        with pytest.raises(ReadOnlyCacheError, match="read-only"):
            cache.clear()
        assert isinstance(ReadOnlyCacheError("x"), PermissionError)
        assert len(cache) == 2
    assert listing(store) == before  # no tmp/, no lock file, no mtime moved


def test_read_only_never_creates(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="never created"):
        ContentAddressedProgramCache(tmp_path / "absent", read_only=True)
    assert not (tmp_path / "absent").exists()


def _hostile_store(tmp_path: Path) -> tuple[Path, dict[str, bytes], Path]:
    """A store with one good key and one hostile entry per trick; returns it, the good key and an outside file."""
    root = tmp_path / "hostile"
    store = CacheStore(root)
    store.put("good", b"good bytes")
    outside_dir = tmp_path / "outside"
    outside_dir.mkdir()
    secret = b"bytes that live outside the store"
    outside = outside_dir / "secret"
    outside.write_bytes(secret)
    digest = digest_of(secret)

    def manifest(key: str, body: bytes) -> Path:
        path = Path(store.inner.layout.manifest_path(key_id(key)))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        return path

    def blob_path(d: str) -> Path:
        path = Path(store.inner.blobs.path_for(d))
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    # A symlink to a file outside the store, under the right name for its bytes:
    # following it would even give bytes that match their digest.
    manifest("symlink-blob", Manifest(digest, len(secret), key_id("symlink-blob")).encode())
    blob_path(digest).symlink_to(outside)
    # A manifest that is itself a symlink to an outside copy of a valid manifest.
    (outside_dir / "manifest").write_bytes(Manifest(digest_of(b"good bytes"), 10, key_id("symlink-manifest")).encode())
    link = Path(store.inner.layout.manifest_path(key_id("symlink-manifest")))
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside_dir / "manifest")
    # Garbage under a valid name, same size as what the manifest says.
    real = b"the real content"
    garbage = b"X" * len(real)
    manifest("garbage", Manifest(digest_of(real), len(real), key_id("garbage")).encode())
    blob_path(digest_of(real)).write_bytes(garbage)
    # Digests that are not hex, or that climb out of the store.
    manifest("nonhex", b"cpcas1 " + b"z" * 64 + b" 10\n")
    manifest("traversal", b"cpcas1 ../../../../../../etc/passwd 10\n")
    manifest("traversal-64", b"cpcas1 " + (b"../" * 22)[:64] + b" 10\n")
    # A blob that is a FIFO (a read would block), a manifest that is a directory,
    # a size no file has, a manifest of megabytes.
    fifo_bytes = b"fifo"
    manifest("fifo", Manifest(digest_of(fifo_bytes), len(fifo_bytes), key_id("fifo")).encode())
    os.mkfifo(blob_path(digest_of(fifo_bytes)))
    Path(store.inner.layout.manifest_path(key_id("dir"))).mkdir(parents=True)
    manifest("huge", Manifest(digest_of(b"good bytes"), 10**15, key_id("huge")).encode())
    manifest("long", b"cpcas1 " + b"a" * (4 << 20))
    # A valid manifest of another key, copied onto this key's path: it names "good".
    manifest("swapped", Manifest(digest_of(b"good bytes"), 10, key_id("good")).encode())
    return root, {"good": b"good bytes"}, outside


HOSTILE_KEYS = ["symlink-blob", "symlink-manifest", "garbage", "nonhex", "traversal", "traversal-64", "fifo", "dir"]
HOSTILE_KEYS += ["huge", "long", "swapped"]


@pytest.mark.parametrize("copy", [True, False])
def test_hostile_shared_store_never_yields_bad_or_outside_bytes(tmp_path: Path, copy: bool) -> None:
    root, good, _outside = _hostile_store(tmp_path)
    age(root)
    before = listing(root)
    cache = CacheStore(tmp_path / "local", shared=[root], copy_shared_hits=copy)
    for _ in range(3):  # first sight, then the repeated-hit path
        for key in HOSTILE_KEYS:
            assert cache.get(key) is None, key
        assert cache.get("good") == good["good"]
    stats = cache.stats()
    assert stats.misses == 3 * len(HOSTILE_KEYS)
    assert stats.corrupt + stats.errors == 3 * len(HOSTILE_KEYS)  # every bad file met is counted
    assert stats.entries == (1 if copy else 0)  # only the good entry was ever copied in
    assert listing(root) == before
    # The same store opened directly read-only behaves the same, and stays unchanged.
    direct = CacheStore(root, read_only=True)
    for key in HOSTILE_KEYS:
        assert direct.get(key) is None, key
    assert direct.get("good") == good["good"]
    assert listing(root) == before


def test_hostile_entries_through_program_cache(tmp_path: Path) -> None:
    root, _good, _outside = _hostile_store(tmp_path)
    with ContentAddressedProgramCache(tmp_path / "local", shared=[root]) as cache:
        for key in HOSTILE_KEYS:
            assert cache.get(key) is None
            with pytest.raises(KeyError):
                cache[key]


@pytest.mark.parametrize("kind", ["missing", "empty", "not-a-cache", "a-file", "newer-layout", "damaged-layout"])
def test_unusable_shared_store_is_a_miss_and_becomes_usable_once_it_appears(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    if kind == "empty":
        shared.mkdir()
    elif kind == "not-a-cache":
        shared.mkdir()
        (shared / "notes.txt").write_text("hello")
    elif kind == "a-file":
        shared.write_text("not a directory")
    elif kind in ("newer-layout", "damaged-layout"):
        CacheStore(shared)
        body = '{"layout": "cuda-program-cas", "version": 99}' if kind == "newer-layout" else "{garbage"
        (shared / "layout.json").write_text(body)
    node = tmp_path / "node"
    CacheStore(node).put("k", b"published bytes")
    caplog.set_level("DEBUG", logger="cuda_program_cas")
    # The retry waits on the clock, not on another process: the test moves the store's clock on, not sleeps.
    clock = MovableClock()
    monkeypatch.setattr(shared_mod, "time", clock)
    cache = CacheStore(tmp_path / "local", shared=[shared])
    for _ in range(3):
        assert cache.get("k") is None
    cache.put("mine", b"local")
    assert cache.get("mine") == b"local"
    stats = cache.stats()
    assert stats.misses == 3 and stats.errors >= 1
    # The first look at a store that cannot be used warns once, naming it (issue 13); the rest is DEBUG.
    warned = [r.getMessage() for r in caplog.records if r.levelname != "DEBUG"]
    assert len(warned) == 1 and "unusable" in warned[0] and str(shared) in warned[0], warned
    # The store appears (published by the operator); the open cache starts using it.
    if kind in ("a-file", "not-a-cache", "newer-layout", "damaged-layout"):
        if shared.is_dir():
            shutil.rmtree(shared)
        else:
            shared.unlink()
    elif kind == "empty":
        shared.rmdir()
    report = publish([node], shared)
    assert report.published == 1
    assert CacheStore(tmp_path / "fresh", shared=[shared]).get("k") == b"published bytes"
    while cache.get("k") is None:
        assert clock.ahead < 3 * _SHARED_RETRY_S, "the shared store was not picked up after it appeared"
        clock.ahead += _SHARED_RETRY_S / 25
    assert cache.get("k") == b"published bytes"


@pytest.mark.mount
def test_shared_store_unmounted_and_remounted(tmp_path: Path, mounts) -> None:
    src = tmp_path / "store"
    values = {f"k{i}": os.urandom(100 + i) for i in range(20)}
    writer = CacheStore(src)
    for key, value in values.items():
        writer.put(key, value)
    mnt = mounts(src, tmp_path / "mnt")
    cache = CacheStore(tmp_path / "local", shared=[mnt], copy_shared_hits=False)
    for _ in range(2):
        assert all(cache.get(k) == v for k, v in values.items())
    umount(mnt)  # the mount point is now an empty directory
    assert all(cache.get(k) is None for k in values)
    mounts(src, mnt)
    assert all(cache.get(k) == v for k, v in values.items())
    stats = cache.stats()
    assert (stats.shared_hits, stats.misses, stats.entries) == (3 * len(values), len(values), 0)


@pytest.mark.mount
def test_eio_is_a_miss_and_an_unreachable_store_is_skipped(
    tmp_path: Path, mounts, caplog: pytest.LogCaptureFixture
) -> None:
    # /proc/<pid>/mem is a regular file whose read at offset 0 fails with EIO: bind
    # mounted over a manifest, it stands for a soft NFS mount whose server is gone.
    src = tmp_path / "store"
    writer = CacheStore(src)
    for key in ("eio", "good", "other"):
        writer.put(key, f"bytes of {key}".encode())
    mem = Path(f"/proc/{os.getpid()}/mem")
    caplog.set_level("DEBUG", logger="cuda_program_cas")
    cache = CacheStore(tmp_path / "local", shared=[src], copy_shared_hits=False)
    bind_file(mounts, mem, Path(writer.inner.layout.manifest_path(key_id("eio"))))
    for _ in range(3):
        assert cache.get("eio") is None
    assert cache.stats().errors == 3
    assert [r.levelname for r in caplog.records if "read error" in r.getMessage()] == ["DEBUG"]
    # One file failing is not an outage: the store still serves the rest.
    assert cache.get("good") == b"bytes of good"
    # The layout unreadable too: the store is skipped (no lookups) until the retry interval.
    bind_file(mounts, mem, src / "layout.json")
    assert cache.get("eio") is None
    assert cache.get("other") is None
    assert cache.stats().shared_hits == 1
    assert CacheStore(tmp_path / "l2", shared=[src]).get("other") is None  # a new cache: the same miss


def bind_file(mounts, src: Path, dst: Path) -> None:
    """A file bind mounted over a file (read-write: the read-only remount is not needed here)."""
    if not is_root():
        pytest.skip("bind mounts need root")
    proc = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot bind mount {src} here: {proc.stderr.strip()}")
    mounts.done.append(dst)


@pytest.mark.mount
def test_permission_denied_is_a_miss(tmp_path: Path) -> None:
    if not is_root() or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to read as another user")
    probe = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            "import cuda_program_cas",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"this interpreter cannot run as user 65534 here: {probe.stderr.strip()[:200]}")
    base = Path(tempfile.mkdtemp(prefix="cas-perm-"))
    try:
        base.chmod(0o755)
        closed, partly = base / "closed", base / "partly"
        CacheStore(closed).put("k", b"closed bytes")
        closed.chmod(0o700)
        store = CacheStore(partly)
        store.put("k", b"readable")
        store.put("hidden", b"hidden bytes")
        for dirpath, dirnames, filenames in os.walk(partly):
            for name in dirnames:
                os.chmod(os.path.join(dirpath, name), 0o755)
            for name in filenames:
                os.chmod(os.path.join(dirpath, name), 0o644)
        os.chmod(store.inner.layout.manifest_path(key_id("hidden")), 0o600)
        local = base / "local"
        local.mkdir(mode=0o777)
        local.chmod(0o777)
        code = (
            "import sys\nfrom cas import CacheStore\n"
            f"c = CacheStore({str(local / 'cas')!r}, shared=[{str(closed)!r}, {str(partly)!r}])\n"
            "assert c.get('hidden') is None\nassert c.get('k') == b'readable'\n"
            "s = c.stats()\nassert s.errors >= 2 and s.shared_hits == 1, s\n"
        )
        proc = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_shared_from_environment_and_explicit_argument_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "store"
    CacheStore(store).put("k", b"from the shared store")
    monkeypatch.setenv("CUDA_PROGRAM_CAS_SHARED", ";".join(["", str(tmp_path / "absent"), str(store), ""]))
    from_env = ContentAddressedProgramCache(tmp_path / "a")
    assert from_env.store.inner.shared_paths() == (str(tmp_path / "absent"), str(store))
    assert from_env.get("k") == b"from the shared store"
    for explicit in ([], None):
        cache = ContentAddressedProgramCache(tmp_path / "b", shared=explicit)
        assert cache.store.inner.shared_paths() == ()
        assert cache.get("k") is None
    other = tmp_path / "other"
    CacheStore(other).put("k", b"from the other store")
    assert ContentAddressedProgramCache(tmp_path / "c", shared=[other]).get("k") == b"from the other store"
    with pytest.raises(TypeError, match="single path"):
        ContentAddressedProgramCache(tmp_path / "d", shared=str(store))  # type: ignore[arg-type]
