"""The manifest: what one key maps to, as one short line of text.

    cpcas1 <digest: 64 lowercase hex> <size: decimal bytes>\n

About 80 bytes. The leading tag carries the format version, so a manifest written
by a future format is rejected (a miss) rather than misread. Anything that is not
exactly this line (empty, truncated, garbled, padded) is rejected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MANIFEST_TAG", "Manifest", "is_digest", "parse_fields", "parse_manifest"]

MANIFEST_TAG = b"cpcas1"
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_LINE_RE = re.compile(rb"cpcas1 ([0-9a-f]{64}) (0|[1-9][0-9]{0,15})\n")


def is_digest(value: object) -> bool:
    """True for a blob digest: exactly 64 lowercase hex characters."""
    return isinstance(value, str) and _DIGEST_RE.fullmatch(value) is not None


@dataclass(frozen=True, slots=True)
class Manifest:
    """A key's target: the blob's digest and its size in bytes."""

    digest: str
    size: int

    def __post_init__(self) -> None:
        if not is_digest(self.digest):
            raise ValueError(f"manifest digest must be 64 lowercase hex characters, got {self.digest!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"manifest size must be a non-negative int, got {self.size!r}")

    def encode(self) -> bytes:
        return b"%s %s %d\n" % (MANIFEST_TAG, self.digest.encode("ascii"), self.size)


def parse_fields(data: bytes) -> tuple[str, int] | None:
    """``(digest, size)`` of a manifest, or None when ``data`` is not exactly one (the hot path)."""
    m = _LINE_RE.fullmatch(data)
    if m is None:
        return None
    return m.group(1).decode("ascii"), int(m.group(2))


def parse_manifest(data: bytes) -> Manifest | None:
    """Decode a manifest, or return None when ``data`` is not exactly one."""
    fields = parse_fields(data)
    if fields is None:
        return None
    # Skip __post_init__: the regular expression already proved both fields.
    manifest = object.__new__(Manifest)
    object.__setattr__(manifest, "digest", fields[0])
    object.__setattr__(manifest, "size", fields[1])
    return manifest
