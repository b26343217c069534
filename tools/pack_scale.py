"""Packed shared stores with many packs: the cost of a hit and of ``publish --pack`` at 1 and at N packs.

    python tools/pack_scale.py [--packs 1100] [--dir DIR]

Builds two stores of the same N entries (one pack of N, N packs of one, each
written by the real pack writer), then for each: first hits of every key in a
fresh process, hits again, the descriptors held, and the time of one
``publish --pack`` of one new entry. The hits run with the default descriptor
bound and with a bound of 1 (a pack opened for every read) for comparison.
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

from cas import CacheStore, publish  # noqa: E402
from cas._layout import Layout, create_layout  # noqa: E402
from cas._pack import write_pack  # noqa: E402
from cas._writer import Writer  # noqa: E402
from cuda_program_cas_index import key_id  # noqa: E402

_HITS = r"""
import json, os, sys, time
import cas._pack
cas._pack.MAX_OPEN_PACKS = int(sys.argv[3])
from cas import CacheStore
store, n = sys.argv[1], int(sys.argv[2])
node = CacheStore(store + "-node-" + sys.argv[3], shared=[store], copy_shared_hits=False)
keys = [f"p{i}" for i in range(n)]
t0 = time.perf_counter()
first = sum(node.get(k) is not None for k in keys)
t1 = time.perf_counter()
again = sum(node.get(k) is not None for k in keys)
t2 = time.perf_counter()
print(json.dumps({"hits": first + again, "first_us": (t1 - t0) / n * 1e6, "again_us": (t2 - t1) / n * 1e6,
                  "fds": len(os.listdir("/proc/self/fd")), "pack_fds": cas._pack.open_packs()}))
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
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", _HITS, str(store), str(n), str(bound)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return dict(json.loads(proc.stdout))


def publish_one(store: Path, work: Path, runs: int = 5) -> float:
    """Median seconds of ``publish --pack`` of a source with one new entry."""
    times = []
    for r in range(runs):
        src = work / f"src-{store.name}-{r}"
        CacheStore(src).put(f"new-{store.name}-{r}", os.urandom(200))
        t0 = time.perf_counter()
        report = publish([src], store, pack=True, fsync=False)
        times.append(time.perf_counter() - t0)
        assert report.published == 1, report
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, default=1100)
    parser.add_argument("--dir", default=None, help="where to build the stores (default: a temp dir)")
    args = parser.parse_args()
    n = args.packs
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        out: dict[str, object] = {"entries": n}
        for name, per_pack in (("one_pack", n), (f"{n}_packs", 1)):
            store = work / name
            build(store, n, per_pack)
            out[name] = {
                "hits_pool": hits(store, n, 32),
                "hits_open_per_read": hits(store, n, 1),
                "publish_pack_s": publish_one(store, work),
            }
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
