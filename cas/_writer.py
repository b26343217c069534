"""The write protocol: every file the cache creates is written here, and only here.

- Each file goes to a unique temp file in the cache's own ``tmp/``, gets its final
  mode, and is renamed into place with :func:`os.replace`: a reader never sees a
  partial file, and the temp file never survives an exception.
- An entry is its blob first, then its manifest, then a re-check that the blob is
  still there (a collector may have removed it in between): a manifest never
  names a blob that was not stored.
- A blob that already exists is not rewritten: its mtime is freshened, so a
  concurrent collector sees it as young. A writer that verifies existing blobs
  (``publish``) hashes one before trusting it and replaces it when it is bad.

What differs between callers is options of one :class:`Writer`, not another
writer: file and directory modes (a shared store's are group-readable, setgid),
whether each file is fsynced, and a shard guard that refuses symlinked shards.
``put``, the local copy of a shared hit, ``import-filestream`` and ``publish``
all write through it.
"""

from __future__ import annotations

import enum
import errno
import itertools
import logging
import os
import secrets
import stat
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from blake3 import blake3

from cuda_program_cas_index import Manifest

from ._files import SizeMismatch, is_sharing_violation, read_regular, with_sharing_retry
from ._fork import after_fork_call

if TYPE_CHECKING:
    from ._files import ShardGuard
    from ._layout import Layout

__all__ = [
    "DROP_ERRNOS",
    "UNWRITABLE_ERRNOS",
    "BlobWrite",
    "WriteResult",
    "Writer",
    "atomic_write",
    "current_umask",
    "make_tmp_dir",
    "sync_filesystem",
]

