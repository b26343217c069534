"""Content-addressed blob store: ``blobs/<2 hex>/<62 hex>``, named by blake3 of the bytes.

A blob holds the compiled binary verbatim, so ``cuobjdump`` and ``nvdisasm`` read it
directly. This module reads blobs, every read verified.
"""

from __future__ import annotations

import enum
import os
import stat
from dataclasses import dataclass

from cuda_program_cas._base.config import env_max_entry_size
from cuda_program_cas._base.engine import StoreFailure
from cuda_program_cas._base.errors import CorruptBlobError
from cuda_program_cas._base.frame import decode, is_framed, room

from .files import SizeMismatch, digest_of, read_regular, shard_path

__all__ = ["BlobCheck", "BlobState", "BlobStore", "digest_of"]


class BlobState(enum.Enum):
    """What hashing one blob found."""

    OK = "ok"
    CORRUPT = "corrupt"
    MISSING = "missing"
    UNREADABLE = "unreadable"


@dataclass(frozen=True, slots=True)
class BlobCheck:
    """The outcome of :meth:`BlobStore.check`: the state, the file's stat (when read) and a detail."""

    state: BlobState
    stat: os.stat_result | None = None
    detail: str = ""


class BlobStore:
    """The blobs under one ``blobs/`` directory, read-only."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def path_for(self, digest: str) -> str:
        """The path of a blob; ``digest`` must already be validated (see ``is_digest``)."""
        return shard_path(self.directory, digest)

    def read(self, digest: str, size: int | None = None) -> tuple[bytes, os.stat_result]:
        """The verified bytes of a blob, and the stat of its file (a shared store's compressed blob: its raw bytes).

        Raises ``FileNotFoundError`` when absent, :class:`cuda_program_cas.CorruptBlobError` when
        it does not hash to ``digest`` or (``size`` given) has another size, and ``OSError``
        for what cannot be read or is not a regular file.
        """
        path = self.path_for(digest)
        try:
            data, st = read_regular(path, size)
        except SizeMismatch as exc:
            if not 0 < exc.actual <= room(exc.expected):
                raise CorruptBlobError(path, digest, f"{exc.actual} bytes instead of {exc.expected}") from None
            data, st = read_regular(path, exc.actual)  # a shared store's framed blob, or cut short or grown
            if not is_framed(data):
                raise CorruptBlobError(path, digest, f"{exc.actual} bytes instead of {exc.expected}", st) from None
        actual = digest_of(data)
        if actual != digest and is_framed(data):  # a raw blob may start like a frame: its own digest says which
            try:
                data = bytes(decode(data, env_max_entry_size() if size is None else size, path))
            except StoreFailure as failed:
                raise CorruptBlobError(path, digest, failed.detail, st) from None
            actual = digest_of(data)
        if actual != digest:
            raise CorruptBlobError(path, digest, actual, st)
        return data, st

    def check(self, digest: str) -> BlobCheck:
        """Read and hash one blob, never raising for what is on disk."""
        try:
            _, st = self.read(digest)
        except FileNotFoundError:
            return BlobCheck(BlobState.MISSING)
        except CorruptBlobError as exc:
            return BlobCheck(BlobState.CORRUPT, exc.stat, f"hashes to {exc.actual}")
        except OSError as exc:
            return BlobCheck(BlobState.UNREADABLE, None, f"{exc.strerror or exc}")
        return BlobCheck(BlobState.OK, st)

    def exists(self, digest: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(self.path_for(digest), follow_symlinks=False).st_mode)
        except OSError:
            return False
