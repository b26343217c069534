"""``cuda-program-cas import-filestream SRC [DEST]``: import a FileStreamProgramCache, keys intact."""

from __future__ import annotations

import argparse
import errno
import os

from cuda_program_cas._base.errors import ReadOnlyCacheError
from cuda_program_cas._verbs.common import cache_root
from cuda_program_cas._verbs.import_filestream import ImportReport, import_filestream

from .main import CommandFailed, add_path_arg, emit, fmt_bytes, plural, print_problems

__all__ = ["DESCRIPTION", "HELP", "arguments", "run"]

HELP = "import a FileStreamProgramCache directory, keeping its keys"
DESCRIPTION = (
    "Import the entries of a cuda.core FileStreamProgramCache directory (SRC/entries/...) into the "
    "cache at DEST (created if missing), keeping their keys: Program.compile(cache=...) then hits "
    "for every kernel FileStream had cached. Idempotent and deduplicating; safe to interrupt and "
    "run again. SRC is only read."
)


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SRC", help="the FileStreamProgramCache directory")
    add_path_arg(p, "dest", metavar="DEST")


def run(args: argparse.Namespace) -> int:
    source, dest = os.path.abspath(args.source), cache_root(args.dest)
    try:
        report = import_filestream(source, dest, progress=args.progress)
    except ReadOnlyCacheError as exc:
        raise CommandFailed(f"{exc}; give a DEST this user can write") from None
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise CommandFailed(
            f"cannot import into {dest!r}: {exc.strerror.lower() if exc.strerror else exc} ({exc.filename}); "
            "give a DEST this user can write"
        ) from None
    return emit(args, report, lambda: _text(report))


def _text(report: ImportReport) -> None:
    print_problems(report)
    print(
        f"imported {plural(report.imported, 'entry')} ({fmt_bytes(report.bytes_imported)}) "
        f"of {report.entries:,} into {report.dest}: {fmt_bytes(report.blob_bytes_added)} of new blobs, "
        f"{report.deduplicated:,} deduplicated, {report.already_present:,} already present, "
        f"{report.kept_existing:,} kept as they were"
    )
