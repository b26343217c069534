#!/usr/bin/env python3
"""What the server sees when many nodes start one job at once: a loose or packed store on NFS or HTTP, or compiling.

    python tools/coldstart_model.py                        # 1,000 nodes, 200 kernels, the measured defaults
    python tools/nfs_harness.py --json > nfs.json          # a run of the NFS harness, as one JSON object
    python tools/coldstart_model.py --measured nfs.json    # the per-node counts of that run
    python tools/coldstart_model.py --nodes 4000 --kernels 50 --json

A model on paper from per-node measurements: each node looks each kernel up once in the
shared store or, with none, compiles it. Inputs: the NFS operations of one node's first hits
(``tools/nfs_harness.py``'s ``packed`` scenario; ``--measured`` reads its ``--json`` output,
a kept run's ``result.json``, or ``{"loose": {...}, "packed": {...}}``), the HTTP requests and
Redis commands a node makes (counted by ``tools/cluster_bench.py`` and the tests), the bytes
per kernel and NVRTC's seconds per kernel. Assumptions are flags: the start ``--window``, the
server's ``--server-ops``, ``--server-gbps``, ``--server-rps`` and ``--redis-ops``, the round
trip ``--rtt-ms`` (a node asks one request at a time), ``--cores`` per node. No queueing is
simulated: it reports the load, its rate over the window and the floor the server's capacity
sets on the start, against compiling instead. Exit 0, or 2 on bad usage or a ``--measured``
file without the inputs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

#: Per-node figures measured with tools/nfs_harness.py on the real NFS server (docs/nfs.md: NFSv4.2
#: and v3, 100 first hits of entries of 0.3-24 KiB, the worst node of four runs on 2026-12-02); used
#: when --measured is not given. ops_per_hit: NFS operations per first hit of one kernel after the first (loose: OPEN,
#: READ, CLOSE, ACCESS and LOOKUP of a manifest and a blob; packed: READs of the pack, which the
#: client coalesces); ops_fixed: what the first hit costs beyond that, once per node and job (the
#: store's directories, layout.json, listing packs/, opening the pack).
DEFAULTS: dict[str, dict[str, float]] = {
    "loose": {"ops_fixed": 14.1, "ops_per_hit": 6.9},
    "packed": {"ops_fixed": 14.4, "ops_per_hit": 0.6},
}

#: The scenario of tools/nfs/scenarios.py whose figures hold the NFS inputs (``model_inputs``).
PACKED_SCENARIO = "loose against packed stores"


class MeasuredError(ValueError):
    """A --measured file that holds no usable per-node inputs."""


def load_measured(path: str) -> dict[str, dict[str, float]]:
    """The loose and packed inputs from a harness result (``nfs_harness.py --json``, a kept run's
    ``result.json``) or from a bare ``{"loose": {...}, "packed": {...}}``."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise MeasuredError(f"cannot read {path}: {exc}") from exc
    if isinstance(data, dict) and "scenarios" in data:
        found = [s for s in data["scenarios"] if isinstance(s, dict) and s.get("name") == PACKED_SCENARIO]
        if not found:
            raise MeasuredError(f"{path}: a harness result without the {PACKED_SCENARIO!r} scenario (run it)")
        data = found[0].get("figures", {}).get("model_inputs")
    measured: dict[str, dict[str, float]] = {}
    for kind in ("loose", "packed"):
        row = data.get(kind) if isinstance(data, dict) else None
        try:
            measured[kind] = {f: float(row[f]) for f in ("ops_fixed", "ops_per_hit")}  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            raise MeasuredError(f"{path}: no {kind} ops_fixed and ops_per_hit in it") from None
        if min(measured[kind].values()) < 0:
            raise MeasuredError(f"{path}: negative operation counts for {kind}: {measured[kind]}")
    return measured


