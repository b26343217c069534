"""One pass over a cache directory: every manifest (parsed) and every blob, with stats.

Eviction, ``stats()`` and the maintenance tools all start from a :class:`Snapshot`.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field

from index import Index, Manifest, parse_manifest
from index._files import read_regular
from index._index import MAX_MANIFEST_BYTES

from ._blobs import BlobStore

__all__ = ["ManifestInfo", "Snapshot", "take_snapshot"]


@dataclass(slots=True)
class ManifestInfo:
    key_id: str
    stat: os.stat_result
    #: None when the file is not a valid manifest.
    manifest: Manifest | None


@dataclass(slots=True)
class Snapshot:
    """What the cache held when the scan began at ``started_ns``."""

    started_ns: int
    manifests: list[ManifestInfo] = field(default_factory=list)
    #: digest -> stat of every blob file.
    blobs: dict[str, os.stat_result] = field(default_factory=dict)
    #: digest -> number of valid manifests naming it.
    refs: Counter[str] = field(default_factory=Counter)
    #: Manifest files that exist but could not be read (EACCES, EIO): the blobs
    #: they name are unknown, so no blob can be proven unreferenced.
    unreadable: list[str] = field(default_factory=list)

    @property
    def manifest_bytes(self) -> int:
        return sum(m.stat.st_size for m in self.manifests)

    @property
    def blob_bytes(self) -> int:
        return sum(st.st_size for st in self.blobs.values())

    @property
    def stored_bytes(self) -> int:
        """What the size cap counts: every blob once, plus every manifest."""
        return self.blob_bytes + self.manifest_bytes

    @property
    def logical_bytes(self) -> int:
        return sum(m.manifest.size for m in self.manifests if m.manifest is not None)

    def is_dangling(self, info: ManifestInfo) -> bool:
        return info.manifest is not None and info.manifest.digest not in self.blobs

    def orphans(self) -> list[str]:
        """Blobs that no valid manifest names."""
        return [d for d in self.blobs if self.refs[d] == 0]


def take_snapshot(index: Index, blobs: BlobStore, *, read_manifests: bool = True) -> Snapshot:
    """Scan the index, then the blobs.

    Manifests first: a blob written after its manifest was scanned is then seen as
    referenced or young, never as an old orphan.
    """
    snap = Snapshot(started_ns=time.time_ns())
    for entry in index.scan(snap.unreadable):
        manifest = None
        if read_manifests and entry.stat.st_size <= MAX_MANIFEST_BYTES:
            try:
                data, _ = read_regular(entry.path)
            except FileNotFoundError:
                continue
            except OSError:
                snap.unreadable.append(entry.path)
                continue
            manifest = parse_manifest(data)
            if manifest is not None:
                snap.refs[manifest.digest] += 1
        snap.manifests.append(ManifestInfo(entry.key_id, entry.stat, manifest))
    for blob in blobs.scan():
        snap.blobs[blob.digest] = blob.stat
    return snap
