"""Where the cache lives and how its knobs are spelled (no CUDA needed).

Every environment variable the package reads is one :class:`Variable` of :data:`VARIABLES`,
read through :meth:`Variable.value`; ``cuda-program-cas config`` lists them all. A value that
cannot be used never fails a job: one WARNING per process (per variable and value), then it
is ignored. A relative path in ``CUDA_PROGRAM_CAS_DIR`` or ``CUDA_PROGRAM_CAS_SHARED`` gets
one WARNING too, and is made absolute when read.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

from cuda_program_cas.index import Frozen

from .fork import ForkSafeLock
from .log import LOGGER as _log
from .log import WARNING

__all__ = [
    "DEFAULT_MAX_ENTRY_BYTES",
    "ENV_DIR",
    "ENV_LOG",
    "ENV_MAX_ENTRY_SIZE",
    "ENV_MAX_SIZE",
    "ENV_SHARED",
    "ENV_SWITCH",
    "NOT_GIVEN",
    "VARIABLES",
    "VAR_CA_BUNDLE",
    "VAR_DIR",
    "VAR_HTTP_TIMEOUT",
    "VAR_HTTP_TOKEN",
    "VAR_JOB",
    "VAR_KEYS_REFRESH",
    "VAR_LOG",
    "VAR_MAX_SIZE",
    "VAR_REDIS_PASSWORD",
    "VAR_REDIS_TIMEOUT",
    "VAR_SHARED",
    "VAR_SIGNING_KEY",
    "VAR_TRUSTED_KEYS",
    "Variable",
    "collecting",
    "default_cache_dir",
    "env_claim_wait",
    "env_lease_ttl",
    "env_max_entry_size",
    "env_max_size",
    "env_shared",
    "env_switched_off",
    "env_value",
    "first_time",
    "installed_version",
    "parse_duration",
    "parse_size",
    "parse_switch",
    "platform_cache_dir",
    "say_once",
    "validate_max_size",
]

_T = TypeVar("_T")

ENV_SWITCH = "CUDA_PROGRAM_CAS"
ENV_DIR = "CUDA_PROGRAM_CAS_DIR"
ENV_SHARED = "CUDA_PROGRAM_CAS_SHARED"
ENV_MAX_SIZE = "CUDA_PROGRAM_CAS_MAX_SIZE"
ENV_LOG = "CUDA_PROGRAM_CAS_LOG"
#: The largest entry the cache reads from a store it does not own, or stores: checked before
#: a byte is read, so that no manifest, ``Content-Length`` or pack trailer decides it.
ENV_MAX_ENTRY_SIZE = "CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE"
#: The largest cubins and fatbins seen (CUTLASS, many architectures) are tens of MB.
DEFAULT_MAX_ENTRY_BYTES = 256 << 20

#: An argument that was not given: its value comes from the environment or the cache.
NOT_GIVEN: Any = type("_NotGiven", (), {"__repr__": lambda self: "<not given>"})()

# Patterns compiled when first matched (re keeps them), not at import: about 0.5 ms a process that parses none.
_SIZE_RE = r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*"
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_AGE_RE = r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*"
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}

#: What this process has said (:func:`say_once`), by key; a forked child keeps its parent's.
_seen: set[Hashable] = set()
_seen_lock = ForkSafeLock()
#: Where :func:`collecting` gathers what is said on this thread (None: nowhere).
_collect = threading.local()


def say_once(
    key: Hashable, message: str, *args: object, level: int = WARNING, seen: set[Hashable] | None = None
) -> bool:
    """Log ``message % args`` at ``level`` the first time ``seen`` (this process's when None) meets ``key``.

    True if it did. Inside :func:`collecting` on this thread, ``(key, text)`` is gathered instead.
    """
    sink: list[tuple[Hashable, str]] | None = getattr(_collect, "sink", None)
    if sink is not None:
        sink.append((key, message % args))
        return False
    if not first_time(key, seen):
        return False
    _log.log(level, message, *args)
    return True


def first_time(key: Hashable, seen: set[Hashable] | None = None) -> bool:
    """True the first time ``seen`` (this process's when None) meets ``key``: :func:`say_once`'s test."""
    with _seen_lock:
        seen = _seen if seen is None else seen
        fresh = key not in seen
        seen.add(key)
        return fresh


@contextlib.contextmanager
def collecting() -> Iterator[list[tuple[Hashable, str]]]:
    """Gather what :func:`say_once` is asked to say on this thread meanwhile, unsaid."""
    outer = getattr(_collect, "sink", None)
    sink: list[tuple[Hashable, str]] = []
    _collect.sink = sink
    try:
        yield sink
    finally:
        _collect.sink = outer


def _read_env(name: str, parse: Callable[[str], _T], secret: bool) -> tuple[_T | None, str | None]:
    """The value (None when unset or empty), and why it is ignored (None when it is not)."""
    text = os.environ.get(name)
    if not text:
        return None, None
    try:
        return parse(text), None
    except ValueError as exc:
        return None, f"{name}={'(set, not shown)' if secret else repr(text)} is ignored: {exc}"


def env_value(name: str, parse: Callable[[str], _T], *, secret: bool = False) -> _T | None:
    """``$name`` read with ``parse``; None when unset, empty or refused (then one WARNING per process)."""
    value, why = _read_env(name, parse, secret)
    if why is not None:
        say_once(("env", name, os.environ.get(name, "")), "cuda-program-cas: %s", why)
    return value


def _absolute(name: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if os.path.isabs(text):
            return text
        absolute = os.path.abspath(text)
        say_once(
            ("env-relative", name, text),
            "cuda-program-cas: %s=%r is a relative path; it is taken as %s (the working directory of the process "
            "that read it first): give an absolute path",
            name,
            text,
            absolute,
        )
        return absolute

    return parse


_SWITCH_MODES = {"0": "off", "1": "on", "read-only": "read-only"}


def parse_switch(text: str) -> str:
    """The mode a ``CUDA_PROGRAM_CAS`` value names: ``"off"`` (``0``), ``"on"`` (``1``) or ``"read-only"``."""
    mode = _SWITCH_MODES.get(text.strip())
    if mode is None:
        raise ValueError("it is 1, read-only or 0; compiles are not cached")
    return mode


def env_switched_off() -> bool:
    """Whether ``CUDA_PROGRAM_CAS=0`` turns the cache off (only ``0`` does)."""
    return VAR_SWITCH.value() == "off"


def env_max_size() -> int | None:
    """``$CUDA_PROGRAM_CAS_MAX_SIZE`` in bytes, or None."""
    return VAR_MAX_SIZE.value()


def env_shared() -> list[str] | None:
    """The stores of ``$CUDA_PROGRAM_CAS_SHARED``, in order, each checked; one that cannot be used is left out."""
    return VAR_SHARED.value()


def _parse_shared(text: str) -> list[str]:
    from .urls import is_store_url, normalize_store_url, parse_store_entry, shown, split_store_list

    parse = _absolute(ENV_SHARED)
    out = []
    for part in split_store_list(text):
        try:
            address, writable = parse_store_entry(part)
            address = normalize_store_url(address) if is_store_url(address) else parse(address)
        except ValueError as exc:
            say_once(
                ("env-url", ENV_SHARED, shown(part)), "cuda-program-cas: %s: a store is left out: %s", ENV_SHARED, exc
            )
            continue
        out.append(f"{address}|write" if writable else address)
    return out


def env_max_entry_size() -> int:
    """``$CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE`` in bytes, else :data:`DEFAULT_MAX_ENTRY_BYTES`."""
    value = VAR_MAX_ENTRY_SIZE.value()
    return DEFAULT_MAX_ENTRY_BYTES if value is None else value


def env_claim_wait() -> float:
    """How long a compile waits for another process of the node compiling the same key.

    5 minutes by default: a CUB kernel compiles in seconds, the largest in a minute or two, so a
    waiter rarely gives up on a live compile, and a hung claimant holds the others back no longer.
    """
    value = VAR_CLAIM_WAIT.value()
    return 300.0 if value is None else value


def env_lease_ttl() -> float:
    """How long a node's lease lives unrenewed (at least 0.3 s); 30 s by default.

    A holder renews every third of it, so a live one loses it only when the store is mute 20 s.
    """
    value = VAR_LEASE_TTL.value()
    return 30.0 if value is None else max(0.3, value)


def default_cache_dir() -> Path:
    """``$CUDA_PROGRAM_CAS_DIR`` if set (made absolute), else :func:`platform_cache_dir`."""
    env = VAR_DIR.value()
    return Path(env) if env else platform_cache_dir()


def platform_cache_dir() -> Path:
    """The per-user cache directory, beside cuda-core's own ``program-cache``."""
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
    m = re.fullmatch(_SIZE_RE, text, re.IGNORECASE) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"not a size: {text!r} (expected e.g. 500M, 10G or a number of bytes)")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def parse_duration(text: str, *, require_unit: bool = False) -> float:
    """Seconds from ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"``.

    A plain number is seconds, unless ``require_unit`` (the command line: a bare ``7`` next to
    ``7d`` reads like days).
    """
    m = re.fullmatch(_AGE_RE, text, re.IGNORECASE) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"not a duration: {text!r} (expected e.g. 30m, 12h, 7d)")
    if require_unit and m.group(2) is None:
        number = m.group(1)
        raise ValueError(
            f"a duration needs a unit: {text.strip()!r} (write {number}s for seconds, or {number}m, {number}h, "
            f"{number}d, {number}w)"
        )
    return float(m.group(1)) * _AGE_UNITS[(m.group(2) or "s").lower()]


