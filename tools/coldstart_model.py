#!/usr/bin/env python3
"""What the NFS server sees when many nodes start one job at once: loose store, packed store, or compiling.

    python tools/coldstart_model.py                        # 1,000 nodes, 200 kernels, the measured defaults
    python tools/coldstart_model.py --measured nfs.json    # per-node counts from tools/nfs_harness.py --json
    python tools/coldstart_model.py --nodes 4000 --kernels 50 --json

A model on paper, from per-node measurements: each node of a job looks each of
its kernels up once (a first hit) in the shared store, or, with no store,
compiles each. The inputs are the NFS operations one node's first hits cost
(measured by ``tools/nfs_harness.py``'s ``packed`` scenario from
``/proc/self/mountstats``: LOOKUP, GETATTR, ACCESS, OPEN, READ and the rest), the
bytes one kernel moves, and NVRTC's seconds per kernel (from ``tools/bench.py``).

Assumptions (each a flag): all nodes start within ``--window`` seconds; the
server completes at most ``--server-ops`` metadata-or-data operations per second
and ``--server-gbps`` GB/s; one node compiles its kernels on ``--cores`` cores in
parallel. The model does not simulate queueing: it reports the load (operations
and bytes, and their rate over the window) and the floor the server's capacity
sets on the start, against the time compiling would take instead. Exit 0, or 2
on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

#: Per-node figures measured with tools/nfs_harness.py on the real NFS server (docs/nfs.md: NFSv4.2,
#: 100 first hits of entries of 0.3-24 KiB, the worst of three nodes); used when --measured is not
#: given. ops_per_hit: NFS operations per first hit of one kernel (loose: OPEN, READ, CLOSE, ACCESS
#: and LOOKUP of a manifest and a blob; packed: READs of index slices and blobs, which the client
#: coalesces); ops_fixed: once per node and job (layout.json, listing packs/, opening the pack).
DEFAULTS: dict[str, dict[str, float]] = {
    "loose": {"ops_fixed": 0.0, "ops_per_hit": 7.3},
    "packed": {"ops_fixed": 9.0, "ops_per_hit": 0.63},
}


def model(args: argparse.Namespace, measured: dict[str, dict[str, float]]) -> dict[str, Any]:
    nodes, kernels = args.nodes, args.kernels
    kernel_bytes = args.kernel_kib * 1024
    out: dict[str, Any] = {
        "assumptions": {
            "nodes": nodes,
            "kernels": kernels,
            "kernel_bytes": kernel_bytes,
            "window_s": args.window,
            "server_ops_per_s": args.server_ops,
            "server_gb_per_s": args.server_gbps,
            "nvrtc_s_per_kernel": args.nvrtc_s,
            "cores_per_node": args.cores,
        },
        "rows": {},
    }
    total_bytes = nodes * kernels * kernel_bytes
    for kind in ("loose", "packed"):
        per_node = measured[kind]["ops_fixed"] + kernels * measured[kind]["ops_per_hit"]
        ops = nodes * per_node
        floor = max(ops / args.server_ops, total_bytes / (args.server_gbps * 1e9))
        out["rows"][kind] = {
            "ops_per_node": per_node,
            "ops_total": ops,
            "ops_per_s_over_window": ops / args.window,
            "bytes_total": total_bytes,
            "server_floor_s": floor,
        }
    compile_s = kernels * args.nvrtc_s / max(1, args.cores)
    out["rows"]["compile"] = {
        "ops_per_node": 0,
        "ops_total": 0,
        "ops_per_s_over_window": 0.0,
        "bytes_total": 0,
        "server_floor_s": 0.0,
        "node_compile_s": compile_s,
        "cpu_hours": nodes * kernels * args.nvrtc_s / 3600,
    }
    return out


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
    ap.add_argument("--measured", help="JSON with loose/packed ops_fixed and ops_per_hit (from nfs_harness)")
    ap.add_argument("--json", action="store_true")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if min(args.nodes, args.kernels, args.cores) <= 0 or min(args.window, args.server_ops, args.server_gbps) <= 0:
        print("coldstart_model.py: error: every count, rate and window must be positive", file=sys.stderr)
        return 2
    measured = DEFAULTS
    if args.measured:
        with open(args.measured) as fh:
            data = json.load(fh)
        measured = data.get("per_node", data)
    result = model(args, measured)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
