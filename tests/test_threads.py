"""One cache instance shared by eight threads: gets, puts, deletes and clears under a cap.

Once for a :class:`cuda_program_cas.CacheStore` and once for a ``ContentAddressedProgramCache``.
About 40 keys with 1-4 KiB values under a 64 KiB cap, so eviction runs all the time.
Every value spells out its key and a version, so a reader can check that the bytes
it got are exactly one version of the key it asked for. Each thread counts its own
calls; at the end the instance's counters must match those counts, no thread may
have raised anything but ``KeyError`` from a delete or ``cache[key]``, and
``cuda_program_cas.verify`` must find no corrupt blob.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import cuda_program_cas

N_THREADS = 8
N_KEYS = 40
N_VERSIONS = 4  # few, so threads often write content that is already stored
CAP = 64 * 1024
DURATION_S = 3.0


def key_of(i: int) -> str | bytes:
    return f"key-{i}" if i % 2 else b"key-%d" % i  # str and bytes keys both


def value_of(i: int, v: int) -> bytes:
    """1-4 KiB, a function of (key, version) only; starts with its key and version."""
    head = f"key={i};v={v};".encode()
    size = 1024 + (i * 977 + v * 331) % 3072
    return (head * (size // len(head) + 1))[:size]


def check(i: int, data: bytes) -> None:
    """``data`` must be exactly one version of key ``i``."""
    head = f"key={i};v=".encode()
    assert data.startswith(head), f"asked for key {i}, got bytes starting {data[:24]!r}"
    v = int(data[len(head) : data.index(b";", len(head))])
    assert data == value_of(i, v), f"key {i} version {v}: {len(data)} bytes, not the {len(value_of(i, v))} written"


class Tally:
    def __init__(self) -> None:
        self.gets = 0
        self.puts: Counter[object] = Counter()  # by result: True/False or a WriteResult


def hammer(ops: dict[str, Any], seed: int, tally: Tally, stop: float) -> None:
    """Random operations on the shared instance until ``stop`` (a time.monotonic value)."""
    rng = random.Random(seed)
    get, getitem, put, delete, clear = (ops[name] for name in ("get", "getitem", "put", "delete", "clear"))
    n = 0
    while time.monotonic() < stop:
        n += 1
        i = rng.randrange(N_KEYS)
        r = rng.random()
        if r < 0.55:
            tally.gets += 1
            if getitem is not None and r < 0.2:
                try:
                    data = getitem(key_of(i))
                except KeyError:
                    continue
            else:
                data = get(key_of(i))
            if data is not None:
                check(i, data)
        elif r < 0.9:
            tally.puts[put(key_of(i), value_of(i, rng.randrange(N_VERSIONS)))] += 1
        elif r < 0.995 or n < 50:
            try:
                delete(key_of(i))
            except KeyError:
                pass
        else:
            clear()


def run_threads(ops: dict[str, Any]) -> list[Tally]:
    tallies = [Tally() for _ in range(N_THREADS)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(N_THREADS)

    def body(t: int) -> None:
        try:
            barrier.wait()
            hammer(ops, 1000 + t, tallies[t], time.monotonic() + DURATION_S)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(t,), name=f"hammer-{t}") for t in range(N_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=DURATION_S + 60)
    assert not any(th.is_alive() for th in threads), "a thread is stuck"
    if errors:
        first = errors[0]
        if len(errors) > 1 and hasattr(first, "add_note"):
            first.add_note("other threads raised: " + "; ".join(f"{type(e).__name__}: {e}" for e in errors[1:]))
        raise first
    return tallies


def check_counters(stats: cuda_program_cas.CacheStats, tallies: list[Tally], path: Path) -> None:
    gets = sum(t.gets for t in tallies)
    puts: Counter[object] = Counter()
    for t in tallies:
        puts.update(t.puts)
    assert gets > 1000 and sum(puts.values()) > 500, (gets, puts)  # the load really ran
    assert stats.hits + stats.misses == gets, (stats, gets)
    assert stats.hits > 0 and stats.misses > 0, stats
    assert stats.shared_hits == 0
    assert stats.corrupt == 0 and stats.errors == 0, stats
    assert stats.evictions > 0, stats  # the cap was exercised
    report = cuda_program_cas.verify(path)
    assert [p for p in report.problems if p.kind == "corrupt_blob"] == [], report.problems
    stored = sum(n for result, n in puts.items() if result)
    dropped = sum(n for result, n in puts.items() if not result)
    assert stats.writes == stored, (stats, puts)
    assert stats.dropped_writes == dropped, (stats, puts)
    assert set(puts) <= set(cuda_program_cas.WriteResult), puts
    assert stats.dedup_writes == puts[cuda_program_cas.WriteResult.DEDUPLICATED], (stats, puts)
    assert stats.dedup_writes > 0, stats


def test_one_cache_store_shared_by_threads(tmp_path: Path) -> None:
    path = tmp_path / "cas"
    store = cuda_program_cas.CacheStore(path, max_size_bytes=CAP)
    ops = {"get": store.get, "getitem": None, "put": store.put, "delete": store.delete, "clear": store.clear}
    tallies = run_threads(ops)
    check_counters(store.stats(), tallies, path)
    for i in range(N_KEYS):  # what is left is still right
        data = store.get(key_of(i))
        if data is not None:
            check(i, data)


def test_one_program_cache_shared_by_threads(tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    path = tmp_path / "cas"
    cache = cuda_program_cas.ContentAddressedProgramCache(path, max_size_bytes=CAP)

    def put(key: str | bytes, data: bytes) -> str:
        # cache[key] = value returns nothing; pass bytes, bytearray and memoryview values alike.
        cache[key] = (bytes, bytearray, memoryview)[len(data) % 3](data)
        return "set"

    def getitem(key: str | bytes) -> bytes:
        return cache[key]

    def delete(key: str | bytes) -> None:
        del cache[key]

    ops = {"get": cache.get, "getitem": getitem, "put": put, "delete": delete, "clear": cache.clear}
    tallies = run_threads(ops)
    stats = cache.stats()
    gets = sum(t.gets for t in tallies)
    sets = sum(t.puts["set"] for t in tallies)
    assert gets > 1000 and sets > 500, (gets, sets)
    assert stats.hits + stats.misses == gets, (stats, gets)
    assert stats.writes + stats.dropped_writes == sets, (stats, sets)
    assert stats.corrupt == 0 and stats.errors == 0, stats
    assert stats.evictions > 0 and stats.dedup_writes > 0, stats
    report = cuda_program_cas.verify(path)
    assert [p for p in report.problems if p.kind == "corrupt_blob"] == [], report.problems
    for i in range(N_KEYS):
        data = cache.get(key_of(i))
        if data is not None:
            check(i, data)
