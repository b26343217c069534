"""Writes: the cost of storing new and already-stored content, and of writing at the size cap."""

from __future__ import annotations

import os
import shutil
import time

from testkit.common import log

from .common import (
    KINDS,
    Config,
    Result,
    Timer,
    fmt_size,
    interleaved,
    key_for,
    median,
    open_cache,
    payload,
    perf_ns,
)

# -- workload 3: store cost ------------------------------------------------------------


def w_store(cfg: Config, base: str) -> Result:
    res = Result()
    for size in cfg.store_sizes:
        for mode in ("new", "stored"):
            caches = {k: open_cache(k, os.path.join(base, f"{k}-{size}-{mode}")) for k in KINDS}
            same = payload(size, 7)
            for kind, cache in caches.items():
                cache[key_for("store-warm", kind)] = payload(size, 1)  # warm-up
                if mode == "stored":
                    cache[key_for("store-original")] = same
            samples: dict[str, list[float]] = {k: [] for k in KINDS}
            blocks = max(2, cfg.store_writes // 10)
            with Timer():
                for b in range(blocks):
                    for kind in interleaved(b):
                        cache = caches[kind]
                        # Each block starts from a committed journal, so neither cache's writes wait
                        # for the other's (FileStream's fsyncs commit the journal, ours' metadata too).
                        os.sync()
                        for j in range(10):
                            i = b * 10 + j
                            data = payload(size, 1000 + i) if mode == "new" else same
                            k = key_for("store", mode, i)
                            t0 = perf_ns()
                            cache[k] = data
                            t1 = perf_ns()
                            samples[kind].append((t1 - t0) / 1000)
            label = "new content" if mode == "new" else "already-stored content, new key"
            res.medians(f"store {label} {fmt_size(size)}", "us", samples, 1.0 if mode == "new" else 0.5)
    res.notes.append(
        f"{max(2, cfg.store_writes // 10) * 10} writes per cache and case in blocks of 10, alternating, each block "
        "after an os.sync() (untimed), after one warm-up write; FileStream fsyncs each entry, ours does not "
        "(neither fsyncs the directory)"
    )
    return res


# -- workload 4: writes at the cap -----------------------------------------------------


def _manifest_overhead(base: str, size: int) -> int:
    """Bytes ours counts per entry beyond the blob (the manifest), measured on a scratch cache."""
    path = os.path.join(base, "ours-probe")
    cache = open_cache("ours", path)
    cache[key_for("probe")] = payload(size, 0)
    extra = cache.stats().stored_bytes - size
    shutil.rmtree(path, ignore_errors=True)
    return int(extra)


def w_cap_writes(cfg: Config, base: str) -> Result:
    res = Result()
    size = cfg.cap_entry_size
    manifest = _manifest_overhead(base, size)
    for n in cfg.cap_sizes:
        per_write: dict[str, float] = {}
        amortized: dict[str, float] = {}
        for kind in interleaved(n):
            path = os.path.join(base, f"{kind}-{n}")
            cap = n * (size + manifest) if kind == "ours" else n * size
            cache = open_cache(kind, path, max_size_bytes=cap)
            t0 = time.perf_counter()
            for i in range(n):
                cache[key_for("cap", i)] = payload(size, i)
            fill_s = time.perf_counter() - t0
            # Entries at the cap of a real cache were written long ago: their data is on disk, not
            # in dirty page cache, and unlinking them costs what freeing blocks costs on this disk.
            if hasattr(os, "sync"):
                os.sync()
            writes = cfg.cap_writes if kind == "ours" else cfg.fs_cap_writes.get(n, cfg.cap_writes)
            log(f"  cap {n}: {kind} filled in {fill_s:.1f} s; timing {writes} writes at the cap")
            times = []
            with Timer():
                for i in range(n, n + writes):
                    k = key_for("cap", i)
                    data = payload(size, i)
                    t1 = perf_ns()
                    cache[k] = data
                    times.append(perf_ns() - t1)
            entries = len(cache)
            evicted = n + writes - entries
            if evicted <= 0:
                raise RuntimeError(f"{kind} did not evict at {n} entries (cap {cap} bytes): {entries} entries")
            per_write[kind] = sum(times) / len(times) / 1e6
            # Steady state: one eviction pass makes room for every entry it evicted, so spread the pass
            # (the time above the median in writes that took over 5x the median) over those entries.
            med = median(times)
            pass_ns = sum(t - med for t in times if t > 5 * med)
            amortized[kind] = (med + pass_ns / evicted) / 1e6
            res.details[f"{kind}_{n}"] = {
                "cap_bytes": cap,
                "fill_s": fill_s,
                "writes_timed": writes,
                "mean_ms": per_write[kind],
                "median_ms": median([t / 1e6 for t in times]),
                "max_ms": max(times) / 1e6,
                "amortized_ms": amortized[kind],
                "entries_after": entries,
                "evicted": evicted,
            }
            del cache
            shutil.rmtree(path, ignore_errors=True)
        d_ours, d_fs = res.details[f"ours_{n}"], res.details[f"filestream_{n}"]
        res.add(
            f"write at cap, {n:,} entries, mean",
            "ms",
            per_write["ours"],
            per_write["filestream"],
            target_ratio=0.02 if n == max(cfg.cap_sizes) else None,
        )
        res.add(
            f"write at cap, {n:,} entries, amortized",
            "ms",
            amortized["ours"],
            amortized["filestream"],
            target_ratio=0.02 if n == max(cfg.cap_sizes) else None,
        )
        res.notes.append(
            f"{n:,} entries of {fmt_size(size)}: ours timed {d_ours['writes_timed']} writes (evicted "
            f"{d_ours['evicted']:,}, max {d_ours['max_ms']:.1f} ms), FileStream {d_fs['writes_timed']} writes (evicted "
            f"{d_fs['evicted']:,}, max {d_fs['max_ms']:.1f} ms); filled, then os.sync(), then timed; "
            "mean: all timed writes, eviction scans included; "
            "amortized: median write + (time above the median of writes over 5x it) / entries evicted, the steady "
            "state where each eviction pass pays for the room it made"
        )
    if any(cfg.fs_cap_writes.get(n, cfg.cap_writes) < cfg.cap_writes for n in cfg.cap_sizes):
        res.notes.append(
            "FileStream rescans the whole cache on every write at the cap, so it was timed on fewer writes where "
            "marked; its per-write cost does not fall with more writes"
        )
    return res


# -- workload: write-back's cost to the writer ---------------------------------------------


def w_writeback(cfg: Config, base: str) -> Result:
    """A new 8 KB entry stored with write-back on (to a redis-server on loopback, else a directory store)."""
    from cuda_program_cas import CacheStore, ContentAddressedProgramCache

    res = Result()
    server = None
    try:
        from testkit.redis_server import RedisServer, find_redis_server

        if find_redis_server() is not None:
            server = RedisServer(os.path.join(base, "redis"), maxmemory="512mb", policy="allkeys-lru").start()
    except Exception as exc:
        log(f"writeback: no redis-server ({exc}); a directory store instead")
    if server is not None:
        store, where = f"{server.url}|write", "Redis on loopback"
    else:
        CacheStore(os.path.join(base, "wb-store")).close()
        store, where = os.path.join(base, "wb-store") + "|write", "a directory store"
    try:
        size = 8 << 10
        caches = {
            "ours": ContentAddressedProgramCache(os.path.join(base, "ours-wb"), shared=[store]),
            "plain": open_cache("ours", os.path.join(base, "ours-plain")),
            "filestream": open_cache("filestream", os.path.join(base, "fs-wb")),
        }
        samples: dict[str, list[float]] = {k: [] for k in caches}
        with Timer():
            for b in range(max(2, cfg.store_writes // 10)):
                for kind in ("ours", "plain", "filestream") if b % 2 == 0 else ("filestream", "plain", "ours"):
                    os.sync()
                    for j in range(10):
                        i = b * 10 + j
                        t0 = perf_ns()
                        caches[kind][key_for("wb", kind, i)] = payload(size, 5000 + i)
                        samples[kind].append((perf_ns() - t0) / 1000)
        caches["ours"].close()
        counts = caches["ours"].stats()
        res.medians(f"store new content 8 KB, write-back on ({where})", "us", samples, 1.0)
        added = median(samples["ours"]) - median(samples["plain"])
        res.notes.append(
            f"write-back adds {added:.1f} us to a write's median (ours without it: {median(samples['plain']):.1f} us); "
            f"{counts.uploads} uploads, {counts.uploads_dropped} dropped; the upload itself runs in the background"
        )
        res.details["writeback_added_us"] = added
    finally:
        if server is not None:
            server.stop()
    return res
