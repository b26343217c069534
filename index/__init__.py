"""Key-to-content index for cuda-program-cas: small atomic manifest files.

Each key (``str`` or ``bytes``; ``"k"`` and ``b"k"`` are the same key) has one
manifest naming the digest and size of its content. This package knows nothing
about how content is stored.
"""

from ._index import Index, IndexEntry, key_bytes, key_id
from ._manifest import MANIFEST_TAG, Manifest, is_digest, parse_manifest

__all__ = [
    "MANIFEST_TAG",
    "Index",
    "IndexEntry",
    "Manifest",
    "is_digest",
    "key_bytes",
    "key_id",
    "parse_manifest",
]
