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

A store URL (``https://host/path/store``) is published through WebDAV PUT, in
the same order and by the same plan; only the destination differs
(:class:`_UrlDest` beside the directory's :class:`_Dest`). A loose publish asks
for each manifest the sources hold (GET: absent, equal or another), asks for
the blob of each new one (HEAD), uploads the blobs that are missing, then the
manifests. ``--pack`` uploads one new pack, then adds its name to
``packs/list``. Each upload is atomic on the server: nginx's dav module writes a
PUT's body to a temp file and renames it; an object store shows an object only
once its upload is complete.

A 2xx is not taken for a proof. Each upload is read back at once, before
anything names it: a blob's size (HEAD), a pack's size and last bytes (a Range
GET), a manifest's, ``layout.json``'s and ``CACHEDIR.TAG``'s every byte (GET),
``packs/list`` by the read that looks for the pack's name in it anyway. A server
that holds less, or other bytes, stops the run with a ``not stored``
:class:`HttpFailure` naming the file. Every read is bounded by the cache's own
limits, never by what the server says: a manifest by its longest form, the
listing by :data:`MAX_LISTING_BYTES`, a pack's index by the ceiling for any
entry (``CUDA_PROGRAM_CAS_MAX_ENTRY_SIZE``) before a byte of it is fetched.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from cuda_program_cas._base.config import env_max_entry_size
from cuda_program_cas._base.errors import CacheError, CorruptBlobError, LayoutError
from cuda_program_cas._base.signing import Signer, env_signer
from cuda_program_cas._base.urls import is_store_url, join, normalize_store_url, shown
from cuda_program_cas._disk.atomic import current_umask
from cuda_program_cas._disk.blobs import BlobStore
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
    mark_shared_store,
    parse_layout,
    url_path,
)
from cuda_program_cas._disk.pack import (
    LISTING,
    MAX_LISTING_BYTES,
    TRAILER_SIZE,
    PackError,
    PackIndex,
    PackInput,
    PackReader,
    encode_listing,
    pack_chunks,
    pack_name,
    parse_listing,
    save_listing,
    write_pack,
)
from cuda_program_cas._disk.packsummary import PackedEntry, PackSummary
from cuda_program_cas._disk.remove import Remover
from cuda_program_cas._disk.writer import BlobWrite, Writer
from cuda_program_cas._remote.client import HttpFailure
from cuda_program_cas._remote.dav import (
    check_bytes,
    check_size,
    check_tail,
    fetch,
    fetch_range,
    fetch_tail,
    not_stored,
    put,
    size_of,
)
from cuda_program_cas.index import MAX_MANIFEST_BYTES, Manifest, is_local_id, parse_manifest

from .common import Report, open_cache

__all__ = ["PublishReport", "check_sources", "publish"]

_log = logging.getLogger("cuda_program_cas")


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
            ("error", self.errors),
        ):
            for item in items:
                self.problem(f"{label}: {item}")


