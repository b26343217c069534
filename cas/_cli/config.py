"""``cuda-program-cas config [PATH] [max-size [SIZE|none]]``: the settings a cache gets, and the cap it stores."""

from __future__ import annotations

import argparse

from cuda_program_cas._base.config import ENV_MAX_SIZE
from cuda_program_cas._verbs.config import MAX_SIZE, SETTING_NAMES, ConfigReport, Setting, config, settings_path

from .main import UsageError, emit, fmt_bytes, print_problems, size_arg

__all__ = ["DESCRIPTION", "HELP", "USAGE", "arguments", "run"]

USAGE = "cuda-program-cas config [-h] [--json] [PATH] [max-size [SIZE | none]]"
_LABELS = {"directory": "directory", MAX_SIZE: "max-size", "shared": "shared", "log_file": "log file"}
HELP = "show every setting and where it comes from; store the cap in the cache (max-size 10G)"
DESCRIPTION = (
    "Without a setting, print every effective setting of the cache at PATH (directory, cap, shared "
    "stores, log file) and where each comes from: argument, environment, cache or default; then every "
    "environment variable the package reads, its value (a token only as 'set'), its source and whether "
    "it was accepted (a refused value is a problem: exit 1). "
    "`max-size 10G` stores the cap in the cache (settings.json), as ccache -M does: every process "
    "that opens the cache honours it unless max_size_bytes= or $CUDA_PROGRAM_CAS_MAX_SIZE says "
    "otherwise. `max-size none` removes it. The cache is created if missing."
)


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("words", nargs="*", metavar="ARG", help=argparse.SUPPRESS)


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


def run(args: argparse.Namespace) -> int:
    path, rest = _split(list(args.words))
    if rest and rest[0] not in SETTING_NAMES:
        after = f" (after the path {path!r})" if path else ""
        raise UsageError(f"unknown setting {rest[0]!r}{after}: a cache stores {', '.join(SETTING_NAMES)}")
    if len(rest) > 2:
        raise UsageError(f"too many arguments: {' '.join(rest[2:])!r} (usage: {USAGE})")
    if len(rest) == 2:
        stored = config(path, max_size=_value(rest[1]))
        return emit(args, stored, lambda: _stored_text(stored), status=0)
    report = config(path, name=SETTING_NAMES[rest[0]] if rest else None)
    return emit(args, report, lambda: _text(report))


def _text(report: ConfigReport) -> None:
    for s in report.settings:
        print(f"{_LABELS[s.name]:<10} {_show_value(s)} ({_show_source(s)})")
    if report.variables:
        print("environment:")
        width = max(len(v.name) for v in report.variables)
        for v in report.variables:
            refused = "" if v.accepted else "; refused" if not v.used else "; partly refused"
            verdict = "" if v.source == "default" else f" ({v.source}{refused})"
            print(f"  {v.name:<{width}}  {v.value}{verdict}")
            for note in v.notes:
                print(f"  {'':<{width}}  note: {note}")
    print_problems(report)


def _stored_text(report: ConfigReport) -> None:
    root, value = report.path, (report.stored or {}).get(MAX_SIZE)
    if value is None:
        print(f"removed the cap stored in {root}: no cap unless max_size_bytes= or ${ENV_MAX_SIZE} gives one")
    else:
        print(
            f"stored max-size {fmt_bytes(value)} ({value:,} bytes) in {settings_path(root)}: every process that "
            f"opens {root} uses it unless max_size_bytes= or ${ENV_MAX_SIZE} says otherwise"
        )
    if any(s.name == MAX_SIZE and s.source == "environment" for s in report.settings):
        print(f"note: ${ENV_MAX_SIZE} is set here, and overrides it in this environment")
