"""What one publish run did: :class:`PublishReport`, the report of :func:`cuda_program_cas._verbs.publish.publish`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .common import Report

__all__ = ["PublishReport"]


@dataclass
class PublishReport(Report):
    """What one :func:`publish` run did (or, with ``dry_run``, would do).

    ``problems`` has one line for each problem of the sources, each left out of
    the store: the items of ``bad_blobs``, ``missing_blobs``,
    ``invalid_manifests`` and ``errors``, in that order, each labelled.
    """

    max_listed: ClassVar[int | None] = None

    sources: list[str]
    dest: str
    dry_run: bool = False
    #: The store did not exist (or had no layout) and was laid out by this run.
    created: bool = False
    scanned: int = 0
    #: Keys the store did not have, now published.
    published: int = 0
    #: Keys whose entry in the store was garbage, dangling or corrupt, now replaced.
    replaced: int = 0
    #: Keys the store already had, identical.
    unchanged: int = 0
    #: Keys the store maps to another valid blob: kept as they were (first published wins).
    conflicts: int = 0
    #: Blobs written into the store (new or restored).
    blobs_published: int = 0
    #: Of those, blobs the store held damaged (bytes that fail their hash, or the wrong size), now rewritten.
    blobs_repaired: int = 0
    bytes_published: int = 0
    #: Source entries that vanished while being read (evicted by their node meanwhile).
    vanished: int = 0
    #: Source blobs that failed verification: ``"<source>: <digest>"``; their manifests were skipped.
    bad_blobs: list[str] = field(default_factory=list)
    #: Source manifests whose blob is missing: ``"<source>: <digest>"``.
    missing_blobs: list[str] = field(default_factory=list)
    #: Source manifest files that are not valid manifests.
    invalid_manifests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: Manifests not published because of the problems above.
    skipped: int = 0
    packs: list[str] = field(default_factory=list)
    #: Warm sets (``sets/*`` of the sources) written into the store, merged with its own; and those it had already.
    sets_published: int = 0
    sets_unchanged: int = 0
    #: Source warm sets that are not whole sets (cut short, garbled, too large): skipped, never copied.
    bad_sets: list[str] = field(default_factory=list)

    def _settle(self) -> None:
        """List the problems the run met, by kind (what ``problems`` and ``problem_count`` say)."""
        for label, items in (
            ("bad blob (skipped)", self.bad_blobs),
            ("missing blob (skipped)", self.missing_blobs),
            ("invalid manifest (skipped)", self.invalid_manifests),
            ("damaged warm set (skipped)", self.bad_sets),
            ("error", self.errors),
        ):
            for item in items:
                self.problem(f"{label}: {item}")
