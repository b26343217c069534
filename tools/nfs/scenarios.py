#!/usr/bin/env python3
"""The shared-store scenarios, run over one writable and several read-only mounts of one store.

    scenarios.py --publisher /mnt/publisher --node /mnt/node1 --node /mnt/node2 \\
        --local /tmp/nodes --json result.json [--quick]
    # over NFS, as tools/nfs/guest.sh runs it: each --node with its mount options
    scenarios.py ... --node /mnt/node1 --node-options ro,vers=4.2 --nfs-export 127.0.0.1:/srv/export

``tools/nfs_harness.py`` runs this in its VM over NFS mounts of one export (``nosharecache``:
one client cache per mount, like nodes); on plain directories it checks the logic but not NFS.
The store is ``<publisher>/store``, each node reads ``<node>/store`` in a process of its own.
docs/nfs-harness.md describes the six scenarios (:data:`SCENARIOS`). A wrong byte, an exception,
a failed worker or a figure that breaks what the docs claim (a ``CLAIM:`` line) fails the run
(exit status 1). Figures go to ``--json`` and, summed up, to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from nfs_common import format_summary, mount_options, mountstats, ops_between  # first: this checkout's cuda_program_cas
from testkit.common import SAXPY
from testkit.workers import answer, collect, spawn_worker, worker_spec

Result = dict[str, Any]

KERNELS = {
    "saxpy": SAXPY,
    "scale": r"""
