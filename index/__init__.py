"""Key-to-content index of cuda-program-cas: cache keys, their ids, and manifests.

Installed as ``cuda_program_cas_index`` (the folder is ``index/``), so that a
user's own ``index.py`` cannot shadow it. Each key (``str`` or ``bytes``; ``"k"``
and ``b"k"`` are the same key) has one manifest naming the digest and size of its
content and the key's own id. This package does no I/O and knows nothing about
how content is stored beyond a digest string.
"""

from ._keys import is_key_id, key_bytes, key_id
from ._manifest import MANIFEST_TAG, MAX_MANIFEST_BYTES, Manifest, is_digest, parse_fields, parse_manifest

__all__ = [
    "MANIFEST_TAG",
    "MAX_MANIFEST_BYTES",
    "Manifest",
    "is_digest",
    "is_key_id",
    "key_bytes",
    "key_id",
    "parse_fields",
    "parse_manifest",
]
