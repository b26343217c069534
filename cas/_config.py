"""Where the cache lives and how its knobs are spelled (no CUDA needed)."""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "ENV_DIR",
    "ENV_LOG",
    "ENV_MAX_SIZE",
    "ENV_SHARED",
    "default_cache_dir",
    "parse_duration",
    "parse_size",
    "validate_max_size",
]

ENV_DIR = "CUDA_PROGRAM_CAS_DIR"
ENV_SHARED = "CUDA_PROGRAM_CAS_SHARED"
ENV_MAX_SIZE = "CUDA_PROGRAM_CAS_MAX_SIZE"
#: A file that every record of the ``cas`` logger, DEBUG and up, is appended to (see :mod:`cas._events`).
ENV_LOG = "CUDA_PROGRAM_CAS_LOG"

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_AGE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*", re.IGNORECASE)
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def default_cache_dir() -> Path:
    """``$CUDA_PROGRAM_CAS_DIR`` if set and not empty, else the per-user cache directory.

    The latter is ``platformdirs.user_cache_path("cuda-python", appauthor=False,
    opinion=False) / "program-cas"``: beside cuda-core's own ``program-cache``.
    """
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env)
    import platformdirs

    return platformdirs.user_cache_path("cuda-python", appauthor=False, opinion=False) / "program-cas"


def validate_max_size(value: object) -> int | None:
    """``None`` or a positive ``int`` (not ``bool``); anything else raises naming the value."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"max_size_bytes must be a positive int or None, got {type(value).__name__}: {value!r}"
            + (" (use cas.parse_size for strings like '10G')" if isinstance(value, str) else "")
        )
    if value <= 0:
        raise ValueError(f"max_size_bytes must be a positive int or None, got {value!r}")
    return value


def parse_size(text: str) -> int:
    """Bytes from ``"500M"``, ``"10G"``, ``"1.5GiB"`` or plain ``"1048576"`` (binary units)."""
    m = _SIZE_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"not a size: {text!r} (expected e.g. 500M, 10G or a number of bytes)")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def parse_duration(text: str, *, require_unit: bool = False) -> float:
    """Seconds from ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"``.

    A plain number (``"90"``) is taken as seconds, unless ``require_unit``: the
    command line asks for one, since a bare ``7`` next to ``7d`` reads like days.
    """
    m = _AGE_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"not a duration: {text!r} (expected e.g. 30m, 12h, 7d)")
    if require_unit and m.group(2) is None:
        number = m.group(1)
        raise ValueError(
            f"a duration needs a unit: {text.strip()!r} (write {number}s for seconds, or {number}m, {number}h, "
            f"{number}d, {number}w)"
        )
    return float(m.group(1)) * _AGE_UNITS[(m.group(2) or "s").lower()]
