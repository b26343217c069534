"""Where the cache lives and how its knobs are spelled (no CUDA needed).

Every environment variable is read here, through :func:`env_value`. A value that
cannot be used never fails a job: it gets one WARNING per process (per variable
and value) on the ``cuda_program_cas`` logger and is ignored. A relative path in
``CUDA_PROGRAM_CAS_DIR`` or ``CUDA_PROGRAM_CAS_SHARED`` would quietly depend on
the working directory: it gets one WARNING too, and is made absolute when read.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .fork import ForkSafeLock

__all__ = [
    "DEFAULT_CLAIM_WAIT_S",
    "DEFAULT_MAX_ENTRY_BYTES",
    "ENV_CLAIM_WAIT",
    "ENV_DIR",
    "ENV_LOG",
    "ENV_MAX_ENTRY_SIZE",
    "ENV_MAX_SIZE",
    "ENV_SHARED",
    "ENV_SWITCH",
    "NOT_GIVEN",
    "default_cache_dir",
    "env_claim_wait",
    "env_dir",
    "env_log_file",
    "env_max_entry_size",
    "env_max_size",
    "env_shared",
    "env_switched_off",
    "env_value",
    "installed_version",
    "parse_duration",
    "parse_size",
    "parse_switch",
    "platform_cache_dir",
    "read_env",
    "validate_max_size",
    "warn_once",
]

_T = TypeVar("_T")
_log = logging.getLogger("cuda_program_cas")

#: The switch: ``1`` routes every compile of a process through the cache, ``read-only`` too but
#: writes nothing, ``0`` turns the cache off everywhere, also for code that passes ``cache=``
#: (as ``CCACHE_DISABLE`` does). The start-up hook (``cas/_cuda/boot.py``) reads it too,
#: with the standard library alone.
ENV_SWITCH = "CUDA_PROGRAM_CAS"
ENV_DIR = "CUDA_PROGRAM_CAS_DIR"
ENV_SHARED = "CUDA_PROGRAM_CAS_SHARED"
ENV_MAX_SIZE = "CUDA_PROGRAM_CAS_MAX_SIZE"
#: A file that every record of the ``cuda_program_cas`` logger, DEBUG and up, is appended to
#: (see :mod:`cuda_program_cas._base.events`).
ENV_LOG = "CUDA_PROGRAM_CAS_LOG"
#: How long a compile waits for another process of the node compiling the same key
#: (see :mod:`cuda_program_cas._store.claims`): a duration, ``0`` never waits.
ENV_CLAIM_WAIT = "CUDA_PROGRAM_CAS_CLAIM_WAIT"
#: The wait's default: 5 minutes. A CUB kernel compiles in seconds and the largest
#: template-heavy kernels in a minute or two, so a waiter rarely gives up on a live
#: compile; and a claimant that hangs without dying holds the others back no longer
#: than this before each compiles itself (a claimant that dies frees them at once).
DEFAULT_CLAIM_WAIT_S = 300.0
#: The largest entry the cache reads from a store it does not own (a shared directory, a
#: server) or stores: a ceiling of the cache's own, checked before a byte is read, so that
#: no manifest, ``Content-Length`` or pack trailer decides how much a node reads.
ENV_MAX_ENTRY_SIZE = "CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE"
#: Its default: 256 MiB. The largest cubins and fatbins seen (CUTLASS, many architectures)
#: are tens of MB; an LTO-IR of a big library a little more.
DEFAULT_MAX_ENTRY_BYTES = 256 << 20

#: An argument that was not given: its value comes from the environment or the cache.
NOT_GIVEN: Any = type("_NotGiven", (), {"__repr__": lambda self: "<not given>"})()

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_AGE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*", re.IGNORECASE)
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


#: What this process has warned about (see :func:`warn_once`).
_seen: set[tuple[str, ...]] = set()
_seen_lock = ForkSafeLock()


def warn_once(key: tuple[str, ...], message: str, *args: object) -> bool:
    """Log ``message % args`` at WARNING the first time this process meets ``key``; True if it did."""
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
    _log.warning(message, *args)
    return True


def read_env(name: str, parse: Callable[[str], _T]) -> tuple[_T | None, str | None]:
    """The environment variable ``name`` read with ``parse``, and why it is ignored (None when it is not).

    Unset or empty: ``(None, None)``. A value ``parse`` refuses (``ValueError``):
    ``(None, "NAME='value' is ignored: why")``.
    """
    text = os.environ.get(name)
    if not text:
        return None, None
    try:
        return parse(text), None
    except ValueError as exc:
        return None, f"{name}={text!r} is ignored: {exc}"


def env_value(name: str, parse: Callable[[str], _T]) -> _T | None:
    """The environment variable ``name`` read with ``parse``; None when it is unset or empty.

    A value ``parse`` refuses (``ValueError``) is one WARNING per process and None:
    a job runs on without it.
    """
    value, why = read_env(name, parse)
    if why is not None:
        warn_once(("env", name, os.environ.get(name, "")), "cuda-program-cas: %s", why)
    return value


def _absolute(name: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if os.path.isabs(text):
            return text
        absolute = os.path.abspath(text)
        warn_once(
            ("env-relative", name, text),
            "cuda-program-cas: %s=%r is a relative path; it is taken as %s (the working directory of the process "
            "that read it first): give an absolute path",
            name,
            text,
            absolute,
        )
        return absolute

    return parse


#: ``CUDA_PROGRAM_CAS`` values and the mode each names.
_SWITCH_MODES = {"0": "off", "1": "on", "read-only": "read-only"}


def parse_switch(text: str) -> str:
    """The mode a ``CUDA_PROGRAM_CAS`` value names: ``"off"`` (``0``), ``"on"`` (``1``) or ``"read-only"``."""
    mode = _SWITCH_MODES.get(text.strip())
    if mode is None:
        raise ValueError("it is 1, read-only or 0; compiles are not cached")
    return mode


def env_switched_off() -> bool:
    """Whether ``CUDA_PROGRAM_CAS=0`` turns the cache off: no lookup, no store, every compile uncached.

    Only ``0`` does. Another value the switch does not know is one WARNING (the
    switch's, where it runs) and leaves ``cache=`` as it is.
    """
    return env_value(ENV_SWITCH, parse_switch) == "off"


def env_max_size() -> int | None:
    """``$CUDA_PROGRAM_CAS_MAX_SIZE`` in bytes; None when unset, empty or not a size (then one WARNING)."""
    return env_value(ENV_MAX_SIZE, parse_size)


def env_shared() -> list[str] | None:
    """The stores of ``$CUDA_PROGRAM_CAS_SHARED``, in order; empty parts skipped.

    Whitespace or ``;`` between stores, and ``os.pathsep`` (the older form) inside
    each part: see :mod:`cuda_program_cas._base.urls` for the rule. Each entry is
    a directory (made absolute; ``file://`` gives its path) or a store URL
    (checked), with ``|write`` kept where the store is named writable. An entry
    that cannot be used is one WARNING and left out.
    """
    from .urls import is_store_url, normalize_store_url, parse_store_entry, shown, split_store_list

    parse = _absolute(ENV_SHARED)

    def stores(text: str) -> list[str]:
        out = []
        for part in split_store_list(text):
            try:
                address, writable = parse_store_entry(part)
                address = normalize_store_url(address) if is_store_url(address) else parse(address)
            except ValueError as exc:
                warn_once(
                    ("env-url", ENV_SHARED, shown(part)),
                    "cuda-program-cas: %s: a store is left out: %s",
                    ENV_SHARED,
                    exc,
                )
                continue
            out.append(f"{address}|write" if writable else address)
        return out

    return env_value(ENV_SHARED, stores)


def env_max_entry_size() -> int:
    """``$CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE`` in bytes, else :data:`DEFAULT_MAX_ENTRY_BYTES` (bad: one WARNING)."""
    value = env_value(ENV_MAX_ENTRY_SIZE, parse_size)
    return DEFAULT_MAX_ENTRY_BYTES if value is None else value


def env_claim_wait() -> float:
    """``$CUDA_PROGRAM_CAS_CLAIM_WAIT`` in seconds, else :data:`DEFAULT_CLAIM_WAIT_S` (a bad value: one WARNING)."""
    value = env_value(ENV_CLAIM_WAIT, parse_duration)
    return DEFAULT_CLAIM_WAIT_S if value is None else value


def env_log_file() -> str | None:
    """``$CUDA_PROGRAM_CAS_LOG``: the file the ``cuda_program_cas`` logger's records go to; None when unset."""
    return env_value(ENV_LOG, str)


def default_cache_dir() -> Path:
    """``$CUDA_PROGRAM_CAS_DIR`` if set and not empty (made absolute), else the per-user cache directory.

    The latter is ``platformdirs.user_cache_path("cuda-python", appauthor=False,
    opinion=False) / "program-cas"``: beside cuda-core's own ``program-cache``.
    """
    env = env_dir()
    return Path(env) if env else platform_cache_dir()


def env_dir() -> str | None:
    """``$CUDA_PROGRAM_CAS_DIR``, absolute (a relative value: one WARNING); None when unset or empty."""
    return env_value(ENV_DIR, _absolute(ENV_DIR))


def platform_cache_dir() -> Path:
    """The per-user cache directory, whatever the environment says."""
    import platformdirs

    return platformdirs.user_cache_path("cuda-python", appauthor=False, opinion=False) / "program-cas"


def validate_max_size(value: object) -> int | None:
    """``None`` or a positive ``int`` (not ``bool``); anything else raises naming the value."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"max_size_bytes must be a positive int or None, got {type(value).__name__}: {value!r}"
            + (" (use cuda_program_cas.parse_size for strings like '10G')" if isinstance(value, str) else "")
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


#: The version said when ``cuda-program-cas`` is not installed (a source tree on ``sys.path``).
UNKNOWN_VERSION = "0+unknown"


def installed_version() -> str:
    """The installed distribution's version, from its metadata, or :data:`UNKNOWN_VERSION`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cuda-program-cas")
    except PackageNotFoundError:
        return UNKNOWN_VERSION
