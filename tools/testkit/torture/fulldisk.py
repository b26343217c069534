"""A full disk: the cache on a 1 MiB tmpfs (root only)."""

from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Callable
from typing import Any

from cuda_program_cas import CacheStore

from .checker import PROBLEMS, describe_problems, inspect_cache
from .common import N_KEYS, N_SEEDS, Report, check_hit, content, expected_digests, key_name, quiet, unexpected

# -- 4. full disk ----------------------------------------------------------------------


def run_full_disk(workdir: str, *, seed: int = 4, compile_program: Callable[..., Any] | None = None) -> Report:
    """The cache on a 1 MiB tmpfs: drops are clean and counted, reads and compiles go on, it recovers."""
    quiet()
    rep = Report("fulldisk", processes=1)
    mnt = os.path.join(workdir, "tmpfs")
    os.makedirs(mnt, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", mnt]
    proc = subprocess.run(mount, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        rep.skipped = f"mount -t tmpfs failed: {proc.stderr.strip() or proc.returncode}"
        return rep
    started = time.monotonic()
    try:
        _full_disk(os.path.join(mnt, "c"), rep, random.Random(seed), compile_program)
    finally:
        subprocess.run(["umount", mnt], capture_output=True, check=False)
    rep.seconds = round(time.monotonic() - started, 1)
    return rep


def _full_disk(root: str, rep: Report, rng: random.Random, compile_program: Callable[..., Any] | None) -> None:
    store = CacheStore(root)
    stored: set[int] = set()
    dropped = 0
    # Fill with big entries, then smaller ones, until even a manifest does not fit.
    order = list(range(N_SEEDS))
    rng.shuffle(order)

    def put(i: int, what: str) -> bool | None:
        """One write on the full disk: True stored, False dropped, None raised (recorded)."""
        nonlocal dropped
        rep.operations += 1
        try:
            ok = store.put(key_name(i), content(i))
        except Exception as exc:
            unexpected(rep, f"{what} {key_name(i)} on a full disk", exc)
            return None
        if ok:
            stored.add(i)
            rep.writes += 1
        else:
            dropped += 1
        return ok

    for i in order:
        if put(i, "put") is False:
            rep.faults += 1
    # Keys 250+ share blobs with 0+: only a manifest to write.
    for i in range(N_SEEDS, N_KEYS):
        put(i, "dedup put")
    st = store.stats()
    rep.dropped_writes = dropped
    rep.notes.append(f"full disk: {len(stored)} stored, {dropped} dropped, stats().dropped_writes={st.dropped_writes}")
    if dropped == 0:
        rep.fail("the 1 MiB disk never filled up")
    if st.dropped_writes != dropped:
        rep.fail(f"{dropped} writes dropped, stats().dropped_writes says {st.dropped_writes}")
    counts = inspect_cache(root, expected_digests())
    if counts["tmp_files"] or any(counts[k] for k in PROBLEMS):
        rep.fail(f"partial files after dropped writes: tmp_files={counts['tmp_files']}, {describe_problems(counts)}")
    if counts["orphans"]:
        rep.fail(f"{counts['orphans']} orphan blob(s) left by dropped writes")
    # Reads keep working, in this instance and a fresh one.
    fresh = CacheStore(root)
    for i in range(N_KEYS):
        for reader in (store, fresh):
            try:
                data = reader.get(key_name(i))
            except Exception as exc:
                unexpected(rep, "get on a full disk", exc)
                continue
            check_hit(i, data, rep, "get on a full disk")
            if i in stored and data is None:
                rep.fail(f"{key_name(i)} was stored but misses on a full disk")
    # Program.compile(cache=...) still returns its result.
    if compile_program is not None:
        from cuda_program_cas import ContentAddressedProgramCache

        try:
            with ContentAddressedProgramCache(root) as cache:
                obj = compile_program(cache=cache, arch="sm_90")
                plain = compile_program(arch="sm_90")
                rep.operations += 2
                if bytes(obj.code) != bytes(plain.code):
                    rep.wrong_bytes += 1
                    rep.fail("Program.compile(cache=...) on a full disk returned other bytes than without a cache")
                again = compile_program(cache=cache, arch="sm_90")
                if bytes(again.code) != bytes(plain.code):
                    rep.wrong_bytes += 1
                    rep.fail("second Program.compile(cache=...) on a full disk returned other bytes")
                rep.notes.append(f"compile on a full disk: adapter stats {cache.stats()}")
        except Exception as exc:
            unexpected(rep, "Program.compile(cache=...) on a full disk", exc)
    else:
        rep.notes.append("Program.compile on a full disk: not run (no compiler given)")
    # Space freed: the cache recovers.
    try:
        store.clear()
    except Exception as exc:
        unexpected(rep, "clear on a full disk", exc)
    recovered = 0
    for i in range(0, N_KEYS, 10):
        rep.operations += 1
        try:
            if store.put(key_name(i), content(i)):
                recovered += 1
            check_hit(i, CacheStore(root).get(key_name(i)), rep, "after recovery")
        except Exception as exc:
            unexpected(rep, "put after freeing space", exc)
    rep.notes.append(f"after clear(): {recovered}/{len(range(0, N_KEYS, 10))} writes stored")
    if recovered == 0:
        rep.fail("the cache did not recover when space was freed")
