"""One pass over a cache directory: every manifest (parsed) and every blob, with stats.

Eviction, ``clear``, ``stats()`` and the maintenance verbs all start from a
:class:`Snapshot`, and judge each manifest with :func:`cuda_program_cas._disk.classify.classify`.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field

from cuda_program_cas.index import MAX_MANIFEST_BYTES, Manifest, parse_manifest

from .files import fs_now, read_regular, read_small, scan_sharded, trusted_mtime_ns
from .fskind import CLOCK_LAG_NS
from .layout import temp_files

__all__ = ["ManifestInfo", "Snapshot", "take_snapshot"]


@dataclass(slots=True)
class ManifestInfo:
    key_id: str
    stat: os.stat_result
    #: None when the file is not a valid manifest for its key.
    manifest: Manifest | None
    #: A valid manifest of another key, copied or renamed onto this key's path.
    misplaced: bool = False


@dataclass(slots=True)
class Snapshot:
    """What the cache held when the scan began at ``started_ns``."""

    started_ns: int
    manifests: list[ManifestInfo] = field(default_factory=list)
    #: digest -> stat of every blob file.
    blobs: dict[str, os.stat_result] = field(default_factory=dict)
    #: digest -> number of valid manifests naming it.
    refs: Counter[str] = field(default_factory=Counter)
    #: Manifests that could not be read: no blob can be proven unreferenced.
    unreadable: list[str] = field(default_factory=list)
    #: Bytes of the files in ``tmp/``, when the scan asked for them (the size cap does).
    temp_bytes: int = 0
    #: The file system's clock when the scan began (else the process clock less a tick): a
    #: file whose mtime is below it was last written before the scan.
    cutoff_ns: int = 0
    #: digest -> the raw size a framed blob's header states, for the blobs of another size than
    #: a manifest naming them says (smaller, or larger where the blob did not compress).
    framed: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.cutoff_ns:
            self.cutoff_ns = self.started_ns - CLOCK_LAG_NS

    def mtime_ns(self, st: os.stat_result) -> int:
        """The mtime of ``st`` as ages are judged (:func:`cuda_program_cas._disk.files.trusted_mtime_ns`)."""
        return trusted_mtime_ns(st.st_mtime_ns, self.cutoff_ns)

    @property
    def manifest_bytes(self) -> int:
        return sum(m.stat.st_size for m in self.manifests)

    @property
    def blob_bytes(self) -> int:
        return sum(st.st_size for st in self.blobs.values())

    @property
    def stored_bytes(self) -> int:
        """What the size cap counts: every blob once, plus every manifest (and :attr:`temp_bytes`)."""
        return self.blob_bytes + self.manifest_bytes + self.temp_bytes

    @property
    def logical_bytes(self) -> int:
        return sum(m.manifest.size for m in self.manifests if m.manifest is not None)

    def orphans(self) -> list[str]:
        """Blobs that no valid manifest names."""
        return [d for d in self.blobs if self.refs[d] == 0]


def take_snapshot(
    index_dir: str,
    blobs_dir: str,
    *,
    read_manifests: bool = True,
    clock_dir: str | None = None,
    temp_dir: str | None = None,
) -> Snapshot:
    """Scan the manifests under ``index_dir``, then the blobs under ``blobs_dir``, then ``temp_dir``.

    A manifest is believed only on the path of the key it names. Manifests first: a blob
    written after its manifest was scanned is seen as referenced or young, never as an old
    orphan. ``clock_dir`` (``tmp/``, when writable) gives :attr:`Snapshot.cutoff_ns`.
    ``temp_dir`` last, so that a temp file renamed into a blob meanwhile counts once at most.
    """
    # The file system's clock first: anything that starts after it (a writer's temp file,
    # a freshen) then carries an mtime of at least the cutoff.
    fs_started = fs_now(clock_dir) if clock_dir is not None else None
    started = time.time_ns()
    snap = Snapshot(started_ns=started, cutoff_ns=fs_started or 0)
    for kid, path, st in scan_sharded(index_dir, snap.unreadable):
        manifest = None
        misplaced = False
        if read_manifests and st.st_size <= MAX_MANIFEST_BYTES:
            try:
                data, _ = read_regular(path)
            except FileNotFoundError:
                continue
            except OSError:
                snap.unreadable.append(path)
                continue
            manifest = parse_manifest(data, kid)
            if manifest is not None:
                snap.refs[manifest.digest] += 1
            else:
                misplaced = parse_manifest(data) is not None
        snap.manifests.append(ManifestInfo(kid, st, manifest, misplaced))
    paths = {}
    for digest, path, st in scan_sharded(blobs_dir):
        snap.blobs[digest] = st
        paths[digest] = path
    for info in snap.manifests:
        m = info.manifest
        held = snap.blobs.get(m.digest) if m is not None else None
        if m is not None and held is not None and held.st_size != m.size and m.digest not in snap.framed:
            stated = _stated_size(paths[m.digest], held.st_size, m.size)
            if stated is not None:
                snap.framed[m.digest] = stated
    if temp_dir is not None:
        snap.temp_bytes = sum(st.st_size for _, st in temp_files(temp_dir))
    return snap


def _stated_size(path: str, held: int, size: int) -> int | None:
    """The raw size the blob file at ``path`` (``held`` bytes) states as a framed one, or None: not framed,
    or larger than a framed blob of ``size`` raw bytes can be."""
    from cuda_program_cas._base.frame import HEADER_SIZE, room, stated_size

    if held > room(size):
        return None
    try:
        return stated_size(read_small(path, HEADER_SIZE))
    except OSError:
        return None
