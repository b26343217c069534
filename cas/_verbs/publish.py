"""Publishing: merge nodes' local caches into a shared store that a cluster reads.

A shared store is an ordinary cache directory that nodes open read-only. Only
the publisher writes it, and only through this module, so that a node reading it
meanwhile never sees a partial file or a manifest whose blob is not there yet:

- per source, first every blob the new manifests need, read from the source,
  verified against its digest (a bad one is skipped and reported, and so is
  every manifest naming it), then the manifests;
- every file is written by the one write protocol (:class:`cuda_program_cas._disk.writer.Writer`,
  with the store's modes): a private temp file in the store's own ``tmp/``, its
  final mode, then :func:`os.replace`;
- a blob already in the store that a new manifest will name is verified and
  freshened (its mtime set to now, so a concurrent collector sees it young); after
  each manifest commit the blob is checked again and restored if a collector took
  it in between.

Last, the store's key list (:mod:`cuda_program_cas._store.keylist`) gets every key
the run published or found the store holding, with the compile time its source
recorded; a directory's whole index is listed, so a publish into the store's
directory gives a store written by older versions a whole key list.

Running it again publishes nothing new (idempotent); after an interruption it
picks up where it stopped (resumable); two publishers at once only ever rename
complete files over each other.

When the store already maps a key to another valid blob (the compiler produced
different bytes for the same inputs on two nodes), the store keeps what it has:
the first published entry wins, so nodes that already copied it stay consistent
and repeated publishes never flip an entry back and forth. Among the sources of
one run, the first listed wins for the same reason. An entry of the store whose
manifest is garbage or whose blob is missing or corrupt is replaced: the store's
blob of every entry a source also holds is hashed (once per digest per run), so
a blob damaged in place, at its right size, is rewritten from the source
(``blobs_repaired``).

The store is reached through its engine (:mod:`cuda_program_cas._base.engine`),
chosen by the address's scheme from the table that shared stores are opened by
(:mod:`cuda_program_cas._store.tiers`): a directory (a path or ``file://``), an
``http(s)://`` WebDAV location, or a ``redis(s)://`` database. One target,
:class:`_Target`, runs the same plan and the same order over each; only a
directory has modes, ``fsync`` and mtimes (options of its engine), and only a
directory's copies are hashed (elsewhere that would download every blob: they
are checked by their size). A loose publish asks for each manifest the sources
hold (absent, equal or another), for the blob of each new one (its size),
uploads the blobs that are missing, then the manifests. ``--pack`` writes one
new pack, then lists it (:class:`~cuda_program_cas._store.tiers.PackTarget`: a
directory's ``packs/``, a WebDAV store's ``packs/list``); a Redis store takes
loose entries only, and ``--pack`` into one is refused. Each upload is atomic
in the store: a rename on a disk and in nginx's dav module, a ``SET`` in Redis.

Warm sets (:mod:`cuda_program_cas._store.warmset`): a source that is a store
directory the job's nodes wrote back into holds their sets (``sets/*``; a node's
own cache keeps none). After every entry and pack, :func:`_publish_sets` copies
them: each parsed whole (a damaged one is a problem line, never copied), its
lines kept where the source holds that entry and the run did not skip its blob,
merged into the store's own set by write-back's read-modify-write
(:func:`~cuda_program_cas._store.warmset.updated`), and every line given the
pack and offset that hold its entry in the store now (this run's pack first),
so a cold node fetches a packed set in one request. A set the store holds so
already is not written again.

An answer is not taken for a proof. Each upload is read back at once, before
anything names it (:func:`cuda_program_cas._store.upload.put_checked`, the one
write-back sends through; not on a directory, whose write protocol is the proof,
and whose blobs are re-checked after their manifests): a blob's size (HEAD,
``STRLEN``), a pack's
size and last bytes (a Range GET), a manifest's, ``layout.json``'s and
``CACHEDIR.TAG``'s every byte, ``packs/list`` by the read that looks for the
pack's name in it anyway. A store that holds less, or other bytes, stops the
run with a ``not stored`` :class:`~cuda_program_cas._base.engine.StoreFailure`
naming the object. Every read is bounded by the cache's own limits, never by
what the server says: a manifest by its longest form, the listing by
:data:`~cuda_program_cas._disk.pack.MAX_LISTING_BYTES`, a pack's index by the
ceiling for any entry (``CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE``) before a byte of it
is fetched.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from cuda_program_cas._base.engine import Engine, StoreFailure
from cuda_program_cas._base.errors import CorruptBlobError, LayoutError
from cuda_program_cas._base.signing import Signer, env_signer
from cuda_program_cas._base.urls import is_store_url, normalize_store_url, parse_store_entry, scheme_of, shown
from cuda_program_cas._disk.blobs import BlobStore
from cuda_program_cas._disk.direngine import DirEngine, DirModes
from cuda_program_cas._disk.files import NotRegularFile, file_id, read_regular, same_file, scan_sharded
from cuda_program_cas._disk.layout import (
    BLOBS,
    CACHEDIR_TAG,
    INDEX,
    LAYOUT_FILE,
    LAYOUT_VERSION,
    Layout,
    LayoutState,
    LayoutVersion,
    check_layout,
    check_layout_data,
    create_layout,
    layout_bytes,
    parse_layout,
    url_path,
)
from cuda_program_cas._disk.pack import PackInput, is_pack_name
from cuda_program_cas._disk.packsummary import PackedEntry
from cuda_program_cas._disk.remove import Remover
from cuda_program_cas._store.tiers import PackTarget, open_engine, open_packs
from cuda_program_cas._store.upload import put_checked, where
from cuda_program_cas._store.warmset import MAX_SET_BYTES, SetEntry, stored_sets
from cuda_program_cas._store.warmset import merge as merge_sets
from cuda_program_cas._store.warmset import parse as parse_set
from cuda_program_cas._store.warmset import updated as updated_set
from cuda_program_cas.index import MAX_MANIFEST_BYTES, Manifest, is_local_id, parse_manifest

from .common import Report, open_cache

__all__ = ["PublishReport", "check_sources", "publish"]

#: The name of the store's cache-directory tag.
CACHEDIR = "CACHEDIR.TAG"


@dataclass
class PublishReport(Report):
    """What one :func:`publish` run did (or, with ``dry_run``, would do).

    ``problems`` has one line for each problem of the sources, each left out of
    the store: the items of ``bad_blobs``, ``missing_blobs``,
    ``invalid_manifests`` and ``errors``, in that order, each labelled.
    """

    #: Every problem is listed.
    max_listed: ClassVar[int | None] = None

    sources: list[str]
    dest: str
    dry_run: bool = False
    #: The store did not exist (or had no layout) and was laid out by this run.
    created: bool = False
    #: Manifests read from the sources.
    scanned: int = 0
    #: Keys the store did not have, now published.
    published: int = 0
    #: Keys whose entry in the store was garbage, dangling or corrupt, now replaced.
    replaced: int = 0
    #: Keys the store already had, identical.
    unchanged: int = 0
    #: Keys the store maps to another valid blob: kept as they were (first published wins).
    conflicts: int = 0
    #: Blobs written into the store (new or restored).
    blobs_published: int = 0
    #: Of those, blobs the store held damaged (bytes that fail their hash, or the wrong size), now rewritten.
    blobs_repaired: int = 0
    #: Bytes of those blobs.
    bytes_published: int = 0
    #: Source entries that vanished while being read (evicted by their node meanwhile).
    vanished: int = 0
    #: Source blobs that failed verification: ``"<source>: <digest>"``; their manifests were skipped.
    bad_blobs: list[str] = field(default_factory=list)
    #: Source manifests whose blob is missing: ``"<source>: <digest>"``.
    missing_blobs: list[str] = field(default_factory=list)
    #: Source manifest files that are not valid manifests.
    invalid_manifests: list[str] = field(default_factory=list)
    #: Sources that could not be read, one message each.
    errors: list[str] = field(default_factory=list)
    #: Manifests not published because of the problems above.
    skipped: int = 0
    #: Packs written (``pack=True``).
    packs: list[str] = field(default_factory=list)
    #: Warm sets (``sets/*`` of the sources) written into the store, merged with its own; and those it had already.
    sets_published: int = 0
    sets_unchanged: int = 0
    #: Source warm sets that are not whole sets (cut short, garbled, too large): skipped, never copied.
    bad_sets: list[str] = field(default_factory=list)
    #: Problems found in the sources (each left out of the store), one labelled line each.
    problems: list[str] = field(default_factory=list)
    problem_count: int = 0

    def to_dict(self) -> dict[str, object]:
        """The same as :meth:`as_dict` (the name this report had before every report shared one shape)."""
        return self.as_dict()

    def _settle(self) -> None:
        """List the problems the run met, by kind (what ``problems`` and ``problem_count`` say)."""
        for label, items in (
            ("bad blob (skipped)", self.bad_blobs),
            ("missing blob (skipped)", self.missing_blobs),
            ("invalid manifest (skipped)", self.invalid_manifests),
            ("damaged warm set (skipped)", self.bad_sets),
            ("error", self.errors),
        ):
            for item in items:
                self.problem(f"{label}: {item}")


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
        _store_url(os.fspath(dest))
        if group_shared:
            raise LayoutError(_GROUP_SHARED_URL)
        if pack and scheme_of(os.fspath(dest)) in ("redis", "rediss"):
            raise LayoutError(_NO_PACKS.format(where=shown(os.fspath(dest))))
    for src in sources:
        if not url and os.path.realpath(src) == os.path.realpath(dest):
            raise LayoutError(f"source {os.path.abspath(src)!r} is the store itself: give nodes' caches as sources")
        open_cache(src, write=False)  # LayoutError: missing, a file, a dangling symlink, foreign...


class _Target:
    """The store being published into, over its engine (a directory, WebDAV or Redis): what it holds, and writes.

    One class for every engine. What differs is the engine's
    (:mod:`cuda_program_cas._store.tiers` picks it by the address's scheme), its
    packs (:func:`cuda_program_cas._store.tiers.open_packs`: none for Redis), and,
    for a directory only, its modes and syncing (:class:`DirModes`, options of the
    :class:`DirEngine`) and the few things only files have: a copy cheap enough to
    hash, an mtime to freshen, a cache to sync.
    """

    def __init__(self, engine: Engine, *, dry_run: bool, verify_existing: bool) -> None:
        self.engine = engine
        self.dry_run = dry_run
        #: The engine when the store is a directory: its copies are hashed, its blobs freshened, its phases synced.
        self.dir = engine if isinstance(engine, DirEngine) else None
        # A copy elsewhere is checked by its size: hashing it would download every blob the sources hold.
        self.verify_existing = verify_existing and self.dir is not None
        #: Signs each manifest written ($CUDA_PROGRAM_CAS_SIGNING_KEY), or None.
        self.signer: Signer | None = None
        #: The store's layout version, by which its manifests are judged (:func:`cuda_program_cas.index.fits_key`).
        self.manifest_layout: int | Callable[[], int] = (
            LayoutVersion(self.dir.root).now if self.dir is not None else LAYOUT_VERSION
        )
        #: digest -> True when the store holds (or, in a dry run, would hold) a verified copy.
        self.good: dict[str, bool] = {}
        #: Digests whose store blob failed its hash.
        self.damaged: set[str] = set()
        #: The store's packs (None: it takes loose entries only), and their entries (key id -> entry).
        self.packs: PackTarget | None = open_packs(engine)
        self.packed: dict[str, PackedEntry] = {}
        #: Blobs this run stored: new, so a collector keeps them; no re-check after their manifest.
        self._uploaded: set[str] = set()
        #: Source -> the keys of it the store holds after the run (for its key list).
        self.held: dict[str, list[str]] = {}

    @property
    def where(self) -> str:
        return self.engine.shown

    def prepare(self, report: PublishReport) -> None:
        """Lay the store out if it has no ``layout.json``, mark it shared, and read what its packs hold.

        As a directory store is laid out: ``CACHEDIR.TAG``, then ``layout.json``
        (marked shared), each read back, before any entry.
        """
        # A directory found without a store (or with a damaged layout.json) is laid out before this, unless dry.
        got = None if report.created and self.dry_run else self.engine.get(LAYOUT_FILE, limit=4096)
        if got is None:
            report.created = True
            current = None
        else:
            current = parse_layout(got)
            if current is None:
                raise LayoutError(
                    f"the store at {self.where} has a damaged {LAYOUT_FILE}: repair it where the store's files are "
                    "(cuda-program-cas verify --repair DIR)"
                )
            version = check_layout_data(self.where, current)  # LayoutError: newer, or other hashes
            if self.dir is None:
                self.manifest_layout = version  # a directory's is asked again for each layout-1 manifest
        if not self.dry_run:
            if self.engine.size(CACHEDIR) is None:
                put_checked(self.engine, CACHEDIR, CACHEDIR_TAG, whole=True)
            raw = layout_bytes(current, shared=True)
            if raw is not None:
                put_checked(self.engine, LAYOUT_FILE, raw, whole=True)
        if self.packs is not None and (self.dir is not None or not report.created):
            self.packed = self.packs.entries()

    # -- what the plan and the phases ask of the store --

    def manifest_bytes(self, kid: str) -> bytes | None:
        """The store's manifest of ``kid``: None when it has none, ``b""`` for an object that is not a manifest."""
        try:
            return self.engine.get(url_path(INDEX, kid), limit=MAX_MANIFEST_BYTES)
        except StoreFailure as exc:
            if exc.outage:
                raise
            return b""  # too large, not a regular file, a shard that is a symlink: replaced

    def blob_ok(self, digest: str, size: int) -> bool:
        """Whether the store holds this blob with the right bytes (a directory's hashed, once per run)."""
        known = self.good.get(digest)
        if known is None:
            if self.dir is None:
                known = self.blob_present(digest, size)
            else:
                try:
                    known = self.dir.get(url_path(BLOBS, digest), limit=size, digest=digest) is not None
                except StoreFailure as exc:
                    if exc.outage:
                        raise
                    known = False
                    if exc.kind in ("damaged", "too large"):
                        self.damaged.add(digest)
            self.good[digest] = known
        return known

    def blob_present(self, digest: str, size: int) -> bool:
        """A cheap check (no read): an object of the right size."""
        try:
            return self.engine.size(url_path(BLOBS, digest)) == size
        except StoreFailure as exc:
            if exc.outage:
                raise
            return False

    def packed_ok(self, packed: PackedEntry) -> bool:
        return self.packs is None or self.packs.ok(packed)

    def put_blob(self, digest: str, blob: bytes) -> bool:
        """Store a verified blob and read it back, before a manifest names it; False when the write was dropped."""
        try:
            put_checked(self.engine, url_path(BLOBS, digest), blob, whole=False)
        except StoreFailure as exc:
            if exc.kind not in _DROPPED:
                raise
            return False
        self._uploaded.add(digest)
        return True

    def keep_blob(self, digest: str, size: int) -> None:
        """A good blob the store has, that a new manifest will name: freshened, so a collector keeps it.

        Only files have an mtime to set; elsewhere :meth:`blob_still_there` asks again after the manifest.
        """
        if self.dir is not None:
            self.dir.freshen(url_path(BLOBS, digest), size)

    def put_manifest(self, manifest: Manifest) -> None:
        """Store the manifest (signed with the run's key) and read every byte of it back."""
        kid = manifest.key_id
        assert kid is not None
        signer = self.signer
        data = manifest.encode() + (b"" if signer is None else signer.sign(manifest.encode()))
        # Another publisher's valid manifest of the key, renamed in at the same moment, is no lie.
        accept = lambda held: parse_manifest(held, kid) is not None  # noqa: E731
        put_checked(self.engine, url_path(INDEX, kid), data, whole=True, accept=accept)

    def blob_still_there(self, digest: str, size: int) -> bool:
        """After a manifest commit: whether its blob is still there (a collector may have taken it)."""
        if digest in self._uploaded and self.dir is None:
            return True  # no mtimes elsewhere: what this run stored is new; a directory's stat costs nothing
        return self.blob_present(digest, size)

    def restore_blob(self, digest: str, blob: bytes) -> None:
        self.put_blob(digest, blob)

    def write_pack(self, inputs: Sequence[PackInput], stats: dict[str, int]) -> str | None:
        """Write one new pack of ``inputs``, stored before anything lists it; where it is."""
        assert self.packs is not None
        return self.packs.write(inputs, stats)

    def finish(self, report: PublishReport) -> None:
        if self.packs is not None and not self.dry_run:
            self.packs.finish(bool(report.packs))
        if not self.dry_run:
            from cuda_program_cas._store.keylist import KEYS, list_published

            index = None if self.dir is None else Layout(self.dir.root).index
            if not list_published(self.engine, self.held, index_dir=index):
                report.errors.append(
                    f"{where(self.engine, KEYS)}: damaged, or other writers kept replacing it: left as it is, the new "
                    "keys are not in it (nodes ask for keys as without one while it is damaged; publish into the "
                    "store's directory rebuilds it)"
                )

    def sync(self) -> None:
        """Make what was written so far durable: on a directory, one ``syncfs`` per phase, not an fsync per file.

        Manifests are renamed into place only after the blobs they name were
        synced, so a crash of the publishing host never leaves a manifest whose
        blob is empty or absent; a blob left damaged is re-hashed and replaced by
        the next run before a new manifest names it. A server makes each upload
        durable before it answers.
        """
        if self.dir is not None and not self.dry_run:
            self.dir.sync()

    def close(self) -> None:
        if self.packs is not None:
            self.packs.close()
        self.engine.close()


#: What a put that was dropped, not failed, says (a full disk, a shard that is not a directory).
_DROPPED = ("dropped", "not a directory")
_GROUP_SHARED_URL = (
    "--group-shared (group_shared) applies to a store directory: over HTTP the server sets the modes of what it writes "
    "(nginx: dav_access)"
)
_NO_PACKS = (
    "--pack (pack) applies to a directory or an HTTP store: {where} takes loose entries only (each its own key; "
    "Redis may evict any key, and an evicted pack would take many entries with it)"
)


def _store_url(dest: str) -> str:
    """``dest`` as a store URL; :class:`LayoutError` (bad usage) naming what is wrong with it."""
    try:
        return normalize_store_url(dest)
    except ValueError as exc:
        raise LayoutError(str(exc)) from None


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
) -> PublishReport:
    """Merge the caches at ``sources`` into the shared store at ``dest`` (created if missing).

    ``dest`` is a directory, or the ``http(s)://`` URL of a WebDAV location that
    serves one (token and CAs: :mod:`cuda_program_cas._remote.client`). Over HTTP the store's
    copies are checked by their size, not hashed, ``fsync`` is the server's
    business, and ``group_shared`` is refused (the server sets the modes).
    A failed request raises a :class:`cuda_program_cas.CacheError` (an HTTP failure): what was
    uploaded until then is complete, and running again resumes.

    ``pack``: write what the sources hold and the store lacks into one new,
    immutable pack under ``dest/packs/`` (see :mod:`cuda_program_cas._disk.pack`) instead of loose
    files: a handful of files for any number of entries, opened once per node.

    With ``$CUDA_PROGRAM_CAS_SIGNING_KEY`` set, every manifest written is signed
    (:mod:`cuda_program_cas._base.signing`), and an entry the store holds unsigned,
    or signed by another key, is signed again (counted as replaced). Packs carry no
    signatures: nodes that trust keys read loose entries only.

    ``verify_existing``: hash the store's copy of every entry it already holds
    (once per blob per run), so a copy damaged in place is replaced. That reads
    the store's copies of everything the sources hold: 125 MiB more read and
    hashed cost 0.16 s on a local disk (docs/cluster.md). False trusts a copy of
    the right size; one damaged in place then stays until ``verify --repair``.

    Sources are only read. ``group_shared`` makes the store's files group-readable
    and its directories setgid; otherwise files and directories follow the umask.
    Temp files are always private. ``dry_run`` reads and verifies everything but
    writes nothing. ``progress(phase, done, total)`` is called per source. Raises
    :class:`LayoutError` when ``dest`` is not a cache, and
    ``OSError`` when it cannot be written; what was published until then is
    complete, and running again resumes.
    """
    srcs = [os.path.abspath(os.fspath(s)) for s in sources]
    if not srcs:
        raise ValueError("publish needs at least one source cache")
    signer = env_signer()  # ValueError naming the key file: nothing is published unsigned by mistake
    url = is_store_url(dest)
    if url:
        if group_shared:
            raise ValueError(_GROUP_SHARED_URL)
        engine = open_engine(_store_url(os.fspath(dest)))
    else:
        root = os.path.abspath(parse_store_entry(os.fspath(dest)).address)  # a path, or file://
        engine = open_engine(root, modes=DirModes.for_process(group_shared, fsync=fsync))
    report = PublishReport(sources=srcs, dest=engine.shown, dry_run=dry_run)
    target = _Target(engine, dry_run=dry_run, verify_existing=verify_existing)
    target.signer = signer
    try:
        if pack and target.packs is None:
            raise ValueError(_NO_PACKS.format(where=target.where))
        if target.dir is not None:
            _open_dir(target.dir, report)
        target.prepare(report)
        if target.dir is not None and not dry_run and (report.created or group_shared):
            _fix_top_modes(target.dir)
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
        _publish_sets(read, target, report)
    finally:
        target.close()
    if progress:
        progress("published", len(srcs), len(srcs))
    report._settle()
    return report


