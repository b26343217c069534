"""A store in an S3 bucket, maintained where it is: its objects listed, counted, checked and collected.

``stats``, ``verify`` and ``gc`` of a directory store read files and take a lock
file; a bucket has neither, so these work on what S3 gives: a listing (``GET
?list-type=2``, 1,000 objects a page, with each object's size and when it was
written) and the objects themselves, through :class:`.s3.S3Engine` (its signed,
bounded requests).

- :func:`bucket_stats`: objects and bytes by kind (manifests, blobs, packs,
  leases, the rest), from the listing alone.
- :func:`bucket_verify`: every manifest read and parsed, its blob present with the
  size it names and hashed (one GET a blob: the whole store is downloaded once),
  and the orphan blobs (named by no manifest) counted. It writes nothing.
- :func:`bucket_gc`: removes what is safe to remove, each written more than
  ``grace_s`` ago: orphan blobs, manifests that cannot be read as one or whose
  blob is gone, and leases past their expiry. A blob is sent before the manifest
  that names it, so a young orphan may be a write-back under way: the grace keeps
  it (at least an hour, as for a published directory). Packs are left alone: they
  are listed in ``packs/list`` and repacked where a directory store's files are.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import quote
from xml.etree import ElementTree

from cuda_program_cas._base.engine import StoreFailure
from cuda_program_cas._disk.layout import BLOBS, INDEX
from cuda_program_cas.index import MAX_MANIFEST_BYTES, is_digest, is_key_id, parse_fields

from .client import HttpFailure, request
from .s3 import LEASES, S3Engine

__all__ = ["BucketObject", "BucketReport", "bucket_gc", "bucket_stats", "bucket_verify", "list_objects"]

#: A listing page (1,000 keys of about 100 bytes, in XML) is far below this.
_PAGE_BYTES = 4 << 20
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
KINDS = ("manifests", "blobs", "packs", "leases", "other")


@dataclass(frozen=True)
class BucketObject:
    """One object of the store: its name below the prefix, size, and when it was written (seconds since the epoch)."""

    name: str
    size: int
    written: float

    @property
    def kind(self) -> str:
        top = self.name.split("/", 1)[0]
        return {INDEX: "manifests", BLOBS: "blobs", "packs": "packs", LEASES: "leases"}.get(top, "other")


@dataclass
class BucketReport:
    """What :func:`bucket_stats`, :func:`bucket_verify` or :func:`bucket_gc` found and did."""

    store: str
    objects: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    #: ``(object name, what is wrong)``, one per problem.
    problems: list[tuple[str, str]] = field(default_factory=list)
    orphan_blobs: int = 0
    #: Objects removed (``gc``), or that would be (``dry_run``).
    removed: list[str] = field(default_factory=list)
    bytes_removed: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "store": self.store,
            "objects": self.objects,
            "bytes": self.bytes,
            "problems": [{"object": name, "problem": what} for name, what in self.problems],
            "orphan_blobs": self.orphan_blobs,
            "removed": self.removed,
            "bytes_removed": self.bytes_removed,
        }


def list_objects(engine: S3Engine) -> Iterator[BucketObject]:
    """Every object under the store's prefix, page by page (ListObjectsV2); a failure is a :class:`StoreFailure`."""
    prefix = f"{engine.prefix}/" if engine.prefix else ""
    token = ""
    if engine.broken is not None:
        raise engine.broken
    while True:
        url = f"{engine.bucket_url}?list-type=2&prefix={quote(prefix, safe='')}"
        if token:
            url += f"&continuation-token={quote(token, safe='')}"
        engine.requests += 1
        reply = request("GET", url, limit=_PAGE_BYTES, error_limit=1 << 16)
        engine._check(url, reply)
        if reply.status != 200:
            raise HttpFailure(url, f"HTTP {reply.status}", "the bucket's listing was refused", outage=False)
        try:
            root = ElementTree.fromstring(reply.body)  # noqa: S314 - a bounded answer from the store's own server
        except ElementTree.ParseError as exc:
            raise HttpFailure(url, "damaged", f"a listing that is not XML: {exc}", outage=False) from None
        for item in root.iter(f"{_NS}Contents"):
            key = item.findtext(f"{_NS}Key") or ""
            size = item.findtext(f"{_NS}Size") or "0"
            written = item.findtext(f"{_NS}LastModified") or ""
            if key.startswith(prefix) and size.isdigit():
                yield BucketObject(key[len(prefix) :], int(size), _epoch(written))
        token = root.findtext(f"{_NS}NextContinuationToken") or ""
        if root.findtext(f"{_NS}IsTruncated") != "true" or not token:
            return