_log = logging.getLogger("cas")
_O_BINARY = getattr(os, "O_BINARY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY | _O_NOFOLLOW
_HAVE_FCHMOD = hasattr(os, "fchmod")

#: Write failures that drop the write instead of failing the caller: the disk is
#: full, something that is not ours is in the way of a file (a directory where a
#: blob or manifest belongs), or the rename would cross file systems (``blobs/`` or
#: ``tmp/`` moved to another disk behind a symlink: staging elsewhere would leave
#: temp files no sweep finds).
DROP_ERRNOS = frozenset(
    e
    for e in (
        errno.ENOSPC,
        getattr(errno, "EDQUOT", None),
        errno.EFBIG,
        errno.EISDIR,
        errno.ENOTDIR,
        errno.ELOOP,
        errno.ENOTEMPTY,
        errno.EEXIST,
        errno.EXDEV,
    )
    if e is not None
)
#: Write failures of a cache that cannot be written (permissions, a read-only
#: mount, perhaps remounted read-only under an open cache). A cache drops such a
#: write, as ccache and sccache do in their read-only modes; a maintenance verb
#: asked to write there fails instead.
UNWRITABLE_ERRNOS = frozenset((errno.EACCES, errno.EPERM, errno.EROFS))


class WriteResult(enum.Enum):
    """What storing one entry did. ``STORED`` and ``DEDUPLICATED`` are true, ``DROPPED`` false."""

    #: New content: a blob and a manifest were written.
    STORED = "stored"
    #: The content was already stored (under this or another key): only a manifest was written.
    DEDUPLICATED = "deduplicated"
    #: Nothing was stored: the disk is full, a file was in the way or locked, a shard is not a directory.
    DROPPED = "dropped"

    def __bool__(self) -> bool:
        return self is not WriteResult.DROPPED


class BlobWrite(enum.Enum):
    """What :meth:`Writer.write_blob` did."""

    WRITTEN = "written"
    EXISTED = "existed"
    DROPPED = "dropped"


class _TempNames:
    """Unique temp file names, ``<pid>-<16 hex>.tmp``: a random half per process, then a counter.

    Drawing them costs no system call (a fresh random name per write cost a
    ``getpid`` and a ``getrandom``); a child after ``fork`` draws a new half.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._prefix = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._count = itertools.count()

    def next(self, tmp_dir: str) -> str:
        return f"{tmp_dir}{os.sep}{self._prefix}{next(self._count) & 0xFFFFFFFF:08x}.tmp"


_TEMP_NAMES = _TempNames()
after_fork_call(_TEMP_NAMES.reset)


def _tmp_name(tmp_dir: str) -> str:
    return _TEMP_NAMES.next(tmp_dir)


def atomic_write(
    target: str,
    data: bytes | memoryview | Iterable[bytes],
    tmp_dir: str,
    *,
    mode: int = 0o600,
    exact_mode: bool = False,
    fsync: bool = False,
    make_dir: object = None,
) -> bool:
    """Write ``data`` to ``target`` through a unique temp file in ``tmp_dir`` and ``os.replace``.

    ``data`` may be an iterable of chunks (a pack, written as it is produced).
    The file gets ``mode`` less the umask, or exactly ``mode`` with ``exact_mode``.
    Creates ``tmp_dir`` and the target's parent directory when they are missing
    (``make_dir(path)`` when given, else :func:`os.makedirs`). Returns False only
    when a Windows sharing violation outlasted the retry budget: the write is
    dropped. The temp file never survives an exception.
    """
    tmp = _tmp_name(tmp_dir)
    try:
        fd = os.open(tmp, _WRITE_FLAGS, 0o600)  # private while incomplete, whatever its final mode
    except (FileNotFoundError, NotADirectoryError):
        make_tmp_dir(tmp_dir)
        fd = os.open(tmp, _WRITE_FLAGS, 0o600)
    except FileExistsError:  # a name left by a process long gone with the same pid and draw
        tmp = os.path.join(tmp_dir, f"{os.getpid()}-{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, _WRITE_FLAGS, 0o600)
    try:
        try:
            for chunk in (data,) if isinstance(data, (bytes, memoryview)) else data:
                view = memoryview(chunk)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            if mode != 0o600 and _HAVE_FCHMOD:
                # The final mode, set once the bytes are all written, just before the rename.
                os.fchmod(fd, mode if exact_mode else mode & ~current_umask())
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            with_sharing_retry(lambda: os.replace(tmp, target))
        except FileNotFoundError:
            # The shard directory is created on first use rather than stat-ed on
            # every write (or a collector pruned it meanwhile).
            parent = os.path.dirname(target)
            if callable(make_dir):
                make_dir(parent)
            else:
                os.makedirs(parent, exist_ok=True)
            with_sharing_retry(lambda: os.replace(tmp, target))
    except PermissionError as exc:
        _discard(tmp)
        if is_sharing_violation(exc):
            return False
        raise
    except BaseException:
        _discard(tmp)
        raise
    return True


def make_tmp_dir(tmp_dir: str) -> None:
    """Create the staging directory ``tmp_dir`` (and its parent) unless it is one already.

    Anything else in its place (a file, a FIFO, a symlink to nothing) would drop
    every write of every process for good: it is replaced by a directory, once,
    with a WARNING. It is unlinked, never moved: ``unlink`` cannot take a directory,
    so a process that races here cannot remove the one another just made.
    """
    try:
        os.mkdir(tmp_dir, 0o700)
        return
    except FileNotFoundError:
        os.makedirs(os.path.dirname(tmp_dir), exist_ok=True)
    except FileExistsError:
        if os.path.isdir(tmp_dir):  # also through a symlink: an operator's choice
            return
        try:
            st = os.lstat(tmp_dir)
            os.unlink(tmp_dir)
        except FileNotFoundError:
            pass  # another process replaced it meanwhile
        else:
            kind = "symlink" if stat.S_ISLNK(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "special file"
            _log.warning(
                "cuda-program-cas: %s was a %s of %d bytes, not a directory; replaced it with a directory",
                tmp_dir,
                kind,
                st.st_size,
            )
    try:
        os.mkdir(tmp_dir, 0o700)
    except FileExistsError:
        if not os.path.isdir(tmp_dir):
            raise


def current_umask() -> int:
    """The process umask, read without changing it where the system allows."""
    try:
        with open("/proc/self/status", "rb") as fh:  # bytes: no codec needed (a restricted child may lack one)
            for line in fh:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def sync_filesystem(path: str) -> None:
    """``syncfs`` on the file system of ``path`` where Linux offers it, else a whole-system ``sync``."""
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
    if hasattr(os, "sync"):
        os.sync()


class Writer:
    """Writes the blobs and manifests of one cache root.

    ``file_mode``/``dir_mode``: modes of new files (less the umask, or exactly
    with ``exact_mode``) and directories (``dir_mode``
    None: :func:`os.makedirs`' default under the umask; with ``setgid`` new
    directories get the setgid bit, so they inherit the root's group).
    ``fsync``: fsync each file (without it, :meth:`sync` makes a batch durable).
    ``verify_existing``: hash a blob already there before trusting it.
    ``guard``: refuse writes through a shard that is a symlink or not a directory.
    """

    def __init__(
        self,
        lay: Layout,
        *,
        file_mode: int = 0o600,
        exact_mode: bool = False,
        dir_mode: int | None = None,
        setgid: bool = False,
        fsync: bool = False,
        verify_existing: bool = False,
        guard: ShardGuard | None = None,
    ) -> None:
        self.lay = lay
        self._file_mode = file_mode
        self._exact_mode = exact_mode
        self._dir_mode = dir_mode
        self._setgid = setgid
        self._fsync = fsync
        self._verify_existing = verify_existing
        self._guard = guard
        #: digest -> True once this writer proved the stored blob good (``verify_existing``).
        self._good: dict[str, bool] = {}
        self._made: set[str] = set()

    # -- files -----------------------------------------------------------------------

    def write_file(self, target: str, data: bytes | memoryview | Iterable[bytes], *, mode: int | None = None) -> bool:
        """Write one file atomically (see :func:`atomic_write`); False when a sharing violation dropped it."""
        make_dir = self.make_dir if self._dir_mode is not None else None
        return atomic_write(
            target,
            data,
            self.lay.tmp,
            mode=self._file_mode if mode is None else mode,
            exact_mode=self._exact_mode,
            fsync=self._fsync,
            make_dir=make_dir,
        )

    def make_dir(self, path: str) -> None:
        """Create ``path`` and its missing parents with this writer's directory mode."""
        if path in self._made:
            return
        parent = os.path.dirname(path)
        if parent != path and not os.path.isdir(parent):
            self.make_dir(parent)
        try:
            os.mkdir(path, 0o777 if self._dir_mode is None else self._dir_mode)
        except FileExistsError:
            pass
        else:
            if self._setgid and self._dir_mode is not None:
                os.chmod(path, self._dir_mode)  # mkdir drops setgid; chmod sets it
        self._made.add(path)

    def sync(self) -> None:
        """Make what was written so far durable: one ``syncfs`` for a batch, not an fsync per file."""
        sync_filesystem(self.lay.root)

    # -- entries ---------------------------------------------------------------------

    def write_blob(self, digest: str, data: bytes | memoryview) -> BlobWrite:
        """Store a blob (``digest`` computed by the caller) unless it is already there.

        An existing blob of the right size (and, with ``verify_existing``, the right
        bytes) is freshened instead of rewritten; one of the wrong size or bytes is
        replaced.
        """
        if self._guard is not None and not self._guard.ok(self.lay.blobs, digest):
            return BlobWrite.DROPPED
        path = self.lay.blob_path(digest)
        if self._existing_ok(digest, path, len(data)) and self.freshen(path, len(data)):
            return BlobWrite.EXISTED
        if not self.write_file(path, data):
            return BlobWrite.DROPPED
        self._good[digest] = True
        return BlobWrite.WRITTEN

    def _existing_ok(self, digest: str, path: str, size: int) -> bool:
        if not self._verify_existing:
            return True
        known = self._good.get(digest)
        if known is None:
            try:
                data, _ = read_regular(path, size)
            except (OSError, SizeMismatch):
                return False  # absent, wrong size, not a file: write it
            known = self._good[digest] = blake3(data).hexdigest() == digest
        return known

    def freshen(self, path: str, size: int) -> bool:
        """Set a blob's mtime to now if it exists with ``size`` bytes; True if it did."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        try:
            os.utime(path)
        except FileNotFoundError:
            # A collector removed it between the stat and the touch: store it again.
            return False
        return True

    def write_manifest(self, manifest: Manifest, *, used_ns: int | None = None) -> bool:
        """Commit the manifest of ``manifest.key_id``; False when it was dropped.

        ``used_ns``: the entry's last use, as its recency (import keeps FileStream's).
        """
        kid = manifest.key_id
        assert kid is not None
        if self._guard is not None and not self._guard.ok(self.lay.index, kid):
            return False
        path = self.lay.manifest_path(kid)
        if not self.write_file(path, manifest.encode()):
            return False
        if used_ns is not None:
            try:
                os.utime(path, ns=(used_ns, used_ns))
            except OSError:
                pass
        return True

    def recheck(self, digest: str, data: bytes | memoryview) -> None:
        """After a manifest commit: store the blob again if a collector took it in between."""
        try:
            if stat.S_ISREG(os.lstat(self.lay.blob_path(digest)).st_mode):
                return
        except FileNotFoundError:
            pass
        self._good.pop(digest, None)
        self.write_blob(digest, data)

    def commit(self, kid: str, data: bytes | memoryview, digest: str, *, used_ns: int | None = None) -> WriteResult:
        """Store one entry: blob, then manifest, then re-check the blob.

        Raises ``OSError`` for what is not a dropped write (permission denied, a
        read-only file system); a blob this call wrote is removed again then.
        """
        blob = self.write_blob(digest, data)
        if blob is BlobWrite.DROPPED:
            return WriteResult.DROPPED  # the blob was not stored: a manifest must not name it
        try:
            committed = self.write_manifest(Manifest(digest, len(data), kid), used_ns=used_ns)
        except OSError:
            if blob is BlobWrite.WRITTEN:
                _discard(self.lay.blob_path(digest))
            raise
        if not committed:
            return WriteResult.DROPPED
        self.recheck(digest, data)
        return WriteResult.DEDUPLICATED if blob is BlobWrite.EXISTED else WriteResult.STORED