def _open_dir(engine: DirEngine, report: PublishReport) -> None:
    """What only a store directory needs before its layout: refused if foreign, laid out, its ``tmp/`` swept.

    A directory that holds no store yet (or a damaged ``layout.json`` among our
    own names) is laid out with the run's modes (``created``); ``layout.json``
    comes last, so nodes wait for it. The shared mark is :meth:`_Target.prepare`'s.
    """
    state = check_layout(engine.root)  # LayoutError for a file, a foreign or a newer layout
    if state is not LayoutState.OK:
        report.created = True
    if report.dry_run:
        return
    lay = Layout(engine.root)
    writer = engine.writer()
    for path in (lay.root, lay.blobs, lay.index):
        writer.make_dir(path)
    modes = engine.modes
    assert modes is not None
    try:
        os.mkdir(lay.tmp, modes.tmp_dir)  # owner-only, or the group's with group_shared (files in it stay private)
    except FileExistsError:
        pass
    else:
        os.chmod(lay.tmp, modes.tmp_dir)
    if state is LayoutState.OK:
        Remover(lay).sweep_temp()
    else:
        create_layout(lay.root)


def _fix_top_modes(engine: DirEngine) -> None:
    """Give the store's top-level files and directories the run's modes, where this user owns them."""
    lay, modes = Layout(engine.root), engine.modes
    assert modes is not None
    wanted = [(lay.root, modes.dir), (lay.blobs, modes.dir), (lay.index, modes.dir), (lay.tmp, modes.tmp_dir)]
    wanted += [(os.path.join(lay.root, n), modes.file) for n in (LAYOUT_FILE, CACHEDIR)]
    for path, mode in wanted:
        try:
            st = os.lstat(path)
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) | mode != stat.S_IMODE(st.st_mode):
                os.chmod(path, stat.S_IMODE(st.st_mode) | mode)
        except OSError:
            continue


