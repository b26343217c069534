"""The index's format: cache keys, their ids, grouped ids, and manifests (``cuda_program_cas.index``).

It does no I/O, and knows nothing about content beyond a digest string.
"""

from ._frozen import Frozen
from ._groups import group_of, grouped_id, is_record, lru_units, partners_of
from ._keys import is_hex, is_key_id, is_local_id, key_bytes, key_id, local_id
from ._manifest import (
    LONGEST_MANIFEST,
    MAX_MANIFEST_BYTES,
    Manifest,
    is_digest,
    manifest_length,
    parse_fields,
    parse_manifest,
    split_signed,
)

__all__ = [
    "LONGEST_MANIFEST",
    "MAX_MANIFEST_BYTES",
    "Frozen",
    "Manifest",
    "group_of",
    "grouped_id",
    "is_digest",
    "is_hex",
    "is_key_id",
    "is_local_id",
    "is_record",
    "key_bytes",
    "key_id",
    "local_id",
    "lru_units",
    "manifest_length",
    "parse_fields",
    "parse_manifest",
    "partners_of",
    "split_signed",
]