def nfs_rows(args: argparse.Namespace, measured: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """A shared store on NFS, loose and packed: every node's first hits, and their load on the server."""
    total_bytes = args.nodes * args.kernels * args.kernel_kib * 1024
    rows = {}
    for kind in ("loose", "packed"):
        per_node = measured[kind]["ops_fixed"] + args.kernels * measured[kind]["ops_per_hit"]
        ops = args.nodes * per_node
        rows[kind] = {
            "transport": "nfs",
            "ops_per_node": per_node,
            "ops_total": ops,
            "ops_per_s_over_window": ops / args.window,
            "bytes_total": total_bytes,
            "server_floor_s": max(ops / args.server_ops, total_bytes / (args.server_gbps * 1e9)),
        }
    return rows


#: Requests one node's process makes over HTTP (tools/cluster_bench.py counts them, and nginx's
#: access log agrees; they do not vary from run to run). Fixed: layout.json and packs/list, and
#: for a loose store its key list (cas/_shared/keylist.py: read at the first loose lookup),
#: plus, for a packed store on a cold node, each pack's trailer and index (2 per pack, once per
#: node: kept in the local cache after). Per hit: a manifest and a blob (loose), one Range GET (packed).
HTTP_REQUESTS: dict[str, dict[str, float]] = {
    "loose": {"fixed": 3.0, "per_pack": 0.0, "per_hit": 2.0},
    "packed": {"fixed": 2.0, "per_pack": 2.0, "per_hit": 1.0},
}


#: The same with the job's warm set (cas/_shared/warmset.py; tests/test_warm_sets.py asserts these):
#: layout.json and the set, then for a packed store one multi-range request per pack, for a loose
#: one a manifest and a blob per entry sent PARALLEL at a time. ``round_trips``: what a node waits
#: for, fixed plus per hit (loose: 2 requests per hit, 16 at once).
HTTP_WARM_REQUESTS: dict[str, dict[str, float]] = {
    "loose": {"fixed": 2.0, "per_pack": 0.0, "per_hit": 2.0, "rt_fixed": 2.0, "rt_per_hit": 2.0 / 16},
    "packed": {"fixed": 2.0, "per_pack": 1.0, "per_hit": 0.0, "rt_fixed": 3.0, "rt_per_hit": 0.0},
}


#: A Redis store with the job's warm set (tests/test_warm_sets.py and tests/test_publish_sets.py assert
#: these against INFO commandstats and a forwarder's count): commands per node, layout.json and the set,
#: then a manifest and a blob per entry; round trips: the connection's first (with layout.json), the
#: set, one pipeline of all the entries.
REDIS_WARM_COMMANDS: dict[str, float] = {"fixed": 2.0, "per_hit": 2.0, "round_trips": 3.0}


def redis_rows(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """A Redis store with the job's warm set: commands per node, the server's command rate and floor."""
    total_bytes = args.nodes * args.kernels * args.kernel_kib * 1024
    per_node = REDIS_WARM_COMMANDS["fixed"] + REDIS_WARM_COMMANDS["per_hit"] * args.kernels
    commands = args.nodes * per_node
    return {
        "redis, warm set": {
            "transport": "redis",
            "requests_per_node": per_node,
            "requests_total": commands,
            "requests_per_s_over_window": commands / args.window,
            "bytes_total": total_bytes,
            "node_wait_s": REDIS_WARM_COMMANDS["round_trips"] * args.rtt_ms / 1000,
            "server_floor_s": max(commands / args.redis_ops, total_bytes / (args.server_gbps * 1e9)),
        }
    }


def http_rows(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """A shared store over HTTP, loose and packed: requests per node, the server's request rate and floor.

    A node's process asks one request at a time: its wait is requests x ``--rtt-ms`` (plus the
    server's time, which the floor covers). Packs: ``--packs`` in the store, all fetched by a cold node.
    """
    total_bytes = args.nodes * args.kernels * args.kernel_kib * 1024

    def row(per_node: float, trips: float) -> dict[str, Any]:
        requests = args.nodes * per_node
        return {
            "transport": "http",
            "requests_per_node": per_node,
            "requests_total": requests,
            "requests_per_s_over_window": requests / args.window,
            "bytes_total": total_bytes,
            "node_wait_s": trips * args.rtt_ms / 1000,
            "server_floor_s": max(requests / args.server_rps, total_bytes / (args.server_gbps * 1e9)),
        }

    rows = {}
    for kind, cost in HTTP_REQUESTS.items():
        per_node = cost["fixed"] + cost["per_pack"] * args.packs + cost["per_hit"] * args.kernels
        rows[f"http {kind}"] = row(per_node, per_node)  # one at a time: a round trip each
    for kind, cost in HTTP_WARM_REQUESTS.items():
        per_node = cost["fixed"] + cost["per_pack"] * args.packs + cost["per_hit"] * args.kernels
        trips = cost["rt_fixed"] + cost["per_pack"] * max(0, args.packs - 1) + cost["rt_per_hit"] * args.kernels
        rows[f"http {kind}, warm set"] = row(per_node, trips)
    return rows


def compile_row(args: argparse.Namespace) -> dict[str, Any]:
    """No shared store: every node compiles every kernel."""
    return {
        "transport": None,
        "ops_per_node": 0,
        "ops_total": 0,
        "ops_per_s_over_window": 0.0,
        "bytes_total": 0,
        "server_floor_s": 0.0,
        "node_compile_s": args.kernels * args.nvrtc_s / max(1, args.cores),
        "cpu_hours": args.nodes * args.kernels * args.nvrtc_s / 3600,
    }


def model(args: argparse.Namespace, measured: dict[str, dict[str, float]]) -> dict[str, Any]:
    return {
        "assumptions": {
            "nodes": args.nodes,
            "kernels": args.kernels,
            "kernel_bytes": args.kernel_kib * 1024,
            "window_s": args.window,
            "server_ops_per_s": args.server_ops,
            "server_gb_per_s": args.server_gbps,
            "nvrtc_s_per_kernel": args.nvrtc_s,
            "cores_per_node": args.cores,
            "http_requests_per_s": args.server_rps,
            "http_rtt_ms": args.rtt_ms,
            "redis_commands_per_s": args.redis_ops,
            "packs": args.packs,
        },
        "measured": measured,
        "rows": {**nfs_rows(args, measured), **http_rows(args), **redis_rows(args), "compile": compile_row(args)},
    }


def render(result: dict[str, Any]) -> str:
    a = result["assumptions"]
    lines = [
        f"{a['nodes']:,} nodes start a job of {a['kernels']} kernels ({a['kernel_bytes'] // 1024} KiB each) "
        f"within {a['window_s']:g} s; server: {a['server_ops_per_s']:,.0f} ops/s, {a['server_gb_per_s']:g} GB/s",
        "",
        f"{'':<10} {'NFS ops/node':>13} {'NFS ops':>12} {'ops/s':>12} {'GB moved':>9} {'start floor':>12}",
    ]
    for kind in ("loose", "packed"):
        r = result["rows"][kind]
        lines.append(
            f"{kind:<10} {r['ops_per_node']:>13,.0f} {r['ops_total']:>12,.0f} {r['ops_per_s_over_window']:>12,.0f} "
            f"{r['bytes_total'] / 1e9:>9.2f} {r['server_floor_s']:>11.1f}s"
        )
    c = result["rows"]["compile"]
    lines.append(
        f"{'compile':<10} {0:>13} {0:>12} {0:>12} {0:>9.2f} {c['node_compile_s']:>11.1f}s"
        f"  (every node compiles: {c['cpu_hours']:,.0f} CPU hours)"
    )
    lines.append("")
    lines.append(
        f"over HTTP: server {a['http_requests_per_s']:,.0f} requests/s, {a['http_rtt_ms']:g} ms a round trip, "
        f"{a['packs']} pack(s); Redis: {a['redis_commands_per_s']:,.0f} commands/s (its requests are commands)"
    )
    lines.append(
        f"{'':<22} {'requests/node':>13} {'requests':>12} {'requests/s':>12} {'node wait':>10} {'start floor':>12}"
    )
    for kind in ("http loose", "http packed", "http loose, warm set", "http packed, warm set", "redis, warm set"):
        r = result["rows"][kind]
        lines.append(
            f"{kind:<22} {r['requests_per_node']:>13,.0f} {r['requests_total']:>12,.0f} "
            f"{r['requests_per_s_over_window']:>12,.0f} {r['node_wait_s']:>9.2f}s {r['server_floor_s']:>11.1f}s"
        )
    loose, packed = result["rows"]["loose"], result["rows"]["packed"]
    lines.append("")
    lines.append(
        f"packed: {loose['ops_total'] / max(1.0, packed['ops_total']):.1f}x fewer NFS operations than loose; "
        f"the server's floor is {packed['server_floor_s']:.1f} s against {c['node_compile_s']:.1f} s of compiling"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="coldstart_model.py")
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--kernels", type=int, default=200)
    ap.add_argument("--kernel-kib", type=float, default=160.0, help="bytes of one kernel's binary, KiB (160)")
    ap.add_argument("--window", type=float, default=10.0, help="seconds over which the nodes start (10)")
    ap.add_argument("--server-ops", type=float, default=100_000.0, help="NFS operations per second served (100k)")
    ap.add_argument("--server-gbps", type=float, default=5.0, help="GB/s the server delivers (5)")
    ap.add_argument("--nvrtc-s", type=float, default=0.5, help="NVRTC seconds per kernel (0.5)")
    ap.add_argument("--cores", type=int, default=16, help="cores a node compiles on in parallel (16)")
    ap.add_argument("--server-rps", type=float, default=50_000.0, help="HTTP requests per second served (50k)")
    ap.add_argument("--rtt-ms", type=float, default=0.5, help="a node's round trip to the HTTP server, ms (0.5)")
    ap.add_argument(
        "--redis-ops", type=float, default=100_000.0, help="Redis commands per second served, one server (100k)"
    )
    ap.add_argument("--packs", type=int, default=1, help="packs in the store, fetched by a cold node (1)")
    ap.add_argument("--measured", help="nfs_harness.py --json output (or loose/packed ops_fixed and ops_per_hit)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if (
        min(args.nodes, args.kernels, args.cores) <= 0
        or min(args.window, args.server_ops, args.server_gbps, args.server_rps, args.redis_ops) <= 0
        or min(args.rtt_ms, args.packs) < 0
    ):
        print("coldstart_model.py: error: every count, rate and window must be positive", file=sys.stderr)
        return 2
    measured = DEFAULTS
    if args.measured:
        try:
            measured = load_measured(args.measured)
        except MeasuredError as exc:
            print(f"coldstart_model.py: error: {exc}", file=sys.stderr)
            return 2
    result = model(args, measured)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
