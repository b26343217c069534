"""Claims: when processes of one node miss the same key at once, one compiles and the others wait.

Real processes and real NVRTC. A worker counts its real compiles through cuda-core's
compile seam and says so on stdout ("compiling"); a worker the test wants to hold
inside its compile then waits for a line on stdin. A worker that waits for another's
claim says "waiting" first. The test waits for those lines, never for a duration.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import NVRTC_RECORD, ChildLines, StartGate, is_root

from cuda_program_cas import CacheStore, ContentAddressedProgramCache, collect, verify
from cuda_program_cas._cuda.trace import PREFIX, STALE_S, sweep_stale
from cuda_program_cas._local import claims
from cuda_program_cas.index import key_id

pytestmark = pytest.mark.skipif(claims.fcntl is None, reason="claims need flock")

SOURCE = r"""
template <class T> __global__ void scale(T *p, T a) { *p = *p * a; }
extern "C" __global__ void claimed(int *out) { *out = 42; }
"""
NAMES = ("scale<float>", "scale<int>")

#: A worker: opens the cache at argv[1], compiles SOURCE through the front door once
#: stdin says "start", prints its counters and the binary. With argv[2] == "hold", its
#: real compile stops until stdin says "go on".
WORKER = f"""
import json, sys
import cuda.core._program as program
from cuda.core import ProgramOptions
from cuda_program_cas import ContentAddressedProgramCache
from cuda_program_cas._local import claims

root, hold = sys.argv[1], sys.argv[2] == "hold"
original = program._program_compile_uncached

def counted(*args, **kwargs):
    print("compiling", flush=True)
    if hold and sys.stdin.readline() != "go on\\n":
        sys.exit("the test gave up")
    return original(*args, **kwargs)

program._program_compile_uncached = counted
waiting = claims._wait

def said(*args):
    print("waiting", flush=True)
    return waiting(*args)

claims._wait = said
cache = ContentAddressedProgramCache(root)
print("ready", flush=True)
if sys.argv[3] == "gate":
    if __import__("os").read(0, 1) != b"g":
        sys.exit("the test gave up before the start")
elif sys.stdin.readline() != "start\\n":
    sys.exit("the test gave up before the start")
obj = cache.compile({SOURCE!r}, "c++", ProgramOptions(arch="sm_80"), "cubin", name_expressions={NAMES!r})
print("result " + json.dumps({{"code": bytes(obj.code).hex(), "mapping": {{k: v.hex() for k, v in
      obj.symbol_mapping.items()}}, **cache.counters()}}), flush=True)
"""


def start(
    root: Path,
    *,
    hold: bool,
    wait_s: str | None = None,
    stdin: int | None = None,
    wait_ready: bool = True,
    tmp: Path | None = None,
) -> ChildLines:
    env = dict(os.environ)
    if tmp is not None:  # its temp directory: what it leaves there is the test's
        env["TMPDIR"] = str(tmp)
    env.pop("CUDA_PROGRAM_CAS_CLAIM_WAIT", None)
    if wait_s is not None:
        env["CUDA_PROGRAM_CAS_CLAIM_WAIT"] = wait_s
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(root), "hold" if hold else "free", "gate" if stdin is not None else "line"],
        stdin=subprocess.PIPE if stdin is None else stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    child = ChildLines(proc)
    if wait_ready:
        child.wait("ready")
    return child


def say(child: ChildLines, line: str) -> None:
    assert child.proc.stdin is not None
    child.proc.stdin.write(line + "\n")
    child.proc.stdin.flush()


def result(child: ChildLines) -> dict[str, object]:
    line = next(line for line in child.lines if line.startswith("result "))
    return json.loads(line[len("result ") :])


def finish(*children: ChildLines) -> list[dict[str, object]]:
    results = []
    for child in children:
        if child.proc.stdin is not None:
            child.proc.stdin.close()
        code = child.finish(timeout=120)
        assert code == 0, child.output()
        results.append(result(child))
    return results


@pytest.fixture
def reference() -> dict[str, object]:
    """The uncached compile's binary and symbol mapping."""
    from cuda.core import Program, ProgramOptions

    obj = Program(SOURCE, "c++", options=ProgramOptions(arch="sm_80")).compile("cubin", NAMES)
    return {"code": bytes(obj.code).hex(), "mapping": {k: v.hex() for k, v in obj.symbol_mapping.items()}}


