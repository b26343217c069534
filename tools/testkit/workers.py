"""Work in a fresh interpreter: the one worker harness of the tools and the tests.

A script that needs a fresh interpreter re-runs itself as ``python SCRIPT _worker '<JSON spec>'``
(:func:`spawn_worker`); its ``main`` finds the spec with :func:`worker_spec`, does the work,
and says its answer as the last line of stdout, one JSON object (:func:`answer`). The parent
waits with :func:`collect` (a timeout, then the child is killed) or :func:`run_worker` (which
raises with the end of the child's stderr when it fails). The child's ``PYTHONPATH`` puts the
checkout and ``tools/`` first (:func:`child_env`), so it imports this checkout's package and
``testkit`` wherever it runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from testkit import REPO, TOOLS

__all__ = [
    "WORKER",
    "Finished",
    "answer",
    "child_env",
    "collect",
    "read_answer",
    "run_worker",
    "spawn_worker",
    "worker_spec",
]

#: The first argument that makes a script a worker.
WORKER = "_worker"


def child_env(*, keep_settings: bool = False) -> dict[str, str]:
    """This environment, the checkout and ``tools/`` first on ``PYTHONPATH``; without ``keep_settings`` the
    cache's ``CUDA_PROGRAM_CAS_*`` variables dropped, so an operator's do not change what a benchmark measures."""
    out = {k: v for k, v in os.environ.items() if keep_settings or not k.startswith("CUDA_PROGRAM_CAS_")}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, TOOLS, out.get("PYTHONPATH")) if p)
    return out


def worker_spec(argv: list[str]) -> dict[str, Any] | None:
    """The spec when ``argv`` makes this process a worker (``_worker '<JSON>'``), else None."""
    if argv[:1] != [WORKER]:
        return None
    spec: dict[str, Any] = json.loads(argv[1])
    return spec


def answer(out: dict[str, Any]) -> None:
    """Say a worker's answer: one JSON object, the last line of stdout."""
    print(json.dumps(out), flush=True)


def read_answer(stdout: str) -> dict[str, Any] | None:
    """The answer on the last line of ``stdout``; None when there is none."""
    lines = stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return out if isinstance(out, dict) else None


def spawn_worker(
    script: str,
    spec: dict[str, Any],
    *,
    keep_settings: bool = False,
    settings: dict[str, str] | None = None,
    **popen: Any,
) -> subprocess.Popen[Any]:
    """Start ``script`` as a worker for ``spec``, with ``settings`` besides the variables kept; ``popen`` to Popen."""
    env = child_env(keep_settings=keep_settings)
    env.update(settings or {})
    return subprocess.Popen([sys.executable, os.path.abspath(script), WORKER, json.dumps(spec)], env=env, **popen)


@dataclass
class Finished:
    """A worker that ended: its answer (None when it said none), exit status and stderr."""

    answer: dict[str, Any] | None
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def failure(self) -> str:
        """Why the worker failed, one line; empty when it answered and exited 0."""
        if self.timed_out:
            return f"did not finish in time: {self.stderr.strip()[-800:]}"
        if self.answer is None:
            return f"exited {self.returncode} without an answer: {self.stderr.strip()[-1500:]}"
        if self.returncode != 0:
            return f"exit status {self.returncode}: {self.stderr.strip()[-800:]}"
        return ""


def collect(proc: subprocess.Popen[Any], timeout: float) -> Finished:
    """Wait for a worker started with stdout and stderr as text pipes; past ``timeout`` it is killed."""
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        stdout, stderr = proc.communicate()
    return Finished(read_answer(stdout or ""), proc.returncode, stdout or "", stderr or "", timed_out)


def run_worker(
    script: str,
    spec: dict[str, Any],
    timeout: float = 300,
    *,
    settings: dict[str, str] | None = None,
    keep_settings: bool = False,
) -> dict[str, Any]:
    """Run ``script`` as a worker for ``spec`` and wait; its answer, or RuntimeError with the end of its stderr."""
    popen: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    proc = spawn_worker(script, spec, keep_settings=keep_settings, settings=settings, **popen)
    done = collect(proc, timeout)
    if done.failure or done.answer is None:
        raise RuntimeError(f"worker {spec.get('task', script)} failed: {done.failure}")
    return done.answer
