"""Publishing: merge nodes' local caches into a shared store that a cluster reads.

A shared store is an ordinary cache directory that nodes open read-only. Only
the publisher writes it, and only through this module, so that a node reading it
meanwhile never sees a partial file or a manifest whose blob is not there yet:

- per source, first every blob the new manifests need, read from the source,
  verified against its digest (a bad one is skipped and reported, and so is
  every manifest naming it), then the manifests;
- every file goes to a private temp file in the store's own ``tmp/``, gets its
  final mode, and is renamed into place with :func:`os.replace`;
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
manifest is garbage or whose blob is missing or corrupt is replaced.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from blake3 import blake3

from index import Manifest, parse_manifest
from index._files import NotRegularFile, read_regular
from index._index import MAX_MANIFEST_BYTES, Index

from ._blobs import BlobStore
from ._errors import CorruptBlobError, LayoutError
from ._gc import SHARED_MIN_GRACE_S
from ._layout import Layout, check_layout, create_layout, mark_shared_store, sweep_stale_temp_files

__all__ = ["SHARED_MIN_GRACE_S", "PublishReport", "publish"]

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)
_HAVE_SYNC = hasattr(os, "sync")
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_BINARY


@dataclass
class PublishReport:
    """What one :func:`publish` run did (or, with ``dry_run``, would do)."""

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

    @property
    def problems(self) -> int:
        """Problems found in the sources (each left out of the store)."""
        return len(self.bad_blobs) + len(self.missing_blobs) + len(self.invalid_manifests) + len(self.errors)

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["problems"] = self.problems
        return out


@dataclass(frozen=True)
class _Modes:
    file: int
    dir: int
    tmp_dir: int
    group_shared: bool

    @classmethod
    def for_process(cls, group_shared: bool) -> _Modes:
        umask = _current_umask()
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


def _sync_filesystem(path: str) -> None:
    """``syncfs`` on the store's filesystem where Linux offers it, else a whole-system ``sync``."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            fd = os.open(path, os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).syncfs(fd) == 0:
                    return
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            pass
    os.sync()


