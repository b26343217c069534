"""Torture runs: concurrency, crashes, corruption, full disks and hostile paths.

Every key maps to content fixed by the key alone (blake3 of the key's seed,
expanded to a size fixed by the seed), so every hit anywhere is checked byte
for byte. A run ends with a summary of figures and exits non-zero on any wrong
byte returned, any unexpected exception, or a cache left unclean.

    python tools/torture.py --processes 4 --seconds 150
    python tools/torture.py --scenarios crash,corrupt --kills 200 --json

Scenarios: ``mixed`` (P processes of get/set/delete/clear/eviction/collection
under a small cap), ``crash`` (writers killed with SIGKILL at random moments),
``corrupt`` (bit flips, truncation, bad manifests, unreadable files),
``fulldisk`` (the cache on a 1 MiB tmpfs; needs root), ``paths`` (bad inputs,
symlinked shard directories, hostile manifests; nothing outside the root is
read or written) and ``shared`` (publish and collect a shared store while
nodes read it; needs ``cuda_program_cas._verbs.publish``).

The ``tests/test_torture.py`` suite runs each scenario briefly through the same
functions.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from blake3 import blake3  # noqa: E402

from cuda_program_cas import BlobStore, CacheStore, CollectorBusyError, collect, publish, verify  # noqa: E402
from cuda_program_cas._disk.blobs import BlobState  # noqa: E402
from cuda_program_cas._disk.classify import Condition, classify  # noqa: E402
from cuda_program_cas._disk.scan import take_snapshot  # noqa: E402
from cuda_program_cas.index import key_id  # noqa: E402

#: Keys ``k0 .. k{N_KEYS-1}``; key ``i`` holds the content of seed ``i % N_SEEDS``,
#: so some keys share a blob (deduplication is exercised too).
N_KEYS = 400
N_SEEDS = 250
#: A cap small enough that the mixed load evicts all the time (about 40 average blobs).
DEFAULT_CAP = 256 * 1024
_HEX = frozenset("0123456789abcdef")


# -- deterministic content ------------------------------------------------------


def key_name(i: int) -> str:
    return f"torture-key-{i}"


def seed_of(i: int) -> int:
    return i % N_SEEDS


def content_of_seed(seed: int) -> bytes:
    """The bytes of one seed: blake3 of its name, expanded to 64 .. 16,447 bytes."""
    name = b"torture-content-%d" % seed
    size = 64 + int.from_bytes(hashlib.sha256(name).digest()[:4], "little") % 16384
    return blake3(name).digest(length=size)


_CONTENT: dict[int, bytes] = {}


def content(i: int) -> bytes:
    seed = seed_of(i)
    data = _CONTENT.get(seed)
    if data is None:
        data = _CONTENT[seed] = content_of_seed(seed)
    return data


def expected_digests() -> dict[str, str]:
    """key id -> the digest its manifest must name, for every torture key."""
    return {key_id(key_name(i)): blake3(content(i)).hexdigest() for i in range(N_KEYS)}


def pick(rng: random.Random) -> int:
    """A key index, skewed towards low numbers: a hot set that fits under the cap, so hits are common."""
    return min(N_KEYS - 1, int(N_KEYS * rng.random() ** 3))


def as_key(i: int, rng: random.Random) -> str | bytes:
    """``str`` and ``bytes`` keys are the same key: use both."""
    name = key_name(i)
    return name.encode() if rng.random() < 0.5 else name


# -- reports --------------------------------------------------------------------


@dataclass
class Report:
    """Figures of one scenario; ``failures`` lists what makes it fail."""

    scenario: str
    processes: int = 0
    seconds: float = 0.0
    operations: int = 0
    hits: int = 0
    misses: int = 0
    writes: int = 0
    dropped_writes: int = 0
    collections: int = 0
    kills: int = 0
    faults: int = 0
    wrong_bytes: int = 0
    exceptions: int = 0
    checks: int = 0
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    skipped: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failures and self.wrong_bytes == 0 and self.exceptions == 0

    def fail(self, message: str) -> None:
        if len(self.failures) < 50 and message not in self.failures:
            self.failures.append(message)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def check_hit(i: int, data: bytes | None, rep: Report, where: str) -> None:
    """Count a lookup; a hit must be exactly the key's content."""
    rep.operations += 1
    if data is None:
        rep.misses += 1
        return
    rep.hits += 1
    want = content(i)
    if data != want:
        rep.wrong_bytes += 1
        first = next((n for n, (a, b) in enumerate(zip(data, want, strict=False)) if a != b), min(len(data), len(want)))
        rep.fail(
            f"{where}: WRONG BYTES for {key_name(i)}: got {len(data)} bytes, want {len(want)}; first diff at {first}"
        )


def unexpected(rep: Report, where: str, exc: BaseException) -> None:
    rep.exceptions += 1
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]).strip()
    rep.fail(f"{where}: unexpected {type(exc).__name__}: {exc} | {tb}")


# -- the collector ------------------------------------------------------------------


def collect_once(root: str, cap: int | None, rng: random.Random, *, shared_store: bool = False) -> None:
    """One collection with ``cuda_program_cas.collect``, with a short grace.

    A shared store is collected half the time as its operator should (shared
    mode, the long grace it demands) and half the time as a careless one would
    (as a plain cache, with a grace of seconds): readers must never get wrong
    bytes either way, only misses.
    """
    kwargs: dict[str, Any] = {"max_size": cap, "verify": rng.random() < 0.2}
    if not shared_store:
        kwargs["grace_s"] = rng.choice((0.0, 0.5, 5.0))
    elif rng.random() < 0.5:
        kwargs.update(grace_s=rng.choice((0.0, 0.5, 5.0)), shared=False)
    else:
        kwargs["grace_s"] = 3600.0
    with contextlib.suppress(CollectorBusyError):  # another collector or an evictor holds the lock
        collect(root, **kwargs)


# -- the cache checker -------------------------------------------------------------

