"""Import a ``FileStreamProgramCache`` directory, keeping its keys.

FileStream stores each entry as the raw binary at ``entries/<2 hex>/<62 hex>``, named by
sha256 of the key bytes, as ``index/`` names manifests here: so ``Program.compile(cache=ours)``
hits for every kernel FileStream had cached. Each entry is committed as ``put`` commits it,
so an import can be killed and run again. An entry this cache holds with other content is
kept. The source is only read.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from cuda_program_cas._base.config import default_cache_dir
from cuda_program_cas._base.errors import LayoutError
from cuda_program_cas._disk.blobs import BlobStore, digest_of
from cuda_program_cas._disk.files import ShardGuard, read_regular
from cuda_program_cas._disk.layout import Layout, check_layout, create_layout
from cuda_program_cas._disk.writer import DROP_ERRNOS, Writer, WriteResult
from cuda_program_cas.index import MAX_MANIFEST_BYTES, is_hex, parse_manifest

from .common import ProgressFn, Report, check_writable

__all__ = ["ImportReport", "import_filestream"]


@dataclass(slots=True)
class ImportReport(Report):
    source: str
    dest: str
    entries: int = 0
    imported: int = 0
    #: Entries already here with the same content.
    already_present: int = 0
    #: Entries already here with other content: kept.
    kept_existing: int = 0
    #: Imported entries whose binary was already stored.
    deduplicated: int = 0
    bytes_imported: int = 0
    blob_bytes_added: int = 0
    #: Entries not stored: a shard is a symlink or not a directory, the disk is full, a file was locked.
    dropped: int = 0
    elapsed_s: float = 0.0


def _entries(entries_dir: str, report: ImportReport) -> list[tuple[str, str]]:
    """``(key id, path)`` of every entry file; misnamed files are problems."""
    found = []
    with os.scandir(entries_dir) as top:
        shards = sorted(e.name for e in top if e.is_dir(follow_symlinks=False) and is_hex(e.name, 2))
    for shard in shards:
        try:
            with os.scandir(os.path.join(entries_dir, shard)) as it:
                for e in it:
                    if not is_hex(e.name, 62):
                        report.problem(f"{e.path}: not a FileStream entry name; skipped")
                        continue
                    found.append((shard + e.name, e.path))
        except OSError as exc:
            report.problem(f"{os.path.join(entries_dir, shard)}: cannot list: {exc.strerror}")
    found.sort()
    return found


def import_filestream(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str] | None = None,
    *,
    progress: ProgressFn | None = None,
) -> ImportReport:
    """Import the FileStream cache at ``source`` into the cache at ``dest`` (None: the default; created if missing).

    Raises :class:`cuda_program_cas.LayoutError` when ``source`` is not a FileStream cache or ``dest`` not a cache.
    """
    t0 = time.monotonic()
    src = os.path.abspath(os.fspath(source))
    entries_dir = os.path.join(src, "entries")
    if not os.path.isdir(src):
        if os.path.islink(src) and not os.path.exists(src):
            check_layout(src)  # says which missing path the symlink names
        if os.path.lexists(src):
            raise LayoutError(
                f"{src!r} is not a directory: a FileStreamProgramCache is a directory (the one holding entries/)"
            )
        raise LayoutError(f"no FileStreamProgramCache at {src!r}: no such directory")
    if not os.path.isdir(entries_dir):
        raise LayoutError(f"{src!r} is not a FileStreamProgramCache directory: it has no entries/")
    target = os.path.abspath(os.fspath(default_cache_dir() if dest is None else dest))
    if os.path.realpath(target) == os.path.realpath(src):
        raise LayoutError(f"source and destination are the same directory: {src!r}")
    create_layout(target)
    lay = Layout(target)
    check_writable(lay, "import")
    writer = Writer(lay, guard=ShardGuard())
    report = ImportReport(src, lay.root)
    todo = _entries(entries_dir, report)
    report.entries = len(todo)
    for n, (kid, path) in enumerate(todo):
        if progress and n % 64 == 0:
            progress("importing", n, len(todo))
        _import_one(lay, writer, kid, path, report)
    if progress:
        progress("importing", len(todo), len(todo))
    report.elapsed_s = time.monotonic() - t0
    return report


def _current(lay: Layout, kid: str) -> str | None:
    """The digest this cache maps ``kid`` to, when its manifest is valid and its blob there, else None."""
    try:
        data, _ = read_regular(lay.manifest_path(kid))
    except OSError:
        return None  # absent, or not a regular file: replaced below
    manifest = parse_manifest(data, kid) if len(data) <= MAX_MANIFEST_BYTES else None
    if manifest is None or not BlobStore(lay.blobs).exists(manifest.digest):
        return None
    return manifest.digest


def _import_one(lay: Layout, writer: Writer, kid: str, path: str, report: ImportReport) -> None:
    try:
        data, src_st = read_regular(path)
    except FileNotFoundError:
        report.entries -= 1  # FileStream evicted it meanwhile
        return
    except OSError as exc:
        report.problem(f"{path}: cannot be read: {exc.strerror or exc}")
        return
    digest = digest_of(data)
    current = _current(lay, kid)
    if current is not None:
        if current == digest:
            report.already_present += 1
        else:
            report.kept_existing += 1
        return
    # FileStream keeps an entry's last use in its atime; carry it over as our
    # recency (never into the future, never before the entry was written).
    used = min(max(src_st.st_atime_ns, src_st.st_mtime_ns), time.time_ns())
    try:
        result = writer.commit(kid, data, digest, used_ns=used)
    except OSError as exc:
        if exc.errno not in DROP_ERRNOS:
            raise
        result = WriteResult.DROPPED
    if not result:
        report.dropped += 1
        report.problem(
            f"{path}: not stored (a shard of the cache is not a directory, the disk is full or a file is locked)"
        )
        return
    report.imported += 1
    report.bytes_imported += len(data)
    if result is WriteResult.DEDUPLICATED:
        report.deduplicated += 1
    else:
        report.blob_bytes_added += len(data)
