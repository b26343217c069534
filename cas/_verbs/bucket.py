"""``stats``, ``verify`` and ``gc`` of a store in an S3 bucket, for the console script (the work is the bucket's own).

The verbs of a directory read its files; a bucket's are read from its listing by
:mod:`cuda_program_cas._remote.bucket`, imported (with botocore) only when one is named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cuda_program_cas._remote.bucket import BucketReport

__all__ = ["bucket_gc", "bucket_repack", "bucket_stats", "bucket_verify"]


def bucket_stats(address: str) -> BucketReport:
    """Objects and bytes by kind of the store at ``address`` (``s3://BUCKET/PREFIX``)."""
    from cuda_program_cas._remote.bucket import bucket_stats as run

    return run(address)


def bucket_verify(address: str) -> BucketReport:
    """Every manifest and blob of the store at ``address`` checked; nothing written."""
    from cuda_program_cas._remote.bucket import bucket_verify as run

    return run(address)


def bucket_gc(address: str, *, grace_s: float, dry_run: bool = False) -> BucketReport:
    """The store's garbage older than ``grace_s`` removed (or only listed, ``dry_run``)."""
    from cuda_program_cas._remote.bucket import bucket_gc as run

    return run(address, grace_s=grace_s, dry_run=dry_run)


def bucket_repack(address: str) -> BucketReport:
    """Every entry of the store at ``address`` into one new pack; what it replaced retired or removed."""
    from cuda_program_cas._remote.bucket import bucket_repack as run

    return run(address)