@dataclass(slots=True)
class _Item:
    kid: str
    manifest: Manifest
    path: str
    stat: os.stat_result
    action: str
    source: str


def _plan(src: str, target: _Target, report: PublishReport) -> list[_Item]:
    """What each manifest of the source ``src`` needs in the store."""
    lay = Layout(src)
    layout_now = LayoutVersion(src).now  # a layout-1 line of a layout-2 source may be any key's: refused
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
        manifest = parse_manifest(data, kid, layout=layout_now) if len(data) <= MAX_MANIFEST_BYTES else None
        if manifest is None:
            report.invalid_manifests.append(path)
            continue
        manifest = Manifest(manifest.digest, manifest.size, kid)  # a layout-1 source names no key
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


def _publish_one(src: str, target: _Target, report: PublishReport) -> None:
    lay = Layout(src)
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
        blob = _read_source_blob(src, lay, digest=digest, size=size, items=items, report=report)
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
                    blob = _read_source_blob(
                        src, lay, digest=manifest.digest, size=manifest.size, items=[], report=report
                    )
                    if blob is not None:
                        target.restore_blob(manifest.digest, blob)
            if item.action == "new":
                report.published += 1
            else:
                report.replaced += 1
        else:  # "restore": the store had this very manifest but not its blob
            report.unchanged += 1
    if todo:
        target.sync()


