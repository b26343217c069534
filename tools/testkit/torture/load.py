"""Loads of several processes: the mixed load, writers killed mid-write, nodes reading a shared store."""

from __future__ import annotations

import os
import random
import signal
import time

from cuda_program_cas import CacheStore, publish

from .checker import inspect_cache, verify_and_repair
from .common import DEFAULT_CAP, N_KEYS, Report, check_hit, content, expected_digests, key_name, unexpected
from .workers import gather, spawn

# -- 1. mixed load -----------------------------------------------------------------


def run_mixed(
    workdir: str, *, processes: int = 4, seconds: float = 30.0, cap: int = DEFAULT_CAP, seed: int = 1
) -> Report:
    """P processes of get/set/delete/clear/eviction/collection at once for T seconds."""
    rep = Report("mixed", processes=processes, seconds=seconds)
    root = os.path.join(workdir, "mixed")
    CacheStore(root, max_size_bytes=cap)
    config = {"mode": "mixed", "root": root, "cap": cap, "seconds": seconds}
    gather(rep, [spawn({**config, "seed": seed * 1000 + p}) for p in range(processes)], seconds + 120)
    counts = inspect_cache(root, expected_digests())
    rep.notes.append(f"final check: {counts}")
    if counts["dangling"]:
        rep.notes.append(f"{counts['dangling']} dangling manifest(s) at the end (each a miss, removed by repair)")
    for kind in ("bad_manifest", "size_mismatch", "wrong_mapping", "bad_blob", "not_regular", "stray"):
        if counts[kind]:
            rep.fail(f"final check: {kind}={counts[kind]}")
    verify_and_repair(root, expected_digests(), rep, "mixed final")
    stored = CacheStore(root).stats().stored_bytes
    rep.notes.append(f"stored bytes at the end: {stored:,} (cap {cap:,})")
    return rep


# -- 2. crashes ----------------------------------------------------------------------


def run_crashes(workdir: str, *, rounds: int = 10, processes: int = 2, cap: int = DEFAULT_CAP, seed: int = 2) -> Report:
    """Writers killed with SIGKILL at random moments; the cache is checked after every round."""
    rng = random.Random(seed)
    rep = Report("crash", processes=processes)
    root = os.path.join(workdir, "crash")
    CacheStore(root, max_size_bytes=cap)
    expected = expected_digests()
    started = time.monotonic()
    dangling = 0
    over_by_orphans = 0
    for rnd in range(rounds):
        config = {"mode": "crash", "root": root, "cap": cap, "seconds": 3600}
        procs = [spawn({**config, "seed": seed * 100000 + rnd * 100 + p}, stderr=None) for p in range(processes)]
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline() != "ready\n":
                rep.fail(f"round {rnd}: a worker died before starting (exit {proc.wait()})")
        # Kill each at its own random moment, so deaths land anywhere in a write.
        kill_at = sorted((rng.uniform(0.02, 0.6), n) for n in range(len(procs)))
        t0 = time.monotonic()
        for when, n in kill_at:
            time.sleep(max(0.0, when - (time.monotonic() - t0)))
            procs[n].send_signal(signal.SIGKILL)
        for proc in procs:
            rc = proc.wait(timeout=60)
            assert proc.stdout is not None
            proc.stdout.close()
            if rc == -signal.SIGKILL:
                rep.kills += 1
            else:
                rep.fail(f"round {rnd}: worker exited {rc} before it was killed")
        # Every hit right, nothing raised, by a fresh reader.
        reader = CacheStore(root)
        for i in range(N_KEYS):
            try:
                check_hit(i, reader.get(key_name(i)), rep, f"round {rnd} reader")
            except Exception as exc:
                unexpected(rep, f"round {rnd} reader", exc)
        before = verify_and_repair(root, expected, rep, f"round {rnd}")
        dangling += before["dangling"]
        for kind in ("bad_manifest", "size_mismatch", "not_regular", "stray"):
            if before[kind]:
                rep.fail(f"round {rnd}: partial or damaged files outside tmp/: {kind}={before[kind]}")
        # The cap holds after the next write.
        writer = CacheStore(root, max_size_bytes=cap)
        i = rng.randrange(N_KEYS)
        try:
            writer.put(key_name(i), content(i))
            rep.writes += 1
        except Exception as exc:
            unexpected(rep, f"round {rnd} writer", exc)
        stored = writer.stats().stored_bytes
        if stored > cap:
            # Blobs no manifest names are kept 10 minutes by design (a writer stores
            # its blob first); only what eviction may remove must fit under the cap.
            young = _young_orphan_bytes(writer)
            if stored - young > cap:
                rep.fail(
                    f"round {rnd}: {stored:,} bytes stored after the next write, over the cap of {cap:,} "
                    f"({young:,} of them in orphans younger than the grace period)"
                )
            else:
                over_by_orphans += 1
    rep.seconds = round(time.monotonic() - started, 1)
    tmp_left = inspect_cache(root)["tmp_files"]
    rep.notes.append(f"dangling manifests found after kills (misses, repaired): {dangling}")
    rep.notes.append(f"temp files left by killed writers: {tmp_left} (swept after an hour)")
    rep.notes.append(
        f"rounds over the cap after the next write only by orphan blobs within their 10-minute grace: {over_by_orphans}"
    )
    return rep


def _young_orphan_bytes(store: CacheStore) -> int:
    """Bytes of blobs that no manifest names and that are within the eviction's grace period."""
    from cuda_program_cas._local.cap import ORPHAN_GRACE_S

    snap = store.inner.snapshot()
    cutoff = time.time_ns() - ORPHAN_GRACE_S * 1e9
    return sum(snap.blobs[d].st_size for d in snap.orphans() if snap.blobs[d].st_mtime_ns > cutoff)


# -- 6. shared stores ----------------------------------------------------------------------


def run_shared(workdir: str, *, nodes: int = 2, seconds: float = 10.0, cap: int = DEFAULT_CAP, seed: int = 6) -> Report:
    """Nodes read through a shared store while it is published into and collected."""
    rep = Report("shared", processes=nodes + 2, seconds=seconds)

    shared = os.path.join(workdir, "shared-store")
    locals_ = [os.path.join(workdir, f"node-{n}") for n in range(nodes)]
    # A first publish so the store exists before nodes open it.
    for n, local in enumerate(locals_):
        store = CacheStore(local)
        for i in range(n, N_KEYS, nodes * 4):
            store.put(key_name(i), content(i))
    publish(locals_, shared, fsync=False)
    common = {"root": "", "cap": cap, "seconds": seconds, "shared": shared, "nodes": nodes}
    configs = [
        {**common, "mode": "node", "root": local, "node": n, "seed": seed * 1000 + n} for n, local in enumerate(locals_)
    ]
    configs.append({**common, "mode": "publisher", "sources": locals_, "seed": seed * 1000 + 98})
    configs.append({**common, "mode": "collector", "shared_cap": cap * 2, "seed": seed * 1000 + 99})
    gather(rep, [spawn(config) for config in configs], seconds + 120)
    expected = expected_digests()
    for root in (shared, *locals_):
        verify_and_repair(root, expected, rep, f"shared end {os.path.basename(root)}")
    return rep
