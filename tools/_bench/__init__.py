"""The workloads of tools/bench.py, one module per group, and the report they make.

Each workload is a function ``(Config, directory) -> Result`` that measures both caches in the
same run; :data:`RUNNERS` names them in the order a run takes them.
"""

from __future__ import annotations

from collections.abc import Callable

from .common import Config, Result
from .compiles import w_compile_hit, w_frontdoor
from .footprint import w_footprint
from .hits import w_hit_first, w_hit_repeat, worker_first_hit
from .processes import w_cold_start, w_processes, w_small_job
from .report import machine_info, render, tally
from .writes import w_cap_writes, w_store, w_writeback

RUNNERS: dict[str, Callable[[Config, str], Result]] = {
    "hit_first": w_hit_first,
    "hit_repeat": w_hit_repeat,
    "compile_hit": w_compile_hit,
    "frontdoor": w_frontdoor,
    "store": w_store,
    "writeback": w_writeback,
    "cap_writes": w_cap_writes,
    "footprint": w_footprint,
    "processes": w_processes,
    "cold_start": w_cold_start,
    "small_job": w_small_job,
}
#: The workloads, in the order a run takes them.
WORKLOADS = tuple(RUNNERS)
#: What a ``_worker`` spec's ``task`` names: the part of a workload run in a fresh interpreter.
WORKER_TASKS = {"first_hit": worker_first_hit}

__all__ = ["RUNNERS", "WORKER_TASKS", "WORKLOADS", "Config", "machine_info", "render", "tally"]
