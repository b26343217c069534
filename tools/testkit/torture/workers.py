"""The worker processes of the mixed, crash and shared loads, and how the parent starts and hears from them."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

from cuda_program_cas import CacheStore, publish
from testkit import TOOLS
from testkit.workers import spawn_worker

from .common import Report, as_key, check_hit, collect_once, content, pick, quiet, unexpected

#: The front whose ``_worker`` mode runs :func:`worker` in a fresh interpreter.
TOOL = os.path.join(TOOLS, "torture.py")

# -- worker processes ----------------------------------------------------------------


def worker(config: dict[str, Any]) -> int:
    """One process of the mixed or crash load; writes its report to ``config['out']``."""
    quiet()
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
                    store.inner.enforce_cap()
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


def spawn(config: dict[str, Any], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Start one worker: tools/torture.py re-run in its ``_worker`` mode, which calls :func:`worker`.

    The operator's ``CUDA_PROGRAM_CAS_*`` settings stay (``CUDA_PROGRAM_CAS_LOG`` for a run under the microscope).
    """
    return spawn_worker(TOOL, config, keep_settings=True, **kwargs)


def worker_report(rep: Report, proc: subprocess.Popen[bytes], out: str, timeout: float) -> dict[str, Any] | None:
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


def merge(rep: Report, part: dict[str, Any]) -> None:
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
