"""Key-to-manifest index: ``index/<2 hex>/<62 hex>``, named by sha256 of the key.

Naming entries by sha256(key bytes), exactly as ``FileStreamProgramCache`` names
its ``entries/`` files, lets a FileStream directory be imported with its keys
intact. The index knows nothing about blobs beyond a digest string.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from ._files import atomic_write, read_regular, scan_sharded, stat_key, unlink_if_unchanged, with_sharing_retry
from ._manifest import Manifest, parse_manifest

__all__ = ["Index", "IndexEntry", "key_bytes", "key_id"]

#: Larger than any valid manifest; a bigger file is garbage, not worth reading whole.
MAX_MANIFEST_BYTES = 256


def key_bytes(key: object) -> bytes:
    """The bytes of a cache key: ``str`` is UTF-8 encoded, so ``"k"`` is ``b"k"``."""
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, bytearray):
        return bytes(key)
    raise TypeError(f"cache keys must be str or bytes, got {type(key).__name__}: {_short_repr(key)}")


def key_id(key: object) -> str:
    """The index name of a key: lowercase hex sha256 of its bytes (as FileStream names entries)."""
    return hashlib.sha256(key_bytes(key), usedforsecurity=False).hexdigest()


def _short_repr(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One manifest file met during a scan."""

    key_id: str
    path: str
    stat: os.stat_result


class Index:
    """The manifests under ``<root>/index``; writes stage in ``tmp_dir``."""

    def __init__(self, directory: str, tmp_dir: str | None, *, file_mode: int = 0o600) -> None:
        self.directory = directory
        self._tmp = tmp_dir
        self._mode = file_mode

    def path_for(self, kid: str) -> str:
        return f"{self.directory}{os.sep}{kid[:2]}{os.sep}{kid[2:]}"

    def read(self, kid: str) -> tuple[Manifest | None, os.stat_result]:
        """The manifest of ``kid`` and the stat of its file.

        The manifest is None when the file exists but is not a valid manifest.
        Raises ``FileNotFoundError`` when there is none (and ``OSError`` for what
        is not a regular file).
        """
        path = self.path_for(kid)
        data, st = read_regular(path)
        if st.st_size > MAX_MANIFEST_BYTES:
            return None, st
        return parse_manifest(data), st

    def write(self, kid: str, manifest: Manifest) -> bool:
        """Commit ``manifest`` for ``kid`` atomically. False if a Windows sharing violation dropped it."""
        if self._tmp is None:
            raise PermissionError(f"index at {self.directory} is read-only")
        return atomic_write(self.path_for(kid), manifest.encode(), self._tmp, mode=self._mode)

    def remove(self, kid: str) -> bool:
        """Unlink the manifest of ``kid``; False when there was none."""
        path = self.path_for(kid)
        try:
            with_sharing_retry(lambda: os.unlink(path))
        except FileNotFoundError:
            return False
        return True

    def remove_if_unchanged(self, kid: str, st: os.stat_result) -> bool:
        """Unlink the manifest only if it is still the file ``st`` describes."""
        return unlink_if_unchanged(self.path_for(kid), stat_key(st))

    def scan(self, unreadable: list[str] | None = None) -> Iterator[IndexEntry]:
        """Every manifest file, with its stat (see :func:`index._files.scan_sharded`)."""
        for kid, path, st in scan_sharded(self.directory, unreadable):
            yield IndexEntry(kid, path, st)

    def count(self) -> int:
        """Number of manifest files."""
        return sum(1 for _ in scan_sharded(self.directory))
