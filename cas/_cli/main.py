"""The ``cuda-program-cas`` console script (also ``python -m cuda_program_cas``): one subcommand per verb.

Each subcommand's module ``cuda_program_cas._cli.<name>`` has ``HELP``, ``DESCRIPTION``,
``arguments(parser)`` and ``run(args) -> int``, which calls the verb of the same name
(:mod:`cuda_program_cas._verbs`) and prints its report: the commands parse and print, the
verbs do the work. ``BUCKET`` names the argument that may be an ``s3://`` store.

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
    "add_path_arg",
    "duration_arg",
    "emit",
    "fmt_age",
    "fmt_bytes",
    "main",
    "plural",
    "print_json",
    "print_problems",
    "size_arg",
]

PROG = "cuda-program-cas"
_COMMAND_MODULES = ("gc", "stats", "explain", "verify", "import_filestream", "publish", "repack", "config", "clear")


class CommandFailed(Exception):
    """A command that could not do its work, said in the command line's own words: exit 1."""


class UsageError(Exception):
    """Bad usage a command finds after parsing (a source that is not a cache...): exit 2."""


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


def duration_arg(text: str, *, zero_ok: bool, require_unit: bool = True, what: str = "an age") -> float:
    """``--max-age``, ``--grace`` and ``--wait`` values: ``90s``, ``30m``, ``12h``, ``7d``, ``2w``."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{what} must not be negative, got {text!r}")
    try:
        seconds = parse_duration(text, require_unit=require_unit)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds <= 0 and not zero_ok:
        raise argparse.ArgumentTypeError(f"{what} must be more than zero, got {text!r}")
    return seconds


def add_path_arg(parser: argparse.ArgumentParser, name: str = "path", metavar: str = "PATH") -> None:
    what = "cache directory (default: $CUDA_PROGRAM_CAS_DIR or the per-user cache directory)"
    parser.add_argument(name, nargs="?", default=None, metavar=metavar, help=what)


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
    """``1 entry``, ``1,204 entries``, ``2 blobs``; ``many`` where neither rule holds."""
    if n == 1:
        return f"1 {word}"
    return f"{n:,} {many or (word[:-1] + 'ies' if word.endswith('y') else word + 's')}"


def fmt_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            value = seconds / size
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{seconds:.0f}s"


def print_json(obj: dict[str, object]) -> None:
    """One JSON object on stdout, with ``problems`` and ``problem_count`` (empty where not given)."""
    print(json.dumps({"problems": [], "problem_count": 0, **obj}, indent=2, sort_keys=True))


def emit(
    args: argparse.Namespace, report: Report, text: Callable[[], None], *, status: int | None = None, empty: str = ""
) -> int:
    """The one way a command prints its verb's report: one JSON object (``as_dict``) with ``--json``, else
    ``text()``, after clearing the progress line; where no cache has been created yet (``exists`` false),
    a line ending with ``empty``. Returns ``status`` where given, else 1 when the report found problems."""
    args.progress.done()
    if args.json:
        print_json(report.as_dict())
    elif empty and not getattr(report, "exists", True):
        root = getattr(report, "root", None) or getattr(report, "path", "")
        print(f"no cache at {root} yet (nothing has been stored): {empty}")
    else:
        text()
    if status is not None:
        return status
    return 1 if report.problem_count else 0


def print_problems(report: Report, show: Callable[[Any], str] = str, most: int | None = None) -> None:
    """A report's problems (``most`` of them), one ``problem:`` line each, and how many more there were."""
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
        module = importlib.import_module(f"cuda_program_cas._cli.{name}")
        usage = getattr(module, "USAGE", None)
        p = sub.add_parser(name.replace("_", "-"), help=module.HELP, description=module.DESCRIPTION, usage=usage)
        module.arguments(p)
        p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
        p.set_defaults(module=module)
    return parser, dict(sub.choices)


def _run(args: argparse.Namespace) -> int:
    """The command's ``run``, or ``_bucket`` for an ``s3://`` store where the command takes one."""
    where = getattr(args.module, "BUCKET", None)
    address = getattr(args, where) if where else None
    if isinstance(address, str) and address[:5].lower() == "s3://":
        return _bucket(args.command, address, args)
    return int(args.module.run(args))


#: Options of the directory commands that a bucket cannot honour, by their argparse names.
_DIRECTORY_ONLY = ("zero", "max_size", "max_age", "verify", "shared", "repair")
_ONE = {"manifests": "manifest", "blobs": "blob", "packs": "pack", "leases": "lease", "other": "other object"}


def _bucket(verb: str, address: str, args: argparse.Namespace) -> int:
    """``verb`` (stats, verify, gc, repack) on a bucket's store: 0 done, 1 problems or no answer."""
    from cuda_program_cas._base.engine import StoreFailure
    from cuda_program_cas._verbs.bucket import bucket_verb
    from cuda_program_cas._verbs.common import SHARED_MIN_GRACE_S

    given = [name for name in _DIRECTORY_ONLY if getattr(args, name, None) not in (None, False)]
    if given:
        options = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"{options}: not for a bucket (a directory store's); see docs/s3.md")
    try:
        if verb == "gc" and args.grace < SHARED_MIN_GRACE_S:
            raise UsageError("a bucket is a shared store: --grace must be at least 1h (write-back under way)")
        gc = {"grace_s": args.grace, "dry_run": args.dry_run} if verb == "gc" else {}
        report = bucket_verb(verb, address, **gc)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except StoreFailure as exc:
        print(f"{PROG} {verb}: {exc}", file=sys.stderr)
        return 1

    def text() -> None:
        counts = [(kind, n) for kind, n in report.objects.items() if n]
        kinds = ", ".join(f"{plural(n, _ONE[kind], kind)} ({fmt_bytes(report.bytes[kind])})" for kind, n in counts)
        print(f"{report.store}: {kinds or 'no objects'}")
        print_problems(report, lambda item: f"{item['object']}: {item['problem']}")
        if verb in ("verify", "gc"):
            print(f"{plural(report.problem_count, 'problem')}; {plural(report.orphan_blobs, 'orphan blob')}")
        if verb == "repack":
            print(f"one new pack; retired or removed {plural(len(report.removed), 'object')}")
        if verb == "gc":
            did = "would remove" if args.dry_run else "removed"
            print(f"{did} {plural(len(report.removed), 'object')} ({fmt_bytes(report.bytes_removed)})")

    return emit(args, report, text, status=None if verb == "verify" else 0)


_NEGATIVE = re.compile(r"-\.?\d")


def _join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--max-size -5M`` as ``--max-size=-5M``: argparse takes ``-5M`` for an option and
    says "expected one argument"; joined, the option's own check says what is wrong."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE.match(arg):
            out[-1] += "=" + arg
        else:
            out.append(arg)
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
    progress = args.progress = Progress(not args.json and sys.stderr.isatty())
    try:
        return _run(args)
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
    if args.json:
        _print_error_json(args.command, text, status)
    return status


def _print_error_json(command: str | None, text: str, status: int) -> None:
    """With ``--json``, an error is one JSON object on stdout too: a script reading stdout sees why."""
    print_json({"command": command, "error": text, "exit_status": status, "problems": [text], "problem_count": 1})


if __name__ == "__main__":
    sys.exit(main())
