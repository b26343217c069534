"""What every workload uses: the configuration, the two caches, keys and payloads, timing, and results."""

from __future__ import annotations

import gc
import hashlib
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

#: tools/bench.py: its ``_worker`` mode runs a workload's part in a fresh interpreter.
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench.py")
KINDS = ("ours", "filestream")
KB = 1024
perf_ns = time.perf_counter_ns


# -- configuration ---------------------------------------------------------------------


@dataclass
class Config:
    quick: bool
    hit_sizes: tuple[int, ...] = (4 * KB, 8 * KB, 32 * KB, 160 * KB)
    first_rounds: int = 6  # fresh processes per cache
    first_keys: int = 100  # keys per size per process
    repeat_keys: int = 50  # keys per size
    repeat_passes: int = 40
    beyond_keys: int = 300  # 160 KB each: 48 MB, beyond ours' 32 MiB of held bytes
    beyond_passes: int = 6
    compile_hits: int = 300
    store_sizes: tuple[int, ...] = (8 * KB, 160 * KB)
    store_writes: int = 300
    cap_entry_size: int = 4 * KB
    cap_sizes: tuple[int, ...] = (10_000, 50_000)
    cap_writes: int = 500
    # FileStream rescans the whole cache on every write at the cap; fewer writes where that is slow.
    fs_cap_writes: dict[int, int] = field(default_factory=lambda: {10_000: 500, 50_000: 20})
    footprint_kernels: int = 8
    mp_procs: tuple[int, ...] = (4, 8)
    mp_duration_s: float = 3.0
    mp_keys: int = 200
    cold_runs: int = 10

    @classmethod
    def make(cls, quick: bool) -> Config:
        if not quick:
            return cls(quick=False)
        return cls(
            quick=True,
            first_rounds=1,
            first_keys=10,
            repeat_keys=8,
            repeat_passes=5,
            beyond_keys=20,
            beyond_passes=2,
            compile_hits=20,
            store_writes=20,
            cap_sizes=(200, 600),
            cap_writes=20,
            fs_cap_writes={200: 20, 600: 10},
            footprint_kernels=2,
            mp_duration_s=0.4,
            mp_keys=30,
            cold_runs=2,
        )


# -- helpers ---------------------------------------------------------------------------


def open_cache(kind: str, path: str, max_size_bytes: int | None = None) -> Any:
    if kind == "ours":
        from cuda_program_cas import ContentAddressedProgramCache

        return ContentAddressedProgramCache(path, max_size_bytes=max_size_bytes, shared=())
    if kind == "filestream":
        from cuda.core.utils import FileStreamProgramCache

        return FileStreamProgramCache(path, max_size_bytes=max_size_bytes)
    raise ValueError(f"unknown cache kind {kind!r}")


def key_for(*parts: object) -> bytes:
    """A 32-byte key, as make_program_cache_key returns."""
    return hashlib.sha256("/".join(map(str, parts)).encode()).digest()


_BASES: dict[int, bytes] = {}


def payload(size: int, n: int) -> bytes:
    """``size`` bytes, unique for each ``n`` (its first 8 bytes), otherwise fixed random bytes."""
    base = _BASES.get(size)
    if base is None:
        base = _BASES[size] = random.Random(size).randbytes(size)
    return n.to_bytes(8, "little") + base[8:]


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return float(s[min(len(s) - 1, max(0, -(-len(s) * 99 // 100) - 1))])


def interleaved(order_seed: int) -> tuple[str, ...]:
    """Alternate which cache goes first, so drift in machine load hits both alike."""
    return KINDS if order_seed % 2 == 0 else KINDS[::-1]


class Timer:
    """gc off while timing; perf_counter_ns deltas."""

    def __enter__(self) -> Timer:
        self._gc = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._gc:
            gc.enable()


def fmt_size(n: int) -> str:
    return f"{n // KB} KB" if n % KB == 0 else f"{n} B"


def wait_until_old(t_written: float, age_s: float = 1.1) -> None:
    """Let stored entries age past ours' 1-second touch window: a job starts long after its kernels were stored."""
    delay = t_written + age_s - time.time()
    if delay > 0:
        time.sleep(delay)


# -- results ---------------------------------------------------------------------------


@dataclass
class Row:
    metric: str
    unit: str
    ours: float
    filestream: float | None
    target: str = ""
    # ratio compared with target_ratio: "<=" or ">=" ; or an explicit verdict for non-ratio targets
    target_op: str = "<="
    target_ratio: float | None = None
    verdict: bool | None = None
    ratio: float | None = None

    def finish(self) -> Row:
        if self.ratio is None and self.filestream:
            self.ratio = self.ours / self.filestream
        if self.verdict is None and self.target_ratio is not None and self.ratio is not None:
            self.verdict = (
                self.ratio <= self.target_ratio if self.target_op == "<=" else self.ratio >= self.target_ratio
            )
        if self.target_ratio is not None and not self.target:
            self.target = f"ratio {'≤' if self.target_op == '<=' else '≥'} {self.target_ratio:g}"
        return self

    def as_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "unit": self.unit,
            "ours": self.ours,
            "filestream": self.filestream,
            "ratio": self.ratio,
            "target": self.target or None,
            "met": self.verdict,
        }


@dataclass
class Result:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def add(self, metric: str, unit: str, ours: float, filestream: float | None, **more: Any) -> None:
        """A row of both caches' figures (:class:`Row`'s fields)."""
        self.rows.append(Row(metric, unit, ours, filestream, **more).finish())

    def medians(self, metric: str, unit: str, samples: dict[str, list[float]], ratio: float | None = None) -> None:
        """The row ``metric, median`` of both caches' samples; ours / filestream held to at most ``ratio``."""
        self.add(f"{metric}, median", unit, median(samples["ours"]), median(samples["filestream"]), target_ratio=ratio)