#: Kinds of damage a clean cache has none of.
PROBLEMS = ("bad_manifest", "dangling", "size_mismatch", "wrong_mapping", "bad_blob", "not_regular", "stray")


def inspect_cache(root: str, expected: dict[str, str] | None = None, *, repair: bool = False) -> dict[str, int]:
    """Count a cache's problems (see :data:`PROBLEMS`) plus ``tmp_files`` and ``orphans``.

    Every manifest is judged by the library's one classifier; every blob is
    hashed. With ``expected`` (key id -> digest), a manifest naming another digest
    than its key's content is ``wrong_mapping``: what a reader would get as wrong
    bytes. With ``repair``, bad manifests and bad blobs are removed (what ``verify
    --repair`` must do); orphans and temp files are left to the collector.
    """
    counts = dict.fromkeys((*PROBLEMS, "tmp_files", "orphans", "manifests", "blobs"), 0)
    for top in ("blobs", "index"):
        for path in _walk_shards(os.path.join(root, top), counts):
            counts["not_regular"] += 1
            if repair:
                _remove(path)
    snap = take_snapshot(os.path.join(root, "index"), os.path.join(root, "blobs"))
    blobs = BlobStore(os.path.join(root, "blobs"))
    bad = {d for d in snap.blobs if blobs.check(d).state is not BlobState.OK}
    counts["bad_blob"] = len(bad)
    counts["blobs"] = len(snap.blobs) - len(bad)
    if repair:
        for digest in bad:
            _remove(blobs.path_for(digest))
    referenced: set[str] = set()
    for info in snap.manifests:
        condition = classify(info, snap, bad)
        kind = _KIND_OF.get(condition)
        if kind is None and expected is not None and info.key_id in expected:
            assert info.manifest is not None
            if expected[info.key_id] != info.manifest.digest:
                kind = "wrong_mapping"
        if kind is not None:
            counts[kind] += 1
            if repair:
                _remove(os.path.join(root, "index", info.key_id[:2], info.key_id[2:]))
            continue
        assert info.manifest is not None
        counts["manifests"] += 1
        referenced.add(info.manifest.digest)
    counts["bad_manifest"] += len(snap.unreadable)
    counts["orphans"] = len(set(snap.blobs) - bad - referenced)
    with contextlib.suppress(FileNotFoundError):
        counts["tmp_files"] = len(os.listdir(os.path.join(root, "tmp")))
    return counts


_KIND_OF = {
    Condition.INVALID: "bad_manifest",
    Condition.MISPLACED: "bad_manifest",
    Condition.DANGLING: "dangling",
    Condition.SIZE_MISMATCH: "size_mismatch",
    Condition.CORRUPT_BLOB: "dangling",
}


def _walk_shards(top: str, counts: dict[str, int]) -> Iterator[str]:
    """Count stray names under a ``<2 hex>/<62 hex>`` tree; yield the paths that are not regular files."""
    try:
        shards = sorted(os.listdir(top))
    except FileNotFoundError:
        return
    for shard in shards:
        spath = os.path.join(top, shard)
        sst = os.lstat(spath)
        if len(shard) != 2 or not set(shard) <= _HEX or not stat.S_ISDIR(sst.st_mode):
            counts["stray"] += 1
            continue
        for name in sorted(os.listdir(spath)):
            path = os.path.join(spath, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if len(name) != 62 or not set(name) <= _HEX:
                counts["stray"] += 1
            elif not stat.S_ISREG(st.st_mode):
                yield path


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def verify_and_repair(root: str, expected: dict[str, str], rep: Report, where: str) -> dict[str, int]:
    """Check, repair with ``cuda_program_cas.verify``, check again.

    Returns the counts found before the repair. After it, the cache must be clean.
    """
    before = inspect_cache(root, expected)
    if before["wrong_mapping"] or before["bad_blob"]:
        rep.fail(f"{where}: damage on disk before repair: {_problems(before)}")
    fixed = verify(root, repair=True)
    left = [p for p in fixed.problems if not p.fixed]
    if left:
        rep.fail(f"{where}: verify --repair left {len(left)} problem(s): {[(p.kind, p.detail) for p in left[:3]]}")
    # Stale temp files aside (they are an hour old), a second pass must find nothing.
    again = [p for p in verify(root).problems if p.kind != "stale_temp_file"]
    if again:
        rep.fail(f"{where}: verify after repair still finds {[(p.kind, p.path) for p in again[:3]]}")
    after = inspect_cache(root, expected)
    if any(after[k] for k in PROBLEMS):
        rep.fail(f"{where}: not clean after repair: {_problems(after)}")
    rep.checks += 1
    return before


def _problems(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}={counts[k]}" for k in PROBLEMS if counts[k]) or "none"


def _quiet() -> None:
    """Corruption is logged as warnings by design; a torture run makes thousands."""
    logging.getLogger("cuda_program_cas").setLevel(logging.ERROR)


# -- worker processes ----------------------------------------------------------------


def _worker(config: dict[str, Any]) -> int:
    """One process of the mixed or crash load; writes its report to ``config['out']``."""
    _quiet()
    rng = random.Random(config["seed"])
    root = config["root"]
    cap = config["cap"]
    rep = Report(config["mode"], processes=1)
    if config["mode"] in ("node", "publisher", "collector"):
        return _shared_worker(config, rep, rng)
    store = CacheStore(root, max_size_bytes=cap)
    deadline = time.monotonic() + config["seconds"]
    crash = config["mode"] == "crash"
    if crash:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
    ops = 0
    while time.monotonic() < deadline:
        ops += 1
        r = rng.random()
        i = pick(rng)
        try:
            if r < 0.55 or r >= 0.955:
                check_hit(i, store.get(as_key(i, rng)), rep, f"worker {os.getpid()} get")
            elif r < 0.85:
                rep.operations += 1
                if store.put(as_key(i, rng), content(i)):
                    rep.writes += 1
                else:
                    rep.dropped_writes += 1
            elif r < 0.90:
                rep.operations += 1
                with contextlib.suppress(KeyError):
                    store.delete(as_key(i, rng))
            elif r < 0.92:
                rep.operations += 1
                store.stats() if r < 0.915 else len(store)
            elif r < 0.93:
                rep.operations += 1
                store = CacheStore(root, max_size_bytes=cap)  # a fresh instance: nothing verified yet
            elif r < 0.954 or crash:
                rep.operations += 1
                rep.collections += 1
                if r < 0.94:
                    store.enforce_cap()
                else:
                    collect_once(root, cap, rng)
            else:
                rep.operations += 1
                store.clear()
        except Exception as exc:
            unexpected(rep, f"worker {os.getpid()}", exc)
    rep.seconds = config["seconds"]
    with open(config["out"], "w") as fh:
        json.dump(rep.as_dict(), fh)
    return 0 if rep.ok else 1


def _shared_worker(config: dict[str, Any], rep: Report, rng: random.Random) -> int:
    """A node reading through a shared store, the publisher, or the shared store's collector."""
    mode = config["mode"]
    deadline = time.monotonic() + config["seconds"]
    shared_hits = 0
    if mode == "node":
        store = CacheStore(config["root"], max_size_bytes=config["cap"], shared=[config["shared"]])
    while time.monotonic() < deadline:
        try:
            if mode == "publisher":
                rep.operations += 1
                out = publish(config["sources"], config["shared"], fsync=False)
                rep.writes += out.published + out.replaced
                if out.bad_blobs or out.invalid_manifests:
                    rep.fail(f"publish met damaged sources: {out.bad_blobs[:2]} {out.invalid_manifests[:2]}")
            elif mode == "collector":
                rep.operations += 1
                rep.collections += 1
                collect_once(config["shared"], config["shared_cap"], rng, shared_store=True)
                time.sleep(rng.uniform(0.0, 0.2))
            else:
                i = pick(rng)
                if rng.random() < 0.8 or i % config["nodes"] != config["node"]:
                    check_hit(i, store.get(as_key(i, rng)), rep, f"node {config['node']} get")
                else:
                    rep.operations += 1
                    rep.writes += bool(store.put(as_key(i, rng), content(i)))
                if rng.random() < 0.002:
                    store.clear()
        except Exception as exc:
            unexpected(rep, f"{mode} {os.getpid()}", exc)
    if mode == "node":
        shared_hits = store.stats().shared_hits
        rep.notes.append(f"node {config['node']}: {shared_hits} shared hits")
    rep.seconds = config["seconds"]
    with open(config["out"], "w") as fh:
        json.dump(rep.as_dict(), fh)
    return 0 if rep.ok else 1


def _spawn(config: dict[str, Any], **kwargs: Any) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "_worker", json.dumps(config)], env=env, **kwargs
    )


