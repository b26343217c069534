"""Shared stores over HTTP, measured on loopback: a real nginx, real cubins, fresh processes.

    .venv/bin/python tools/http_bench.py [--kernels 200] [--json] [--dir DIR]

It compiles ``--kernels`` SAXPY variants with NVRTC into a builder's cache, publishes
them twice (a loose store and a packed one) into a directory that a real nginx serves
on 127.0.0.1, and then times the cold start of fresh processes: each looks up every
kernel with ``Program.compile(cache=)`` against an empty local cache whose shared store
is that directory (read as files) or its URL (read over HTTP). It reports, per case,
the wall time of the cold start, the time and HTTP requests per first hit, and the
requests the server answered (from nginx's access log). A packed store is timed twice
over HTTP: on a cold node (the pack's index fetched) and on a warm one (the index
kept in the local cache by an earlier process). Then an outage: the same cold start
(lookups only) against a port where nothing listens and against a server that accepts
and never answers, to show what the tier's pause leaves of its cost per process.

Absolute numbers are loopback's (no network latency): on a real network, each request
adds one round trip, so the request counts are the figures to carry over
(``tools/coldstart_model.py`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import threading
import time
from typing import Any

from testkit.common import log, work_dir
from testkit.nginx import Nginx, find_nginx
from testkit.workers import run_worker, worker_spec

SAXPY = r"""
extern "C" __global__ void KERNEL(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i] + SALT;
}
"""


def kernel(i: int) -> str:
    return SAXPY.replace("KERNEL", f"k{i}").replace("SALT", f"{i}.0f")


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """A fresh process's cold start: every kernel through Program.compile(cache=), timed as a whole.

    With ``lookups``, only that many lookups of keys the store does not answer (an outage), timed.
    """
    if "lookups" in spec:
        from cuda_program_cas import CacheStore

        store = CacheStore(spec["local"], shared=[spec["shared"]])
        t0 = time.perf_counter()
        found = [store.get(f"absent {i}") for i in range(spec["lookups"])]
        elapsed = time.perf_counter() - t0
        if any(v is not None for v in found):
            raise RuntimeError("an outage answered")
        return {"elapsed_s": elapsed, "counters": store.counters(), "requests": store.inner.shared[0].engine.requests}
    from cuda.core import Program, ProgramOptions

    from cuda_program_cas import ContentAddressedProgramCache

    opts = ProgramOptions(arch="sm_80")
    cache = ContentAddressedProgramCache(spec["local"], shared=[spec["shared"]])
    t0 = time.perf_counter()
    digests = []
    for i in range(spec["kernels"]):
        obj = Program(kernel(i), "c++", options=opts).compile("cubin", cache=cache)
        digests.append(bytes(obj.code).hex()[:32])
    elapsed = time.perf_counter() - t0
    counts = cache.counters()
    requests = getattr(cache.store.inner.shared[0], "requests", 0)  # an HTTP store counts its requests
    cache.close()
    return {"elapsed_s": elapsed, "counters": counts, "requests": requests, "digests": digests}


def _stall_server() -> tuple[socket.socket, int]:
    """A server that accepts connections and never answers (a hung web server)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return srv, srv.getsockname()[1]


def _refused_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/store"


def build_stores(base: str, kernels: int) -> tuple[float, str]:
    """``kernels`` real cubins compiled by NVRTC, published under ``base/served`` as ``loose`` and ``packed``.

    Returns the seconds the compiles took and the folder that holds both stores.
    """
    from cuda.core import Program, ProgramOptions

    from cuda_program_cas import ContentAddressedProgramCache, publish

    builder = os.path.join(base, "builder")
    log(f"compiling {kernels} kernels with NVRTC ...")
    opts = ProgramOptions(arch="sm_80")
    t0 = time.perf_counter()
    with ContentAddressedProgramCache(builder) as cache:
        for i in range(kernels):
            Program(kernel(i), "c++", options=opts).compile("cubin", cache=cache)
    compile_s = time.perf_counter() - t0
    served = os.path.join(base, "served")
    publish([builder], os.path.join(served, "loose"))
    publish([builder], os.path.join(served, "packed"), pack=True)
    return compile_s, served


