"""The ``cuda-program-cas`` console script: one subcommand per maintenance verb.

Each subcommand lives in its own module ``cas._cmd_<name>`` exposing
``register(subparsers) -> None``; ``register`` adds a parser whose default
``func`` takes the parsed arguments and returns the exit status.
Exit status: 0 done, 1 problems found that were not fixed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._errors import CacheError

__all__ = ["main"]

_COMMAND_MODULES = ("gc", "stats", "verify", "import_filestream", "publish")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cuda-program-cas",
        description="Inspect and maintain a cuda-program-cas cache directory.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"cas._cmd_{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"cas._cmd_{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (CacheError, OSError) as exc:
        # Expected failures (missing directory, not a cache, permission denied)
        # are one line, never a traceback.
        print(f"cuda-program-cas {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"cuda-program-cas {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