def _worker_report(rep: Report, proc: subprocess.Popen[bytes], out: str, timeout: float) -> dict[str, Any] | None:
    """Wait for a worker and read the report it wrote; a hang, a missing report or a
    non-zero exit is a failure of the run."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rep.fail(f"worker {proc.pid} hung past {timeout:.0f} s")
        return None
    try:
        with open(out) as fh:
            part: dict[str, Any] = json.load(fh)
    except FileNotFoundError:
        rep.fail(f"worker {proc.pid} exited {rc} without a report")
        return None
    if rc != 0 and rep.ok:
        rep.fail(f"worker {proc.pid} exited {rc}")
    return part


def _merge(rep: Report, part: dict[str, Any]) -> None:
    for name in (
        "operations",
        "hits",
        "misses",
        "writes",
        "dropped_writes",
        "collections",
        "wrong_bytes",
        "exceptions",
    ):
        setattr(rep, name, getattr(rep, name) + part[name])
    for message in part["failures"]:
        rep.fail(message)


# -- 1. mixed load -----------------------------------------------------------------


def run_mixed(
    workdir: str, *, processes: int = 4, seconds: float = 30.0, cap: int = DEFAULT_CAP, seed: int = 1
) -> Report:
    """P processes of get/set/delete/clear/eviction/collection at once for T seconds."""
    rep = Report("mixed", processes=processes, seconds=seconds)
    root = os.path.join(workdir, "mixed")
    CacheStore(root, max_size_bytes=cap)
    procs = []
    for p in range(processes):
        out = os.path.join(workdir, f"mixed-{p}.json")
        config = {"mode": "mixed", "root": root, "cap": cap, "seconds": seconds, "seed": seed * 1000 + p, "out": out}
        procs.append((_spawn(config), out))
    for proc, out in procs:
        part = _worker_report(rep, proc, out, seconds + 120)
        if part is not None:
            _merge(rep, part)
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
        procs = []
        for p in range(processes):
            config = {
                "mode": "crash",
                "root": root,
                "cap": cap,
                "seconds": 3600,
                "seed": seed * 100000 + rnd * 100 + p,
                "out": os.devnull,
            }
            procs.append(_spawn(config, stdout=subprocess.PIPE))
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline() != b"ready\n":
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
    from cuda_program_cas._store.cap import ORPHAN_GRACE_S

    snap = store.snapshot()
    cutoff = time.time_ns() - ORPHAN_GRACE_S * 1e9
    return sum(snap.blobs[d].st_size for d in snap.orphans() if snap.blobs[d].st_mtime_ns > cutoff)


# -- 3. corruption -------------------------------------------------------------------

_BLOB_FAULTS = ("bitflip", "truncate", "empty", "extend")
_MANIFEST_FAULTS = ("m_empty", "m_truncate", "m_garbage", "m_wrong_size", "m_missing_digest", "m_other_size")


def _flip(path: str, rng: random.Random) -> None:
    """Flip one bit in place, keeping size and mtime (what silent media damage looks like)."""
    st = os.stat(path)
    with open(path, "r+b") as fh:
        pos = rng.randrange(st.st_size)
        fh.seek(pos)
        byte = fh.read(1)[0]
        fh.seek(pos)
        fh.write(bytes([byte ^ (1 << rng.randrange(8))]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _apply_fault(kind: str, store: CacheStore, i: int, rng: random.Random) -> None:
    digest = blake3(content(i)).hexdigest()
    bpath = store.blobs.path_for(digest)
    mpath = store.layout.manifest_path(key_id(key_name(i)))
    size = len(content(i))
    if kind == "bitflip":
        _flip(bpath, rng)
    elif kind == "truncate":
        os.truncate(bpath, rng.randrange(1, size))
    elif kind == "empty":
        os.truncate(bpath, 0)
    elif kind == "extend":
        with open(bpath, "ab") as fh:
            fh.write(b"\0")
    elif kind == "m_empty":
        os.truncate(mpath, 0)
    elif kind == "m_truncate":
        os.truncate(mpath, rng.randrange(1, os.path.getsize(mpath)))
    elif kind == "m_garbage":
        with open(mpath, "wb") as fh:
            fh.write(os.urandom(rng.randrange(1, 120)))
    elif kind == "m_wrong_size":
        with open(mpath, "wb") as fh:
            fh.write(b"cpcas1 %s %d\n" % (digest.encode(), size + rng.choice((-1, 1, 1000))))
    elif kind == "m_missing_digest":
        with open(mpath, "wb") as fh:
            fh.write(b"cpcas1 %s %d\n" % (os.urandom(32).hex().encode(), size))
    elif kind == "m_other_size":
        # A valid digest whose blob has another size: the bytes would be someone else's.
        other = blake3(content_of_seed((seed_of(i) + 1) % N_SEEDS)).hexdigest()
        with open(mpath, "wb") as fh:
            fh.write(b"cpcas1 %s %d\n" % (other.encode(), size))
    else:  # pragma: no cover
        raise ValueError(kind)


def run_corruption(workdir: str, *, rounds: int = 3, seed: int = 3) -> Report:
    """Damage entries in every way we know; each must be a miss, counted, cleaned, recoverable."""
    _quiet()
    rng = random.Random(seed)
    rep = Report("corrupt", processes=1)
    started = time.monotonic()
    kinds = _BLOB_FAULTS + _MANIFEST_FAULTS
    for rnd in range(rounds):
        root = os.path.join(workdir, f"corrupt-{rnd}")
        # Keys 0 .. N_SEEDS-1 have distinct contents; 250+ share with 0+.
        store = CacheStore(root)
        for i in range(N_KEYS):
            store.put(key_name(i), content(i))
        for i in range(N_KEYS):
            check_hit(i, store.get(key_name(i)), rep, "warm-up")  # verified and remembered
        victims = rng.sample(range(1, N_SEEDS - 1), 2 * len(kinds))
        faulted: dict[int, str] = {}
        for n, i in enumerate(victims):
            kind = kinds[n % len(kinds)]
            _apply_fault(kind, store, i, rng)
            faulted[i] = kind
            rep.faults += 1
        # Half the lookups by the instance that verified everything before, half by a fresh one.
        fresh = CacheStore(root)
        for n, i in enumerate(victims):
            reader = store if n % 2 == 0 else fresh
            try:
                data = reader.get(key_name(i))
            except Exception as exc:
                unexpected(rep, f"get after {faulted[i]}", exc)
                continue
            check_hit(i, data, rep, f"get after {faulted[i]}")
            if data is not None:
                rep.fail(f"{faulted[i]} on {key_name(i)}: a hit, expected a miss")
        counted = sum(s.corrupt + s.errors for s in (store.stats(), fresh.stats()))
        # A manifest naming a missing blob looks exactly like one whose blob was
        # collected: a plain miss, removed, not counted as damage.
        countable = sum(1 for kind in faulted.values() if kind != "m_missing_digest")
        rep.notes.append(f"round {rnd}: {len(victims)} faults, stats() corrupt+errors={counted}")
        if counted < countable:
            rep.fail(f"round {rnd}: {countable} countable faults but stats() counted {counted} corrupt+errors")
        # A fault affects only its own entry: every other key still hits, unless it shares a damaged blob.
        damaged_seeds = {seed_of(i) for i, kind in faulted.items() if kind in _BLOB_FAULTS}
        for i in range(N_KEYS):
            if i in faulted:
                continue
            data = fresh.get(key_name(i))
            check_hit(i, data, rep, "bystander")
            if data is None and seed_of(i) not in damaged_seeds:
                rep.fail(
                    f"round {rnd}: {key_name(i)} (untouched, its blob intact) became a miss; "
                    f"the fault next to it: {faulted.get(i - N_SEEDS) or faulted.get(i + N_SEEDS)}"
                )
        # The bad files were moved aside or removed, and the cache heals on the next write.
        counts = inspect_cache(root, expected_digests())
        if any(counts[k] for k in PROBLEMS if k != "dangling"):
            rep.fail(f"round {rnd}: bad files left in place after the misses: {_problems(counts)}")
        for i in victims:
            try:
                store.put(key_name(i), content(i))
                data = CacheStore(root).get(key_name(i))
            except Exception as exc:
                unexpected(rep, f"rewrite after {faulted[i]}", exc)
                continue
            check_hit(i, data, rep, "rewrite")
            if data is None:
                rep.fail(f"round {rnd}: {key_name(i)} ({faulted[i]}) did not recover after a rewrite")
        verify_and_repair(root, expected_digests(), rep, f"corrupt round {rnd}")
    rep.seconds = round(time.monotonic() - started, 1)
    return rep


_UNREADABLE_CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[2])
import torture
from cuda_program_cas import CacheStore
from cuda_program_cas.index import key_id
import filelock
torture._quiet()
# Everything imported first: the interpreter's own files may be unreadable to nobody.
os.setgid(65534); os.setuid(65534)
root = sys.argv[1]
store = CacheStore(root)
keys = range(40)
for i in keys:
    store.put(torture.key_name(i), torture.content(i))
out = {"failures": [], "faults": 0, "operations": 0, "put_denied": 0}
def blob(i):
    return store.blobs.path_for(torture.blake3(torture.content(i)).hexdigest())
def man(i):
    return store.layout.manifest_path(key_id(torture.key_name(i)))
locked = [blob(1), man(2), os.path.dirname(blob(3)), os.path.dirname(man(4))]
for path in locked:
    os.chmod(path, 0)
out["faults"] = len(locked)
def blocked(i):
    return any(p in locked for p in (blob(i), man(i), os.path.dirname(blob(i)), os.path.dirname(man(i))))
fresh = CacheStore(root)
for i in keys:
    out["operations"] += 1
    try:
        data = fresh.get(torture.key_name(i))
    except Exception as exc:
        out["failures"].append(f"unreadable: get({i}) raised {type(exc).__name__}: {exc}")
        continue
    if data is not None and data != torture.content(i):
        out["failures"].append(f"unreadable: WRONG BYTES for key {i}")
    if blocked(i) and data is not None:
        out["failures"].append(f"unreadable: key {i} hit through an unreadable file")
    if not blocked(i) and data is None:
        out["failures"].append(f"unreadable: key {i}, readable, missed")
try:
    errors = fresh.stats().errors
except Exception as exc:
    out["failures"].append(f"unreadable: stats() raised {type(exc).__name__}: {exc}")
    errors = fresh._counters.as_dict()["errors"]
if errors < len(locked):
    out["failures"].append(f"unreadable: {len(locked)} unreadable files, errors counted: {errors}")
capped = CacheStore(root, max_size_bytes=16384)
for i in keys:
    out["operations"] += 1
    for who in (fresh, capped):
        try:
            if not who.put(torture.key_name(i), torture.content(i)):
                # A shard directory we may not write: the write is dropped and counted; only there.
                if os.path.dirname(blob(i)) not in locked and os.path.dirname(man(i)) not in locked:
                    out["failures"].append(f"unreadable: put({i}) dropped outside the locked shards")
                out["put_denied"] += 1
        except Exception as exc:
            how = "with a cap " if who is capped else ""
            out["failures"].append(f"unreadable: put({i}) {how}raised {type(exc).__name__}: {exc}")
out["errors"] = errors
print(json.dumps(out))
"""