def claim_files(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "tmp").iterdir() if p.name.endswith(".claim"))


def test_one_compile_while_the_others_wait(cache_dir: Path, reference: dict[str, object]) -> None:
    """Four processes miss one key: the first compiles, three wait for it and hit; NVRTC runs once."""
    first = start(cache_dir, hold=True)
    others = [start(cache_dir, hold=False) for _ in range(3)]
    try:
        say(first, "start")
        first.wait("compiling")  # it holds the claim, stopped inside its compile
        for child in others:
            say(child, "start")
            child.wait("waiting")
        say(first, "go on")
        results = finish(first, *others)
    finally:
        for child in (first, *others):
            child.kill()
    compiled = [c.lines.count("compiling") for c in (first, *others)]
    assert compiled == [1, 0, 0, 0], [c.output() for c in (first, *others)]
    for got in results:
        assert (got["code"], got["mapping"]) == (reference["code"], reference["mapping"])
    assert [(r["misses"], r["hits"], r["claim_waits"], r["claim_hits"]) for r in results] == [
        (1, 0, 0, 0),
        *[(0, 1, 1, 1)] * 3,
    ]
    assert claim_files(cache_dir) == []


def test_eight_ranks_at_once_compile_once(cache_dir: Path, reference: dict[str, object]) -> None:
    """Eight processes let go at the same moment, as the ranks of a job's cold start: one NVRTC run."""
    gate = StartGate()
    children = []
    try:
        children = [start(cache_dir, hold=False, stdin=gate.fd, wait_ready=False) for _ in range(8)]
        for child in children:
            child.wait("ready")
        gate.open(len(children))
        results = finish(*children)
    finally:
        gate.close()
        for child in children:
            child.kill()
    assert sum(c.lines.count("compiling") for c in children) == 1, [c.output() for c in children]
    assert sum(r["misses"] for r in results) == 1  # type: ignore[misc]
    assert sum(r["hits"] for r in results) == 7  # type: ignore[misc]
    assert all((r["code"], r["mapping"]) == (reference["code"], reference["mapping"]) for r in results)
    assert claim_files(cache_dir) == []


def test_a_killed_claimant_frees_its_waiter_at_once(cache_dir: Path, reference: dict[str, object]) -> None:
    """SIGKILL the claimant mid-compile: the waiter (bound: 10 minutes) compiles right away."""
    # The killed claimant's trace folder stays behind: in a temp directory of the test's own, not $TMPDIR.
    tmp = cache_dir.parent / "tmp"
    tmp.mkdir()
    first = start(cache_dir, hold=True, tmp=tmp)
    second = start(cache_dir, hold=True, wait_s="600", tmp=tmp)
    try:
        say(first, "start")
        first.wait("compiling")
        assert len(claim_files(cache_dir)) == 1
        say(second, "start")
        second.wait("waiting")
        t0 = time.monotonic()
        first.proc.send_signal(signal.SIGKILL)
        second.wait("compiling", timeout=60)
        taken_over_s = time.monotonic() - t0
        say(second, "go on")
        (got,) = finish(second)
        assert first.finish() == -signal.SIGKILL
    finally:
        first.kill()
        second.kill()
    assert taken_over_s < 30
    assert (got["code"], got["mapping"]) == (reference["code"], reference["mapping"])
    left = [p for p in tmp.iterdir() if p.name.startswith(PREFIX)]
    assert len(left) == 1  # the killed one's; the waiter removed its own
    t = time.time() - STALE_S - 60
    os.utime(left[0], (t, t))
    assert sweep_stale(str(tmp)) == 1 and list(tmp.iterdir()) == []
    assert (got["misses"], got["hits"], got["claim_waits"], got["claim_hits"]) == (1, 0, 1, 0)
    assert claim_files(cache_dir) == []  # the dead claimant's file went with the waiter that took it over


