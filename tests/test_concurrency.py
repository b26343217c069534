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
import time
from pathlib import Path

import pytest
from conftest import REPO
from cuda_program_cas_index import parse_manifest

from cas import CacheStore

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

    root, role, seed, seconds, sync = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    rng = random.Random(seed)

    from cas import ContentAddressedProgramCache

    cap = 200_000 if role == "capped" else None
    cache = ContentAddressedProgramCache(root, max_size_bytes=cap)
    # Start together: imports take a while on a loaded machine.
    open(os.path.join(sync, f"ready-{seed}"), "w").close()
    give_up = time.time() + 60
    while not os.path.exists(os.path.join(sync, "go")):
        if time.time() > give_up:
            sys.exit(4)
        time.sleep(0.005)
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


def start_workers(root: Path, roles: list[str], seconds: float, sync: Path) -> list[subprocess.Popen[str]]:
    """Start one process per role; they run ``seconds`` together once all have started."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    sync.mkdir()
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(root), role, str(seed), str(seconds), str(sync)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for seed, role in enumerate(roles)
    ]
    give_up = time.monotonic() + 60
    while len(list(sync.glob("ready-*"))) < len(roles) and time.monotonic() < give_up:
        if any(w.poll() is not None for w in workers):
            break  # one died while starting: wait_all reports it
        time.sleep(0.01)
    (sync / "go").touch()
    return workers


def wait_all(workers: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    results = []
    end = time.monotonic() + timeout
    for proc in workers:
        try:
            out, err = proc.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            results.append((-999, f"timed out\n{out}{err}"))
            continue
        results.append((proc.returncode, out + err))
    return results


def test_processes_racing_on_the_same_keys(cache_dir: Path, tmp_path: Path) -> None:
    CacheStore(cache_dir)  # laid out once, so no worker races on creating the layout
    workers = start_workers(cache_dir, ROLES, RUN_SECONDS, tmp_path / "sync")
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
        import sys, time
        from cas import CacheStore
        store = CacheStore(sys.argv[1])
        go = float(sys.argv[2])
        while time.time() < go:
            pass
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
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    go = str(time.time() + 1.0)
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(cache_dir), go], env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    stats = CacheStore(cache_dir).stats()
    assert (stats.entries, stats.blobs) == (1, 1)
    assert os.listdir(cache_dir / "tmp") == []
