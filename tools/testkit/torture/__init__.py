"""The torture scenarios and the cache checker: importable test code.

Every key maps to content fixed by the key alone (blake3 of the key's seed, expanded to a
size fixed by the seed), so every hit anywhere is checked byte for byte. Each scenario
returns a :class:`Report` of figures; it fails on any wrong byte returned, any unexpected
exception, or a cache left unclean.

``tests/test_torture.py`` runs each scenario briefly; ``tools/torture.py`` is the command
line for long runs (its ``_worker`` mode runs :func:`worker`, the processes of the loads).
"""

from __future__ import annotations

from .checker import PROBLEMS, inspect_cache, verify_and_repair
from .common import (
    DEFAULT_CAP,
    N_KEYS,
    N_SEEDS,
    Report,
    check_hit,
    content,
    content_of_seed,
    expected_digests,
    key_name,
    quiet,
)
from .faults import run_corruption, run_unreadable
from .fulldisk import run_full_disk
from .load import run_crashes, run_mixed, run_shared
from .paths import merge_reports, run_bad_inputs, run_hostile_paths, run_paths
from .workers import worker

__all__ = [
    "DEFAULT_CAP",
    "N_KEYS",
    "N_SEEDS",
    "PROBLEMS",
    "Report",
    "check_hit",
    "content",
    "content_of_seed",
    "expected_digests",
    "inspect_cache",
    "key_name",
    "merge_reports",
    "quiet",
    "run_bad_inputs",
    "run_corruption",
    "run_crashes",
    "run_full_disk",
    "run_hostile_paths",
    "run_mixed",
    "run_paths",
    "run_shared",
    "run_unreadable",
    "verify_and_repair",
    "worker",
]
