"""``cuda-program-cas explain [PATH]``: why the recent misses of a cache missed (:func:`cuda_program_cas.explain`)."""

from __future__ import annotations

import argparse

from cuda_program_cas._verbs.explain import ExplainReport, explain

from .main import add_path_arg, emit, plural

__all__ = ["DESCRIPTION", "HELP", "arguments", "run"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


HELP = "why recent compiles missed: the input that differed from its own earlier variant"
DESCRIPTION = (
    "For each recent miss of the cache, the one input that differed from its own earlier "
    "variant (the same code compiled before): an option, a header (its path and how it changed), a "
    "directory whose listing changed, the compiler's version, the working directory, the code. Reads only."
)


def arguments(p: argparse.ArgumentParser) -> None:
    add_path_arg(p)
    p.add_argument("--last", type=_positive, default=10, metavar="N", help="explain the last N misses (default 10)")


def run(args: argparse.Namespace) -> int:
    report = explain(args.path, last=args.last)
    return emit(args, report, lambda: _text(report), status=0, empty="no misses recorded")


def _text(report: ExplainReport) -> None:
    for miss in report.misses:
        print(
            f"{miss.time.replace('T', ' ').replace('+00:00', ' UTC')}  {miss.key_id[:16]}  {miss.via:5}  "
            f"compiled in {miss.compile_seconds:.3f} s: {miss.summary}"
        )
    print(f"explained {plural(len(report.misses), 'miss', 'misses')} of {report.recorded:,} recorded in {report.path}")
