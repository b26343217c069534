"""The torture scenarios and the cache checker (``tools/torture.py`` is their command line).

Each scenario returns a :class:`Report` of figures; ``tests/test_torture.py`` runs each briefly.
"""

from __future__ import annotations

from .checker import inspect_cache
from .common import (
    DEFAULT_CAP,
    N_SEEDS,
    Report,
    check_hit,
    content,
    content_of_seed,
    expected_digests,
    key_name,
)
from .faults import run_corruption, run_unreadable
from .fulldisk import run_full_disk
from .load import run_crashes, run_mixed, run_shared
from .paths import merge_reports, run_bad_inputs, run_hostile_paths, run_paths
from .workers import worker

__all__ = [
    "DEFAULT_CAP",
    "N_SEEDS",
    "Report",
    "check_hit",
    "content",
    "content_of_seed",
    "expected_digests",
    "inspect_cache",
    "key_name",
    "merge_reports",
    "run_bad_inputs",
    "run_corruption",
    "run_crashes",
    "run_full_disk",
    "run_hostile_paths",
    "run_mixed",
    "run_paths",
    "run_shared",
    "run_unreadable",
    "worker",
]