def _current_umask() -> int:
    """The process umask, read without changing it where the system allows."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class _Dest:
    """The store being published into: its paths, modes and what this run verified."""

    def __init__(self, root: str, modes: _Modes, *, dry_run: bool, fsync: bool) -> None:
        self.lay = Layout(root)
        self.index = Index(self.lay.index, None)
        self.modes = modes
        self.dry_run = dry_run
        self.fsync = fsync
        #: digest -> True when the store holds a verified copy (or will, in a dry run).
        self.good: dict[str, bool] = {}
        self._made: set[str] = set()

    def blob_path(self, digest: str) -> str:
        return os.path.join(self.lay.blobs, digest[:2], digest[2:])

    def blob_ok(self, digest: str, size: int) -> bool:
        """Whether the store holds this blob with the right bytes (hashed once per run)."""
        known = self.good.get(digest)
        if known is not None:
            return known
        try:
            data, _ = read_regular(self.blob_path(digest), size)
        except OSError:
            return False  # absent, wrong size, not a file: not good (yet)
        ok = blake3(data).hexdigest() == digest
        self.good[digest] = ok
        return ok

    def blob_present(self, digest: str, size: int) -> bool:
        """A cheap check (no read): a regular file of the right size."""
        try:
            st = os.lstat(self.blob_path(digest))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == size

    def freshen(self, digest: str) -> None:
        # A collector keeps what was written or freshened after its scan began.
        try:
            os.utime(self.blob_path(digest))
        except OSError:
            pass  # another publisher's file; the re-check after the manifest covers it

    def sync(self) -> None:
        """Make what was written so far durable: one ``sync()`` per phase, not an fsync per file.

        Manifests are renamed into place only after the blobs they name were
        synced, so a crash of the publishing host never leaves a manifest whose
        blob is empty or absent; a blob left damaged is re-hashed and replaced by
        the next run before a new manifest names it.
        """
        if self.fsync and not self.dry_run and _HAVE_SYNC:
            _sync_filesystem(self.lay.root)

    def ensure_dir(self, path: str) -> None:
        if path in self._made:
            return
        parent = os.path.dirname(path)
        if parent != path and not os.path.isdir(parent):
            self.ensure_dir(parent)
        try:
            os.mkdir(path, self.modes.dir)
        except FileExistsError:
            pass
        else:
            if self.modes.group_shared:
                os.chmod(path, self.modes.dir)  # mkdir drops setgid; chmod sets it
        self._made.add(path)

    def make_tmp(self) -> None:
        """The store's ``tmp/``: owner-only, or the group's with ``group_shared`` (files in it stay private)."""
        self.ensure_dir(self.lay.root)
        try:
            os.mkdir(self.lay.tmp, self.modes.tmp_dir)
        except FileExistsError:
            return
        os.chmod(self.lay.tmp, self.modes.tmp_dir)

    def install(self, target: str, data: bytes) -> None:
        """Write ``target`` atomically: private temp file, final mode, ``os.replace``."""
        self.ensure_dir(os.path.dirname(target))
        tmp = os.path.join(self.lay.tmp, f"publish-{os.getpid()}-{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, _TMP_FLAGS, 0o600)
        except FileNotFoundError:  # tmp/ removed meanwhile (by hand, or a cleanup)
            self.make_tmp()
            fd = os.open(tmp, _TMP_FLAGS, 0o600)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if hasattr(os, "fchmod"):
                    os.fchmod(fd, self.modes.file)
                if self.fsync and not _HAVE_SYNC:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.replace(tmp, target)
            except FileNotFoundError:  # the shard directory went (a collector pruning empty ones)
                self._made.discard(os.path.dirname(target))
                self.ensure_dir(os.path.dirname(target))
                os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


def publish(
    sources: Iterable[str | os.PathLike[str]],
    dest: str | os.PathLike[str],
    *,
    group_shared: bool = False,
    dry_run: bool = False,
    fsync: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
) -> PublishReport:
    """Merge the caches at ``sources`` into the shared store at ``dest`` (created if missing).

    Sources are only read. ``group_shared`` makes the store's files group-readable
    and its directories setgid; otherwise files and directories follow the umask.
    Temp files are always private. ``dry_run`` reads and verifies everything but
    writes nothing. ``progress(phase, done, total)`` is called per source. Raises
    :class:`LayoutError` when ``dest`` is not a cache, and
    ``OSError`` when it cannot be written; what was published until then is
    complete, and running again resumes.
    """
    root = os.path.abspath(os.fspath(dest))
    srcs = [os.path.abspath(os.fspath(s)) for s in sources]
    if not srcs:
        raise ValueError("publish needs at least one source cache")
    report = PublishReport(sources=srcs, dest=root, dry_run=dry_run)
    modes = _Modes.for_process(group_shared)
    state = check_layout(root)  # LayoutError for a file, a foreign or a newer layout
    target = _Dest(root, modes, dry_run=dry_run, fsync=fsync)
    if state != "ok":
        report.created = True
        if not dry_run:
            _lay_out(target)
    elif not dry_run:
        target.make_tmp()
        mark_shared_store(root, target.lay.tmp, mode=modes.file)
        if group_shared:
            _fix_top_modes(target)
        sweep_stale_temp_files(target.lay.tmp)
    for n, src in enumerate(srcs):
        if progress:
            progress(f"publishing {src}", n, len(srcs))
        if os.path.realpath(src) == os.path.realpath(root):
            report.errors.append(f"{src}: is the destination itself")
            continue
        try:
            src_state = check_layout(src)
        except (LayoutError, OSError) as exc:
            report.errors.append(f"{src}: {exc}")
            continue
        if src_state != "ok":
            report.errors.append(f"{src}: not a cuda-program-cas cache ({src_state})")
            continue
        _publish_one(src, target, report)
    if progress:
        progress("published", len(srcs), len(srcs))
    return report


def _lay_out(target: _Dest) -> None:
    """Create the store with the run's modes; ``layout.json`` comes last, so nodes wait for it."""
    lay = target.lay
    for path in (lay.root, lay.blobs, lay.index):
        target.ensure_dir(path)
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