def test_a_waiter_past_its_bound_compiles_itself(cache_dir: Path, reference: dict[str, object]) -> None:
    """A claimant that neither finishes nor dies holds a waiter back only until the waiter's bound."""
    first = start(cache_dir, hold=True)
    second = start(cache_dir, hold=True, wait_s="0.2s")
    try:
        say(first, "start")
        first.wait("compiling")
        say(second, "start")
        second.wait("waiting")
        second.wait("compiling")  # the bound passed while the first still compiles
        say(second, "go on")
        say(first, "go on")
        results = finish(second, first)
    finally:
        first.kill()
        second.kill()
    for got in results:
        assert (got["code"], got["mapping"]) == (reference["code"], reference["mapping"])
    assert [(r["misses"], r["claim_waits"], r["claim_hits"]) for r in results] == [(1, 1, 0), (1, 0, 0)]
    assert claim_files(cache_dir) == []


def test_read_only_and_unclaimable_caches_compile(cache_dir: Path, reference: dict[str, object], monkeypatch) -> None:
    """No claim can be taken (no locks, a directory in the way, read-only): compiles go on, nothing raises."""
    from cuda.core import ProgramOptions

    opts = ProgramOptions(arch="sm_80")
    ContentAddressedProgramCache(cache_dir).close()
    ro = ContentAddressedProgramCache(cache_dir, read_only=True)
    obj = ro.compile(SOURCE, "c++", opts, "cubin", name_expressions=NAMES)
    assert bytes(obj.code).hex() == reference["code"] and ro.counters()["dropped_writes"] == 1

    def no_locks(*args: object) -> bool:
        raise OSError(errno.ENOLCK, "No locks available")  # an NFS mount without its lock daemon

    monkeypatch.setattr(claims, "try_lock", no_locks)
    cache = ContentAddressedProgramCache(cache_dir)
    obj = cache.compile(SOURCE, "c++", opts, "cubin", name_expressions=NAMES)
    assert bytes(obj.code).hex() == reference["code"]
    counts = cache.counters()
    assert (counts["misses"], counts["writes"], counts["claim_waits"]) == (1, 2 + NVRTC_RECORD, 0)
    assert claim_files(cache_dir) == []
    monkeypatch.undo()
    hit = ContentAddressedProgramCache(cache_dir).compile(SOURCE, "c++", opts, "cubin", name_expressions=NAMES)
    assert bytes(hit.code).hex() == reference["code"]