def run_unreadable(workdir: str) -> Report:
    """chmod 000 files and shard directories, used as an unprivileged user (root reads anything)."""
    rep = Report("unreadable", processes=1)
    if not hasattr(os, "setuid") or os.geteuid() != 0:
        rep.skipped = "needs root to hand the cache to an unprivileged user (uid 65534)"
        return rep
    started = time.monotonic()
    base = tempfile.mkdtemp(prefix="torture-nobody-", dir="/tmp" if os.path.isdir("/tmp") else None)
    try:
        if os.geteuid() == 0:
            os.chown(base, 65534, 65534)
        env = dict(os.environ, PYTHONPATH=REPO)
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _UNREADABLE_CHILD,
                os.path.join(base, "c"),
                os.path.dirname(os.path.abspath(__file__)),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
        rep.seconds = time.monotonic() - started
        if proc.returncode != 0:
            rep.fail(f"unreadable child exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
            return rep
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        rep.faults = out["faults"]
        rep.operations = out["operations"]
        for message in out["failures"]:
            rep.fail(message)
        rep.notes.append(
            f"unreadable (as uid 65534): {out['faults']} faults, stats().errors={out['errors']}, "
            f"{out['put_denied']} puts into a locked shard dropped and counted"
        )
        return rep
    finally:
        for dirpath, dirnames, _ in os.walk(base):
            for d in dirnames:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(dirpath, d), 0o700)
        shutil.rmtree(base, ignore_errors=True)


