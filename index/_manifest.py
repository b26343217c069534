"""The manifest: what one key maps to, as one short line of text (about 140 bytes).

    cpcas2 <key id: 64 hex> <digest: 64 hex> <size: decimal bytes>\n

It names its own key: one copied onto another key's path is a miss. Anything
else is rejected, but for a second line, a site's signature of the first, whose
form alone is checked here (:mod:`cuda_program_cas._base.signing`)::

    ed25519 <signer: 16 hex> <signature: 128 hex>\n
"""

from __future__ import annotations

import functools
import re
from typing import Any

from ._frozen import Frozen
from ._keys import is_hex, is_key_id

__all__ = [
    "LONGEST_MANIFEST",
    "MAX_MANIFEST_BYTES",
    "Manifest",
    "is_digest",
    "manifest_length",
    "parse_fields",
    "parse_manifest",
    "split_signed",
]

MANIFEST_TAG = b"cpcas2"
#: Larger than any valid manifest, signed ones included; a bigger file is garbage, not worth reading whole.
MAX_MANIFEST_BYTES = 512
#: The most decimal digits a size may have.
_MAX_SIZE_DIGITS = 16
#: A current manifest's bytes besides its size's digits: the tag, three spaces, two ids of 64 hex, the newline.
_FIXED_BYTES = len(MANIFEST_TAG) + 1 + 64 + 1 + 64 + 1 + 1
#: The length of the longest current manifest (a size of 16 digits).
LONGEST_MANIFEST = _FIXED_BYTES + _MAX_SIZE_DIGITS


def manifest_length(size: int) -> int:
    """The length in bytes of the current manifest of a blob of ``size`` bytes (what a store accounts for it)."""
    return _FIXED_BYTES + len(str(size))


@functools.cache
def _signature_re() -> re.Pattern[bytes]:  # 0.1 to 0.2 ms: a hit of an unsigned manifest needs none
    return re.compile(rb"ed25519 ([0-9a-f]{16}) ([0-9a-f]{128})\n")


def split_signed(data: bytes) -> tuple[bytes, str, str] | None:
    """``(the manifest line, signer id, signature hex)`` of a signed manifest, or None when ``data`` is not
    a line followed by one well-formed signature line (whether the line is a manifest is not asked here)."""
    cut = data.find(b"\n") + 1
    m = _signature_re().fullmatch(data, cut) if cut > 0 else None
    if m is None:
        return None
    return data[:cut], m.group(1).decode("ascii"), m.group(2).decode("ascii")


def is_digest(value: object) -> bool:
    return is_hex(value, 64)


class Manifest(Frozen):
    """A key's target: the blob's digest and its size in bytes, and the id of the key (immutable)."""

    __slots__ = ("digest", "key_id", "size")
    __match_args__ = ("digest", "size", "key_id")

    digest: str
    size: int
    key_id: str

    def __init__(self, digest: str, size: int, key_id: str) -> None:
        if not is_digest(digest):
            raise ValueError(f"manifest digest must be 64 lowercase hex characters, got {digest!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"manifest size must be a non-negative int, got {size!r}")
        if not is_key_id(key_id):
            raise ValueError(f"manifest key id must be 64 lowercase hex characters, got {key_id!r}")
        self._set(digest=digest, size=size, key_id=key_id)

    def _fields(self) -> tuple[str, int, str]:
        return (self.digest, self.size, self.key_id)

    def __repr__(self) -> str:
        return f"Manifest(digest={self.digest!r}, size={self.size!r}, key_id={self.key_id!r})"

    def __reduce__(self) -> tuple[Any, tuple[str, int, str]]:
        return (Manifest, self._fields())

    def encode(self) -> bytes:
        return b"%s %s %s %d\n" % (MANIFEST_TAG, self.key_id.encode("ascii"), self.digest.encode("ascii"), self.size)


_HEX_BYTES = b"0123456789abcdef"
#: The shortest current manifest: its size has one digit.
_MIN_V2 = _FIXED_BYTES + 1


def parse_fields(data: bytes) -> tuple[str, str, int] | None:
    """``(key id, digest, size)`` of a manifest, or None when ``data`` is not one (the hot path: field by field,
    a few times faster than a regular expression)."""
    n = len(data)
    if n > LONGEST_MANIFEST:
        # A signed manifest: the line, then one signature line (checked by a node that trusts keys).
        signed = split_signed(data)
        if signed is None:
            return None
        data = signed[0]
        n = len(data)
    if _MIN_V2 <= n <= LONGEST_MANIFEST and data[:7] == b"cpcas2 " and data[71] == 32 and data[136] == 32:
        kid, digest, size = data[7:71], data[72:136], data[137:-1]
        # strip() of every hex digit leaves nothing only if the field is all lowercase hex.
        if (
            data[-1] == 10
            and not kid.strip(_HEX_BYTES)
            and not digest.strip(_HEX_BYTES)
            and size.isdigit()
            and (size[0] != 48 or len(size) == 1)
        ):
            return kid.decode("ascii"), digest.decode("ascii"), int(size)
    return None


def parse_manifest(data: bytes, key_id: str | None = None) -> Manifest | None:
    """Decode a manifest, or None when ``data`` is not exactly one.

    With ``key_id``, a manifest that names another key is rejected too (it was
    copied or renamed onto this key's path). Without it, only the line's form is checked.
    """
    fields = parse_fields(data)
    if fields is None or (key_id is not None and fields[0] != key_id):
        return None
    # Skip __init__: parse_fields already proved every field.
    manifest = object.__new__(Manifest)
    object.__setattr__(manifest, "digest", fields[1])
    object.__setattr__(manifest, "size", fields[2])
    object.__setattr__(manifest, "key_id", fields[0])
    return manifest
