"""The ``cuda-program-cas`` console script (also ``python -m cuda_program_cas``): one subcommand per verb.

Each subcommand's module ``cuda_program_cas._cli.<name>`` has ``register(subparsers)``,
which adds a parser whose ``func`` calls the verb of the same name
(:mod:`cuda_program_cas._verbs`), prints its report and returns the exit status:
the commands parse and print, the verbs do the work.

Exit status: 0 done, 1 problems found that were not fixed (or the command could
not do its work: permission denied, read-only cache, lock busy), 2 bad usage.
Expected failures are one line on stderr, never a traceback; with ``--json``
also one JSON object on stdout. ``CUDA_PROGRAM_CAS_LOG`` gets the records of
what a command did, as the library's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from cuda_program_cas._base.config import installed_version, parse_duration, parse_size
from cuda_program_cas._base.errors import CacheError, LayoutError
from cuda_program_cas._base.events import open_log_file

if TYPE_CHECKING:
    from cuda_program_cas._verbs.common import Report

__all__ = [
    "CommandFailed",
    "UsageError",
    "add_json_arg",
    "add_path_arg",
    "age_arg",
    "emit",
    "fmt_age",
    "fmt_bytes",
    "grace_arg",
    "main",
    "not_created_line",
    "plural",
    "print_json",
    "print_problems",
    "seconds_arg",
    "size_arg",
]

PROG = "cuda-program-cas"
_COMMAND_MODULES = ("gc", "stats", "explain", "verify", "import_filestream", "publish", "repack", "config", "clear")


class CommandFailed(Exception):
    """A command that could not do its work, said in the command line's own words: one line, exit 1."""


class UsageError(Exception):
    """Bad usage a command finds after parsing (a source that is not a cache...): one line, exit 2."""


# -- argument types -----------------------------------------------------------------


def size_arg(text: str) -> int:
    """``--max-size`` values: ``500M``, ``10G``, ``1.5GiB``, plain bytes; more than zero."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"a size must be more than zero, got {text!r}")
    try:
        return parse_size(text)
    except ValueError as exc:
        if "positive" in str(exc):
            raise argparse.ArgumentTypeError(f"a size must be more than zero, got {text!r}") from None
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration(text: str, *, zero_ok: bool, require_unit: bool = True, what: str = "an age") -> float:
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{what} must not be negative, got {text!r}")
    try:
        seconds = parse_duration(text, require_unit=require_unit)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds <= 0 and not zero_ok:
        raise argparse.ArgumentTypeError(f"{what} must be more than zero, got {text!r}")
    return seconds


def age_arg(text: str) -> float:
    """``--max-age`` values: ``90s``, ``30m``, ``12h``, ``7d``, ``2w``; a unit is required, zero refused."""
    return _duration(text, zero_ok=False)


def grace_arg(text: str) -> float:
    """``--grace`` values: an age with its unit; ``0s`` (collect every orphan now) is allowed."""
    return _duration(text, zero_ok=True)


def seconds_arg(text: str) -> float:
    """``--wait`` values: seconds (``30``) or an age with its unit (``2m``); zero or more."""
    return _duration(text, zero_ok=True, require_unit=False, what="a wait")


def add_path_arg(parser: argparse.ArgumentParser, name: str = "path", metavar: str = "PATH") -> None:
    parser.add_argument(
        name,
        nargs="?",
        default=None,
        metavar=metavar,
        help="cache directory (default: $CUDA_PROGRAM_CAS_DIR or the per-user cache directory)",
    )


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


# -- output ---------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    """``48.2 MiB``: binary units, as ``--max-size`` reads them."""
    if n < 1024:
        return f"{int(n):,} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:,.1f} {unit}"
    return f"{n / 1024:,.1f} TiB"


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 entry``, ``1,204 entries``."""
    if n == 1:
        return f"1 {word}"
    return f"{n:,} {many or word + 's'}"


def fmt_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            value = seconds / size
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{seconds:.0f}s"


def not_created_line(root: str, nothing: str) -> str:
    """What ``gc``, ``verify`` and ``clear`` print where no cache has been created yet (exit 0, as ``stats``)."""
    return f"no cache at {root} yet (nothing has been stored): {nothing}"


def print_json(obj: dict[str, object]) -> None:
    """One JSON object on stdout; one that is not a report's gets an empty ``problems`` and ``problem_count``."""
    print(json.dumps({"problems": [], "problem_count": 0, **obj}, indent=2, sort_keys=True))


