"""Several real processes writing, reading, deleting, clearing and evicting the same keys.

Every key maps deterministically to its content (and many keys share content, so
blobs are deduplicated, freshened and collected under the workers' feet), so each
hit is checked byte for byte. A worker fails, through its exit status, on wrong
or partial data, on any exception from a lookup other than ``KeyError``, on any
exception from a write, and on any corrupt or error count in its stats.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import ChildLines, StartGate

from cuda_program_cas import CacheStore
from cuda_program_cas.index import parse_manifest

HELPERS = textwrap.dedent(
    """
    import hashlib

    N_KEYS = 40

    def content(i):
        # Deterministic per key; keys i and i + 8 share content (dedup); sizes
        # from a few bytes to 96 KB (small blobs are hashed, large ones fstat-ed).
        j = i % 8
        size = (7, 300, 5000, 20000, 40000, 70000, 98304, 1)[j]
        block = hashlib.sha256(b"content-%d" % j).digest()
        return (block * (size // 32 + 1))[:size]

    def key(i):
        return f"key-{i}" if i % 2 else b"key-%d" % i  # str and bytes keys both
    """
)
_helpers: dict[str, object] = {}
exec(HELPERS, _helpers)
content = _helpers["content"]
key = _helpers["key"]

WORKER = HELPERS + textwrap.dedent(
    """
    import os, random, sys, time, traceback

    root, role, seed, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    rng = random.Random(seed)

    from cuda_program_cas import ContentAddressedProgramCache

    cap = 200_000 if role == "capped" else None
    cache = ContentAddressedProgramCache(root, max_size_bytes=cap)
    # Start together: imports take a while on a loaded machine. Say so, then wait for the
    # start (a byte on stdin; end of file: the parent gave up).
    print("ready", flush=True)
    if os.read(0, 1) != b"g":
        sys.exit(4)
    deadline = time.time() + seconds
    checked = 0
    while time.time() < deadline:
        i = rng.randrange(N_KEYS)
        r = rng.random()
        if role == "reader":
            r = 0.45 + 0.55 * r  # lookups only
        try:
            if role == "clearer" and r < 0.05:
                cache.clear()
            elif role == "deleter" and r < 0.3:
                try:
                    del cache[key(i)]
                except KeyError:
                    pass
            elif r < 0.45:
                cache[key(i)] = content(i)
            elif r < 0.7:
                try:
                    data = cache[key(i)]
                except KeyError:
                    continue
                if data != content(i):
                    print(f"wrong data for key {i}: {len(data)} bytes", file=sys.stderr)
                    sys.exit(2)
                checked += 1
            else:
                data = cache.get(key(i))
                if data is not None:
                    if data != content(i):
                        print(f"wrong data for key {i}: {len(data)} bytes", file=sys.stderr)
                        sys.exit(2)
                    checked += 1
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
    stats = cache.stats()
    if stats.corrupt or stats.errors or stats.dropped_writes:
        print(f"bad counters: {stats}", file=sys.stderr)
        sys.exit(3)
    print(f"{role}: {checked} hits checked, {stats.writes} writes, {stats.evictions} evictions")
    """
)

ROLES = ["writer", "reader", "deleter", "clearer", "capped", "capped"]
RUN_SECONDS = 3.0


def start_workers(root: Path, roles: list[str], seconds: float) -> list[ChildLines]:
    """Start one process per role; they run ``seconds`` together once every one has said it is ready."""
    env = dict(os.environ)
    gate = StartGate()
    workers = [
        ChildLines(
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(root), role, str(seed), str(seconds)],
                stdin=gate.fd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
        for seed, role in enumerate(roles)
    ]
    try:
        for worker in workers:
            worker.wait("ready", timeout=60)
    except BaseException:
        gate.close()  # the others read end of file and exit
        for worker in workers:
            worker.kill()
        raise
    gate.open(len(workers))
    return workers


def wait_all(workers: list[ChildLines], timeout: float) -> list[tuple[int, str]]:
    results = []
    end = time.monotonic() + timeout
    for worker in workers:
        code = worker.finish(timeout=max(1.0, end - time.monotonic()))
        text = "\n".join(line for line in worker.lines if line != "ready") + "\n" + worker.stderr
        results.append((-999, f"timed out\n{text}") if worker.timed_out else (code, text))
    return results


def test_processes_racing_on_the_same_keys(cache_dir: Path) -> None:
    CacheStore(cache_dir)  # laid out once, so no worker races on creating the layout
    workers = start_workers(cache_dir, ROLES, RUN_SECONDS)
    results = wait_all(workers, timeout=60)
    report = "\n".join(f"[{role}] exit {rc}: {text.strip()}" for role, (rc, text) in zip(ROLES, results, strict=True))
    assert all(rc == 0 for rc, _ in results), report
    # Each worker did real work: the races happened.
    assert all("hits checked" in text for _, text in results), report
    reader_hits = int(results[1][1].split(":")[1].split()[0])
    assert reader_hits > 0, report

    # What is left on disk is consistent: no temp files, nothing quarantined,
    # every manifest well formed, every surviving key holds its own content.
    assert sorted(os.listdir(cache_dir / "tmp")) == []
    assert not (cache_dir / "quarantine").exists() or os.listdir(cache_dir / "quarantine") == []
    for path in (cache_dir / "index").rglob("*"):
        if path.is_file():
            assert parse_manifest(path.read_bytes()) is not None, path
    store = CacheStore(cache_dir)
    for i in range(40):
        data = store.get(key(i))  # type: ignore[operator]
        assert data is None or data == content(i), i  # type: ignore[operator]
    assert store.stats().corrupt == 0


@pytest.mark.parametrize("n", [4])
def test_concurrent_first_writes_of_one_key(cache_dir: Path, n: int) -> None:
    """Processes storing the same key at the same instant: one blob, one manifest, the right bytes."""
    code = textwrap.dedent(
        """
        import os, sys
        from cuda_program_cas import CacheStore
        store = CacheStore(sys.argv[1])
        print("ready", flush=True)
        if os.read(0, 1) != b"g":  # all start at once; end of file: the parent gave up
            sys.exit(3)
        for _ in range(200):
            if not store.put("k", b"x" * 50_000):
                sys.exit(1)
            data = store.get("k")
            if data is not None and data != b"x" * 50_000:
                sys.exit(2)
        """
    )
    CacheStore(cache_dir)
    env = dict(os.environ)
    gate = StartGate()
    procs = [
        ChildLines(
            subprocess.Popen(
                [sys.executable, "-c", code, str(cache_dir)],
                stdin=gate.fd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
        for _ in range(n)
    ]
    try:
        for proc in procs:
            proc.wait("ready", timeout=60)  # every one has opened the store: the puts below race
    except BaseException:
        gate.close()
        for proc in procs:
            proc.kill()
        raise
    gate.open(n)
    for proc in procs:
        assert proc.finish(timeout=60) == 0, proc.output()
    stats = CacheStore(cache_dir).stats()
    assert (stats.entries, stats.blobs) == (1, 1)
    assert os.listdir(cache_dir / "tmp") == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_temp_names_stay_unique_across_fork(tmp_path: Path) -> None:
    # Temp names are a per-process random half and a counter: a forked child must
    # not draw the names its parent draws next.
    from cuda_program_cas._disk.atomic import _tmp_name

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, "\n".join(_tmp_name(str(tmp_path)) for _ in range(50)).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as fh:
        child = set(fh.read().split("\n"))
    parent = {_tmp_name(str(tmp_path)) for _ in range(50)}
    assert len(child) == 50 and len(parent) == 50
    assert not child & parent


def test_a_write_whose_temp_name_is_taken_still_lands(tmp_path: Path) -> None:
    # A name left behind by a process long gone (same pid, same draw) is never
    # overwritten: the writer takes another name.
    import cuda_program_cas._disk.atomic as writer

    tmp_dir = tmp_path / "tmp"
    tmp_dir.mkdir()
    taken = writer._tmp_name(str(tmp_dir))
    prefix, counter = taken[: -len("00000000.tmp")], int(taken[-len("00000000.tmp") : -4], 16)
    squatter = f"{prefix}{counter + 1:08x}.tmp"  # the next name drawn
    Path(squatter).write_bytes(b"someone else's")
    target = tmp_path / "out"
    assert writer.atomic_write(str(target), b"mine", str(tmp_dir))
    assert target.read_bytes() == b"mine"
    assert Path(squatter).read_bytes() == b"someone else's"


def test_a_cache_directory_another_process_makes_meanwhile_is_never_taken_for_a_file(tmp_path: Path) -> None:
    # Processes that open one new cache at once: each checks the path while another may be
    # making it. A check that asked "a directory?" and then "anything there?" took a directory
    # made in between for a file, and the open failed (CI saw it twice: a stampede tool worker,
    # and a switched compile that ran uncached). Threads switching every microsecond land in
    # that window thousands of times in 20,000 checks (tried on the old code: it failed).
    from cuda_program_cas._base.errors import LayoutError
    from cuda_program_cas._disk.layout import LayoutState, check_layout

    n = 20_000
    made = [-1]

    def make() -> None:
        for i in range(n):
            os.mkdir(tmp_path / str(i))
            made[0] = i

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    wrong: list[str] = []
    try:
        maker = threading.Thread(target=make)
        maker.start()
        i = 0
        while i < n:
            try:
                state = check_layout(str(tmp_path / str(i)))
            except LayoutError as exc:
                wrong.append(str(exc))
            else:
                assert state is LayoutState.MISSING
            if made[0] >= i:
                i += 1
        maker.join()
    finally:
        sys.setswitchinterval(old)
    assert wrong == []
