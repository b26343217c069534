"""``stats``, ``verify``, ``gc`` and ``repack`` of a store in an S3 bucket, for the console script.

The verbs of a directory read its files; a bucket's are read from its listing by
:mod:`cuda_program_cas._remote.bucket`, imported (with botocore) only when one is named.
What it found is given the one shape of every verb's report (:class:`.common.Report`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .common import Report

if TYPE_CHECKING:
    from cuda_program_cas._remote.bucket import BucketFound

__all__ = ["BucketReport", "bucket_gc", "bucket_repack", "bucket_stats", "bucket_verify"]


@dataclasses.dataclass(kw_only=True)
class BucketReport(Report):
    """What a bucket's ``stats``, ``verify``, ``gc`` or ``repack`` found and did.

    ``objects``/``bytes``: by kind (manifests, blobs, packs, leases, other). Each problem
    is ``{"object": name below the prefix, "problem": what is wrong}``. ``removed``: the
    objects removed (``gc``, ``repack``), or that would be (``gc --dry-run``).
    """

    store: str
    objects: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    orphan_blobs: int = 0
    removed: list[str] = dataclasses.field(default_factory=list)
    bytes_removed: int = 0


def _report(found: BucketFound) -> BucketReport:
    report = BucketReport(
        store=found.store,
        objects=found.objects,
        bytes=found.bytes,
        orphan_blobs=found.orphan_blobs,
        removed=found.removed,
        bytes_removed=found.bytes_removed,
    )
    for name, what in found.problems:
        report.problem({"object": name, "problem": what})
    return report


def bucket_stats(address: str) -> BucketReport:
    """Objects and bytes by kind of the store at ``address`` (``s3://BUCKET/PREFIX``)."""
    from cuda_program_cas._remote.bucket import bucket_stats as run

    return _report(run(address))


def bucket_verify(address: str) -> BucketReport:
    """Every manifest and blob of the store at ``address`` checked; nothing written."""
    from cuda_program_cas._remote.bucket import bucket_verify as run

    return _report(run(address))


def bucket_gc(address: str, *, grace_s: float, dry_run: bool = False) -> BucketReport:
    """The store's garbage older than ``grace_s`` removed (or only listed, ``dry_run``)."""
    from cuda_program_cas._remote.bucket import bucket_gc as run

    return _report(run(address, grace_s=grace_s, dry_run=dry_run))


def bucket_repack(address: str) -> BucketReport:
    """Every entry of the store at ``address`` into one new pack; what it replaced retired or removed."""
    from cuda_program_cas._remote.bucket import bucket_repack as run

    return _report(run(address))