def _epoch(text: str) -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()  # unknown: as young as can be, so gc keeps it


def bucket_stats(address: str) -> BucketReport:
    """Objects and bytes of the store at ``address`` (``s3://BUCKET/PREFIX``) by kind, from its listing."""
    engine = S3Engine(address)
    report = BucketReport(engine.shown)
    for obj in list_objects(engine):
        report.objects[obj.kind] += 1
        report.bytes[obj.kind] += obj.size
    return report


def _blob_name(digest: str) -> str:
    return f"{BLOBS}/{digest[:2]}/{digest[2:]}"


def _check_manifests(
    engine: S3Engine, objects: dict[str, BucketObject], report: BucketReport, *, hash_blobs: bool
) -> tuple[set[str], list[BucketObject]]:
    """The blobs the manifests name, and the manifests that are damaged or name a blob gone (problems noted)."""
    named: set[str] = set()
    bad: list[BucketObject] = []
    for obj in objects.values():
        if obj.kind != "manifests":
            continue
        kid = obj.name[len(INDEX) + 1 :].replace("/", "")
        data = engine.get(obj.name, limit=MAX_MANIFEST_BYTES) if obj.size <= MAX_MANIFEST_BYTES else b""
        if data is None:
            continue  # removed since the listing
        fields = parse_fields(data) if is_key_id(kid) else None
        if fields is None or (fields[0] is not None and fields[0] != kid) or not is_digest(fields[1]):
            report.problems.append((obj.name, "damaged manifest"))
            bad.append(obj)
            continue
        _found, digest, size = fields
        blob = _blob_name(digest)
        named.add(blob)
        held = objects.get(blob)
        if held is None:
            report.problems.append((obj.name, f"its blob {blob} is missing"))
            bad.append(obj)
        elif held.size != size:
            report.problems.append((blob, f"{held.size:,} bytes, not the {size:,} its manifest names"))
        elif hash_blobs:
            try:
                engine.get(blob, limit=size, digest=digest)
            except StoreFailure as exc:
                if exc.outage:
                    raise
                report.problems.append((blob, f"{exc.kind}: {exc.detail}"))
    return named, bad


def bucket_verify(address: str) -> BucketReport:
    """Every manifest and blob of the store at ``address`` checked (module docstring); nothing is written."""
    engine = S3Engine(address)
    report = BucketReport(engine.shown)
    objects = {obj.name: obj for obj in list_objects(engine)}
    for obj in objects.values():
        report.objects[obj.kind] += 1
        report.bytes[obj.kind] += obj.size
    named, _bad = _check_manifests(engine, objects, report, hash_blobs=True)
    report.orphan_blobs = sum(1 for o in objects.values() if o.kind == "blobs" and o.name not in named)
    return report


def bucket_gc(address: str, *, grace_s: float, dry_run: bool = False) -> BucketReport:
    """Remove the store's garbage written more than ``grace_s`` ago (module docstring); what was removed."""
    engine = S3Engine(address)
    report = BucketReport(engine.shown)
    objects = {obj.name: obj for obj in list_objects(engine)}
    for obj in objects.values():
        report.objects[obj.kind] += 1
        report.bytes[obj.kind] += obj.size
    named, bad = _check_manifests(engine, objects, report, hash_blobs=False)
    old = time.time() - grace_s
    doomed = [o for o in bad if o.written < old]
    doomed += [o for o in objects.values() if o.kind == "blobs" and o.name not in named and o.written < old]
    report.orphan_blobs = sum(1 for o in objects.values() if o.kind == "blobs" and o.name not in named)
    for obj in objects.values():
        # A live lease is rewritten every third of its time to live (30 s): one untouched for the grace is
        # expired, whoever left it. Asked again before it goes (a node may have taken it over since the listing).
        name = obj.name[len(LEASES) + 1 :]
        if obj.kind == "leases" and obj.written < old and engine.lease(name, 0, take=False) == "":
            doomed.append(obj)
    for obj in doomed:
        report.removed.append(obj.name)
        report.bytes_removed += obj.size
        if not dry_run:
            engine.remove(obj.name)
    return report
