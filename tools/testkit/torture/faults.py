"""Corruption: bit flips, truncation and bad manifests injected under a running cache; unreadable files."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from blake3 import blake3

from cuda_program_cas import CacheStore
from cuda_program_cas.index import key_id
from testkit.workers import child_env

from .checker import PROBLEMS, describe_problems, inspect_cache, verify_and_repair
from .common import (
    N_KEYS,
    N_SEEDS,
    Report,
    check_hit,
    content,
    content_of_seed,
    expected_digests,
    key_name,
    quiet,
    seed_of,
    unexpected,
)

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
    bpath = store.inner.blobs.path_for(digest)
    mpath = store.inner.layout.manifest_path(key_id(key_name(i)))
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
        Path(mpath).write_bytes(os.urandom(rng.randrange(1, 120)))
    elif kind == "m_wrong_size":
        Path(mpath).write_bytes(b"cpcas1 %s %d\n" % (digest.encode(), size + rng.choice((-1, 1, 1000))))
    elif kind == "m_missing_digest":
        Path(mpath).write_bytes(b"cpcas1 %s %d\n" % (os.urandom(32).hex().encode(), size))
    elif kind == "m_other_size":
        # A valid digest whose blob has another size: the bytes would be someone else's.
        other = blake3(content_of_seed((seed_of(i) + 1) % N_SEEDS)).hexdigest()
        Path(mpath).write_bytes(b"cpcas1 %s %d\n" % (other.encode(), size))
    else:  # pragma: no cover
        raise ValueError(kind)


def run_corruption(workdir: str, *, rounds: int = 3, seed: int = 3) -> Report:
    """Damage entries in every way we know; each must be a miss, counted, cleaned, recoverable."""
    quiet()
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
            rep.fail(f"round {rnd}: bad files left in place after the misses: {describe_problems(counts)}")
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
from testkit import torture
from testkit.torture.common import quiet
from blake3 import blake3
from cuda_program_cas import CacheStore
from cuda_program_cas.index import key_id
import filelock
quiet()
# Everything imported first: the interpreter's own files may be unreadable to nobody.
os.setgid(65534); os.setuid(65534)
root = sys.argv[1]
store = CacheStore(root)
keys = range(40)
for i in keys:
    store.put(torture.key_name(i), torture.content(i))
out = {"failures": [], "faults": 0, "operations": 0, "put_denied": 0}
def blob(i):
    return store.inner.blobs.path_for(blake3(torture.content(i)).hexdigest())
def man(i):
    return store.inner.layout.manifest_path(key_id(torture.key_name(i)))
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
    errors = fresh._local.counters.as_dict()["errors"]
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
        cmd = [sys.executable, "-c", _UNREADABLE_CHILD, os.path.join(base, "c")]
        env = child_env(keep_settings=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
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
