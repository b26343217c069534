"""``stats``, ``verify``, ``gc`` and ``repack`` of a store in an S3 bucket, in the one report shape of every verb.

:mod:`cuda_program_cas._remote.bucket` reads them from its listing, imported (with botocore) only when one is named.
"""

from __future__ import annotations

import dataclasses

from .common import Report

__all__ = ["BucketReport", "bucket_verb"]


@dataclasses.dataclass(kw_only=True)
class BucketReport(Report):
    """``objects``/``bytes`` by kind (manifests, blobs, packs, leases, other); each problem is
    ``{"object": name below the prefix, "problem": what}``; ``removed`` (or would be: ``gc --dry-run``)."""

    store: str
    objects: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    orphan_blobs: int = 0
    removed: list[str] = dataclasses.field(default_factory=list)
    bytes_removed: int = 0


def bucket_verb(verb: str, address: str, *, grace_s: float = 0.0, dry_run: bool = False) -> BucketReport:
    """``stats``, ``verify``, ``gc`` (garbage older than ``grace_s``; ``dry_run`` only lists it) or ``repack``
    (every entry into one new pack) of the store at ``address`` (``s3://BUCKET/PREFIX``)."""
    from cuda_program_cas._remote.bucket import bucket_gc, bucket_repack, bucket_stats, bucket_verify

    if verb == "gc":
        found = bucket_gc(address, grace_s=grace_s, dry_run=dry_run)
    else:
        found = {"stats": bucket_stats, "verify": bucket_verify, "repack": bucket_repack}[verb](address)
    report = BucketReport(**{k: v for k, v in dataclasses.asdict(found).items() if k != "problems"})
    for name, what in found.problems:
        report.problem({"object": name, "problem": what})
    return report
