"""Publish's target: the store being published into, over its engine (a directory, WebDAV or Redis).

What it holds and how it is written, for :mod:`cuda_program_cas._verbs.publish` (whose docstring
says the plan and its order); a directory's own set-up (laid out, its top-level modes).
"""

from __future__ import annotations

import os
import stat

from cuda_program_cas._base.engine import Engine, StoreFailure
from cuda_program_cas._base.errors import LayoutError
from cuda_program_cas._base.frame import encode, room
from cuda_program_cas._base.signing import Signer
from cuda_program_cas._base.urls import normalize_store_url
from cuda_program_cas._disk.direngine import DirEngine
from cuda_program_cas._disk.layout import (
    BLOBS,
    CACHEDIR_TAG,
    INDEX,
    LAYOUT_FILE,
    Layout,
    LayoutState,
    check_layout,
    check_layout_data,
    create_layout,
    layout_bytes,
    parse_layout,
    url_path,
)
from cuda_program_cas._disk.packsummary import PackedEntry
from cuda_program_cas._disk.remove import Remover
from cuda_program_cas._shared.tiers import PackTarget, open_packs
from cuda_program_cas._shared.upload import put_checked, where
from cuda_program_cas.index import MAX_MANIFEST_BYTES, Manifest, parse_manifest

from .pubreport import PublishReport

#: What a put that was dropped, not failed, says (a full disk, a shard that is not a directory).
_DROPPED = ("dropped", "not a directory")

__all__ = ["CACHEDIR", "Target", "fix_top_modes", "open_dir", "store_url"]


#: The name of the store's cache-directory tag.
CACHEDIR = "CACHEDIR.TAG"


class Target:
    """The store being published into, over its engine (a directory, WebDAV or Redis): what it holds, and writes.

    One class for every engine. What differs is the engine's
    (:mod:`cuda_program_cas._shared.tiers` picks it by the address's scheme), its
    packs (:func:`cuda_program_cas._shared.tiers.open_packs`: none for Redis), and,
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
            check_layout_data(self.where, current)  # LayoutError: older, newer, or other hashes
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
        """A cheap check (no read): an object of the right size (framed: any size it may take, :func:`.frame.room`)."""
        try:
            held = self.engine.size(url_path(BLOBS, digest))
            return held is not None and (held == size or 0 < held <= room(size))
        except StoreFailure as exc:
            if exc.outage:
                raise
            return False

    def put_blob(self, digest: str, blob: bytes) -> bool:
        """Store a verified blob and read it back, before a manifest names it; False when the write was dropped."""
        try:
            put_checked(self.engine, url_path(BLOBS, digest), encode(blob), whole=False)
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
            name = url_path(BLOBS, digest)
            held = self.dir.size(name)  # a framed blob's size is not the raw size (verified by blob_ok)
            self.dir.freshen(name, size if held is None or held > room(size) else held)

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

    def finish(self, report: PublishReport) -> None:
        if self.packs is not None and not self.dry_run:
            self.packs.finish(bool(report.packs))
        if not self.dry_run:
            from cuda_program_cas._shared.keylist import KEYS, list_published

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


def store_url(dest: str) -> str:
    """``dest`` as a store URL; :class:`LayoutError` (bad usage) naming what is wrong with it."""
    try:
        return normalize_store_url(dest)
    except ValueError as exc:
        raise LayoutError(str(exc)) from None


def open_dir(engine: DirEngine, report: PublishReport) -> None:
    """What only a store directory needs before its layout: refused if foreign, laid out, its ``tmp/`` swept.

    A directory that holds no store yet (or a damaged ``layout.json`` among our
    own names) is laid out with the run's modes (``created``); ``layout.json``
    comes last, so nodes wait for it. The shared mark is :meth:`Target.prepare`'s.
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


def fix_top_modes(engine: DirEngine) -> None:
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