def _publish_one(src: str, target: _Dest, report: PublishReport) -> None:
    lay = Layout(src)
    # 1. Plan: what each source manifest needs in the store.
    todo: list[tuple[str, Manifest, str, os.stat_result, str]] = []  # kid, manifest, path, stat, action
    for entry in Index(lay.index, None).scan():
        report.scanned += 1
        try:
            data, mst = read_regular(entry.path)
        except FileNotFoundError:
            report.vanished += 1
            continue
        except OSError as exc:
            report.invalid_manifests.append(f"{entry.path}: {exc.strerror or exc}")
            continue
        manifest = parse_manifest(data) if len(data) <= MAX_MANIFEST_BYTES else None
        if manifest is None:
            report.invalid_manifests.append(entry.path)
            continue
        action = _action(target, entry.key_id, manifest)
        if action == "same":
            report.unchanged += 1
        elif action == "conflict":
            report.conflicts += 1
        else:
            todo.append((entry.key_id, manifest, entry.path, mst, action))
    # 2. Blobs: every blob the plan needs, verified, before any manifest naming it.
    needed: dict[str, list[tuple[str, Manifest, str, os.stat_result, str]]] = {}
    for item in todo:
        needed.setdefault(item[1].digest, []).append(item)
    for digest, items in needed.items():
        size = items[0][1].size
        if target.blob_ok(digest, size):
            if not target.dry_run:
                target.freshen(digest)
            continue
        blob = _read_source_blob(src, lay, digest=digest, size=size, items=items, report=report)
        if blob is None:
            continue
        if not target.dry_run:
            target.install(target.blob_path(digest), blob)
        target.good[digest] = True
        report.blobs_published += 1
        report.bytes_published += len(blob)
    if needed:
        target.sync()
    # 3. Manifests, each after its blob; then make sure the blob is still there.
    for kid, manifest, _path, _mst, action in todo:
        if not target.good.get(manifest.digest):
            continue
        if action in ("new", "replace"):
            if not target.dry_run:
                target.install(target.index.path_for(kid), manifest.encode())
                if not target.blob_present(manifest.digest, manifest.size):
                    # A collector removed it after the blob phase: store it again.
                    blob = _read_source_blob(
                        src, lay, digest=manifest.digest, size=manifest.size, items=[], report=report
                    )
                    if blob is not None:
                        target.install(target.blob_path(manifest.digest), blob)
            if action == "new":
                report.published += 1
            else:
                report.replaced += 1
        else:  # "restore": the store had this very manifest but not its blob
            report.unchanged += 1
    if todo:
        target.sync()


def _action(target: _Dest, kid: str, manifest: Manifest) -> str:
    """``same``, ``restore`` (blob missing), ``new``, ``replace`` (store entry bad) or ``conflict``."""
    try:
        data, _ = read_regular(target.index.path_for(kid))
    except FileNotFoundError:
        return "new"
    except NotRegularFile:
        return "replace"
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            return "new"  # the store does not exist yet (dry run) or a shard is not a directory
        raise
    theirs = parse_manifest(data) if len(data) <= MAX_MANIFEST_BYTES else None
    if theirs == manifest:
        return "same" if target.blob_present(manifest.digest, manifest.size) else "restore"
    if theirs is not None and target.blob_ok(theirs.digest, theirs.size):
        return "conflict"
    return "replace"


def _read_source_blob(
    src: str,
    lay: Layout,
    *,
    digest: str,
    size: int,
    items: list[tuple[str, Manifest, str, os.stat_result, str]],
    report: PublishReport,
) -> bytes | None:
    """The verified bytes of a source blob, or None (reported) when it is missing or bad."""
    source = BlobStore(lay.blobs, None, lay.quarantine)
    path = source.path_for(digest)
    try:
        data, _st = source.read(digest, size)
    except FileNotFoundError:
        # Evicted by its node after we read the manifest? Then the manifest went too.
        still = sum(1 for it in items if _unchanged(it[2], it[3]))
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


def _unchanged(path: str, st: os.stat_result) -> bool:
    try:
        now = os.lstat(path)
    except OSError:
        return False
    return (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
