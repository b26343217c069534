"""Publish's warm sets: the sources' ``sets/*`` copied into the store after every entry they name."""

from __future__ import annotations

import os
from collections.abc import Sequence

from cuda_program_cas._base.engine import StoreFailure
from cuda_program_cas._disk.direngine import DirEngine
from cuda_program_cas._disk.layout import INDEX, url_path
from cuda_program_cas._disk.packset import is_pack_name
from cuda_program_cas._shared.upload import put_checked
from cuda_program_cas._shared.warmset import MAX_SET_BYTES, SetEntry, stored_sets
from cuda_program_cas._shared.warmset import merge as merge_sets
from cuda_program_cas._shared.warmset import parse as parse_set
from cuda_program_cas._shared.warmset import updated as updated_set
from cuda_program_cas.index import MAX_MANIFEST_BYTES, parse_manifest

from .pubreport import PublishReport
from .pubtarget import Target

__all__ = ["publish_sets", "source_holds"]


def publish_sets(sources: Sequence[str], target: Target, report: PublishReport) -> None:
    """The sources' warm sets (``sets/*``) into the store, after every entry and pack they may name.

    Each source set is read bounded and parsed whole (one that is not is a
    problem line, never copied). Its lines are kept where the source holds that
    entry and this run did not skip its blob; the sets of one job from several
    sources are merged (the first source's first), then merged into the store's
    own set by write-back's read-modify-write, each line given the pack and offset
    that hold its entry in the store now. A set the store already holds so is not
    written again.
    """
    found: dict[str, list[SetEntry]] = {}
    for src in sources:
        engine = DirEngine(src)
        skipped = {i.rsplit(": ", 1)[1] for i in report.bad_blobs + report.missing_blobs if i.startswith(f"{src}: ")}
        for name in stored_sets(src):
            try:
                entries = parse_set(engine.get(name, limit=MAX_SET_BYTES))
            except StoreFailure as exc:  # too large, not a regular file, unreadable
                report.bad_sets.append(f"{engine.path(name)}: {exc.kind}")
                continue
            if entries is None:
                report.bad_sets.append(engine.path(name))
                continue
            ours = [e for e in entries if e.digest not in skipped and source_holds(engine, e)]
            earlier = found.get(name)
            found[name] = ours if earlier is None else (merge_sets(earlier, ours, set()) or ours)
    if not found:
        return
    written = {} if target.packs is None else target.packs.written()

    def where(kid: str, digest: str) -> tuple[str, int, int, int] | None:
        at = written.get(kid)
        if at is None:
            at = target.packed.get(kid)
            if at is not None and digest in target.damaged:
                return None  # its copy there failed its hash: served loose, or by this run's pack
        if at is None or at.entry.digest != digest:
            return None
        name = os.path.basename(at.pack)
        return (name, at.entry.offset, at.entry.size, at.entry.at) if is_pack_name(name) else None

    for name, ours in found.items():
        try:
            had = target.engine.get(name, limit=MAX_SET_BYTES)
        except StoreFailure as exc:
            if exc.outage:
                raise
            had = b""  # too large, not a file: replaced by a whole set
        data = updated_set(had, ours, None, where)
        if data is None:
            report.sets_unchanged += 1
            continue
        if not target.dry_run:
            put_checked(target.engine, name, data, whole=True, accept=lambda got: parse_set(got) is not None)
        report.sets_published += 1


def source_holds(engine: DirEngine, e: SetEntry) -> bool:
    """Whether the source behind ``engine`` holds the entry of this set line (a manifest naming its digest)."""
    try:
        data = engine.get(url_path(INDEX, e.kid), limit=MAX_MANIFEST_BYTES)
    except StoreFailure:
        return False
    manifest = None if data is None else parse_manifest(data, e.kid)
    return manifest is not None and (manifest.digest, manifest.size) == (e.digest, e.size)