def emit(args: argparse.Namespace, report: Report, text: Callable[[], None], *, status: int | None = None) -> int:
    """The one way a command prints its verb's report: one JSON object (``as_dict``) with ``--json``, else
    ``text()``, after clearing the progress line. Returns the exit status: ``status`` where given, else 1
    when the report found problems."""
    args.progress.done()
    if args.json:
        print_json(report.as_dict())
    else:
        text()
    if status is not None:
        return status
    return 1 if report.problem_count else 0


def print_problems(report: Report, show: Callable[[Any], str] = str, most: int | None = None) -> None:
    """A report's problems (``most`` of them), one ``problem:`` line each, and how many more were counted."""
    listed = report.problems[:most]
    for item in listed:
        print(f"problem: {show(item)}")
    if report.problem_count > len(listed):
        print(f"problem: ... and {report.problem_count - len(listed):,} more")


class Progress:
    """``progress(phase, done, total)`` for the library calls: a status line on stderr, once a run lasts a second."""

    def __init__(self, enabled: bool, stream: TextIO | None = None, delay_s: float = 1.0) -> None:
        self._stream = stream or sys.stderr
        self._enabled = enabled
        self._start = time.monotonic()
        self._delay = delay_s
        self._last = 0.0
        self._shown = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if now - self._start < self._delay or (now - self._last < 0.2 and done != total):
            return
        self._last = now
        text = f"{phase} {done:,}/{total:,}" if total else f"{phase}..."
        self._stream.write(f"\r\x1b[K{PROG}: {text}")
        self._stream.flush()
        self._shown = True

    def done(self) -> None:
        if self._shown:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._shown = False


# -- the script -----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that remembers its last usage error, so ``--json`` can report it too."""

    last_error: str | None = None

    def error(self, message: str) -> NoReturn:
        _Parser.last_error = message
        super().error(message)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The script's parser, and each subcommand's parser by name."""
    parser = _Parser(
        prog=PROG,
        description="Inspect and maintain a cuda-program-cas cache directory.",
        epilog="Exit status: 0 done, 1 problems found that were not fixed, 2 bad usage.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"{PROG} {installed_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(f"cuda_program_cas._cli.{name}").register(sub)
    return parser, dict(sub.choices)


_NEGATIVE = re.compile(r"-\.?\d")


def _join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--max-size -5M`` as ``--max-size=-5M``: argparse takes ``-5M`` for an option and
    says "expected one argument"; joined, the option's own check says what is wrong."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "=" not in arg and i + 1 < len(argv) and _NEGATIVE.match(argv[i + 1]):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser, commands = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    _Parser.last_error = None
    try:
        args, extra = parser.parse_known_args(_join_negative_values(argv))
        if extra:
            # Say it with the subcommand's usage, not the top-level one.
            commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version (0) or bad usage (2): argparse has printed why
        status = exc.code if isinstance(exc.code, int) else 2
        if status and "--json" in argv:
            command = next((a for a in argv if a in commands), None)
            _print_error_json(command, _Parser.last_error or "bad usage", status)
        return status
    # As a cache opened by the library does: CUDA_PROGRAM_CAS_LOG gets this command's records.
    open_log_file()
    progress = args.progress = Progress(not getattr(args, "json", False) and sys.stderr.isatty())
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as other Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (LayoutError, UsageError) as exc:
        # A path that does not exist, is a file, or is not a cache: bad usage.
        return _fail(args, exc, 2)
    except (CacheError, OSError, CommandFailed) as exc:
        # Expected failures (permission denied, read-only, lock busy) are one line.
        return _fail(args, exc, 1)
    except KeyboardInterrupt:
        return _fail(args, "interrupted", 130)
    finally:
        progress.done()


def _fail(args: argparse.Namespace, exc: BaseException | str, status: int) -> int:
    text = str(exc)
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    print(f"{PROG} {args.command}: error: {text}", file=sys.stderr)
    if getattr(args, "json", False):
        _print_error_json(args.command, text, status)
    return status


def _print_error_json(command: str | None, text: str, status: int) -> None:
    """With ``--json``, an error is one JSON object on stdout too: a script reading stdout sees why."""
    print_json({"command": command, "error": text, "exit_status": status, "problems": [text], "problem_count": 1})


if __name__ == "__main__":
    sys.exit(main())