def run(kernels: int, parent: str | None, repeat: int = 3) -> dict[str, Any]:

    base = work_dir(parent, "http-bench")
    try:
        compile_s, served = build_stores(base, kernels)
        results: dict[str, Any] = {"kernels": kernels, "repeat": repeat, "uncached_compile_s": compile_s, "cases": {}}
        with Nginx(os.path.join(base, "nginx"), served) as server:
            cases = [
                ("directory, loose", os.path.join(served, "loose"), "fresh"),
                ("directory, packed", os.path.join(served, "packed"), "fresh"),
                ("HTTP, loose", server.read_url("loose"), "fresh"),
                ("HTTP, packed, cold node", server.read_url("packed"), "fresh"),
                ("HTTP, packed, warm node", server.read_url("packed"), "warm"),
            ]
            reference = None
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in cases}
            for r in range(repeat):  # rounds interleave the cases, so a busy moment hits them all alike
                for name, shared, node in cases:
                    log(f"round {r + 1}/{repeat}: {name} ...")
                    local = os.path.join(base, f"node-{r}-{len(runs[name])}-{name.replace(' ', '').replace(',', '-')}")
                    if node == "warm":  # an earlier process of the node kept the pack's index; its entries went
                        run_worker(__file__, {"local": local, "shared": shared, "kernels": 1})
                        _drop_all_but_local_ids(local)
                    server.reset_log()
                    out = run_worker(__file__, {"local": local, "shared": shared, "kernels": kernels})
                    out["answered"] = len(server.requests(wait_for=out["requests"])) if out["requests"] else 0
                    if reference is None:
                        reference = out["digests"]
                    elif out["digests"] != reference:
                        raise RuntimeError(f"{name}: other bytes than the first case")
                    if out["counters"]["shared_hits"] != kernels:
                        raise RuntimeError(f"{name}: {out['counters']['shared_hits']} shared hits, not {kernels}")
                    runs[name].append(out)
            for name, outs in runs.items():
                cold = statistics.median(o["elapsed_s"] for o in outs)
                results["cases"][name] = {
                    "cold_start_s": cold,
                    "cold_start_s_all": [o["elapsed_s"] for o in outs],
                    "ms_per_first_hit": cold * 1000 / kernels,
                    "requests": outs[0]["requests"],
                    "requests_per_first_hit": outs[0]["requests"] / kernels,
                    "server_answered": outs[0]["answered"],
                }
        stall, port = _stall_server()
        try:
            for name, url in (
                ("outage: connection refused", _refused_url()),
                ("outage: server accepts, never answers", f"http://127.0.0.1:{port}/store"),
            ):
                log(f"{name} ...")
                local = os.path.join(base, f"node-{len(results['cases'])}")
                out = run_worker(
                    __file__,
                    {"local": local, "shared": url, "lookups": kernels},
                    settings={"CUDA_PROGRAM_CAS_HTTP_TIMEOUT": "1,2"},
                    timeout=600,
                )
                results["cases"][name] = {
                    "lookups": kernels,
                    "cold_start_s": out["elapsed_s"],
                    "requests": out["requests"],
                    "errors": out["counters"]["errors"],
                    "note": "1 s connect and 2 s read timeouts; every lookup a miss",
                }
        finally:
            stall.close()
        return results
    finally:
        if parent is None:
            shutil.rmtree(base, ignore_errors=True)


def _drop_all_but_local_ids(local: str) -> None:
    """Remove a node's entries except the node-local ones (the kept pack index): a warm node, cold entries."""
    from cuda_program_cas.index import is_local_id

    index = os.path.join(local, "index")
    for shard in os.listdir(index):
        for name in os.listdir(os.path.join(index, shard)):
            if not is_local_id(shard + name):
                os.unlink(os.path.join(index, shard, name))


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{results['kernels']} kernels; uncached compile of all: {results['uncached_compile_s']:.1f} s; "
        f"cold starts: the median of {results['repeat']}",
        "",
        f"{'case':42} {'cold start':>11} {'per hit':>9} {'requests':>9} {'per hit':>8}",
    ]
    for name, case in results["cases"].items():
        if "lookups" in case:
            lines.append(
                f"{name:42} {case['cold_start_s']:>9.2f} s {'':>9} {case['requests']:>9}"
                f"   ({case['lookups']} lookups, {case['note']})"
            )
            continue
        lines.append(
            f"{name:42} {case['cold_start_s']:>9.3f} s {case['ms_per_first_hit']:>6.2f} ms "
            f"{case['requests']:>9} {case['requests_per_first_hit']:>8.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    spec = worker_spec(args_in)
    if spec is not None:
        print(json.dumps(_worker(spec)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=int, default=200, help="kernels per cold start (default 200)")
    parser.add_argument("--repeat", type=int, default=3, help="cold starts per case; the median is shown (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--dir", help="where the caches and the served store go (kept); default a temp dir")
    args = parser.parse_args(args_in)
    if find_nginx() is None:
        print("http_bench: nginx is not installed (apt-get install nginx)", file=sys.stderr)
        return 2
    results = run(args.kernels, args.dir, args.repeat)
    print(json.dumps(results, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