def _publish_pack(todo: list[_Item], target: _Target, report: PublishReport) -> None:
    """One new pack of every planned entry (first source wins per key), its blobs verified as they are read."""
    written: set[str] = set()

    def loader(item: _Item) -> Callable[[], bytes | None]:
        def load() -> bytes | None:
            blob = _read_source_blob(
                item.source,
                Layout(item.source),
                digest=item.manifest.digest,
                size=item.manifest.size,
                items=[item],
                report=report,
            )
            if blob is not None:
                written.add(item.manifest.digest)
            return blob

        return load

    seen: set[str] = set()
    inputs = []
    for item in todo:
        if item.kid in seen:
            continue
        seen.add(item.kid)
        inputs.append((item.kid, item.manifest.digest, loader(item), item.stat.st_mtime_ns))
    stats: dict[str, int] = {}
    if target.dry_run:
        for _kid, digest, load, _t in inputs:
            if digest not in target.good and load() is not None:
                target.good[digest] = True
        stats = {"entries": sum(1 for i in inputs if i[1] in target.good), "blobs": len(target.good), "bytes": 0}
    else:
        path = target.write_pack(inputs, stats)
        if path is not None:
            report.packs.append(path)
            for item in todo:
                if item.manifest.digest in written:
                    target.held.setdefault(item.source, []).append(item.kid)
    report.blobs_repaired += len(written & target.damaged)
    report.published += stats.get("entries", 0)
    report.blobs_published += stats.get("blobs", 0)
    report.bytes_published += stats.get("bytes", 0)