@pytest.mark.parametrize("what", ["directory", "symlink", "fifo", "unwritable", "read-only file system"])
def test_no_claim_where_none_can_be_taken(cache_dir: Path, what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Something in the claim file's place, or a tmp/ that cannot be written: no claim, no wait, no exception."""
    if what == "unwritable" and is_root():
        pytest.skip("root writes anywhere")
    store = CacheStore(cache_dir)
    kid = key_id("k")
    place = cache_dir / "tmp" / f"{kid}.claim"
    if what == "directory":
        place.mkdir()
    elif what == "symlink":
        place.symlink_to(cache_dir / "elsewhere")
    elif what == "fifo":
        os.mkfifo(place)
    elif what == "read-only file system":

        def read_only_fs(path: str) -> int:
            raise OSError(errno.EROFS, "Read-only file system", path)

        monkeypatch.setattr(claims, "_open", read_only_fs)
    else:
        (cache_dir / "tmp").chmod(0o500)
    try:
        t0 = time.monotonic()
        with store.inner.claim(kid, wait_s=600) as claim:
            assert (claim.held, claim.waited, claim.timed_out) == (False, False, False)
        assert time.monotonic() - t0 < 60
        assert not (cache_dir / "elsewhere").exists()
    finally:
        (cache_dir / "tmp").chmod(0o700)
    assert store.put("k", b"x")
    read_only = CacheStore(cache_dir, read_only=True)
    with read_only.inner.claim(kid) as claim:
        assert not claim.held and not claim.waited


def test_a_dead_claimants_file_is_taken_over_or_swept(cache_dir: Path) -> None:
    """A claim file no one holds is free: the next claimant takes it (and freshens it); else gc takes it."""
    store = CacheStore(cache_dir)
    old = time.time() - 2 * 3600
    for name in ("k", "gone"):
        leftover = cache_dir / "tmp" / f"{key_id(name)}.claim"
        leftover.write_bytes(b"")
        os.utime(leftover, (old, old))
    with store.inner.claim(key_id("k"), wait_s=0) as claim:
        assert claim.held and not claim.waited
        assert (cache_dir / "tmp" / f"{key_id('k')}.claim").stat().st_mtime > old + 3600  # no sweep takes it now
    assert claim_files(cache_dir) == [f"{key_id('gone')}.claim"]
    assert [p.kind for p in verify(cache_dir).problems] == ["stale_temp_file"]
    assert collect(cache_dir).temp_files_removed == 1
    assert claim_files(cache_dir) == []


def test_threads_of_one_process_wait_for_each_other(cache_dir: Path) -> None:
    """A claim belongs to the open file, not the process: a second thread waits for the first's."""
    store = CacheStore(cache_dir)
    kid = key_id("k")
    seen: list[claims.Claim] = []
    with store.inner.claim(kid) as mine:
        assert mine.held and not mine.waited

        def other_thread() -> None:
            with store.inner.claim(kid, wait_s=0) as theirs:
                seen.append(theirs)

        other = threading.Thread(target=other_thread)
        other.start()
        other.join()
        assert seen[0].timed_out and not seen[0].held
    with store.inner.claim(kid) as again:  # let go: free at once, and its file is gone
        assert again.held and not again.waited
    assert claim_files(cache_dir) == []
    counts = store.counters()
    assert (counts["claim_waits"], counts["claim_hits"]) == (1, 0)


#: A process that holds a claim, forks, and lets its child leave the claim's block.
FORKER = """
import os, sys
from cuda_program_cas import CacheStore
from cuda_program_cas.index import key_id
store = CacheStore(sys.argv[1])
kid = key_id("k")
with store.inner.claim(kid) as claim:
    assert claim.held
    print("parent holds", flush=True)
    pid = os.fork()
    if pid == 0:
        with store.inner.claim(kid, wait_s=0) as mine:  # the parent's claim is another's to the child
            print("child busy" if mine.timed_out and not mine.held else "child holds", flush=True)
    else:
        sys.stdin.read()  # until killed
print(f"child-left {os.getpid()}", flush=True)  # out of the block: it let nothing go
sys.stdin.read()
os._exit(0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_hold_its_parents_claim(cache_dir: Path) -> None:
    """The child neither holds nor lets go of its parent's claim, and the claim dies with the parent."""
    store = CacheStore(cache_dir)
    kid = key_id("k")
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKER, str(cache_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    parent = ChildLines(proc)
    try:
        parent.wait("parent holds")
        parent.wait("child busy")
        child_pid = int(parent.wait("child-left", at_least=1).split()[1])
        with store.inner.claim(kid, wait_s=0) as claim:  # the child left the block: still held
            assert claim.timed_out and not claim.held
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL  # its stdin stays open: the child waits on it
        os.kill(child_pid, 0)  # the child lives on, with the copies of its parent's descriptors closed
        t0 = time.monotonic()
        with store.inner.claim(kid, wait_s=60) as claim:
            assert claim.held and not claim.timed_out, claim
        assert time.monotonic() - t0 < 30
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the child, reading end of file, exits
        parent.kill()
