"""Settings stored in the cache itself: ``settings.json`` in its root (``cuda-program-cas config``).

As with ``ccache -M``, a cap set once in the cache is honoured by every process
that opens it, unless an argument or the environment says otherwise. Each
setting comes from the first of: an argument, the environment, the cache, the
default. :func:`effective_settings` says which, for ``config``.

The file is a small JSON object (``{"max_size_bytes": 10737418240}``) written
through the one atomic write (:func:`cas._writer.atomic_write`). A file that
cannot be used (not a regular file, unreadable, not JSON, a value that is not a
positive int) is one WARNING per process and ignored, never an exception: a
lookup or a write does not fail for a setting.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass

from ._config import (
    ENV_DIR,
    ENV_LOG,
    ENV_MAX_SIZE,
    ENV_SHARED,
    env_dir,
    env_log_file,
    env_max_size,
    env_shared,
    platform_cache_dir,
    warn_once,
)
from ._layout import SETTINGS_FILE, Layout, LayoutState, check_layout
from ._writer import atomic_write

__all__ = [
    "MAX_SIZE",
    "SETTING_NAMES",
    "Setting",
    "effective_settings",
    "read_settings",
    "settings_path",
    "store_setting",
    "stored_max_size",
]

#: The stored name of the cap, and the command line's names of what can be stored.
MAX_SIZE = "max_size_bytes"
SETTING_NAMES = {"max-size": MAX_SIZE}

#: A settings file is a few dozen bytes; anything past this is not ours.
_MAX_BYTES = 64 * 1024
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def settings_path(root: str) -> str:
    return os.path.join(root, SETTINGS_FILE)


def _ignored(path: str, why: str) -> dict[str, object]:
    message = "cuda-program-cas: %s is ignored: %s (set the cap again with `cuda-program-cas config`)"
    warn_once(("settings", path), message, path, why)
    return {}


def read_settings(root: str) -> dict[str, object]:
    """The usable settings stored in the cache at ``root``: ``{}`` when there are none.

    Never raises for what is on disk. O_NONBLOCK: a FIFO put in its place must not
    hang the open; O_NOFOLLOW: a symlink is not the cache's file.
    """
    path = settings_path(root)
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return {}
        return _ignored(path, f"cannot be opened ({exc.strerror or exc})")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return _ignored(path, "not a regular file")
        raw = os.read(fd, _MAX_BYTES + 1)
    except OSError as exc:
        return _ignored(path, f"cannot be read ({exc.strerror or exc})")
    finally:
        os.close(fd)
    if len(raw) > _MAX_BYTES:
        return _ignored(path, f"larger than {_MAX_BYTES:,} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return _ignored(path, "not a JSON object")
    if not isinstance(data, dict):
        return _ignored(path, "not a JSON object")
    found: dict[str, object] = {}
    cap = data.get(MAX_SIZE)
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
            return _ignored(path, f"{MAX_SIZE} is {cap!r}, not a positive number of bytes")
        found[MAX_SIZE] = cap
    return found


def stored_max_size(root: str) -> int | None:
    """The cap stored in the cache at ``root``, or None."""
    value = read_settings(root).get(MAX_SIZE)
    return value if isinstance(value, int) else None


def store_setting(root: str, name: str, value: int | None) -> None:
    """Store ``name`` (a stored name, e.g. :data:`MAX_SIZE`) in the cache at ``root``; None removes it.

    The cache must exist. What else the file holds is kept (a damaged file is
    rewritten with only the new value). Two runs at once: the last one wins.
    """
    settings = read_settings(root)
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
    #: The variable or the file it came from ("" for an argument or the default).
    origin: str = ""
    #: What else the reader should know (a value it overrides, a cache not created yet).
    note: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"value": self.value, "source": self.source, "origin": self.origin, "note": self.note}


def effective_settings(path: str | None) -> list[Setting]:
    """Every setting a cache opened at ``path`` (None: the default directory) gets with no arguments.

    Directory, cap, shared stores and log file, in the order the library reads
    them. Raises :class:`cas.LayoutError` when ``path`` is a file or not a cache.
    """
    if path:
        directory = Setting("directory", os.path.abspath(path), "argument")
    elif (env := env_dir()) is not None:
        directory = Setting("directory", env, "environment", ENV_DIR)
    else:
        directory = Setting("directory", os.fspath(platform_cache_dir()), "default")
    root = str(directory.value)
    state = check_layout(root)
    stored = stored_max_size(root) if state is not LayoutState.MISSING else None
    where = settings_path(root)
    env_cap = env_max_size()
    if env_cap is not None:
        note = f"overrides the cache's {stored:,} bytes" if stored is not None else ""
        cap = Setting("max_size_bytes", env_cap, "environment", ENV_MAX_SIZE, note)
    elif stored is not None:
        cap = Setting("max_size_bytes", stored, "cache", where)
    else:
        cap = Setting("max_size_bytes", None, "default", note="no cap")
    if state is LayoutState.MISSING:
        directory = Setting(directory.name, root, directory.source, directory.origin, "no cache there yet")
    shared = env_shared()
    log_file = env_log_file()
    return [
        directory,
        cap,
        Setting("shared", shared, "environment", ENV_SHARED) if shared else Setting("shared", [], "default"),
        Setting("log_file", log_file, "environment", ENV_LOG) if log_file else Setting("log_file", None, "default"),
    ]
