"""import-filestream: a directory written by cuda-core's real FileStreamProgramCache, keys intact."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SAXPY, ChildLines, compile_program

from cuda_program_cas import CacheStore, collect, import_filestream, verify
from cuda_program_cas._cli.main import main

SCALE = r"""
extern "C" __global__ void scale(float *x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
"""
REDUCE = r"""
extern "C" __global__ void reduce(const int *x, int *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(out, x[i]);
}
"""
#: (source, target, options): several kernels, targets and arches; the two saxpy
#: cubins for sm_80 differ only in `name`, which gives byte-identical binaries.
KERNELS = [
    (SAXPY, "cubin", {"arch": "sm_80"}),
    (SAXPY, "cubin", {"arch": "sm_80", "name": "other.cu"}),
    (SAXPY, "cubin", {"arch": "sm_90"}),
    (SCALE, "cubin", {"arch": "sm_80"}),
    (REDUCE, "cubin", {"arch": "sm_86"}),
    (REDUCE, "ltoir", {"arch": "sm_80"}),
]


def listing(root: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def test_filestream_entries_hit_through_program_compile_without_nvrtc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cuda.core.utils import FileStreamProgramCache

    from cuda_program_cas import ContentAddressedProgramCache

    fs_dir, dest = tmp_path / "filestream", tmp_path / "cas"
    with FileStreamProgramCache(fs_dir) as fs:
        codes = [bytes(compile_program(src, target, cache=fs, **opts).code) for src, target, opts in KERNELS]
        assert len(fs) == len(KERNELS)
    assert codes[0] == codes[1], "NVRTC no longer gives identical cubins for a different `name`"

    assert main(["import-filestream", str(fs_dir), str(dest), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["entries"] == report["imported"] == len(KERNELS)
    assert report["deduplicated"] == 1  # the two identical saxpy cubins share one blob
    assert CacheStore(dest).stats().blobs == len(KERNELS) - 1

    def no_nvrtc(*args: object, **kwargs: object) -> object:
        raise AssertionError("NVRTC was called: the cache missed")

    import cuda.core._program

    monkeypatch.setattr(cuda.core._program, "_program_compile_uncached", no_nvrtc)
    with ContentAddressedProgramCache(dest) as cache:
        with pytest.raises(AssertionError, match="NVRTC was called"):  # the seam works: a miss compiles
            compile_program(SAXPY, "cubin", cache=cache, arch="sm_75")
        for (src, target, opts), code in zip(KERNELS, codes, strict=True):
            assert bytes(compile_program(src, target, cache=cache, **opts).code) == code
        assert cache.stats().hits == len(KERNELS)

    # Again: nothing to do, nothing rewritten.
    before = listing(dest)
    assert main(["import-filestream", str(fs_dir), str(dest)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"imported 0 entries (0 B) of {len(KERNELS)} into ")
    assert f"{len(KERNELS)} already present" in out
    assert listing(dest) == before


def write_filestream_entries(fs_dir: Path, items: dict[str, bytes]) -> None:
    """Lay entries out exactly as FileStreamProgramCache does (see the format test below)."""
    for key, data in items.items():
        digest = hashlib.sha256(key.encode()).hexdigest()
        path = fs_dir / "entries" / digest[:2] / digest[2:]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (fs_dir / "tmp").mkdir(exist_ok=True)


def test_the_fixture_layout_is_filestreams_own(tmp_path: Path) -> None:
    from cuda.core.utils import FileStreamProgramCache

    real, ours = tmp_path / "real", tmp_path / "ours"
    with FileStreamProgramCache(real) as fs:
        fs["key-1"] = b"abc"
        fs[b"key-2"] = b"defg"
    write_filestream_entries(ours, {"key-1": b"abc", "key-2": b"defg"})
    files = {str(p.relative_to(real)): p.read_bytes() for p in real.rglob("*") if p.is_file()}
    assert files == {str(p.relative_to(ours)): p.read_bytes() for p in ours.rglob("*") if p.is_file()}


def payload(i: int) -> bytes:
    return hashlib.sha256(str(i % 700).encode()).digest() * 64  # 2 KB; 700 distinct binaries


#: The import-filestream command, saying "written 200" once it has put 200 manifests in place (and going on).
_IMPORT_SAYING_WRITTEN = r"""
import os, sys
from cuda_program_cas._cli.main import main
index = os.path.realpath(os.path.join(sys.argv[2], "index"))
replace, written = os.replace, 0
def counting_replace(src, dst, *args, **kwargs):
    global written
    replace(src, dst, *args, **kwargs)
    if os.path.realpath(os.path.dirname(os.path.dirname(os.fspath(dst)))) == index:
        written += 1
        if written == 200:
            print("written", written, flush=True)
os.replace = counting_replace
sys.exit(main(["import-filestream", *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_an_interrupted_import_can_be_run_again(tmp_path: Path) -> None:
    n = 2500
    fs_dir, dest = tmp_path / "filestream", tmp_path / "cas"
    write_filestream_entries(fs_dir, {f"kernel-{i}": payload(i) for i in range(n)})
    proc = subprocess.Popen(
        [sys.executable, "-c", _IMPORT_SAYING_WRITTEN, str(fs_dir), str(dest)],
        stdout=subprocess.PIPE,
        text=True,
    )
    importer = ChildLines(proc)
    index = dest / "index"
    try:
        importer.wait("written", at_least=200, timeout=60)  # it runs on: the kill lands wherever it is then
        assert proc.poll() is None, "the import finished before it could be interrupted"
    finally:
        proc.send_signal(signal.SIGKILL)
        importer.finish(timeout=30)
    done = sum(len(files) for _, _, files in os.walk(index))
    assert 200 <= done < n
    assert verify(dest).problems == []  # nothing half-written is visible

    report = import_filestream(fs_dir, dest)
    assert report.problems == [] and report.entries == n
    assert report.imported + report.already_present == n and report.already_present >= done
    store = CacheStore(dest)
    assert store.stats().entries == n and store.stats().blobs == 700
    for i in range(n):
        assert store.get(f"kernel-{i}") == payload(i)


def test_recency_is_carried_over_and_this_cache_wins_conflicts(tmp_path: Path) -> None:
    fs_dir, dest = tmp_path / "filestream", tmp_path / "cas"
    write_filestream_entries(fs_dir, {"old": b"o" * 100, "new": b"n" * 100, "mine": b"theirs"})
    old = fs_dir / "entries" / hashlib.sha256(b"old").hexdigest()[:2] / hashlib.sha256(b"old").hexdigest()[2:]
    three_days_ago = time.time() - 3 * 86400
    os.utime(old, (three_days_ago, three_days_ago))  # FileStream's last use is its atime
    store = CacheStore(dest)
    store.put("mine", b"ours")
    report = import_filestream(fs_dir, dest)
    assert (report.imported, report.kept_existing) == (2, 1)
    assert store.get("mine") == b"ours"
    assert collect(dest, max_age_s=2 * 86400).entries_removed == 1
    assert store.get("old") is None and store.get("new") == b"n" * 100
