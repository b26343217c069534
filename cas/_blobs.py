"""Content-addressed blob store: ``blobs/<2 hex>/<62 hex>``, named by blake3 of the bytes.

A blob holds the compiled binary verbatim and nothing else, so ``cuobjdump`` and
``nvdisasm`` read it directly. A blob is never rewritten in place: storing bytes
that are already there freshens the blob's mtime instead, so a concurrent
collector sees it as young.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass

from blake3 import blake3

from index._files import (
    SizeMismatch,
    atomic_write,
    is_sharing_violation,
    read_regular,
    scan_sharded,
    with_sharing_retry,
)

from ._errors import CorruptBlobError

__all__ = ["BlobEntry", "BlobStore", "digest_of"]


def digest_of(data: bytes | bytearray | memoryview) -> str:
    """The digest that names ``data``: lowercase hex blake3."""
    return blake3(data).hexdigest()


@dataclass(frozen=True, slots=True)
class BlobEntry:
    """One blob file met during a scan."""

    digest: str
    path: str
    stat: os.stat_result


class BlobStore:
    """The blobs under ``<root>/blobs``; writes stage in ``tmp_dir`` (None: read-only)."""

    def __init__(self, directory: str, tmp_dir: str | None, quarantine_dir: str, *, file_mode: int = 0o600) -> None:
        self.directory = directory
        self._tmp = tmp_dir
        self._quarantine = quarantine_dir
        self._mode = file_mode

    def path_for(self, digest: str) -> str:
        """The path of a blob; ``digest`` must already be validated (see :func:`index.is_digest`)."""
        return f"{self.directory}{os.sep}{digest[:2]}{os.sep}{digest[2:]}"

    def read(self, digest: str, size: int | None = None) -> tuple[bytes, os.stat_result]:
        """The verified bytes of a blob, and the stat of its file.

        Raises ``FileNotFoundError`` when absent, :class:`cas.CorruptBlobError` when
        it does not hash to ``digest`` or (``size`` given) has another size, and
        ``OSError`` (``index._files.NotRegularFile`` among them) for what cannot be read
        or is not a regular file. The cache's own hit path does the same with fewer
        system calls (``CacheStore._read_blob``).
        """
        path = self.path_for(digest)
        try:
            data, st = read_regular(path, size)
        except SizeMismatch as exc:
            raise CorruptBlobError(path, digest, f"{exc.actual} bytes instead of {exc.expected}") from None
        actual = digest_of(data)
        if actual != digest:
            raise CorruptBlobError(path, digest, actual, st)
        return data, st

    def put(self, data: bytes | memoryview, digest: str) -> bool | None:
        """Store ``data`` (whose digest the caller computed); True if it was already stored.

        An existing blob of the right size is freshened (mtime set to now) rather
        than rewritten; one of the wrong size is damaged and replaced. None when
        the write was dropped (a Windows sharing violation outlasted the retries).
        """
        if self._tmp is None:
            raise PermissionError(f"blob store at {self.directory} is read-only")
        path = self.path_for(digest)
        if self.freshen(path, len(data)):
            return True
        if not atomic_write(path, data, self._tmp, mode=self._mode):
            return None
        return False

    def freshen(self, path: str, size: int) -> bool:
        """Set the blob's mtime to now if it exists with ``size`` bytes; True if it did."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        try:
            os.utime(path)
        except FileNotFoundError:
            # A collector removed it between the stat and the touch: store it again.
            return False
        return True

    def exists(self, digest: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(self.path_for(digest), follow_symlinks=False).st_mode)
        except OSError:
            return False

    def quarantine(self, digest: str, st: os.stat_result | None = None) -> str | None:
        """Move a bad blob aside into ``quarantine/`` (never returned again); returns where it went.

        With ``st``, only if it is still that file: a writer may have replaced it with good bytes.
        """
        path = self.path_for(digest)
        if self._tmp is None:
            return None
        if st is not None:
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                return None
            if (now.st_ino, now.st_size, now.st_mtime_ns) != (st.st_ino, st.st_size, st.st_mtime_ns):
                return None
        os.makedirs(self._quarantine, mode=0o700, exist_ok=True)
        dest = os.path.join(self._quarantine, f"{digest}.{time.time_ns()}.{os.getpid()}")
        try:
            with_sharing_retry(lambda: os.replace(path, dest))
        except FileNotFoundError:
            return None
        except PermissionError:
            return None
        return dest

    def remove_if_older(self, digest: str, cutoff_ns: int, seen: os.stat_result | None = None) -> int:
        """Unlink a blob unless it was written or freshened at or after ``cutoff_ns``.

        Returns the bytes freed (0 when it was kept or already gone). The mtime is
        checked just before the unlink so a writer that deduplicated against this
        blob after the collector's scan began keeps it; that writer re-checks the
        blob after committing its manifest, which covers the remaining window.

        ``seen`` is the blob's stat from the scan: a blob newer than the cutoff
        still goes when it is provably untouched since then (a freshen changes its
        mtime and ctime), or a blob written just before the scan would outlive its
        last manifest as an orphan and hold the cache over its cap.
        """
        path = self.path_for(digest)
        try:
            st = os.lstat(path)
            if st.st_mtime_ns >= cutoff_ns and (
                seen is None
                or (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                != (seen.st_ino, seen.st_size, seen.st_mtime_ns, seen.st_ctime_ns)
            ):
                return 0
            with_sharing_retry(lambda: os.unlink(path))
        except FileNotFoundError:
            return 0
        except PermissionError as exc:
            if is_sharing_violation(exc):
                return 0
            raise
        return st.st_size

    def scan(self) -> Iterator[BlobEntry]:
        """Every blob file with its stat; names that are not digests are skipped."""
        for digest, path, st in scan_sharded(self.directory):
            yield BlobEntry(digest, path, st)
