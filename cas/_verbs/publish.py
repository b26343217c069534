"""Publishing: merge nodes' local caches into a shared store that a cluster reads.

Only the publisher writes a shared store, so a node reading it meanwhile never
sees a partial file or a manifest whose blob is not there yet: per source, every
blob the new manifests need (read and verified; a bad one is skipped with every
manifest naming it), then the manifests. A blob the store already has is
freshened, and after each manifest commit checked again and restored if a
collector took it meanwhile. Last, the store's key list gets every key the run
published or found the store holding. Running again publishes nothing new and
resumes after an interruption; two publishers at once only rename complete
files over each other. Where the store maps a key to another valid blob, what it
has wins (so nodes stay consistent and publishes never flip an entry); among
the sources of one run, the first listed wins.

The store is reached through its engine (a directory, ``http(s)://`` WebDAV or
``redis(s)://``); :class:`Target` runs the same plan and order over each. Each
upload is atomic in the store and read back before anything names it
(:func:`cuda_program_cas._shared.upload.put_checked`): a store that holds less or
other bytes stops the run with a ``not stored``
:class:`~cuda_program_cas._base.engine.StoreFailure`. Every read is bounded by the
cache's own limits, never by what the server says. Warm sets follow every entry
and pack (:func:`cuda_program_cas._verbs.pubsets.publish_sets`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cuda_program_cas._base.errors import CorruptBlobError, LayoutError
from cuda_program_cas._base.signing import env_signer
from cuda_program_cas._base.urls import is_store_url, parse_store_entry, scheme_of, shown
from cuda_program_cas._disk.blobs import BlobStore
from cuda_program_cas._disk.direngine import DirModes
from cuda_program_cas._disk.files import NotRegularFile, file_id, read_regular, same_file, scan_sharded
from cuda_program_cas._disk.layout import BLOBS, Layout, LayoutState, check_layout, url_path
from cuda_program_cas._shared.tiers import open_engine
from cuda_program_cas._shared.upload import where
from cuda_program_cas.index import MAX_MANIFEST_BYTES, Manifest, is_local_id, parse_manifest

from .common import open_cache
from .pubreport import PublishReport
from .pubsets import publish_sets
from .pubtarget import Target, fix_top_modes, open_dir, store_url

__all__ = ["PublishReport", "check_sources", "publish"]


def check_sources(
    sources: Iterable[str | os.PathLike[str]],
    dest: str | os.PathLike[str],
    *,
    group_shared: bool = False,
    pack: bool = False,
) -> None:
    """Raise :class:`LayoutError` for a source that is the store ``dest`` itself or not a cache at all.

    :func:`publish` reports such a source as a problem and publishes the others;
    a caller that wants to refuse the whole run before anything is written asks this first.
    A ``dest`` that is a store URL must be a valid one, and takes no ``group_shared``.
    """
    url = is_store_url(dest)
    if url:
        store_url(os.fspath(dest))
        if group_shared:
            raise LayoutError(_GROUP_SHARED_URL)
        if pack and scheme_of(os.fspath(dest)) in ("redis", "rediss"):
            raise LayoutError(_NO_PACKS.format(where=shown(os.fspath(dest))))
    for src in sources:
        if not url and os.path.realpath(src) == os.path.realpath(dest):
            raise LayoutError(f"source {os.path.abspath(src)!r} is the store itself: give nodes' caches as sources")
        open_cache(src, write=False)  # LayoutError: missing, a file, a dangling symlink, foreign...


_GROUP_SHARED_URL = (
    "--group-shared (group_shared) applies to a store directory: over HTTP the server sets the modes of what it writes "
    "(nginx: dav_access)"
)
_NO_PACKS = (
    "--pack (pack) applies to a directory or an HTTP store: {where} takes loose entries only (each its own key; "
    "Redis may evict any key, and an evicted pack would take many entries with it)"
)


def publish(
    sources: Iterable[str | os.PathLike[str]],
    dest: str | os.PathLike[str],
    *,
    group_shared: bool = False,
    dry_run: bool = False,
    fsync: bool = True,
    pack: bool = False,
    verify_existing: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
    init: bool = False,
) -> PublishReport:
    """Merge the caches at ``sources`` into the shared store at ``dest`` (created if missing).

    ``dest`` is a directory or a store URL (``http(s)://``, ``redis(s)://``); over
    a URL the store's copies are checked by size, ``fsync`` is the server's
    business and ``group_shared`` is refused. ``pack``: write what the store lacks
    into one new immutable pack instead of loose files. With
    ``$CUDA_PROGRAM_CAS_SIGNING_KEY`` set every manifest written is signed, and an
    entry the store holds unsigned or signed by another key is signed again
    (counted as replaced); packs carry no signatures.

    ``verify_existing``: hash the store's copy of every entry it already holds, so
    one damaged in place is replaced (docs/cluster.md has the cost); False trusts
    a copy of the right size. ``group_shared`` makes the store's files
    group-readable and its directories setgid. ``dry_run`` reads and verifies
    everything but writes nothing. ``progress(phase, done, total)`` is called per
    source. ``init``: ``sources`` may be empty, and then the store is only laid
    out (``created`` says whether it was new). Sources are only read.

    Raises :class:`LayoutError` when ``dest`` is not a cache, a
    :class:`cuda_program_cas.CacheError` for a failed request and ``OSError``
    when it cannot be written; what was published until then is complete, and
    running again resumes.
    """
    srcs = [os.path.abspath(os.fspath(s)) for s in sources]
    if not srcs and not init:
        raise ValueError("publish needs at least one source cache (init=True lays out an empty store)")
    signer = env_signer()  # ValueError naming the key file: nothing is published unsigned by mistake
    url = is_store_url(dest)
    if url:
        if group_shared:
            raise ValueError(_GROUP_SHARED_URL)
        engine = open_engine(store_url(os.fspath(dest)))
    else:
        root = os.path.abspath(parse_store_entry(os.fspath(dest)).address)  # a path, or file://
        engine = open_engine(root, modes=DirModes.for_process(group_shared, fsync=fsync))
    report = PublishReport(sources=srcs, dest=engine.shown, dry_run=dry_run)
    target = Target(engine, dry_run=dry_run, verify_existing=verify_existing)
    target.signer = signer
    try:
        if pack and target.packs is None:
            raise ValueError(_NO_PACKS.format(where=target.where))
        if target.dir is not None:
            open_dir(target.dir, report)
        target.prepare(report)
        if target.dir is not None and not dry_run and (report.created or group_shared):
            fix_top_modes(target.dir)
        pending: list[_Item] = []
        read: list[str] = []  # the sources read, whose warm sets follow their entries
        for n, src in enumerate(srcs):
            if progress:
                progress(f"publishing {src}", n, len(srcs))
            if not url and os.path.realpath(src) == os.path.realpath(target.where):
                report.errors.append(f"{src}: is the destination itself")
                continue
            try:
                src_state = check_layout(src)
            except (LayoutError, OSError) as exc:
                report.errors.append(f"{src}: {exc}")
                continue
            if src_state is not LayoutState.OK:
                report.errors.append(f"{src}: not a cuda-program-cas cache ({src_state.value})")
                continue
            read.append(src)
            if pack:
                pending.extend(_plan(src, target, report))
            else:
                _publish_one(src, target, report)
        if pack and pending:
            _publish_pack(pending, target, report)
        target.finish(report)
        publish_sets(read, target, report)
    finally:
        target.close()
    if progress:
        progress("published", len(srcs), len(srcs))
    report._settle()
    return report


@dataclass(slots=True)
class _Item:
    kid: str
    manifest: Manifest
    path: str
    stat: os.stat_result
    action: str
    source: str


def _plan(src: str, target: Target, report: PublishReport) -> list[_Item]:
    """What each manifest of the source ``src`` needs in the store."""
    lay = Layout(src)
    todo: list[_Item] = []
    for kid, path, _st in scan_sharded(lay.index):
        if is_local_id(kid):
            continue  # what the node keeps for itself (the index of a pack it read over HTTP)
        report.scanned += 1
        try:
            data, mst = read_regular(path)
        except FileNotFoundError:
            report.vanished += 1
            continue
        except OSError as exc:
            report.invalid_manifests.append(f"{path}: {exc.strerror or exc}")
            continue
        manifest = parse_manifest(data, kid) if len(data) <= MAX_MANIFEST_BYTES else None
        if manifest is None:
            report.invalid_manifests.append(path)
            continue
        action = _action(target, kid, manifest)
        if action in ("same", "conflict"):
            target.held.setdefault(src, []).append(kid)  # the store holds the key: listed
        if action == "same":
            report.unchanged += 1
        elif action == "conflict":
            report.conflicts += 1
        else:
            todo.append(_Item(kid, manifest, path, mst, action, src))
    return todo


def _publish_one(src: str, target: Target, report: PublishReport) -> None:
    # 1. Plan: what each source manifest needs in the store.
    todo = _plan(src, target, report)
    # 2. Blobs: every blob the plan needs, verified, before any manifest naming it.
    needed: dict[str, list[_Item]] = {}
    for item in todo:
        needed.setdefault(item.manifest.digest, []).append(item)
    for digest, items in needed.items():
        size = items[0].manifest.size
        if target.blob_ok(digest, size):
            if not target.dry_run:
                target.keep_blob(digest, size)
            continue
        blob = _read_source_blob(src, digest, size, items, report)
        if blob is None:
            continue
        if not target.dry_run and not target.put_blob(digest, blob):
            report.errors.append(f"{where(target.engine, url_path(BLOBS, digest))}: the write was dropped")
            continue
        target.good[digest] = True
        report.blobs_published += 1
        report.bytes_published += len(blob)
        report.blobs_repaired += digest in target.damaged
    if needed:
        target.sync()
    # 3. Manifests, each after its blob; then make sure the blob is still there.
    for item in todo:
        manifest = item.manifest
        if not target.good.get(manifest.digest):
            continue
        target.held.setdefault(src, []).append(item.kid)
        if item.action in ("new", "replace"):
            if not target.dry_run:
                target.put_manifest(manifest)
                if not target.blob_still_there(manifest.digest, manifest.size):
                    # A collector removed it after the blob phase: store it again.
                    blob = _read_source_blob(src, manifest.digest, manifest.size, [], report)
                    if blob is not None:
                        target.put_blob(manifest.digest, blob)
            if item.action == "new":
                report.published += 1
            else:
                report.replaced += 1
        else:  # "restore": the store had this very manifest but not its blob
            report.unchanged += 1
    if todo:
        target.sync()


def _publish_pack(todo: list[_Item], target: Target, report: PublishReport) -> None:
    """One new pack of every planned entry (first source wins per key), its blobs verified as they are read."""
    written: set[str] = set()

    def load(item: _Item) -> bytes | None:
        blob = _read_source_blob(item.source, item.manifest.digest, item.manifest.size, [item], report)
        if blob is not None:
            written.add(item.manifest.digest)
        return blob

    first: dict[str, _Item] = {}
    for item in todo:
        first.setdefault(item.kid, item)  # the first source wins
    inputs = [(i.kid, i.manifest.digest, functools.partial(load, i), i.stat.st_mtime_ns) for i in first.values()]
    stats: dict[str, int] = {}
    if target.dry_run:
        for _kid, digest, load, _t in inputs:
            if digest not in target.good and load() is not None:
                target.good[digest] = True
        stats = {"entries": sum(1 for i in inputs if i[1] in target.good), "blobs": len(target.good), "bytes": 0}
    else:
        assert target.packs is not None
        path = target.packs.write(inputs, stats)
        if path is not None:
            report.packs.append(path)
            for item in todo:
                if item.manifest.digest in written:
                    target.held.setdefault(item.source, []).append(item.kid)
    report.blobs_repaired += len(written & target.damaged)
    report.published += stats.get("entries", 0)
    report.blobs_published += stats.get("blobs", 0)
    report.bytes_published += stats.get("bytes", 0)


def _action(target: Target, kid: str, manifest: Manifest) -> str:
    """``same``, ``restore`` (blob missing), ``new``, ``replace`` (store entry bad) or ``conflict``.

    An entry of one of the store's packs counts as the store's: equal, ``same``;
    another digest, ``conflict`` (first published wins, packed or loose); either
    whose blob in the pack fails its hash, ``replace`` (a newer pack, or a loose
    entry, serves the key before it).
    """
    packed = target.packed.get(kid)
    if packed is not None:
        # The digest is of the raw bytes, and so names their size too; the entry's size is of its stored (framed) bytes.
        same = packed.entry.digest == manifest.digest
        if target.verify_existing and target.packs is not None and not target.packs.ok(packed):
            if same:
                target.damaged.add(manifest.digest)
            return "replace"
        return "same" if same else "conflict"
    data = target.manifest_bytes(kid)
    if data is None:
        return "new"
    theirs = parse_manifest(data, kid) if len(data) <= MAX_MANIFEST_BYTES else None
    if theirs is not None and (theirs.digest, theirs.size) == (manifest.digest, manifest.size):
        # Hashed, not only stat'ed: a blob damaged in place keeps its size, and
        # would otherwise stay lost for every node until ``verify --repair``.
        good = target.blob_ok if target.verify_existing else target.blob_present
        if not good(manifest.digest, manifest.size):
            return "restore"
        # Publishing with a key signs what the store holds unsigned (or signed by another key).
        return "same" if target.signer is None or target.signer.signed(data) else "replace"
    if theirs is not None and target.blob_ok(theirs.digest, theirs.size):
        return "conflict"
    return "replace"


def _read_source_blob(src: str, digest: str, size: int, items: list[_Item], report: PublishReport) -> bytes | None:
    """The verified bytes of a source blob, or None (reported) when it is missing or bad."""
    source = BlobStore(Layout(src).blobs)
    path = source.path_for(digest)
    try:
        data, _st = source.read(digest, size)
    except FileNotFoundError:
        # Evicted by its node after we read the manifest? Then the manifest went too.
        still = sum(1 for it in items if same_file(it.path, file_id(it.stat)))
        report.vanished += len(items) - still
        report.skipped += still
        if still or not items:
            report.missing_blobs.append(f"{src}: {digest}")
        return None
    except (CorruptBlobError, NotRegularFile):
        report.bad_blobs.append(f"{src}: {digest}")
    except OSError as exc:
        report.errors.append(f"{path}: {exc.strerror or exc}")
    else:
        return data
    report.skipped += len(items)
    return None
