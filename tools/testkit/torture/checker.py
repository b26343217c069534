"""The cache checker: counts a cache's problems, checks every blob, and repairs what a killed writer left."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator

from cuda_program_cas import BlobStore, verify
from cuda_program_cas._disk.blobs import BlobState
from cuda_program_cas._disk.classify import Condition, classify
from cuda_program_cas._disk.scan import take_snapshot

from .common import HEX, Report

# -- the cache checker -------------------------------------------------------------

#: Kinds of damage a clean cache has none of.
PROBLEMS = ("bad_manifest", "dangling", "size_mismatch", "wrong_mapping", "bad_blob", "not_regular", "stray")


def inspect_cache(root: str, expected: dict[str, str] | None = None, *, repair: bool = False) -> dict[str, int]:
    """Count a cache's problems (see :data:`PROBLEMS`) plus ``tmp_files`` and ``orphans``.

    Every manifest is judged by the library's one classifier; every blob is
    hashed. With ``expected`` (key id -> digest), a manifest naming another digest
    than its key's content is ``wrong_mapping``: what a reader would get as wrong
    bytes. With ``repair``, bad manifests and bad blobs are removed (what ``verify
    --repair`` must do); orphans and temp files are left to the collector.
    """
    counts = dict.fromkeys((*PROBLEMS, "tmp_files", "orphans", "manifests", "blobs"), 0)
    for top in ("blobs", "index"):
        for path in _walk_shards(os.path.join(root, top), counts):
            counts["not_regular"] += 1
            if repair:
                remove(path)
    snap = take_snapshot(os.path.join(root, "index"), os.path.join(root, "blobs"))
    blobs = BlobStore(os.path.join(root, "blobs"))
    bad = {d for d in snap.blobs if blobs.check(d).state is not BlobState.OK}
    counts["bad_blob"] = len(bad)
    counts["blobs"] = len(snap.blobs) - len(bad)
    if repair:
        for digest in bad:
            remove(blobs.path_for(digest))
    referenced: set[str] = set()
    for info in snap.manifests:
        condition = classify(info, snap, bad)
        kind = _KIND_OF.get(condition)
        if kind is None and expected is not None and info.key_id in expected:
            assert info.manifest is not None
            if expected[info.key_id] != info.manifest.digest:
                kind = "wrong_mapping"
        if kind is not None:
            counts[kind] += 1
            if repair:
                remove(os.path.join(root, "index", info.key_id[:2], info.key_id[2:]))
            continue
        assert info.manifest is not None
        counts["manifests"] += 1
        referenced.add(info.manifest.digest)
    counts["bad_manifest"] += len(snap.unreadable)
    counts["orphans"] = len(set(snap.blobs) - bad - referenced)
    with contextlib.suppress(FileNotFoundError):
        counts["tmp_files"] = len(os.listdir(os.path.join(root, "tmp")))
    return counts


_KIND_OF = {
    Condition.INVALID: "bad_manifest",
    Condition.MISPLACED: "bad_manifest",
    Condition.DANGLING: "dangling",
    Condition.SIZE_MISMATCH: "size_mismatch",
    Condition.CORRUPT_BLOB: "dangling",
}


def _walk_shards(top: str, counts: dict[str, int]) -> Iterator[str]:
    """Count stray names under a ``<2 hex>/<62 hex>`` tree; yield the paths that are not regular files."""
    try:
        shards = sorted(os.listdir(top))
    except FileNotFoundError:
        return
    for shard in shards:
        spath = os.path.join(top, shard)
        sst = os.lstat(spath)
        if len(shard) != 2 or not set(shard) <= HEX or not stat.S_ISDIR(sst.st_mode):
            counts["stray"] += 1
            continue
        for name in sorted(os.listdir(spath)):
            path = os.path.join(spath, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if len(name) != 62 or not set(name) <= HEX:
                counts["stray"] += 1
            elif not stat.S_ISREG(st.st_mode):
                yield path


def remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def verify_and_repair(root: str, expected: dict[str, str], rep: Report, where: str) -> dict[str, int]:
    """Check, repair with ``cuda_program_cas.verify``, check again.

    Returns the counts found before the repair. After it, the cache must be clean.
    """
    before = inspect_cache(root, expected)
    if before["wrong_mapping"] or before["bad_blob"]:
        rep.fail(f"{where}: damage on disk before repair: {describe_problems(before)}")
    fixed = verify(root, repair=True)
    left = [p for p in fixed.problems if not p.fixed]
    if left:
        rep.fail(f"{where}: verify --repair left {len(left)} problem(s): {[(p.kind, p.detail) for p in left[:3]]}")
    # Stale temp files aside (they are an hour old), a second pass must find nothing.
    again = [p for p in verify(root).problems if p.kind != "stale_temp_file"]
    if again:
        rep.fail(f"{where}: verify after repair still finds {[(p.kind, p.path) for p in again[:3]]}")
    after = inspect_cache(root, expected)
    if any(after[k] for k in PROBLEMS):
        rep.fail(f"{where}: not clean after repair: {describe_problems(after)}")
    rep.checks += 1
    return before


def describe_problems(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}={counts[k]}" for k in PROBLEMS if counts[k]) or "none"