def _action(target: _Target, kid: str, manifest: Manifest) -> str:
    """``same``, ``restore`` (blob missing), ``new``, ``replace`` (store entry bad) or ``conflict``.

    An entry of one of the store's packs counts as the store's: equal, ``same``;
    another digest, ``conflict`` (first published wins, packed or loose); either
    whose blob in the pack fails its hash, ``replace`` (a newer pack, or a loose
    entry, serves the key before it).
    """
    packed = target.packed.get(kid)
    if packed is not None:
        same = (packed.entry.digest, packed.entry.size) == (manifest.digest, manifest.size)
        if target.verify_existing and not target.packed_ok(packed):
            if same:
                target.damaged.add(manifest.digest)
            return "replace"
        return "same" if same else "conflict"
    data = target.manifest_bytes(kid)
    if data is None:
        return "new"
    theirs = parse_manifest(data, kid, layout=target.manifest_layout) if len(data) <= MAX_MANIFEST_BYTES else None
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


def _read_source_blob(
    src: str, lay: Layout, *, digest: str, size: int, items: list[_Item], report: PublishReport
) -> bytes | None:
    """The verified bytes of a source blob, or None (reported) when it is missing or bad."""
    source = BlobStore(lay.blobs)
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


def _publish_sets(sources: Sequence[str], target: _Target, report: PublishReport) -> None:
    """The sources' warm sets (``sets/*``) into the store, after every entry and pack they may name.

    Each source set is read bounded (:data:`~cuda_program_cas._store.warmset.MAX_SET_BYTES`)
    and parsed whole: one that is not a whole set is a problem line, never copied.
    Its lines are kept where the source holds that entry (its manifest names that
    digest) and this run did not skip its blob; the sets of one job from several
    sources are merged, the first source's first; then merged into the store's
    own set of the job, and every line given the pack and offset that hold its
    entry in the store now (:func:`~cuda_program_cas._store.warmset.updated`,
    write-back's one read-modify-write), read back as write-back's are. A set the
    store already holds so is not written again.
    """
    found: dict[str, list[SetEntry]] = {}
    for src in sources:
        engine = DirEngine(src)
        skipped = {i.rsplit(": ", 1)[1] for i in report.bad_blobs + report.missing_blobs if i.startswith(f"{src}: ")}
        layout_now = LayoutVersion(src).now
        for name in stored_sets(src):
            try:
                entries = parse_set(engine.get(name, limit=MAX_SET_BYTES))
            except StoreFailure as exc:  # too large, not a regular file, unreadable
                report.bad_sets.append(f"{engine.path(name)}: {exc.kind}")
                continue
            if entries is None:
                report.bad_sets.append(engine.path(name))
                continue
            ours = [e for e in entries if e.digest not in skipped and _source_holds(engine, layout_now, e)]
            earlier = found.get(name)
            found[name] = ours if earlier is None else (merge_sets(earlier, ours, set()) or ours)
    if not found:
        return
    written = {} if target.packs is None else target.packs.written()

    def where(kid: str, digest: str) -> tuple[str, int] | None:
        """The pack and offset of ``kid`` in the store now: this run's pack, else an older one whose copy is good."""
        at = written.get(kid)
        if at is None:
            at = target.packed.get(kid)
            if at is not None and digest in target.damaged:
                return None  # its copy there failed its hash: served loose, or by this run's pack
        if at is None or at.entry.digest != digest:
            return None
        name = os.path.basename(at.pack)
        return (name, at.entry.offset) if is_pack_name(name) else None

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


def _source_holds(engine: DirEngine, layout_now: int | Callable[[], int], e: SetEntry) -> bool:
    """Whether the source behind ``engine`` holds the entry of this set line (a manifest naming its digest)."""
    try:
        data = engine.get(url_path(INDEX, e.kid), limit=MAX_MANIFEST_BYTES)
    except StoreFailure:
        return False
    manifest = None if data is None else parse_manifest(data, e.kid, layout=layout_now)
    return manifest is not None and (manifest.digest, manifest.size) == (e.digest, e.size)