def installed_version() -> str:
    """The installed distribution's version, or ``0+unknown`` from a source tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cuda-program-cas")
    except PackageNotFoundError:
        return "0+unknown"


class Variable(Frozen, Generic[_T]):
    """One environment variable the package reads (not a dataclass: 0.4 ms a process to build the registry)."""

    __slots__ = ("default", "meaning", "name", "parse", "secret")

    name: str
    #: Reads a value that is set and not empty; ``ValueError`` refuses it.
    parse: Callable[[str], _T]
    meaning: str
    #: What applies when it is unset or empty, in words.
    default: str
    #: A token or password: never shown, only said to be ``set``.
    secret: bool

    def __init__(self, name: str, parse: Callable[[str], _T], meaning: str, default: str, secret: bool = False):
        self._set(name=name, parse=parse, meaning=meaning, default=default, secret=secret)

    def _fields(self) -> tuple[object, ...]:
        return (self.name, self.parse, self.meaning, self.default, self.secret)

    def __repr__(self) -> str:
        return f"Variable{self._fields()!r}"

    def read(self) -> tuple[_T | None, str | None]:
        """The value, and why it is ignored (None when it is not); says nothing."""
        return _read_env(self.name, self.parse, self.secret)

    def value(self) -> _T | None:
        """The value the package uses; None when unset, empty or refused (then one WARNING per process)."""
        return env_value(self.name, self.parse, secret=self.secret)


def _elsewhere(ref: str) -> Callable[[str], Any]:
    """The parser ``module:function`` of a floor above this one, imported when a value is read."""

    def parse(text: str) -> Any:
        import importlib

        module, _, function = ref.partition(":")
        return getattr(importlib.import_module(f"cuda_program_cas.{module}"), function)(text)

    return parse


VAR_SWITCH: Variable[str] = Variable(
    ENV_SWITCH,
    parse_switch,
    "1: every compile of a process through the cache; read-only: the same, writing nothing; 0: the cache off "
    "everywhere, also for cache= (as CCACHE_DISABLE)",
    "the switch off; a cache= passed is used",
)
VAR_DIR: Variable[str] = Variable(
    ENV_DIR, _absolute(ENV_DIR), "the cache directory", "the per-user cache directory (platformdirs)"
)
VAR_MAX_SIZE: Variable[int] = Variable(
    ENV_MAX_SIZE, parse_size, "the cap on stored bytes (10G, 500M)", "the cap stored in the cache, else none"
)
VAR_SHARED: Variable[list[str]] = Variable(
    ENV_SHARED, _parse_shared, "shared stores read after the local cache, in order (directories, URLs)", "none"
)
VAR_MAX_ENTRY_SIZE: Variable[int] = Variable(
    ENV_MAX_ENTRY_SIZE, parse_size, "the largest entry read from a store the cache does not own, or stored", "256 MiB"
)
VAR_CLAIM_WAIT: Variable[float] = Variable(
    "CUDA_PROGRAM_CAS_CLAIM_WAIT",
    parse_duration,
    "how long a miss waits for another process of the node compiling the same key (90s, 10m; 0: never)",
    "5 minutes",
)
VAR_LOG: Variable[str] = Variable(
    ENV_LOG, str, "a file every record of the cuda_program_cas logger is appended to", "none"
)
VAR_HTTP_TIMEOUT: Variable[Any] = Variable(
    "CUDA_PROGRAM_CAS_HTTP_TIMEOUT",
    _elsewhere("_remote.client:_parse_timeouts"),
    "CONNECT[,READ] seconds for store servers",
    "3,10",
)
VAR_HTTP_TOKEN: Variable[str] = Variable(
    "CUDA_PROGRAM_CAS_HTTP_TOKEN",
    str,
    "a bearer token for store servers",
    "the host's .netrc password, else none",
    secret=True,
)
VAR_CA_BUNDLE: Variable[Any] = Variable(
    "CUDA_PROGRAM_CAS_CA_BUNDLE",
    _elsewhere("_remote.client:_parse_file"),
    "a PEM file of CAs trusted for https:// stores besides the system's",
    "the system's CAs",
)
VAR_LEASE_TTL: Variable[float] = Variable(
    "CUDA_PROGRAM_CAS_LEASE_TTL",
    parse_duration,
    "how long a node's lease on a key in a Redis store lives unrenewed (a killed holder frees it within this)",
    "30 s",
)
VAR_KEYS_REFRESH: Variable[float] = Variable(
    "CUDA_PROGRAM_CAS_KEYS_REFRESH",
    parse_duration,
    "how long a node trusts its copy of a store's key list before asking for it again",
    "30 s",
)
VAR_SIGNING_KEY: Variable[str] = Variable(
    "CUDA_PROGRAM_CAS_SIGNING_KEY",
    str,
    "an ed25519 private key (PEM) that signs each manifest write-back and publish write to a shared store",
    "none: unsigned",
)
VAR_TRUSTED_KEYS: Variable[str] = Variable(
    "CUDA_PROGRAM_CAS_TRUSTED_KEYS",
    str,
    "public keys (PEM files or ed25519:<hex>); entries of shared stores not signed by one are ignored",
    "none: every verified entry is used",
)
VAR_REDIS_PASSWORD: Variable[str] = Variable(
    "CUDA_PROGRAM_CAS_REDIS_PASSWORD", str, "the password of redis(s):// stores whose URL has none", "none", secret=True
)
VAR_REDIS_TIMEOUT: Variable[Any] = Variable(
    "CUDA_PROGRAM_CAS_REDIS_TIMEOUT",
    _elsewhere("_remote.redis:_positive_duration"),
    "each Redis call's deadline in seconds",
    "5",
)
VAR_JOB: Variable[str] = Variable(
    "CUDA_PROGRAM_CAS_JOB",
    _elsewhere("_shared.warmset:parse_job"),
    "the job whose warm set (the entries it used) is kept in the shared stores and fetched by a cold node; off: none",
    "the main script's name and a hash of its path; none for an interactive session",
)


#: Every ``VAR_*`` above, in the order ``config`` lists them; tests/test_config_env.py fails
#: for a name the package spells that is not one.
VARIABLES: tuple[Variable[Any], ...] = tuple(v for v in tuple(globals().values()) if isinstance(v, Variable))