def check_sources(
    sources: Iterable[str | os.PathLike[str]], dest: str | os.PathLike[str], *, group_shared: bool = False
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
    for src in sources:
        if not url and os.path.realpath(src) == os.path.realpath(dest):
            raise LayoutError(f"source {os.path.abspath(src)!r} is the store itself: give nodes' caches as sources")
        open_cache(src, write=False)  # LayoutError: missing, a file, a dangling symlink, foreign...


@dataclass(frozen=True)
class _Modes:
    file: int
    dir: int
    tmp_dir: int
    group_shared: bool

    @classmethod
    def for_process(cls, group_shared: bool) -> _Modes:
        umask = current_umask()
        file_mode = 0o644 & ~umask
        dir_mode = 0o777 & ~umask
        if group_shared:
            # Group members read everything; new files and directories inherit
            # the directory's group (setgid). Group write follows the umask, so a
            # publishing team with umask 002 can publish into one store together.
            file_mode |= 0o640
            dir_mode |= 0o2750
            return cls(file_mode, dir_mode, dir_mode, True)
        return cls(file_mode, dir_mode, 0o700, False)


class _Dest:
    """The store being published into: its layout, its writer (with the run's modes), and what it holds."""

    def __init__(self, root: str, modes: _Modes, *, dry_run: bool, fsync: bool, verify_existing: bool = True) -> None:
        self.lay = Layout(root)
        #: The store's layout version, by which its manifests are judged (:func:`cuda_program_cas.index.fits_key`).
        self.manifest_layout: int | Callable[[], int] = LayoutVersion(root).now
        self.modes = modes
        self.dry_run = dry_run
        self.fsync = fsync
        self.verify_existing = verify_existing
        #: Signs each manifest written ($CUDA_PROGRAM_CAS_SIGNING_KEY), or None.
        self.signer: Signer | None = None
        self.writer = Writer(
            self.lay,
            file_mode=modes.file,
            exact_mode=True,
            dir_mode=modes.dir,
            setgid=modes.group_shared,
            verify_existing=True,
        )
        #: digest -> True when the store holds (or, in a dry run, would hold) a verified copy.
        self.good: dict[str, bool] = {}
        #: Digests whose store blob failed its hash.
        self.damaged: set[str] = set()
        #: The store's packed entries (key id -> entry), read once per run from ``packs/summary``
        #: and the packs it does not cover, not from every pack.
        self.summary = PackSummary.load(root)
        self.packed = self.summary.entries()
        self._packed_ok: dict[tuple[str, int], bool] = {}
        self._readers: dict[str, PackReader | None] = {}

    def blob_ok(self, digest: str, size: int) -> bool:
        """Whether the store holds this blob with the right bytes (hashed once per run)."""
        known = self.good.get(digest)
        if known is None:
            try:
                BlobStore(self.lay.blobs).read(digest, size)
                known = True
            except CorruptBlobError:
                known = False
                self.damaged.add(digest)
            except OSError:
                known = False  # absent, wrong size, not a file: not good (yet)
            self.good[digest] = known
        return known

    def packed_ok(self, packed: PackedEntry) -> bool:
        """Whether the pack's copy of this entry's blob has the right bytes (hashed once per run)."""
        where = (packed.pack, packed.entry.offset)
        known = self._packed_ok.get(where)
        if known is None:
            if packed.pack not in self._readers:
                try:
                    self._readers[packed.pack] = PackReader(packed.pack)
                except (OSError, PackError):
                    self._readers[packed.pack] = None
            reader = self._readers[packed.pack]
            try:
                known = reader is not None and reader.read(packed.entry) is not None
            except OSError:
                known = False
            self._packed_ok[where] = known
        return known

    def close(self) -> None:
        for reader in self._readers.values():
            if reader is not None:
                reader.close()
        self._readers.clear()

    def pack_writer(self) -> Writer:
        """The writer of packs and of ``packs/summary``: the run's file mode, synced when the run is."""
        return Writer(self.lay, file_mode=self.modes.file, exact_mode=True, dir_mode=self.modes.dir, fsync=self.fsync)

    def blob_present(self, digest: str, size: int) -> bool:
        """A cheap check (no read): a regular file of the right size."""
        try:
            st = os.lstat(self.lay.blob_path(digest))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == size

    # -- what the plan and the phases ask of a destination (the URL one has the same methods) --

    @property
    def where(self) -> str:
        return self.lay.root

    def manifest_bytes(self, kid: str) -> bytes | None:
        """The store's manifest of ``kid``: None when it has none, ``b""`` for a file that is not a manifest."""
        try:
            data, _ = read_regular(self.lay.manifest_path(kid))
        except FileNotFoundError:
            return None
        except NotRegularFile:
            return b""
        except OSError as exc:
            if exc.errno == errno.ENOTDIR:
                return None  # the store does not exist yet (dry run) or a shard is not a directory
            raise
        return data

    def blob_where(self, digest: str) -> str:
        return self.lay.blob_path(digest)

    def put_blob(self, digest: str, blob: bytes) -> bool:
        """Store a verified blob; False when the write was dropped."""
        return self.writer.write_blob(digest, blob) is not BlobWrite.DROPPED

    def keep_blob(self, digest: str, size: int) -> None:
        """A good blob the store has, that a new manifest will name: freshened, so a collector keeps it."""
        self.writer.freshen(self.lay.blob_path(digest), size)

    def put_manifest(self, manifest: Manifest) -> None:
        self.writer.write_manifest(manifest, signature=_signature(self, manifest))

    def blob_still_there(self, digest: str, size: int) -> bool:
        """After a manifest commit: whether its blob is still there (a collector may have taken it)."""
        return self.blob_present(digest, size)

    def restore_blob(self, digest: str, blob: bytes) -> None:
        self.writer.recheck(digest, blob)

    def write_pack(self, inputs: Sequence[PackInput], stats: dict[str, int]) -> str | None:
        """Write one new pack of ``inputs``; its path."""
        path = write_pack(self.lay, inputs, self.pack_writer().write_file, stats)
        self.summary.add(path)
        return path

    def finish(self, report: PublishReport) -> None:
        """After the last write: ``packs/summary`` for later publishers, ``packs/list`` for HTTP readers."""
        if self.dry_run:
            return
        if not self.summary.current and os.path.isdir(self.summary.packs_dir):
            self.summary.save(self.pack_writer().write_file)  # publishers after this one read one file
        if report.packs:
            save_listing(self.lay.root, self.pack_writer().write_file)  # what HTTP readers list

    def sync(self) -> None:
        """Make what was written so far durable: one ``syncfs`` per phase, not an fsync per file.

        Manifests are renamed into place only after the blobs they name were
        synced, so a crash of the publishing host never leaves a manifest whose
        blob is empty or absent; a blob left damaged is re-hashed and replaced by
        the next run before a new manifest names it.
        """
        if self.fsync and not self.dry_run:
            self.writer.sync()

    def make_tmp(self) -> None:
        """The store's ``tmp/``: owner-only, or the group's with ``group_shared`` (files in it stay private)."""
        self.writer.make_dir(self.lay.root)
        try:
            os.mkdir(self.lay.tmp, self.modes.tmp_dir)
        except FileExistsError:
            return
        os.chmod(self.lay.tmp, self.modes.tmp_dir)


#: How often one publisher reads ``packs/list`` and writes it again to get its pack listed.
_LISTING_TRIES = 5
_GROUP_SHARED_URL = (
    "--group-shared (group_shared) applies to a store directory: over HTTP the server sets the modes of what it writes "
    "(nginx: dav_access)"
)


def _store_url(dest: str) -> str:
    """``dest`` as a store URL; :class:`LayoutError` (bad usage) naming what is wrong with it."""
    try:
        return normalize_store_url(dest)
    except ValueError as exc:
        raise LayoutError(str(exc)) from None


class _UrlDest:
    """A store reached over HTTP: read with GET and HEAD, written with WebDAV PUT (see :mod:`.._remote.dav`).

    It answers what :class:`_Dest` answers, from requests: there is no listing of
    a directory, so each manifest a source holds is asked for (GET), and each blob
    a new manifest needs (HEAD). The store's copies are checked by their size, not
    hashed: that would download every blob the sources hold. ``verify`` where the
    store's files are hashes them. There are no mtimes to freshen: a blob this
    run did not upload is asked for again (HEAD) after the manifest naming it is
    stored, and stored again if a collector took it meanwhile.
    """

    verify_existing = False

    def __init__(self, url: str, *, dry_run: bool) -> None:
        self.url = url
        self.dry_run = dry_run
        self.signer: Signer | None = None
        #: The store's layout version (from its ``layout.json``, read by :meth:`prepare`).
        self.manifest_layout: int | Callable[[], int] = LAYOUT_VERSION
        self.good: dict[str, bool] = {}
        self.damaged: set[str] = set()
        #: The store's packed entries (key id -> entry): from the indexes of the packs ``packs/list`` names.
        self.packed: dict[str, PackedEntry] = {}
        #: Blobs this run stored: a collector keeps them (their mtime is new), so no re-check is needed.
        self._uploaded: set[str] = set()

    @property
    def where(self) -> str:
        return shown(self.url)

    def _at(self, relative: str) -> str:
        return join(self.url, relative)

    def _put(self, relative: str, data: bytes, *, accept: Callable[[bytes], bool] | None = None) -> None:
        """Upload a small file, then read every byte of it back (``accept``: what else it may hold)."""
        url = self._at(relative)
        check_bytes(url, data, put(url, data, root=self.url), accept=accept)

    def prepare(self, report: PublishReport) -> None:
        """Lay the store out if it has no ``layout.json``, mark it shared, and read what its packs hold."""
        got = fetch(self._at(LAYOUT_FILE), limit=4096)
        if got is None:
            report.created = True
            current = None
        else:
            current = parse_layout(got[0])
            if current is None:
                raise LayoutError(
                    f"the store at {self.where} has a damaged {LAYOUT_FILE}: repair it where the store's files are "
                    "(cuda-program-cas verify --repair DIR)"
                )
            self.manifest_layout = check_layout_data(self.where, current)  # LayoutError: newer, or other hashes
        if not self.dry_run:
            # As a directory store is laid out: the tag, then layout.json (marked shared), before any entry.
            if size_of(self._at("CACHEDIR.TAG")) is None:
                self._put("CACHEDIR.TAG", CACHEDIR_TAG)
            raw = layout_bytes(current, shared=True)
            if raw is not None:
                self._put(LAYOUT_FILE, raw)
        if report.created:
            return
        names, _etag = self._listing()
        for name in reversed(names):  # oldest first: a newer pack's entry of a key replaces an older one's
            index = self._pack_index(name)
            if index is None:
                continue
            for key in index.key_ids():
                entry = index.find_key(key)  # None for a damaged entry: absent
                if entry is not None:
                    self.packed[entry.key_id] = PackedEntry(name, entry)

    def _listing(self, sent: tuple[bytes, int] | None = None) -> tuple[list[str], str | None]:
        """The pack names ``packs/list`` holds (none when it is absent), and its ETag.

        ``sent``: the bytes this run just uploaded there and the status the PUT got.
        What is read instead must be a valid listing (another publisher's, written
        since): nothing, or a part, is a server that did not store it.
        """
        url = self._at(f"packs/{LISTING}")
        got = fetch(url, limit=MAX_LISTING_BYTES)
        if sent is not None and (got is None or (got[0] != sent[0] and parse_listing(got[0]) is None)):
            body, status = sent
            held = None if got is None else len(got[0])
            raise not_stored(url, status, len(body), held, other=held == len(body))
        if got is None:
            return [], None
        names = parse_listing(got[0])
        if names is None:
            raise CacheError(
                f"the store at {self.where} has a damaged packs/{LISTING}: write it again where the store's files "
                "are (cuda-program-cas repack STORE does)"
            )
        return names, got[1]

    def _pack_index(self, name: str) -> PackIndex | None:
        """The index of the pack ``name``: its trailer, then its index, each one Range GET; None when it is gone."""
        url = self._at(f"packs/{name}")
        tail = fetch_tail(url, TRAILER_SIZE)
        if tail is None:
            return None  # retired since the listing was written: its entries are in a newer pack
        trailer, size = tail
        try:
            # The trailer's count and the size the server gave decide nothing: an index
            # longer than any entry may be is refused before it is fetched.
            offset, length = PackIndex.span(size, trailer, name, max_index=env_max_entry_size())
            raw = fetch_range(url, offset, length)
            return None if raw is None else PackIndex(name, size, trailer, raw)
        except PackError as exc:
            # A pack nodes cannot read either: its entries count as absent, and are published again.
            _log.debug("cuda-program-cas: pack %s of %s is not usable: %s", name, self.where, exc)
            return None

    # -- what the plan and the phases ask (as of :class:`_Dest`) --

    def manifest_bytes(self, kid: str) -> bytes | None:
        try:
            got = fetch(self._at(url_path(INDEX, kid)), limit=MAX_MANIFEST_BYTES)
        except HttpFailure as exc:
            if exc.kind == "too large":
                return b""  # not a manifest: replaced
            raise
        return None if got is None else got[0]

    def blob_ok(self, digest: str, size: int) -> bool:
        known = self.good.get(digest)
        if known is None:
            known = self.good[digest] = size_of(self._at(url_path(BLOBS, digest))) == size
        return known

    blob_present = blob_ok

    def packed_ok(self, packed: PackedEntry) -> bool:
        return True  # its index entry passed its check; the blob is not downloaded to be hashed

    def blob_where(self, digest: str) -> str:
        return self._at(url_path(BLOBS, digest))

    def put_blob(self, digest: str, blob: bytes) -> bool:
        url = self._at(url_path(BLOBS, digest))
        check_size(url, blob, put(url, blob, root=self.url))  # before a manifest names it
        self._uploaded.add(digest)
        return True

    def keep_blob(self, digest: str, size: int) -> None:
        return  # no mtime to set over HTTP: blob_still_there() checks again after the manifest

    def put_manifest(self, manifest: Manifest) -> None:
        kid = manifest.key_id
        assert kid is not None
        # Another publisher's valid manifest of the key, renamed in at the same moment, is no lie.
        data = manifest.encode() + _signature(self, manifest)
        self._put(url_path(INDEX, kid), data, accept=lambda held: parse_manifest(held, kid) is not None)

    def blob_still_there(self, digest: str, size: int) -> bool:
        if digest in self._uploaded:
            return True
        self.good.pop(digest, None)
        return self.blob_ok(digest, size)

    def restore_blob(self, digest: str, blob: bytes) -> None:
        self.put_blob(digest, blob)

    def write_pack(self, inputs: Sequence[PackInput], stats: dict[str, int]) -> str | None:
        """Upload one new pack of ``inputs``, then add it to ``packs/list``; its URL (None: nothing to pack).

        The pack is built in a temp file (its blobs read and verified one by
        one), so memory holds one blob at a time whatever the pack's size.
        """
        name = pack_name()
        with tempfile.TemporaryFile(prefix="cpcas-pack-") as f:
            for chunk in pack_chunks(inputs, stats):
                f.write(chunk)
            if not stats.get("entries"):
                return None
            f.flush()
            url = self._at(f"packs/{name}")
            check_tail(url, f, put(url, f, root=self.url))  # before the listing names it
        self._list_pack(name)
        return self._at(f"packs/{name}")

    def _list_pack(self, name: str) -> None:
        """Add ``name`` to ``packs/list``, after the pack itself is stored.

        Read, add, write, read again: another publisher's write of the listing
        at the same moment may have dropped this name, so it is added again
        until a read shows it (a few tries). The write is conditional on the
        ETag read (``If-Match``; ``If-None-Match: *`` where there was none): a
        server that honours it (S3 does) refuses a write over a listing that
        changed meanwhile; nginx ignores it, and the read after catches most such races.
        """
        sent: tuple[bytes, int] | None = None
        for _ in range(_LISTING_TRIES):
            names, etag = self._listing(sent)
            if name in names:
                return
            cond = {"If-None-Match": "*"} if etag is None else {} if etag.startswith("W/") else {"If-Match": etag}
            body = encode_listing([*names, name])
            status = put(self._at(f"packs/{LISTING}"), body, root=self.url, headers=cond)
            sent = None if status == 412 else (body, status)  # 412: refused, another publisher's is newer
        names, _ = self._listing(sent)
        if name not in names:
            raise CacheError(
                f"{self.where}/packs/{LISTING}: other publishers kept replacing it; the pack {name} is stored but "
                "not listed: publish again, or run repack where the store's files are"
            )

    def finish(self, report: PublishReport) -> None:
        return  # the listing was written with the pack; no packs/summary over HTTP (it is a directory's cache)

    def sync(self) -> None:
        return  # the server makes each upload durable before it answers

    def close(self) -> None:
        return


_Target = _Dest | _UrlDest


def _signature(target: _Target, manifest: Manifest) -> bytes:
    """The signature line of ``manifest`` by the run's key (``$CUDA_PROGRAM_CAS_SIGNING_KEY``), or nothing."""
    signer = target.signer
    return b"" if signer is None else signer.sign(manifest.encode())


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
    target: _Target
    if is_store_url(dest):
        url = _store_url(os.fspath(dest))
        if group_shared:
            raise ValueError(_GROUP_SHARED_URL)
        report = PublishReport(sources=srcs, dest=shown(url), dry_run=dry_run)
        target = _UrlDest(url, dry_run=dry_run)
        target.prepare(report)
    else:
        root = os.path.abspath(os.fspath(dest))
        report = PublishReport(sources=srcs, dest=root, dry_run=dry_run)
        target = _open_dir(root, report, group_shared=group_shared, fsync=fsync, verify_existing=verify_existing)
    target.signer = signer
    try:
        pending: list[_Item] = []
        for n, src in enumerate(srcs):
            if progress:
                progress(f"publishing {src}", n, len(srcs))
            if isinstance(target, _Dest) and os.path.realpath(src) == os.path.realpath(target.where):
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
            if pack:
                pending.extend(_plan(src, target, report))
            else:
                _publish_one(src, target, report)
        if pack and pending:
            _publish_pack(pending, target, report)
        target.finish(report)
    finally:
        target.close()
    if progress:
        progress("published", len(srcs), len(srcs))
    report._settle()
    return report


def _open_dir(root: str, report: PublishReport, *, group_shared: bool, fsync: bool, verify_existing: bool) -> _Dest:
    """The store directory at ``root``, laid out (``created``) or made ready for this run."""
    modes = _Modes.for_process(group_shared)
    state = check_layout(root)  # LayoutError for a file, a foreign or a newer layout
    target = _Dest(root, modes, dry_run=report.dry_run, fsync=fsync, verify_existing=verify_existing)
    if state is not LayoutState.OK:
        report.created = True
        if not report.dry_run:
            _lay_out(target)
    elif not report.dry_run:
        target.make_tmp()
        mark_shared_store(root, target.lay.tmp, mode=modes.file)
        if group_shared:
            _fix_top_modes(target)
        Remover(target.lay).sweep_temp()
    return target


def _lay_out(target: _Dest) -> None:
    """Create the store with the run's modes; ``layout.json`` comes last, so nodes wait for it."""
    lay = target.lay
    for path in (lay.root, lay.blobs, lay.index):
        target.writer.make_dir(path)
    target.make_tmp()
    create_layout(lay.root)
    mark_shared_store(lay.root, lay.tmp, mode=target.modes.file)
    _fix_top_modes(target)


def _fix_top_modes(target: _Dest) -> None:
    """Give the store's top-level files and directories the run's modes, where this user owns them."""
    lay = target.lay
    wanted = [(lay.root, target.modes.dir), (lay.blobs, target.modes.dir), (lay.index, target.modes.dir)]
    wanted += [(lay.tmp, target.modes.tmp_dir)]
    wanted += [(os.path.join(lay.root, n), target.modes.file) for n in ("layout.json", "CACHEDIR.TAG")]
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
            report.errors.append(f"{target.blob_where(digest)}: the write was dropped")
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
