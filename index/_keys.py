"""Cache keys: their bytes, and the id that names their manifest.

``str`` and ``bytes`` keys are the same key (``"k"`` is ``b"k"``), as in
``cuda.core``. A key's id is the lowercase hex sha256 of its bytes, as
``FileStreamProgramCache`` names its entry files. A *node-local* key id ends in
:data:`LOCAL_TAG`: an entry a node keeps for itself, which ``publish`` leaves
out (a sha256 ending so is only not published, never served wrongly).
"""

from __future__ import annotations

import hashlib

__all__ = ["is_hex", "is_key_id", "is_local_id", "key_bytes", "key_id", "local_id"]

_HEX = "0123456789abcdef"
#: The last 8 hex digits of every node-local key id.
LOCAL_TAG = "10ca1000"


def key_bytes(key: object) -> bytes:
    """The bytes of a cache key: ``str`` is UTF-8 encoded; one UTF-8 cannot encode raises ``TypeError``."""
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        try:
            return key.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate ("\udc80", from os.fsdecode of bad bytes)
            raise TypeError(
                f"cache keys must be str that UTF-8 can encode, or bytes: {_short_repr(key)} has "
                f"{key[exc.start]!r} at index {exc.start} ({exc.reason}); pass the key as bytes"
            ) from None
    if isinstance(key, bytearray):
        return bytes(key)
    raise TypeError(f"cache keys must be str or bytes, got {type(key).__name__}: {_short_repr(key)}")


def key_id(key: object) -> str:
    """The id of a key: lowercase hex sha256 of its bytes (as FileStream names entries)."""
    # SHA-256 is FIPS-approved: no usedforsecurity=False (the keyword alone costs half a microsecond).
    return hashlib.sha256(key_bytes(key)).hexdigest()


def is_hex(value: object, length: int) -> bool:
    """True for a ``str`` of exactly ``length`` lowercase hex digits: a key id, a digest, a shard's name."""
    # No regular expression: compiling one costs a fresh process about 50 us.
    return isinstance(value, str) and len(value) == length and not value.strip(_HEX)


def is_key_id(value: object) -> bool:
    return is_hex(value, 64)


def _short_repr(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def local_id(key: object) -> str:
    """The node-local key id of ``key``: never published (see the module docstring)."""
    return hashlib.sha256(key_bytes(key)).hexdigest()[:56] + LOCAL_TAG


def is_local_id(kid: str) -> bool:
    return kid.endswith(LOCAL_TAG)
