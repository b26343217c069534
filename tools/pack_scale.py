"""Packed shared stores with many packs: the cost of a hit and of ``publish --pack`` at 1 and at N packs.

    python tools/pack_scale.py [--packs 1100] [--republish 2000:65536] [--dir DIR]

Builds two stores of the same N entries (one pack of N, N packs of one, each
written by the real pack writer), then for each: the first lookup in a fresh
process (it opens the packs), the rest of the first hits, hits again (best of
5 rounds: the least disturbed by other work), the descriptors held, and
``publish --pack`` of one new entry (the first run, then the best of 5); and
hits again of 16 keys in 16 packs (a working set within the bound). Hits run with the default descriptor bound
and with a bound of 1 (a pack opened for every read) for comparison.
``--republish E:S`` also times a publish of E entries of S bytes that the store
already holds, loose and packed: what verifying the store's copies costs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from blake3 import blake3

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cuda_program_cas import CacheStore, publish  # noqa: E402
from cuda_program_cas._disk.layout import Layout, create_layout  # noqa: E402
from cuda_program_cas._disk.pack import write_pack  # noqa: E402
from cuda_program_cas._disk.writer import Writer  # noqa: E402
from cuda_program_cas.index import key_id  # noqa: E402

_HITS = r"""
import json, os, sys, time
import cuda_program_cas._disk.pack
cuda_program_cas._disk.pack.MAX_OPEN_PACKS = int(sys.argv[3])
from cuda_program_cas import CacheStore
store, n = sys.argv[1], int(sys.argv[2])
node = CacheStore(store + "-node-" + sys.argv[3], shared=[store], copy_shared_hits=False)
keys = [f"p{i}" for i in range(n)]
t0 = time.perf_counter()
hits = node.get(keys[0]) is not None
t1 = time.perf_counter()
hits += sum(node.get(k) is not None for k in keys[1:])
t2 = time.perf_counter()
rounds = []
for _ in range(5):
    t = time.perf_counter()
    hits += sum(node.get(k) is not None for k in keys)
    rounds.append((time.perf_counter() - t) / n * 1e6)
hot = keys[:16] * 20  # a working set of 16 packs, within the bound
best = []
for _ in range(5):
    t = time.perf_counter()
    hits += sum(node.get(k) is not None for k in hot)
    best.append((time.perf_counter() - t) / len(hot) * 1e6)
print(json.dumps({"hits": hits, "first_lookup_ms": (t1 - t0) * 1e3, "first_us": (t2 - t1) / (n - 1) * 1e6,
                  "again_us": min(rounds), "hot_us": min(best), "fds": len(os.listdir("/proc/self/fd")),
                  "pack_fds": getattr(cuda_program_cas._disk.pack, "open_packs", lambda: -1)()}))  # -1: before the pool
"""


def value(i: int) -> bytes:
    return (f"p:{i}:".encode() * 40)[: 100 + i % 50]


def build(store: Path, n: int, per_pack: int) -> None:
    create_layout(str(store))
    lay = Layout(str(store))
    writer = Writer(lay, file_mode=0o644, exact_mode=True)
    items = [(key_id(f"p{i}"), blake3(value(i)).hexdigest(), value(i), i) for i in range(n)]
    for start in range(0, n, per_pack):
        write_pack(lay, items[start : start + per_pack], writer.write_file)


def hits(store: Path, n: int, bound: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
    proc = subprocess.run(
        [sys.executable, "-c", _HITS, str(store), str(n), str(bound)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return dict(json.loads(proc.stdout))


def publish_one(store: Path, work: Path, runs: int = 6) -> dict[str, float]:
    """Milliseconds of ``publish --pack`` of a source with one new entry: the first run, the best of the rest."""
    times = []
    for r in range(runs):
        src = work / f"src-{store.name}-{r}"
        CacheStore(src).put(f"new-{store.name}-{r}", os.urandom(200))
        t0 = time.perf_counter()
        report = publish([src], store, pack=True, fsync=False)
        times.append((time.perf_counter() - t0) * 1e3)
        assert report.published == 1, report
    return {"first_ms": times[0], "best_ms": min(times[1:])}


def republish(work: Path, entries: int, size: int) -> dict[str, float]:
    """Seconds of publishing a source whose every entry the store already holds (loose, then packed)."""
    src = CacheStore(work / "rp-src")
    for i in range(entries):
        src.put(f"r{i}", os.urandom(size))
    out: dict[str, float] = {"mib": entries * size / 2**20}
    for name, pack in (("loose", False), ("packed", True)):
        store = work / f"rp-{name}"
        publish([work / "rp-src"], store, pack=pack, fsync=False)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            report = publish([work / "rp-src"], store, pack=pack, fsync=False)
            times.append(time.perf_counter() - t0)
            assert report.unchanged == entries, report
        out[f"{name}_s"] = min(times)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, default=1100)
    parser.add_argument("--republish", default=None, metavar="E:S", help="also time a publish of E entries of S bytes")
    parser.add_argument("--dir", default=None, help="where to build the stores (default: a temp dir)")
    args = parser.parse_args()
    n = args.packs
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        out: dict[str, object] = {"entries": n}
        if args.republish:
            entries, size = map(int, args.republish.split(":"))
            out["republish"] = republish(work, entries, size)
        for name, per_pack in (("one_pack", n), (f"{n}_packs", 1)):
            store = work / name
            build(store, n, per_pack)
            out[name] = {
                "hits_pool": hits(store, n, 32),
                "hits_open_per_read": hits(store, n, 1),
                "publish_pack": publish_one(store, work),
            }
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
