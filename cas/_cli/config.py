"""``cuda-program-cas config [PATH] [max-size [SIZE|none]]``: the settings a cache gets, and the cap it stores.

Without a setting: every effective setting (directory, cap, shared stores, log
file) and where each came from (argument, environment, cache, default). With
``max-size SIZE``: store the cap in the cache (``settings.json``), as ``ccache -M``
does; every process that opens the cache honours it unless ``max_size_bytes=`` or
``$CUDA_PROGRAM_CAS_MAX_SIZE`` says otherwise. ``max-size none`` removes it.
"""

from __future__ import annotations

import argparse
from typing import Any

from cuda_program_cas._base.config import ENV_MAX_SIZE, env_max_size
from cuda_program_cas._disk.layout import Layout, create_layout
from cuda_program_cas._disk.settings import (
    MAX_SIZE,
    SETTING_NAMES,
    Setting,
    effective_settings,
    settings_path,
    store_setting,
)
from cuda_program_cas._verbs.common import check_writable

from .main import UsageError, cache_path, fmt_bytes, print_json, size_arg

__all__ = ["register"]

_USAGE = "cuda-program-cas config [-h] [--json] [PATH] [max-size [SIZE | none]]"
_LABELS = {"directory": "directory", MAX_SIZE: "max-size", "shared": "shared", "log_file": "log file"}


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "config",
        help="show every setting and where it comes from; store the cap in the cache (max-size 10G)",
        usage=_USAGE,
        description=(
            "Without a setting, print every effective setting of the cache at PATH (directory, cap, shared "
            "stores, log file) and where each comes from: argument, environment, cache or default. "
            "`max-size 10G` stores the cap in the cache (settings.json), as ccache -M does: every process "
            "that opens the cache honours it unless max_size_bytes= or $CUDA_PROGRAM_CAS_MAX_SIZE says "
            "otherwise. `max-size none` removes it. The cache is created if missing."
        ),
    )
    p.add_argument("words", nargs="*", metavar="ARG", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def _split(words: list[str]) -> tuple[str | None, list[str]]:
    """``[PATH] [NAME [VALUE]]``: a first word that names a setting is not a path."""
    if words and words[0] in SETTING_NAMES:
        return None, words
    return (words[0] if words else None), words[1:]


def _value(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return size_arg(text)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"max-size: {exc} (or none to remove the cap)") from None


def _show_value(s: Setting) -> str:
    if s.name == MAX_SIZE:
        return "none" if s.value is None else f"{fmt_bytes(int(str(s.value)))} ({int(str(s.value)):,} bytes)"
    if s.name == "shared":
        return ", ".join(s.value) if isinstance(s.value, list) and s.value else "none"
    return "none" if s.value is None else str(s.value)


def _show_source(s: Setting) -> str:
    where = {"environment": f"environment: {s.origin}", "cache": f"cache: {s.origin}"}.get(s.source, s.source)
    return where + (f"; {s.note}" if s.note else "")


def _as_json(path: str, settings: list[Setting], problems: list[str], **extra: object) -> dict[str, object]:
    return {
        "path": path,
        **extra,
        "settings": {s.name: s.as_dict() for s in settings},
        "problems": problems,
        "problem_count": len(problems),
    }


def run(args: argparse.Namespace) -> int:
    path, rest = _split(list(args.words))
    if rest and rest[0] not in SETTING_NAMES:
        after = f" (after the path {path!r})" if path else ""
        raise UsageError(f"unknown setting {rest[0]!r}{after}: a cache stores {', '.join(SETTING_NAMES)}")
    if len(rest) > 2:
        raise UsageError(f"too many arguments: {' '.join(rest[2:])!r} (usage: {_USAGE})")
    root = cache_path(path)
    if len(rest) == 2:
        return _store(args, path, root, _value(rest[1]))
    settings = effective_settings(path)
    if len(rest) == 1:
        settings = [s for s in settings if s.name == SETTING_NAMES[rest[0]]]
    problems = [s.problem for s in settings if s.problem]
    if args.json:
        print_json(_as_json(root, settings, problems))
    else:
        for s in settings:
            print(f"{_LABELS[s.name]:<10} {_show_value(s)} ({_show_source(s)})")
        for text in problems:
            print(f"problem: {text}")
    return 1 if problems else 0


def _store(args: argparse.Namespace, path: str | None, root: str, value: int | None) -> int:
    create_layout(root)  # a cache set up before its first job: as a first open would
    check_writable(Layout(root), "store a setting")
    store_setting(root, MAX_SIZE, value)
    settings = effective_settings(path and root)
    if args.json:
        print_json(_as_json(root, settings, [], stored={MAX_SIZE: value}))
        return 0
    if value is None:
        print(f"removed the cap stored in {root}: no cap unless max_size_bytes= or ${ENV_MAX_SIZE} gives one")
    else:
        print(
            f"stored max-size {fmt_bytes(value)} ({value:,} bytes) in {settings_path(root)}: every process that "
            f"opens {root} uses it unless max_size_bytes= or ${ENV_MAX_SIZE} says otherwise"
        )
    if env_max_size() is not None:
        print(f"note: ${ENV_MAX_SIZE} is set here, and overrides it in this environment")
    return 0
