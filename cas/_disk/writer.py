"""The write protocol: every file the cache creates is written here, and only here.

- Each file is written whole or not at all (:mod:`.atomic`).
- An entry is its blob first, then its manifest, then a re-check that the blob is still
  there (a collector may have removed it in between): a manifest never names a blob that
  was not stored.
- A blob that already exists is not rewritten: its mtime is freshened, so a concurrent
  collector sees it as young.

What differs between callers (modes, fsync, a shard guard) is options of one :class:`Writer`.
"""

from __future__ import annotations

import enum
import errno
import os
import stat
from collections.abc import Iterable
from typing import TYPE_CHECKING

from cuda_program_cas.index import Manifest

from .atomic import atomic_write, discard, sync_filesystem

if TYPE_CHECKING:
    from .files import ShardGuard
    from .layout import Layout

__all__ = ["DROP_ERRNOS", "UNWRITABLE_ERRNOS", "WriteResult", "Writer"]

#: Write failures that drop the write instead of failing the caller: a full disk, something
#: not ours in the way, or a rename across file systems (``tmp/`` moved behind a symlink).
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
#: Write failures of a cache that cannot be written: a cache drops such a write (as ccache
#: does in its read-only mode); a maintenance verb fails instead.
UNWRITABLE_ERRNOS = frozenset((errno.EACCES, errno.EPERM, errno.EROFS))


class WriteResult(enum.Enum):
    """What storing one entry did. ``STORED`` and ``DEDUPLICATED`` are true, ``DROPPED`` false."""

    STORED = "stored"
    #: The content was already stored: only a manifest was written.
    DEDUPLICATED = "deduplicated"
    DROPPED = "dropped"

    def __bool__(self) -> bool:
        return self is not WriteResult.DROPPED


class BlobWrite(enum.Enum):
    """What :meth:`Writer.write_blob` did."""

    WRITTEN = "written"
    EXISTED = "existed"
    DROPPED = "dropped"


class Writer:
    """Writes the blobs and manifests of one cache root: ``file_mode`` less the umask (exactly: ``exact_mode``);
    ``dir_mode`` (None: the umask's; ``setgid``: the root's group); ``fsync`` each file (else :meth:`sync` a
    batch); ``guard``: no writes through a shard that is a symlink or not a directory."""

    def __init__(
        self,
        lay: Layout,
        *,
        file_mode: int = 0o600,
        exact_mode: bool = False,
        dir_mode: int | None = None,
        setgid: bool = False,
        fsync: bool = False,
        guard: ShardGuard | None = None,
    ) -> None:
        self.lay = lay
        self._file_mode = file_mode
        self._exact_mode = exact_mode
        self._dir_mode = dir_mode
        self._setgid = setgid
        self._fsync = fsync
        self._guard = guard
        self._made: set[str] = set()

    def write_file(self, target: str, data: bytes | memoryview | Iterable[bytes]) -> bool:
        """Write one file atomically (see :func:`atomic_write`); False when a sharing violation dropped it."""
        make_dir = self.make_dir if self._dir_mode is not None else None
        return atomic_write(
            target,
            data,
            self.lay.tmp,
            mode=self._file_mode,
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

    def write_blob(self, digest: str, data: bytes | memoryview) -> BlobWrite:
        """Store a blob (``digest`` computed by the caller); one there of the right size is freshened instead."""
        if self._guard is not None and not self._guard.ok(self.lay.blobs, digest):
            return BlobWrite.DROPPED
        path = self.lay.blob_path(digest)
        if self.freshen(path, len(data)):
            return BlobWrite.EXISTED
        if not self.write_file(path, data):
            return BlobWrite.DROPPED
        return BlobWrite.WRITTEN

    def freshen(self, path: str, size: int) -> bool:
        """Set a blob's mtime to now if it exists with ``size`` bytes; True if it did."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        try:
            os.utime(path)
        except FileNotFoundError:  # a collector took it between the stat and the touch
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

    def commit(self, kid: str, data: bytes | memoryview, digest: str, *, used_ns: int | None = None) -> WriteResult:
        """Store one entry: blob, then manifest, then re-check the blob.

        ``OSError`` for what is not a dropped write; a blob this call wrote is removed again then.
        """
        blob = self.write_blob(digest, data)
        if blob is BlobWrite.DROPPED:
            return WriteResult.DROPPED
        try:
            committed = self.write_manifest(Manifest(digest, len(data), kid), used_ns=used_ns)
        except OSError:
            if blob is BlobWrite.WRITTEN:
                discard(self.lay.blob_path(digest))
            raise
        if not committed:
            return WriteResult.DROPPED
        try:  # a collector may have taken the blob between its write and the manifest's: stored again
            kept = stat.S_ISREG(os.lstat(self.lay.blob_path(digest)).st_mode)
        except FileNotFoundError:
            kept = False
        if not kept:
            self.write_blob(digest, data)
        return WriteResult.DEDUPLICATED if blob is BlobWrite.EXISTED else WriteResult.STORED