extern "C" __global__ void scale(float a, float *x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
""",
}
#: (kernel, target, arch) compiled by the publisher and looked up by every node.
COMPILES = [("saxpy", "cubin", "sm_80"), ("scale", "cubin", "sm_80"), ("saxpy", "ltoir", "sm_90")]


# -- the data: every process derives the expected bytes of a key itself -------------------


def key_of(gen: str, i: int) -> str:
    return f"nfs-harness/{gen}/{i}"


def value_of(gen: str, i: int) -> bytes:
    """Deterministic content; every fourth key shares its predecessor's bytes (a shared blob)."""
    content = i - 1 if i % 4 == 3 else i
    rng = random.Random(f"{gen}:{content}")
    return rng.randbytes(256 + rng.randrange(24 * 1024))


def make_source(path: str, gen: str, indices: range | list[int]) -> int:
    """A local cache holding the given entries (what a node would have compiled). Returns bytes."""
    from cuda_program_cas import CacheStore

    store = CacheStore(path)
    total = 0
    for i in indices:
        data = value_of(gen, i)
        store.put(key_of(gen, i), data)
        total += len(data)
    return total


# -- node workers: separate processes, one per mount ----------------------------------------


def _node_store(cfg: Result) -> Any:
    from cuda_program_cas import CacheStore

    local = cfg["local"]
    shutil.rmtree(local, ignore_errors=True)
    return CacheStore(local, shared=[cfg["store"]], copy_shared_hits=False)


def _check(store: Any, gen: str, i: int, out: Result) -> bool | None:
    """Look one key up: True hit (right bytes), False miss, None wrong bytes or an exception."""
    try:
        data = store.get(key_of(gen, i))
    except Exception:
        out["exceptions"].append(traceback.format_exc(limit=4))
        return None
    if data is None:
        return False
    if data != value_of(gen, i):
        out["wrong"].append(
            f"{key_of(gen, i)}: {len(data)} bytes, first difference at {_first_diff(data, value_of(gen, i))}"
        )
        return None
    return True


def _first_diff(a: bytes, b: bytes) -> int:
    return next((n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def worker_sweep(cfg: Result) -> Result:
    """Read keys ``0..n`` of ``gen`` over and over until the stop file appears, then report."""
    store = _node_store(cfg)
    gen, n = cfg["gen"], cfg["n"]
    out: Result = {"reads": 0, "hits": 0, "misses": 0, "wrong": [], "exceptions": [], "sweeps": 0}
    first_seen: dict[int, float] = {}
    lost: set[int] = set()
    seen_now: set[int] = set()
    deadline = time.monotonic() + cfg["max_s"]
    with open(cfg["ready"], "w"):
        pass
    stopped_at = None
    # Every lookup that met an I/O error (a miss all the same): when, and why (ESTALE, ...).
    error_events: list[list[Any]] = []
    miss_reasons: dict[str, int] = {}
    errors_seen = 0
    while True:
        seen_now = set()
        for i in range(n):
            t_start = time.monotonic()
            ok = _check(store, gen, i, out)
            out["reads"] += 1
            if ok:
                out["hits"] += 1
                seen_now.add(i)
                first_seen.setdefault(i, time.monotonic())
            elif ok is False:
                out["misses"] += 1
                reason = store.inner.shared[0].miss_reason()
                miss_reasons[reason] = miss_reasons.get(reason, 0) + 1
                errors_now = store.stats().errors
                if errors_now != errors_seen:
                    errors_seen = errors_now
                    if len(error_events) < 1000:
                        error_events.append([t_start, time.monotonic(), reason])
                if i in first_seen:
                    lost.add(i)
        out["sweeps"] += 1
        now = time.monotonic()
        if stopped_at is not None:
            # After the stop, sweep until every key is visible (a node that missed a key may keep
            # a negative lookup cached for a while) or the settle time runs out.
            out.setdefault("visible_after_stop", len(seen_now))
            if len(seen_now) == n or now - stopped_at > cfg["settle_s"]:
                if len(seen_now) == n:
                    out["all_visible_after_stop_s"] = round(now - stopped_at, 2)
                break
            time.sleep(0.2)
        elif now > deadline:
            break
        elif os.path.exists(cfg["stop"]):
            stopped_at = now
        else:
            time.sleep(cfg["pause_s"])  # leave the publisher some CPU: nodes are processes of one VM
    stats = store.stats()
    out.update(
        first_seen={str(k): v for k, v in first_seen.items()},
        lost_after_seen=len(lost),
        visible_at_end=len(seen_now),
        store_errors=stats.errors,
        store_corrupt=stats.corrupt,
        error_events=error_events,
        miss_reasons=miss_reasons,
    )
    return out


def worker_serve(cfg: Result) -> Result:
    """Answer ``get GEN I`` lines on stdin with ``hit``/``miss``/``bad`` (one process per node)."""
    store = _node_store(cfg)
    out: Result = {"wrong": [], "exceptions": []}
    for line in sys.stdin:
        _cmd, gen, i = line.split()
        ok = _check(store, gen, int(i), out)
        print("hit" if ok else "miss" if ok is False else "bad", flush=True)
    return out


def worker_compile(cfg: Result) -> Result:
    """Compile every kernel through a cache layered over the shared store; count real NVRTC runs."""
    import cuda.core._program as program_mod

    from cuda_program_cas import ContentAddressedProgramCache

    real = program_mod._program_compile_uncached
    calls = {"n": 0}

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return real(*args, **kwargs)

    program_mod._program_compile_uncached = counted
    shutil.rmtree(cfg["local"], ignore_errors=True)
    out: Result = {}
    with ContentAddressedProgramCache(cfg["local"], shared=[cfg["store"]]) as cache:
        out["times_ms"], out["digests"] = compile_all(cache)
        out["second_times_ms"], _ = compile_all(cache)
        stats = cache.stats()
    out.update(nvrtc_compiles=calls["n"], hits=stats.hits, shared_hits=stats.shared_hits, misses=stats.misses)
    return out


def compile_all(cache: Any) -> tuple[list[float], list[str]]:
    """Each of :data:`COMPILES` through ``cache``: milliseconds each took, and the digests of the binaries."""
    from cuda.core import Program, ProgramOptions

    from cuda_program_cas import digest_of

    times, digests = [], []
    for name, target, arch in COMPILES:
        lto = {"relocatable_device_code": True, "link_time_optimization": True} if target == "ltoir" else {}
        t0 = time.perf_counter()
        obj = Program(KERNELS[name], "c++", options=ProgramOptions(arch=arch, **lto)).compile(target, cache=cache)
        times.append(round((time.perf_counter() - t0) * 1e3, 1))
        digests.append(digest_of(bytes(obj.code)))
    return times, digests


def worker_firsthits(cfg: Result) -> Result:
    """One node's cold job: the first hit of each of ``n`` keys in a fresh process; the NFS operations it cost.

    ``ops_first``: the first lookup (it opens the store: layout.json, packs/, the pack);
    ``ops_rest``: the other ``n - 1``. Both are differences of the mount's counters.
    """
    from cuda_program_cas import CacheStore

    local = cfg["local"]
    shutil.rmtree(local, ignore_errors=True)
    before = mountstats(cfg["mount"])
    store = CacheStore(local, shared=[cfg["store"]])
    out: Result = {"wrong": [], "exceptions": [], "hits": 0, "misses": 0, "nfs": before is not None}
    t0 = time.perf_counter()
    after_first = before
    for i in range(cfg["n"]):
        ok = _check(store, cfg["gen"], i, out)
        out["hits" if ok else "misses"] += 1
        if i == 0:
            after_first = mountstats(cfg["mount"])
    out["seconds"] = round(time.perf_counter() - t0, 4)
    after = mountstats(cfg["mount"])
    out["ops_first"] = ops_between(before, after_first)
    out["ops_rest"] = ops_between(after_first, after)
    out["ops"] = ops_between(before, after)
    return out


WORKERS: dict[str, Callable[[Result], Result]] = {
    "sweep": worker_sweep,
    "serve": worker_serve,
    "compile": worker_compile,
    "firsthits": worker_firsthits,
}


def worker_main(cfg: Result) -> int:
    """A node's process (testkit's worker protocol): the role's work, answered as one JSON line."""
    role = cfg["role"]
    try:
        out = WORKERS[role](cfg)
    except Exception:
        out = {"wrong": [], "exceptions": [traceback.format_exc()]}
    out["role"] = role
    answer(out)
    return 1 if out.get("exceptions") or out.get("wrong") else 0


def spawn(role: str, cfg: Result, stdin: int | None = None) -> subprocess.Popen[str]:
    return spawn_worker(
        __file__, {**cfg, "role": role}, keep_settings=True,
        stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def collect_worker(proc: subprocess.Popen[str], timeout: float, failures: list[str], who: str) -> Result:
    done = collect(proc, timeout)
    if done.timed_out:
        failures.append(f"{who}: did not finish within {timeout:.0f} s")
    out = done.answer
    if out is None:
        failures.append(f"{who}: exited {done.returncode} without a result: {done.stderr.strip()[-1500:]}")
        return {}
    for text in out.get("wrong", [])[:5]:
        failures.append(f"{who}: WRONG BYTES {text}")
    for text in out.get("exceptions", [])[:3]:
        failures.append(f"{who}: exception: {text.strip()}")
    if done.returncode != 0 and not out.get("wrong") and not out.get("exceptions"):
        failures.append(f"{who}: exit status {done.returncode}: {done.stderr.strip()[-800:]}")
    return out


def ask(proc: subprocess.Popen[str], gen: str, i: int) -> str:
    """A ``serve`` worker's answer for key ``i`` of ``gen``: hit, miss, bad, or "" where it died."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"get {gen} {i}\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def stop_servers(env: Env, servers: list[subprocess.Popen[str]], failures: list[str]) -> None:
    for k, proc in enumerate(servers):
        assert proc.stdin is not None
        proc.stdin.close()
        proc.stdin = None  # communicate() must not flush it
        collect_worker(proc, 60, failures, env.who(k))


# -- the scenarios (run by the publisher process) ---------------------------------------------


class Env:
    def __init__(self, args: argparse.Namespace) -> None:
        self.publisher = os.path.join(args.publisher, "store")
        self.nodes = [os.path.join(n, "store") for n in args.node]
        self.mounts = list(args.node)
        self.local = args.local
        self.quick = args.quick
        self.n = args.keys or (48 if args.quick else 400)
        self.batches = 4 if self.n < 200 else 8
        self.neg_wait_s = 5.0 if args.quick else 75.0
        #: What the nodes mount (``host:/path``) and each node's mount options: where given, the
        #: packed scenario counts each cold job on a mount of its own (see :meth:`fresh_mount`).
        self.export = args.nfs_export
        self.node_options = list(args.node_options or [])
        #: The claims scenario runs only its cases whose label contains one of these (all when empty).
        self.claim_cases = list(getattr(args, "claim_case", None) or [])
        if self.export and len(self.node_options) != len(self.mounts):
            raise SystemExit("scenarios.py: --nfs-export needs one --node-options per --node")
        os.makedirs(self.local, exist_ok=True)

    def caches_negative_lookups(self, k: int) -> bool:
        """Whether node ``k`` may keep missing a file created after it missed it (an NFS mount
        without ``lookupcache=positive`` or ``none``: the negative lookup stays cached)."""
        opts = mount_options([self.mounts[k]])[self.mounts[k]]
        fstype, _, flags = opts.partition(" ")
        if not fstype.startswith("nfs"):
            return False
        return not any(f in flags.split(",") for f in ("lookupcache=positive", "lookupcache=pos", "lookupcache=none"))

    def fresh_mount(self, k: int, tag: str) -> str:
        """A new mount of the export with node ``k``'s options, for one measurement; the node's own
        mount where there is no export to mount (plain directories).

        A mount of its own keeps one phase's NFS operations out of another's count. The per-op
        counters of ``/proc/self/mountstats`` are per mount, and the client sends some operations
        late: it returns the read delegations of the files a phase opened (DELEGRETURN) when it
        likes, or at unmount. On a shared mount one run counted 141 of them in the next phase.
        """
        if not self.export:
            return self.mounts[k]
        path = os.path.join(os.path.dirname(self.mounts[k].rstrip("/")), f"fresh-{tag}-{k + 1}")
        os.makedirs(path, exist_ok=True)
        opts = f"nosharecache,{self.node_options[k]}"
        subprocess.run(["mount", "-t", "nfs", "-o", opts, self.export, path], check=True, capture_output=True)
        return path

    def drop_mount(self, path: str) -> None:
        """Unmount what :meth:`fresh_mount` mounted (it returns delegations the mount still holds)."""
        if self.export and path not in self.mounts:
            subprocess.run(["umount", path], check=False, capture_output=True)

    def tmp(self, *parts: str) -> str:
        path = os.path.join(self.local, *parts)
        shutil.rmtree(path, ignore_errors=True)
        return path

    def node_cfg(self, k: int, **extra: Any) -> Result:
        return {"store": self.nodes[k], "local": os.path.join(self.local, f"node{k}-cache"), **extra}

    def who(self, k: int) -> str:
        return f"node{k + 1} ({self.mounts[k]})"

    def start_sweepers(self, gen: str, tag: str, max_s: float) -> tuple[list[subprocess.Popen[str]], str]:
        stop = self.tmp(f"{tag}.stop")
        procs = []
        ready = []
        for k in range(len(self.nodes)):
            r = self.tmp(f"{tag}.ready{k}")
            ready.append(r)
            cfg = self.node_cfg(
                k, gen=gen, n=self.n, stop=stop, ready=r, max_s=max_s, settle_s=self.neg_wait_s, pause_s=0.05
            )
            procs.append(spawn("sweep", cfg))
        deadline = time.monotonic() + 120
        while not all(os.path.exists(r) for r in ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        return procs, stop

    def stop_sweepers(
        self, procs: list[subprocess.Popen[str]], stop: str, failures: list[str], what: str
    ) -> Iterator[tuple[int, Result, Result]]:
        """Stop the sweepers; each node's answer, as ``(k, answer, row)``: the row its figures both scenarios show."""
        with open(stop, "w"):
            pass
        for k, proc in enumerate(procs):
            out = collect_worker(proc, 600, failures, self.who(k))
            if not out:
                continue
            if out["visible_at_end"] != self.n:
                failures.append(
                    f"{self.who(k)}: {self.n - out['visible_at_end']} {what} keys still missing after "
                    f"{self.neg_wait_s:.0f} s"
                )
            yield k, out, {
                "node": self.who(k), "reads": out["reads"], "hits": out["hits"], "misses": out["misses"],
                "store_errors": out["store_errors"], "visible_right_after": out.get("visible_after_stop"),
                "all_visible_after_s": out.get("all_visible_after_stop_s"),
                "negative_lookups_cached": self.caches_negative_lookups(k),
            }  # fmt: skip


def scenario_publish(env: Env) -> Result:
    """Nodes read every key in a loop (missing at first) while the publisher publishes batches."""
    from cuda_program_cas import publish

    failures: list[str] = []
    gen = "publish"
    per = env.n // env.batches
    sources = []
    for b in range(env.batches):
        src = env.tmp("publish-src", f"batch{b}")
        make_source(src, gen, range(b * per, env.n if b == env.batches - 1 else (b + 1) * per))
        sources.append(src)
    seed = env.tmp("publish-src", "seed")
    make_source(seed, "seed", [0])
    publish([seed], env.publisher)  # the store exists before nodes start, as on a cluster
    procs, stop = env.start_sweepers(gen, "publish", max_s=600)
    time.sleep(1.0)  # every node misses every key at least once first (negative lookups cached)
    published_at: list[float] = []
    t0 = time.monotonic()
    published = 0
    for src in sources:
        report = publish([src], env.publisher)
        published_at.append(time.monotonic())
        published += report.published
        if report.problems:
            failures.append(f"publish reported problems: {report.as_dict()}")
        time.sleep(0.3)
    publish_s = time.monotonic() - t0
    if published != env.n:
        failures.append(f"published {published} keys, expected {env.n}")
    figures: Result = {"keys": env.n, "batches": env.batches, "publish_s": round(publish_s, 2)}
    nodes = []
    for k, out, row in env.stop_sweepers(procs, stop, failures, "published"):
        lags = []
        for key, seen in out["first_seen"].items():
            b = min(int(key) // per, env.batches - 1)
            lags.append(max(0.0, seen - published_at[b]))
        if out["lost_after_seen"]:
            failures.append(f"{env.who(k)}: {out['lost_after_seen']} keys missed after they had been read")
        if out["store_errors"]:
            failures.append(
                f"{env.who(k)}: {out['store_errors']} store errors with no file removed: {out['miss_reasons']}"
            )
        if not env.caches_negative_lookups(k) and out.get("visible_after_stop") != env.n:
            failures.append(
                f"CLAIM: {env.who(k)}: {out.get('visible_after_stop')} of {env.n} keys visible right after "
                "the last batch, with no negative lookup cached"
            )
        max_lag = round(max(lags), 2) if lags else None
        nodes.append(
            {**row, "sweeps": out["sweeps"], "max_lag_s": max_lag, "lag_over_1s": sum(lag > 1 for lag in lags)}
        )
    figures["nodes"] = nodes
    return {"failures": failures, "figures": figures}


def scenario_collect(env: Env) -> Result:
    """Nodes read while the collector empties the store in two steps and the publisher refills it."""
    from cuda_program_cas import collect, publish

    failures: list[str] = []
    gen = "publish"  # the entries published by the previous scenario (published again if missing)
    src = env.tmp("collect-src")
    make_source(src, gen, range(env.n))
    publish([src], env.publisher)
    held = hold_open_blobs(env, 4)
    procs, stop = env.start_sweepers(gen, "collect", max_s=600)
    time.sleep(1.0)
    steps = []
    from cuda_program_cas import CacheStore

    # First as a shared store is collected (manifests go; their blobs stay for the grace period),
    # then everything at once with no grace, blobs under the readers' feet: stale handles.
    steps_plan = (("half, as a shared store", 2, True, 3600.0), ("all, no grace, blobs too", 0, False, 0.0))
    removing: list[float] = []  # when files began to vanish under the readers, and when that ended
    for label, fraction, shared, grace in steps_plan:
        size = CacheStore(env.publisher).inner.snapshot().stored_bytes // fraction if fraction else 0
        t0 = time.monotonic()
        removing = removing or [t0]
        report = collect(env.publisher, grace_s=grace, max_size=size, shared=shared)
        steps.append({
            "step": f"collect {label}", "s": round(time.monotonic() - t0, 2),
            "entries_removed": report.entries_removed, "blobs_removed": report.blobs_removed,
            "kept_changed": report.kept_changed, "problems": report.problem_count,
        })  # fmt: skip
        if report.problem_count:
            failures.append(f"collect {label}: problems {report.problems[:5]}")
        time.sleep(1.0)
    stale = read_held(held)
    t0 = time.monotonic()
    removing.append(t0)
    report = publish([src], env.publisher)
    steps.append({"step": "publish again", "s": round(time.monotonic() - t0, 2), "published": report.published})
    time.sleep(1.0)
    nodes = []
    for _k, out, row in env.stop_sweepers(procs, stop, failures, "republished"):
        nodes.append({**row, "miss_reasons": out["miss_reasons"], **errors_in_window(out["error_events"], removing)})
    failures += check_collect(nodes, env.n)
    figures = {"keys": env.n, "steps": steps, "held_open_reads": stale, "nodes": nodes}
    return {"failures": failures, "figures": figures}


#: The miss reasons a store error may have while the collector removes files under a node: the
#: file of a name the node had looked up is gone on the server (ESTALE), or went between steps.
STALE_REASONS = ("cannot read (ESTALE)", "cannot read (ENOENT)")


def errors_in_window(events: list[list[Any]], window: list[float]) -> Result:
    """Split a node's store errors (``[start, end, reason]`` of each lookup that met one) into those
    that overlap ``window`` (``[start, end]``: while files vanished under the readers) and the others."""
    inside = [e for e in events if e[1] >= window[0] and e[0] <= window[1]]
    outside = [e for e in events if not (e[1] >= window[0] and e[0] <= window[1])]
    reasons: dict[str, int] = {}
    for e in inside:
        reasons[e[2]] = reasons.get(e[2], 0) + 1
    return {
        "errors_while_removing": len(inside),
        "error_reasons_while_removing": reasons,
        "errors_otherwise": [f"{e[2]} at {e[0] - window[0]:+.1f} s" for e in outside[:5]],
        "errors_otherwise_count": len(outside),
    }


def check_collect(nodes: list[Result], n: int) -> list[str]:
    """What docs/nfs-harness.md says of a collection under the readers.

    A store error is a lookup that met a file the collector removed (a stale NFS file handle):
    a miss, never wrong bytes. It happens only while files vanish, with a stale reason, and each
    is counted. A node that caches no negative lookups sees every republished key at once.
    """
    failures = []
    for node in nodes:
        who = node["node"]
        counted = node["errors_while_removing"] + node["errors_otherwise_count"]
        if counted != node["store_errors"]:
            failures.append(f"{who}: {node['store_errors']} store errors, {counted} of them seen by the lookups")
        if node["errors_otherwise_count"]:
            failures.append(
                f"CLAIM: {who}: {node['errors_otherwise_count']} store errors while no file was being removed: "
                f"{node['errors_otherwise']}"
            )
        odd = {r: c for r, c in node["error_reasons_while_removing"].items() if r not in STALE_REASONS}
        if odd:
            failures.append(f"CLAIM: {who}: store errors other than stale files while collecting: {odd}")
        if not node["negative_lookups_cached"] and node["visible_right_after"] != n:
            failures.append(
                f"CLAIM: {who}: {node['visible_right_after']} of {n} republished keys visible right after, "
                "with no negative lookup cached"
            )
    return failures


def hold_open_blobs(env: Env, per_node: int) -> list[tuple[str, int, str]]:
    """Open a few blobs on every node mount (as a reader between open and read would)."""
    blob_root = os.path.join(env.publisher, "blobs")
    names = []
    for shard in sorted(os.listdir(blob_root))[:per_node]:
        files = os.listdir(os.path.join(blob_root, shard))
        if files:
            names.append(os.path.join("blobs", shard, files[0]))
    held = []
    for k, node in enumerate(env.nodes):
        for name in names:
            held.append((env.who(k), os.open(os.path.join(node, name), os.O_RDONLY), name))
    return held


def read_held(held: list[tuple[str, int, str]]) -> Result:
    """Read each held descriptor after its file was collected: what the NFS client answers."""
    outcomes: dict[str, dict[str, int]] = {}
    for who, fd, _name in held:
        try:
            os.fstat(fd)
            os.read(fd, 1 << 20)
            what = "read ok"
        except OSError as exc:
            what = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        finally:
            os.close(fd)
        node = outcomes.setdefault(who, {})
        node[what] = node.get(what, 0) + 1
    return outcomes


def scenario_compile(env: Env) -> Result:
    """The publisher compiles with NVRTC and publishes; each node's Program.compile must hit."""
    from cuda_program_cas import ContentAddressedProgramCache, publish

    failures: list[str] = []
    src = env.tmp("compile-src")
    with ContentAddressedProgramCache(src) as cache:
        times, digests = compile_all(cache)
    report = publish([src], env.publisher)
    procs = [spawn("compile", env.node_cfg(k)) for k in range(len(env.nodes))]
    nodes = []
    for k, proc in enumerate(procs):
        out = collect_worker(proc, 900, failures, env.who(k))
        if not out:
            continue
        if out["digests"] != digests:
            failures.append(f"{env.who(k)}: WRONG BYTES: compiled objects differ from the publisher's")
        if out["nvrtc_compiles"] or out["misses"] or out["shared_hits"] != len(COMPILES):
            failures.append(
                f"{env.who(k)}: expected {len(COMPILES)} shared hits and no compile, got "
                f"{out['shared_hits']} shared hits, {out['misses']} misses, {out['nvrtc_compiles']} NVRTC compiles"
            )
        nodes.append({
            "node": env.who(k), "hit_ms": out["times_ms"], "local_hit_ms": out["second_times_ms"],
            "shared_hits": out["shared_hits"], "nvrtc_compiles": out["nvrtc_compiles"],
        })  # fmt: skip
    figures = {"kernels": [f"{n} {t} {a}" for n, t, a in COMPILES], "publisher_compile_ms": times,
               "published": report.published, "nodes": nodes}  # fmt: skip
    return {"failures": failures, "figures": figures}


def scenario_visibility(env: Env) -> Result:
    """Close-to-open: a key published on the writable mount is at once visible on the others,
    unless that node missed it before (a cached negative lookup): then measure how long it lags."""
    from cuda_program_cas import publish

    failures: list[str] = []
    servers = [spawn("serve", env.node_cfg(k), stdin=subprocess.PIPE) for k in range(len(env.nodes))]

    def ask_node(k: int, gen: str, i: int) -> str:
        answer = ask(servers[k], gen, i)
        if answer not in ("hit", "miss"):
            failures.append(f"{env.who(k)}: {gen}/{i}: {answer or 'worker died'}")
        return answer

    m = 8 if env.quick else 20
    fresh_missing = [0] * len(servers)
    for i in range(m):
        src = env.tmp("vis-src", f"fresh{i}")
        make_source(src, "fresh", [i])
        publish([src], env.publisher)
        for k in range(len(servers)):
            if ask_node(k, "fresh", i) != "hit":
                fresh_missing[k] += 1
    for k, count in enumerate(fresh_missing):
        if count:
            failures.append(f"{env.who(k)}: {count} of {m} entries not visible right after publishing (close-to-open)")
    # Negative lookups first: each node misses the keys, then they are published.
    for i in range(m):
        for k in range(len(servers)):
            ask_node(k, "missed", i)
    src = env.tmp("vis-src", "missed")
    make_source(src, "missed", range(m))
    publish([src], env.publisher)
    t_pub = time.monotonic()
    pending = {(k, i) for k in range(len(servers)) for i in range(m)}
    seen_after: dict[tuple[int, int], float] = {}
    immediate = [0] * len(servers)
    first = True
    while pending and time.monotonic() - t_pub < env.neg_wait_s:
        for k, i in sorted(pending):
            if ask_node(k, "missed", i) == "hit":
                seen_after[(k, i)] = time.monotonic() - t_pub
                immediate[k] += first
        pending -= set(seen_after)
        first = False
        if pending:
            time.sleep(0.5)
    nodes = []
    for k in range(len(servers)):
        lags = [v for (kk, _i), v in seen_after.items() if kk == k]
        nodes.append({
            "node": env.who(k), "fresh_visible_at_once": m - fresh_missing[k],
            "missed_then_published_visible_at_once": immediate[k],
            "missed_then_published_max_lag_s": round(max(lags), 1) if lags else None,
            "still_missing_after_wait": sum(1 for kk, _i in pending if kk == k),
            "negative_lookups_cached": env.caches_negative_lookups(k),
        })  # fmt: skip
    failures += check_visibility(nodes, m)
    stop_servers(env, servers, failures)
    return {"failures": failures, "figures": {"entries": m, "wait_limit_s": env.neg_wait_s, "nodes": nodes}}


def check_visibility(nodes: list[Result], m: int) -> list[str]:
    """What docs/nfs-harness.md says of entries a node had missed before they were published: each
    becomes visible within the wait (the directory attribute cache time, 60 s at most by default),
    and at once on a node that caches no negative lookups."""
    failures = []
    for node in nodes:
        if node["still_missing_after_wait"]:
            failures.append(
                f"CLAIM: {node['node']}: {node['still_missing_after_wait']} of {m} entries it had missed "
                "still missing after the wait"
            )
        if not node["negative_lookups_cached"] and node["missed_then_published_visible_at_once"] != m:
            failures.append(
                f"CLAIM: {node['node']}: {node['missed_then_published_visible_at_once']} of {m} entries it had "
                "missed visible at once, with no negative lookup cached"
            )
    return failures


def _files_and_inodes(root: str) -> tuple[int, int]:
    files = dirs = 0
    for _dirpath, dirnames, filenames in os.walk(root):
        files += len(filenames)
        dirs += len(dirnames)
    return files, files + dirs + 1


#: What docs/nfs.md says of loose and packed stores, checked by every run: a run that breaks one
#: fails. These are bounds with a margin over the measured figures, which vary from run to run.
#: The operation counts are checked only over NFS (they come from /proc/self/mountstats).
PACKED_CLAIMS: dict[str, float] = {
    # NFS operations per first hit in a packed store (all of a cold job's, over its hits), every node.
    "packed_ops_per_hit_max": 1.0,
    # A loose store costs every node at least this many times the operations of a packed one.
    "loose_over_packed_min": 5.0,
    # Files in the packed store: layout.json, CACHEDIR.TAG, the pack, packs/summary, packs/list, keys.
    "packed_files": 6,
    # Files in the loose store besides one manifest a key and one blob per distinct content (layout.json,
    # CACHEDIR.TAG, keys: the key list publish writes).
    "loose_extra_files": 3,
    # Seconds until a new packed generation is visible on every node, each having missed its keys.
    "packed_visible_max_s": 10.0,
    # The same for a loose store, on a node that caches no negative lookups (lookupcache=positive).
    "loose_visible_uncached_max_s": 5.0,
}


def scenario_packed(env: Env) -> Result:
    """Loose against packed stores of the same entries: NFS operations per first hit and per cold job,
    files and inodes in the store, and how soon a new generation is visible on every node."""
    from cuda_program_cas import publish

    failures: list[str] = []
    n = env.n // 4 if env.quick else 100
    gen = "packcmp"
    src = env.tmp("packed-src")
    make_source(src, gen, range(n))
    roots = {"loose": os.path.join(os.path.dirname(env.publisher), "loose"),
             "packed": os.path.join(os.path.dirname(env.publisher), "packed")}  # fmt: skip
    for kind, root in roots.items():
        shutil.rmtree(root, ignore_errors=True)
        publish([src], root, pack=kind == "packed")
    figures: Result = {"entries": n, "claims": PACKED_CLAIMS, "store": {}, "per_node": [], "visibility": []}
    for kind, root in roots.items():
        files, inodes = _files_and_inodes(root)
        figures["store"][kind] = {"files": files, "inodes": inodes}
    figures["store"]["distinct_contents"] = len({value_of(gen, i) for i in range(n)})
    for k in range(len(env.mounts)):
        row: Result = {"node": env.who(k)}
        for kind, root in roots.items():
            # Each cold job on a mount of its own: no other phase's late operations in its count.
            mount = env.fresh_mount(k, kind)
            try:
                cfg = {"store": os.path.join(mount, os.path.basename(root)), "mount": mount, "gen": gen, "n": n,
                       "local": os.path.join(env.local, f"firsthits-{kind}-{k}")}  # fmt: skip
                out = collect_worker(spawn("firsthits", cfg), 300, failures, f"{env.who(k)} {kind}")
            finally:
                env.drop_mount(mount)
            if out.get("misses"):
                failures.append(f"{env.who(k)} {kind}: {out['misses']} of {n} first lookups missed")
            ops = out.get("ops", {})
            row["nfs"] = bool(out.get("nfs"))
            row[f"{kind}_ops_per_hit"] = round(sum(ops.values()) / n, 2)
            row[f"{kind}_ops_first"] = sum(out.get("ops_first", {}).values())
            row[f"{kind}_ops_rest"] = sum(out.get("ops_rest", {}).values())
            row[f"{kind}_ops"] = ops
            row[f"{kind}_ms_per_hit"] = round(1000 * out.get("seconds", 0) / n, 3)
        figures["per_node"].append(row)
    # A new generation: published while long-lived node processes already read the store.
    for kind, root in roots.items():
        servers = [spawn("serve", {**env.node_cfg(k), "store": os.path.join(m, os.path.basename(root))},
                         stdin=subprocess.PIPE) for k, m in enumerate(env.mounts)]  # fmt: skip
        m = 8
        for k in range(len(servers)):
            for i in range(m):
                if ask(servers[k], "newgen", i) == "bad":
                    failures.append(f"{env.who(k)} {kind}: bad answer before publishing")
        nsrc = env.tmp(f"newgen-{kind}")
        make_source(nsrc, "newgen", range(m))
        publish([nsrc], root, pack=kind == "packed")
        t_pub = time.monotonic()
        pending = {(k, i) for k in range(len(servers)) for i in range(m)}
        lag: dict[int, float] = {}
        while pending and time.monotonic() - t_pub < env.neg_wait_s:
            for k, i in sorted(pending):
                answer = ask(servers[k], "newgen", i)
                if answer == "hit":
                    pending.discard((k, i))
                    lag[k] = time.monotonic() - t_pub
                elif answer != "miss":
                    failures.append(f"{env.who(k)} {kind}: {answer or 'worker died'}")
                    pending.discard((k, i))
            if pending:
                time.sleep(0.25)
        stop_servers(env, servers, failures)
        for k in range(len(servers)):
            figures["visibility"].append({
                "store": kind, "node": env.who(k), "all_visible_after_s": round(lag.get(k, -1), 2),
                "still_missing": sum(1 for kk, _ in pending if kk == k),
                "negative_lookups_cached": env.caches_negative_lookups(k),
            })  # fmt: skip
    figures["model_inputs"] = model_inputs(figures)
    failures += check_packed(figures)
    return {"failures": failures, "figures": figures}


def model_inputs(figures: Result) -> dict[str, dict[str, float]]:
    """Per-node inputs of the cold-start arithmetic in docs/nfs.md, from the node whose cold job cost the most.

    ``ops_per_hit``: the operations of the hits after the first, per hit. ``ops_fixed``: what
    the first hit cost beyond that (opening the store). ``ops_fixed + n * ops_per_hit`` is the job.
    """
    n = figures["entries"]
    out: dict[str, dict[str, float]] = {}
    for kind in ("loose", "packed"):
        rows = [r for r in figures["per_node"] if f"{kind}_ops_first" in r]
        if not rows or n < 2:
            out[kind] = {"ops_fixed": 0.0, "ops_per_hit": 0.0}
            continue
        worst = max(rows, key=lambda r: r[f"{kind}_ops_first"] + r[f"{kind}_ops_rest"])
        per_hit = worst[f"{kind}_ops_rest"] / (n - 1)
        out[kind] = {"ops_fixed": round(worst[f"{kind}_ops_first"] - per_hit, 2), "ops_per_hit": round(per_hit, 3)}
    return out


def check_packed(figures: Result) -> list[str]:
    """The claims of :data:`PACKED_CLAIMS` against one run's figures: one line per broken claim."""
    claims = figures["claims"]
    failures = []
    store = figures["store"]
    loose_files = figures["entries"] + store["distinct_contents"] + claims["loose_extra_files"]
    if store["loose"]["files"] != loose_files:
        failures.append(f"CLAIM: the loose store holds {store['loose']['files']} files, expected {loose_files}")
    if store["packed"]["files"] != claims["packed_files"]:
        failures.append(
            f"CLAIM: the packed store holds {store['packed']['files']} files, expected {claims['packed_files']:g}"
        )
    for row in figures["per_node"]:
        if not row.get("nfs"):
            continue  # no operation counts off NFS
        packed, loose = row["packed_ops_per_hit"], row["loose_ops_per_hit"]
        if packed > claims["packed_ops_per_hit_max"]:
            failures.append(
                f"CLAIM: {row['node']}: {packed} NFS operations per packed first hit, "
                f"more than {claims['packed_ops_per_hit_max']:g}: {row['packed_ops']}"
            )
        if loose < claims["loose_over_packed_min"] * packed:
            failures.append(
                f"CLAIM: {row['node']}: loose {loose} against packed {packed} NFS operations per first hit, "
                f"less than {claims['loose_over_packed_min']:g} times"
            )
    for vis in figures["visibility"]:
        who = f"{vis['node']} {vis['store']}"
        if vis["still_missing"]:
            failures.append(f"CLAIM: {who}: {vis['still_missing']} keys of a new generation never visible")
            continue
        if vis["store"] == "packed":
            bound = claims["packed_visible_max_s"]
        elif not vis["negative_lookups_cached"]:
            bound = claims["loose_visible_uncached_max_s"]
        else:
            continue  # up to the directory attribute cache time (acdirmax): reported, not bounded
        if vis["all_visible_after_s"] > bound:
            failures.append(
                f"CLAIM: {who}: a new generation visible after {vis['all_visible_after_s']} s, over {bound:g} s"
            )
    return failures


def scenario_claims(env: Env) -> Result:
    """Claims on a cache that sits on NFS (tools/nfs/claim_scenario.py): one mount, several, a holder
    killed, a dead node, node-local locks, no lock daemon."""
    import claim_scenario

    return claim_scenario.run(env)


SCENARIOS: dict[str, Callable[[Env], Result]] = {
    "publish while nodes read": scenario_publish,
    "collect while nodes read": scenario_collect,
    "Program.compile on nodes hits the shared store": scenario_compile,
    "close-to-open visibility": scenario_visibility,
    "loose against packed stores": scenario_packed,
    "claims on an NFS-mounted cache": scenario_claims,
}


def run_all(args: argparse.Namespace) -> Result:
    env = Env(args)
    result: Result = {
        "kernel": os.uname().release,
        "mounts": mount_options([args.publisher, *args.node]),
        "quick": args.quick,
        "scenarios": [],
    }
    t_all = time.monotonic()
    for name, fn in SCENARIOS.items():
        if args.only and not any(o in name for o in args.only):
            continue
        print(f"nfsh: scenario: {name} ...", flush=True)
        t0 = time.monotonic()
        try:
            out = fn(env)
        except Exception:
            out = {"failures": [f"unexpected exception in the scenario: {traceback.format_exc()}"], "figures": {}}
        out.update(name=name, ok=not out["failures"], seconds=round(time.monotonic() - t0, 1))
        print(f"nfsh: scenario: {name}: {'ok' if out['ok'] else 'FAILED'} in {out['seconds']} s", flush=True)
        result["scenarios"].append(out)
    result["seconds"] = round(time.monotonic() - t_all, 1)
    # Against the VM's time on the host (the harness): under emulation on a busy host the guest's
    # clock may run slow, and every figure in seconds is the guest's.
    with contextlib.suppress(OSError, ValueError), open("/proc/uptime") as fh:
        result["guest_uptime_s"] = float(fh.read().split()[0])
    result["ok"] = all(s["ok"] for s in result["scenarios"]) and bool(result["scenarios"])
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = worker_spec(argv)
    if spec is not None:
        return worker_main(spec)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--publisher", required=True, help="the writable mount (the store is <mount>/store)")
    parser.add_argument("--node", action="append", required=True, help="a read-only mount, one per node")
    parser.add_argument("--local", required=True, help="a local directory for the nodes' own caches")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="fewer keys, shorter waits")
    parser.add_argument("--keys", type=int, help="keys per scenario (default 400, 48 with --quick)")
    parser.add_argument("--only", action="append", help="run only scenarios whose name contains this")
    parser.add_argument("--claim-case", action="append", help="claims: run only cases whose label contains this")
    parser.add_argument("--nfs-export", help="HOST:/PATH the nodes mount: count each cold job on a fresh mount")
    parser.add_argument("--node-options", action="append", help="mount options of each --node, in order")
    args = parser.parse_args(argv)
    shutil.rmtree(os.path.join(args.publisher, "store"), ignore_errors=True)
    result = run_all(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    print(format_summary(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