# -- 4. full disk ----------------------------------------------------------------------


def mount_tmpfs(path: str, size: str = "1m") -> str | None:
    """Mount a small tmpfs at ``path``; None when that works, else why not."""
    os.makedirs(path, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", path],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        return f"mount -t tmpfs failed: {proc.stderr.strip() or proc.returncode}"
    return None


def unmount(path: str) -> None:
    subprocess.run(["umount", path], capture_output=True, check=False)


def run_full_disk(workdir: str, *, seed: int = 4, compile_program: Callable[..., Any] | None = None) -> Report:
    """The cache on a 1 MiB tmpfs: drops are clean and counted, reads and compiles go on, it recovers."""
    _quiet()
    rep = Report("fulldisk", processes=1)
    mnt = os.path.join(workdir, "tmpfs")
    why = mount_tmpfs(mnt)
    if why is not None:
        rep.skipped = why
        return rep
    started = time.monotonic()
    try:
        _full_disk(os.path.join(mnt, "c"), rep, random.Random(seed), compile_program)
    finally:
        unmount(mnt)
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
        rep.fail(f"partial files after dropped writes: tmp_files={counts['tmp_files']}, {_problems(counts)}")
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


# -- 5. bad inputs and paths --------------------------------------------------------------


def _listing(top: str) -> dict[str, tuple[int, int, str]]:
    """Every path under ``top`` with mode, size and a hash of its content (symlinks by target)."""
    out: dict[str, tuple[int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                digest = "->" + os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as fh:
                    digest = hashlib.sha256(fh.read()).hexdigest()
            else:
                digest = ""
            out[os.path.relpath(path, top)] = (st.st_mode, st.st_size if not stat.S_ISDIR(st.st_mode) else 0, digest)
    return out


def _expect_raise(
    rep: Report, what: str, exc_types: tuple[type[BaseException], ...], fn: Callable[[], object], named: str | None
) -> None:
    rep.operations += 1
    rep.faults += 1
    try:
        fn()
    except exc_types as exc:
        if named is not None and named not in str(exc):
            rep.fail(f"{what}: {type(exc).__name__} does not name the offending value {named!r}: {exc}")
        return
    except Exception as exc:
        rep.fail(f"{what}: raised {type(exc).__name__} ({exc}), expected {'/'.join(t.__name__ for t in exc_types)}")
        return
    rep.fail(f"{what}: accepted, expected {'/'.join(t.__name__ for t in exc_types)}")


def _key_in_shard(prefix: str, of: Callable[[int], str], start: int = 0) -> int:
    """A torture key index whose name (as ``of`` computes it) starts with ``prefix``."""
    i = start
    while not of(i).startswith(prefix):
        i += 1
    return i


def merge_reports(name: str, *parts: Report) -> Report:
    """One report of several single-process parts."""
    rep = Report(name, processes=1)
    for part in parts:
        for field_name in ("operations", "hits", "misses", "writes", "faults", "wrong_bytes", "exceptions", "seconds"):
            setattr(rep, field_name, getattr(rep, field_name) + getattr(part, field_name))
        rep.notes += part.notes
        if part.skipped:
            rep.notes.append(f"{part.scenario}: skipped: {part.skipped}")
        for message in part.failures:
            rep.fail(message)
    rep.seconds = round(rep.seconds, 1)
    return rep


def run_paths(workdir: str) -> Report:
    """The bad-input table of the design brief, and hostile paths; nothing outside the root is touched."""
    return merge_reports("paths", run_bad_inputs(workdir), run_hostile_paths(workdir))


def run_bad_inputs(workdir: str) -> Report:
    """Each row of "What a bad input gets": a clear exception naming the value, nothing on disk changed."""
    from cuda_program_cas import LayoutError, ReadOnlyCacheError

    _quiet()
    started = time.monotonic()
    rep = Report("bad-inputs", processes=1)
    base = os.path.join(workdir, "inputs")
    root = os.path.join(base, "cache")
    store = CacheStore(root)
    store.put("good", b"good bytes")
    before = _listing(base)
    for key in (1, 1.5, None, ["k"], object()):
        for op, fn in (
            ("get", lambda k=key: store.get(k)),
            ("put", lambda k=key: store.put(k, b"x")),
            ("delete", lambda k=key: store.delete(k)),
        ):
            _expect_raise(rep, f"{op} with key {key!r}", (TypeError,), fn, type(key).__name__)
    for value in ("text", 1, None, [1, 2]):
        _expect_raise(
            rep, f"put value {value!r}", (TypeError,), lambda v=value: store.put("k", v), type(value).__name__
        )
    for cap in (True, 1.5, 0, -1, "10G"):
        target = os.path.join(base, "never-created")
        _expect_raise(
            rep,
            f"max_size_bytes={cap!r}",
            (TypeError, ValueError),
            lambda c=cap, t=target: CacheStore(t, max_size_bytes=c),
            repr(cap),
        )
        if os.path.lexists(target):
            rep.fail(f"max_size_bytes={cap!r} was rejected but {target} was created")
    a_file = os.path.join(base, "a-file")
    with open(a_file, "wb") as fh:
        fh.write(b"not a cache\n")
    foreign = os.path.join(base, "foreign")
    os.makedirs(foreign)
    with open(os.path.join(foreign, "notes.txt"), "wb") as fh:
        fh.write(b"mine\n")
    before = _listing(base)
    _expect_raise(rep, "path is a file", (LayoutError, OSError), lambda: CacheStore(a_file), "a-file")
    _expect_raise(rep, "path is ''", (ValueError,), lambda: CacheStore(""), "''")
    _expect_raise(rep, "path is a foreign directory", (LayoutError,), lambda: CacheStore(foreign), "foreign")
    ro = CacheStore(root, read_only=True)
    rep.operations += 1
    if ro.put("new", b"bytes") or ro.counters()["dropped_writes"] != 1:
        rep.fail("put on a read-only cache: not dropped and counted")  # not bad input: never raised
    _expect_raise(rep, "delete on a read-only cache", (ReadOnlyCacheError,), lambda: ro.delete("good"), "read-only")
    _expect_raise(rep, "clear on a read-only cache", (ReadOnlyCacheError,), ro.clear, "read-only")
    if ro.get("good") != b"good bytes":
        rep.fail("a read-only cache did not return its entry")
    after = _listing(base)
    if after != before:
        changed = sorted(set(after.items()) ^ set(before.items()))[:5]
        rep.fail(f"bad inputs changed the disk: {changed}")
    try:
        from cuda_program_cas import ContentAddressedProgramCache
    except ImportError:  # pragma: no cover
        rep.notes.append("adapter checks skipped: cuda.core not importable")
        return rep
    cache = ContentAddressedProgramCache(root)
    _expect_raise(rep, "`key in cache`", (TypeError,), lambda: "good" in cache, "cache.get(key)")
    for value in ("text", 1, None, [1, 2]):
        _expect_raise(
            rep, f"cache[k] = {value!r}", (TypeError,), lambda v=value: cache.__setitem__("k", v), type(value).__name__
        )
    for key in (1, None):
        _expect_raise(
            rep, f"cache[{key!r}] = b''", (TypeError,), lambda k=key: cache.__setitem__(k, b"x"), type(key).__name__
        )
    if _listing(base) != after:
        rep.fail("bad inputs through the adapter changed the disk")
    rep.seconds = time.monotonic() - started
    return rep


def run_hostile_paths(workdir: str) -> Report:
    """Symlinked shard directories and files, hostile manifests: misses, and a sentinel left untouched."""
    _quiet()
    started = time.monotonic()
    rep = Report("hostile-paths", processes=1)
    base = os.path.join(workdir, "hostile")
    sentinel = os.path.join(base, "sentinel")
    os.makedirs(os.path.join(sentinel, "ab"))
    with open(os.path.join(sentinel, "secret"), "wb") as fh:
        fh.write(b"do not read or write me\n")
    root = os.path.join(base, "cache")
    store = CacheStore(root)
    for i in range(40):
        store.put(key_name(i), content(i))
    # A key whose manifest shard is replaced by a symlink into the sentinel, holding a
    # valid-looking manifest: a hit would mean the cache read outside its root.
    ki = _key_in_shard("ab", lambda n: key_id(key_name(n)), 1000)
    kid = key_id(key_name(ki))
    good = blake3(content(0)).hexdigest()
    store.put(key_name(0), content(0))
    with open(os.path.join(sentinel, "ab", kid[2:]), "wb") as fh:
        fh.write(b"cpcas1 %s %d\n" % (good.encode(), len(content(0))))
    index_shard = os.path.join(root, "index", "ab")
    _remove(index_shard)
    os.symlink(os.path.join(sentinel, "ab"), index_shard)
    # A blob shard symlinked into the sentinel; the blob sitting there is valid.
    bi = _key_in_shard("cd", lambda n: blake3(content(n)).hexdigest(), 0)
    bdigest = blake3(content(bi)).hexdigest()
    os.makedirs(os.path.join(sentinel, "cd"), exist_ok=True)
    with open(os.path.join(sentinel, "cd", bdigest[2:]), "wb") as fh:
        fh.write(content(bi))
    store.put(key_name(bi), content(bi))
    blob_shard = os.path.join(root, "blobs", "cd")
    _remove(blob_shard)
    os.symlink(os.path.join(sentinel, "cd"), blob_shard)
    # Hostile manifests: path traversal, non-hex, upper-case digests; symlinked files.
    hostile = {
        "traversal": b"cpcas1 ../../etc/passwd 100\n",
        "nonhex": b"cpcas1 " + b"z" * 64 + b" 10\n",
        "upper": b"cpcas1 " + good.upper().encode() + b" %d\n" % len(content(0)),
        "abs": b"cpcas1 /etc/passwd 10\n",
    }
    hostile_keys = {}
    for n, (name, body) in enumerate(hostile.items()):
        hk = key_name(2000 + n)
        hostile_keys[name] = hk
        path = store.layout.manifest_path(key_id(hk))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(body)
    link_key = key_name(3000)
    lpath = store.layout.manifest_path(key_id(link_key))
    os.makedirs(os.path.dirname(lpath), exist_ok=True)
    os.symlink(os.path.join(sentinel, "secret"), lpath)
    blob_link_i = 5
    os.unlink(store.blobs.path_for(blake3(content(blob_link_i)).hexdigest()))
    os.symlink(os.path.join(sentinel, "secret"), store.blobs.path_for(blake3(content(blob_link_i)).hexdigest()))
    before = _listing(sentinel)
    # Now use the cache every way there is.
    rep.faults += 4 + len(hostile)
    checks: list[tuple[str, Callable[[], object]]] = [
        ("get through a symlinked index shard", lambda: store.get(key_name(ki))),
        ("get through a symlinked blob shard", lambda: store.get(key_name(bi))),
        ("get of a symlinked manifest", lambda: store.get(link_key)),
        ("get of a symlinked blob", lambda: store.get(key_name(blob_link_i))),
    ] + [(f"get of a {name} manifest", lambda k=k: store.get(k)) for name, k in hostile_keys.items()]
    for what, fn in checks:
        rep.operations += 1
        try:
            data = fn()
        except Exception as exc:
            unexpected(rep, what, exc)
            continue
        if data is not None:
            rep.fail(f"{what}: a hit ({len(data)} bytes) read from outside the cache root")
    for what, fn2 in (
        ("put into a symlinked index shard", lambda: store.put(key_name(ki), content(ki))),
        ("put into a symlinked blob shard", lambda: store.put(key_name(bi), content(bi))),
        ("put over a symlinked manifest", lambda: store.put(link_key, b"new bytes")),
        ("put over a symlinked blob", lambda: store.put(key_name(blob_link_i), content(blob_link_i))),
        ("stats", store.stats),
        ("enforce_cap", lambda: CacheStore(root, max_size_bytes=4096).enforce_cap()),
        ("delete through a symlinked index shard", lambda: store.delete(key_name(ki))),
        ("clear", store.clear),
    ):
        rep.operations += 1
        try:
            fn2()
        except KeyError:
            pass
        except Exception as exc:
            unexpected(rep, what, exc)
    rep.operations += 1
    try:
        collect(root, grace_s=0.0, max_size=4096, verify=True)
    except Exception as exc:
        unexpected(rep, "collect", exc)
    after = _listing(sentinel)
    if after != before:
        changed = sorted({k for k in set(after) | set(before) if after.get(k) != before.get(k)})
        rep.fail(f"the sentinel directory next to the cache changed: {changed[:8]}")
    with open(os.path.join(sentinel, "secret"), "rb") as fh:
        if fh.read() != b"do not read or write me\n":
            rep.fail("the sentinel file was overwritten")
    _not_regular(os.path.join(base, "odd"), rep)
    rep.seconds = time.monotonic() - started
    return rep


def _not_regular(root: str, rep: Report) -> None:
    """Directories where a blob or manifest belongs, a file where a shard directory belongs.

    ``get`` must miss without raising. What ``put`` does there is recorded as a
    note (a policy question: today it raises the ``OSError``).
    """
    store = CacheStore(root)
    for i in range(8):
        store.put(key_name(i), content(i))
    blob_dir = store.blobs.path_for(blake3(content(1)).hexdigest())
    os.unlink(blob_dir)
    os.mkdir(blob_dir)
    man_dir = store.layout.manifest_path(key_id(key_name(2)))
    os.unlink(man_dir)
    os.mkdir(man_dir)
    kid = key_id(key_name(3))
    shard_file = os.path.join(root, "index", kid[:2])
    shutil.rmtree(shard_file)
    with open(shard_file, "wb") as fh:
        fh.write(b"not a directory\n")
    rep.faults += 3
    fresh = CacheStore(root)
    raised = []
    for i in (1, 2, 3):
        rep.operations += 1
        try:
            data = fresh.get(key_name(i))
        except Exception as exc:
            unexpected(rep, f"get of key {i} with a non-regular file in the way", exc)
            continue
        if data is not None:
            rep.fail(f"key {i}: a hit through a non-regular file")
        try:
            fresh.put(key_name(i), content(i))
        except OSError as exc:
            raised.append(type(exc).__name__)
    for what, fn in (("stats", fresh.stats), ("clear", fresh.clear)):
        rep.operations += 1
        try:
            fn()
        except Exception as exc:
            unexpected(rep, f"{what} with non-regular files in the way", exc)
    if raised:
        rep.notes.append(f"put where a directory or a file is in the way raises {', '.join(raised)} (not dropped)")


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
    procs = []
    for n, config in enumerate(configs):
        config["out"] = os.path.join(workdir, f"shared-{n}.json")
        procs.append((_spawn(config), config["out"]))
    for proc, out in procs:
        part = _worker_report(rep, proc, out, seconds + 120)
        if part is not None:
            _merge(rep, part)
            rep.notes.extend(part["notes"])
    expected = expected_digests()
    for root in (shared, *locals_):
        verify_and_repair(root, expected, rep, f"shared end {os.path.basename(root)}")
    return rep


# -- the command line ------------------------------------------------------------------------

SCENARIOS = ("mixed", "crash", "corrupt", "fulldisk", "paths", "shared")


def _compiler() -> Callable[..., Any] | None:
    try:
        from cuda.core import Program, ProgramOptions
    except ImportError:
        return None
    src = 'extern "C" __global__ void saxpy(float a, const float *x, float *y, int n) {\n'
    src += "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < n) y[i] = a * x[i] + y[i];\n}\n"

    def compile_program(cache: Any = None, **options: Any) -> Any:
        return Program(src, "c++", options=ProgramOptions(**options)).compile("cubin", cache=cache)

    return compile_program


def run(args: argparse.Namespace, workdir: str) -> list[Report]:
    reports = []
    for name in args.scenarios:
        t0 = time.monotonic()
        if name == "mixed":
            rep = run_mixed(workdir, processes=args.processes, seconds=args.seconds, cap=args.cap, seed=args.seed)
        elif name == "crash":
            rep = run_crashes(
                workdir,
                rounds=args.kills // max(1, args.crash_processes),
                processes=args.crash_processes,
                cap=args.cap,
                seed=args.seed,
            )
        elif name == "corrupt":
            rep = merge_reports(
                "corrupt", run_corruption(workdir, rounds=args.corrupt_rounds, seed=args.seed), run_unreadable(workdir)
            )
        elif name == "fulldisk":
            rep = run_full_disk(workdir, seed=args.seed, compile_program=_compiler())
        elif name == "paths":
            rep = run_paths(workdir)
        else:
            rep = run_shared(
                workdir, nodes=max(1, args.processes - 2), seconds=args.shared_seconds, cap=args.cap, seed=args.seed
            )
        if not rep.seconds:
            rep.seconds = round(time.monotonic() - t0, 1)
        reports.append(rep)
        if not args.json:
            _print_one(rep)
    return reports


def _print_one(rep: Report) -> None:
    if rep.skipped:
        print(f"{rep.scenario:9} SKIPPED: {rep.skipped}")
        return
    verdict = "ok" if rep.ok else "FAILED"
    print(
        f"{rep.scenario:9} {verdict:6} {rep.processes} proc x {rep.seconds:g} s: {rep.operations:,} ops, "
        f"{rep.hits:,} hits, {rep.misses:,} misses, {rep.writes:,} writes, {rep.dropped_writes:,} dropped, "
        f"{rep.collections:,} collections, {rep.kills} kills, {rep.faults} faults, "
        f"{rep.wrong_bytes} wrong bytes, {rep.exceptions} exceptions"
    )
    for note in rep.notes:
        print(f"          {note}")
    for failure in rep.failures:
        print(f"          FAIL {failure}")


def totals(reports: list[Report]) -> dict[str, int]:
    keys = ("operations", "hits", "kills", "faults", "wrong_bytes", "exceptions")
    return {k: sum(getattr(r, k) for r in reports) for k in keys}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torture.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, from {','.join(SCENARIOS)}")
    p.add_argument("--processes", "-p", type=int, default=4, help="mixed-load processes (default 4)")
    p.add_argument("--seconds", "-t", type=float, default=60.0, help="mixed-load duration (default 60)")
    p.add_argument("--shared-seconds", type=float, default=30.0, help="shared-store duration (default 30)")
    p.add_argument("--kills", type=int, default=100, help="SIGKILLs in the crash scenario (default 100)")
    p.add_argument("--crash-processes", type=int, default=2, help="writers killed per crash round (default 2)")
    p.add_argument("--corrupt-rounds", type=int, default=5, help="rounds of fault injection (default 5)")
    p.add_argument("--cap", type=int, default=DEFAULT_CAP, help=f"size cap in bytes (default {DEFAULT_CAP})")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", help="work directory (default: a temporary one, removed afterwards)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        return _worker(json.loads(argv[1]))
    args = build_parser().parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad or args.processes < 1 or args.seconds <= 0 or args.kills < 0:
        print(f"torture.py: error: bad arguments ({', '.join(bad) or 'counts must be positive'})", file=sys.stderr)
        return 2
    workdir = args.dir or tempfile.mkdtemp(prefix="cas-torture-")
    os.makedirs(workdir, exist_ok=True)
    started = time.monotonic()
    try:
        reports = run(args, workdir)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    total = totals(reports)
    ok = all(r.ok for r in reports)
    if args.json:
        print(
            json.dumps(
                {
                    "ok": ok,
                    "seconds": round(time.monotonic() - started, 1),
                    "totals": total,
                    "scenarios": [r.as_dict() for r in reports],
                }
            )
        )
    else:
        print(
            f"{'PASS' if ok else 'FAIL'}: {total['operations']:,} operations, {total['kills']:,} kills, "
            f"{total['faults']:,} faults injected, {total['wrong_bytes']} wrong bytes returned, "
            f"{total['exceptions']} exceptions, in {time.monotonic() - started:.0f} s"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
    sys.exit(1)
