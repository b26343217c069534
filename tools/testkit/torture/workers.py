"""The worker processes of the mixed, crash and shared loads, and how the parent starts and hears from them."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import time
from typing import Any

from cuda_program_cas import CacheStore, publish
from testkit import TOOLS
from testkit.workers import answer, collect, spawn_worker

from .common import Report, as_key, check_hit, collect_once, content, pick, quiet, unexpected

#: The front whose ``_worker`` mode runs :func:`worker` in a fresh interpreter.
TOOL = os.path.join(TOOLS, "torture.py")

# -- worker processes ----------------------------------------------------------------


def worker(config: dict[str, Any]) -> int:
    """One process of a load; its report is its answer (``testkit.workers``)."""
    quiet()
    rng = random.Random(config["seed"])
    rep = Report(config["mode"], processes=1)
    if config["mode"] in ("node", "publisher", "collector"):
        _shared_load(config, rep, rng)
    else:
        _load(config, rep, rng)
    rep.seconds = config["seconds"]
    answer(rep.as_dict())
    return 0 if rep.ok else 1


def _load(config: dict[str, Any], rep: Report, rng: random.Random) -> None:
    """The mixed load, or a writer of the crash load (killed: it never answers)."""
    root, cap = config["root"], config["cap"]
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


def _shared_load(config: dict[str, Any], rep: Report, rng: random.Random) -> None:
    """A node reading through a shared store, the publisher, or the shared store's collector."""
    mode = config["mode"]
    deadline = time.monotonic() + config["seconds"]
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
        rep.notes.append(f"node {config['node']}: {store.stats().shared_hits} shared hits")


def spawn(config: dict[str, Any], **kwargs: Any) -> subprocess.Popen[str]:
    """Start one worker: tools/torture.py re-run in its ``_worker`` mode, which calls :func:`worker`.

    The operator's ``CUDA_PROGRAM_CAS_*`` settings stay (``CUDA_PROGRAM_CAS_LOG`` for a run under the microscope).
    """
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return spawn_worker(TOOL, config, keep_settings=True, **{**pipes, **kwargs})


def gather(rep: Report, procs: list[subprocess.Popen[str]], timeout: float) -> None:
    """Add each worker's report to ``rep``; a hang, a missing report or a non-zero exit fails the run."""
    for proc in procs:
        done = collect(proc, timeout)
        part = done.answer
        if done.timed_out or part is None:
            rep.fail(f"worker {proc.pid}: {done.failure}")
            continue
        if done.returncode != 0 and rep.ok:
            rep.fail(f"worker {proc.pid} exited {done.returncode}")
        for name in ("operations", "hits", "misses", "writes", "dropped_writes", "collections", "wrong_bytes"):
            setattr(rep, name, getattr(rep, name) + part[name])
        rep.exceptions += part["exceptions"]
        for message in part["failures"]:
            rep.fail(message)
        rep.notes.extend(part["notes"])
