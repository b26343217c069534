"""Settings stored in the cache itself: ``settings.json`` in its root (``cuda-program-cas config``).

As with ``ccache -M``, a cap set once in the cache is honoured by every process that opens
it. Each setting comes from the first of: an argument, the environment, the cache, the
default. A file that cannot be used is one WARNING per process and ignored, never an
exception: a lookup or a write does not fail for a setting.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass

from cuda_program_cas._base.config import (
    ENV_DIR,
    ENV_LOG,
    ENV_MAX_SIZE,
    ENV_SHARED,
    VAR_DIR,
    VAR_LOG,
    VAR_MAX_SIZE,
    env_shared,
    platform_cache_dir,
    say_once,
)

from .atomic import atomic_write
from .files import NotRegularFile, read_small
from .layout import SETTINGS_FILE, Layout, LayoutState, check_layout

__all__ = [
    "MAX_SIZE",
    "SETTING_NAMES",
    "Setting",
    "effective_settings",
    "settings_path",
    "store_setting",
    "stored_max_size",
]

MAX_SIZE = "max_size_bytes"
SETTING_NAMES = {"max-size": MAX_SIZE}

_MAX_BYTES = 64 * 1024


def settings_path(root: str) -> str:
    return os.path.join(root, SETTINGS_FILE)


def load_settings(root: str) -> tuple[dict[str, object], str | None]:
    """The usable settings stored in the cache at ``root``, and why the file is ignored (None: it is not)."""
    try:
        raw = read_small(settings_path(root), _MAX_BYTES + 1)
    except NotRegularFile:
        return {}, "not a regular file"
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return {}, None
        return {}, f"cannot be opened or read ({exc.strerror or exc})"
    if len(raw) > _MAX_BYTES:
        return {}, f"larger than {_MAX_BYTES:,} bytes"
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return {}, "not a JSON object"
    if not isinstance(data, dict):
        return {}, "not a JSON object"
    found: dict[str, object] = {}
    cap = data.get(MAX_SIZE)
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
            return {}, f"{MAX_SIZE} is {cap!r}, not a positive number of bytes"
        found[MAX_SIZE] = cap
    return found, None


def stored_max_size(root: str) -> int | None:
    """The cap stored in the cache at ``root``, or None (a file that cannot be used: one WARNING)."""
    settings, why = load_settings(root)
    if why is not None:
        message = "cuda-program-cas: %s is ignored: %s (store the cap again with `cuda-program-cas config`)"
        say_once(("settings", settings_path(root)), message, settings_path(root), why)
    value = settings.get(MAX_SIZE)
    return value if isinstance(value, int) else None


def store_setting(root: str, name: str, value: int | None) -> None:
    """Store ``name`` (e.g. :data:`MAX_SIZE`) in the existing cache at ``root``; None removes it.

    What else the file holds is kept (a damaged file is rewritten with only the new value).
    """
    settings, _ = load_settings(root)
    if value is None:
        settings.pop(name, None)
    else:
        settings[name] = value
    data = (json.dumps(settings, indent=2, sort_keys=True) + "\n").encode()
    atomic_write(settings_path(root), data, Layout(root).tmp, mode=0o644)


@dataclass(frozen=True, slots=True)
class Setting:
    """One effective setting: its value, and where it came from."""

    name: str
    value: object
    #: ``argument``, ``environment``, ``cache`` or ``default``.
    source: str
    #: The variable or the file it came from.
    origin: str = ""
    note: str = ""
    #: A value that was ignored, and why.
    problem: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"value": self.value, "source": self.source, "origin": self.origin, "note": self.note}


def effective_settings(path: str | None) -> list[Setting]:
    """Every setting a cache opened at ``path`` (None: the default directory) gets with no arguments.

    Raises :class:`cuda_program_cas.LayoutError` when ``path`` is a file or not a cache.
    """
    env_text = os.environ.get(ENV_DIR, "")
    if path:
        directory = Setting("directory", os.path.abspath(path), "argument")
    elif (env := VAR_DIR.value()) is not None:
        note = "" if os.path.isabs(env_text) else f"the relative {env_text!r} taken from the working directory"
        directory = Setting("directory", env, "environment", ENV_DIR, note)
    else:
        directory = Setting("directory", os.fspath(platform_cache_dir()), "default")
    root = str(directory.value)
    state = check_layout(root)
    if state is LayoutState.MISSING:
        note = "; ".join(n for n in (directory.note, "no cache there yet") if n)
        directory = Setting(directory.name, root, directory.source, directory.origin, note)
    stored, stored_problem = load_settings(root) if state is not LayoutState.MISSING else ({}, None)
    stored_cap = stored.get(MAX_SIZE)
    where = settings_path(root)
    env_cap, env_problem = VAR_MAX_SIZE.read()
    problem = "; ".join(p for p in (env_problem, stored_problem and f"{where} is ignored: {stored_problem}") if p)
    if env_cap is not None:
        note = f"overrides the cache's {stored_cap:,} bytes" if isinstance(stored_cap, int) else ""
        cap = Setting(MAX_SIZE, env_cap, "environment", ENV_MAX_SIZE, note, problem)
    elif stored_cap is not None:
        cap = Setting(MAX_SIZE, stored_cap, "cache", where, "", problem)
    else:
        cap = Setting(MAX_SIZE, None, "default", "", "no cap", problem)
    shared = env_shared()
    log_file = VAR_LOG.value()
    return [
        directory,
        cap,
        Setting("shared", shared, "environment", ENV_SHARED) if shared else Setting("shared", [], "default"),
        Setting("log_file", log_file, "environment", ENV_LOG) if log_file else Setting("log_file", None, "default"),
    ]
