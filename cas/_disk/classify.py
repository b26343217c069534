"""What is wrong with a manifest: the one classification gc, verify, stats and the torture checker ask."""

from __future__ import annotations

import enum
from collections.abc import Container

from .scan import ManifestInfo, Snapshot

__all__ = ["Condition", "classify", "describe"]


class Condition(enum.Enum):
    """A manifest's condition, judged against a snapshot (worst first where several apply)."""

    OK = "ok"
    #: Empty, truncated, garbled, too large, or of an unknown format.
    INVALID = "invalid_manifest"
    #: A valid manifest of another key, copied or renamed onto this key's path.
    MISPLACED = "misplaced_manifest"
    #: Names a blob that is not there.
    DANGLING = "dangling_manifest"
    #: Names a blob whose size differs from the one the manifest records.
    SIZE_MISMATCH = "size_mismatch"
    #: Names a blob that failed its hash (known only where blobs were hashed).
    CORRUPT_BLOB = "manifest_of_corrupt_blob"

    @property
    def bad(self) -> bool:
        return self is not Condition.OK


def classify(info: ManifestInfo, snap: Snapshot, corrupt: Container[str] = ()) -> Condition:
    """The condition of one manifest of ``snap``; ``corrupt`` holds digests that failed their hash."""
    m = info.manifest
    if m is None:
        return Condition.MISPLACED if info.misplaced else Condition.INVALID
    st = snap.blobs.get(m.digest)
    if st is None:
        return Condition.DANGLING
    if st.st_size != m.size and snap.framed.get(m.digest) != m.size:  # a framed blob states the raw size
        return Condition.SIZE_MISMATCH
    if m.digest in corrupt:
        return Condition.CORRUPT_BLOB
    return Condition.OK


def describe(condition: Condition, info: ManifestInfo, snap: Snapshot) -> str:
    """One line saying what is wrong, for reports."""
    m = info.manifest
    if condition is Condition.INVALID:
        return "empty, truncated or garbled"
    if condition is Condition.MISPLACED:
        return "a manifest of another key (copied or renamed here)"
    assert m is not None
    if condition is Condition.DANGLING:
        return f"blob {m.digest} is missing"
    if condition is Condition.SIZE_MISMATCH:
        return f"says {m.size} bytes, blob {m.digest} has {snap.blobs[m.digest].st_size}"
    if condition is Condition.CORRUPT_BLOB:
        return f"names corrupt blob {m.digest}"
    return ""
