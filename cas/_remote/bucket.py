"""A store in an S3 bucket, maintained where it is, from its listing (each object's size and time) and objects.

- :func:`bucket_stats`: objects and bytes by kind, from the listing alone.
- :func:`bucket_verify`: every manifest parsed, its blob present with its size (or fewer
  bytes: compressed) and hashed, the orphan blobs counted. It writes nothing.
- :func:`bucket_gc`: removes, each written more than ``grace_s`` ago (a young one may be a
  write-back under way), orphan blobs, manifests damaged or whose blob is gone, and expired
  leases. Packs are left alone.
- :func:`bucket_repack`: every entry (packed and loose, verified as read) into one new pack
  through the one pack publisher; the packs it replaced copied to ``packs/retired/`` and
  removed, ``packs/list`` and ``packs/summary`` written, the loose manifests removed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from urllib.parse import quote

from cuda_program_cas._base.engine import StoreFailure
from cuda_program_cas._base.frame import room
from cuda_program_cas._disk.layout import BLOBS, INDEX, url_path
from cuda_program_cas.index import MAX_MANIFEST_BYTES, is_digest, is_key_id, parse_fields

from .s3 import LEASES, S3Engine

__all__ = ["BucketFound", "bucket_gc", "bucket_repack", "bucket_stats", "bucket_verify"]

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

    @property
    def key_id(self) -> str:
        """The key id a manifest's name spells (not checked)."""
        return self.name[len(INDEX) + 1 :].replace("/", "")


@dataclass
class BucketFound:
    """What a bucket verb found and did (:class:`cuda_program_cas._verbs.bucket.BucketReport` shapes it)."""

    store: str
    objects: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    #: ``(object name, what is wrong)``, one per problem.
    problems: list[tuple[str, str]] = field(default_factory=list)
    orphan_blobs: int = 0
    #: Objects removed (``gc``), or that would be (``dry_run``).
    removed: list[str] = field(default_factory=list)
    bytes_removed: int = 0


def _epoch(text: str) -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()  # unknown: as young as can be, so gc keeps it


def bucket_stats(address: str) -> BucketFound:
    """Objects and bytes of the store at ``address`` (``s3://BUCKET/PREFIX``) by kind, from its listing."""
    return _survey(address)[1]


def _survey(address: str) -> tuple[S3Engine, BucketFound, dict[str, BucketObject]]:
    """The engine of the store at ``address``, a report of its objects and bytes by kind, and its listing by name."""
    engine = S3Engine(address)
    report = BucketFound(engine.shown)
    objects = {name: BucketObject(name, size, _epoch(written)) for name, size, written in engine.listed()}
    for obj in objects.values():
        report.objects[obj.kind] += 1
        report.bytes[obj.kind] += obj.size
    return engine, report, objects


def _named(kid: str, data: bytes) -> tuple[str, int] | None:
    """The digest and size the manifest ``data`` of key id ``kid`` names; None when it is damaged."""
    fields = parse_fields(data) if is_key_id(kid) else None
    if fields is None or fields[0] not in (None, kid) or not is_digest(fields[1]):
        return None
    return fields[1], fields[2]


def _manifests(
    engine: S3Engine, objects: dict[str, BucketObject]
) -> Iterator[tuple[BucketObject, tuple[str, int] | None]]:
    """Each manifest not removed since the listing, with the digest and size it names (None: damaged)."""
    for obj in objects.values():
        if obj.kind == "manifests":
            data = engine.get(obj.name, limit=MAX_MANIFEST_BYTES) if obj.size <= MAX_MANIFEST_BYTES else b""
            if data is not None:
                yield obj, _named(obj.key_id, data)


def _check_manifests(
    engine: S3Engine, objects: dict[str, BucketObject], report: BucketFound, *, hash_blobs: bool
) -> tuple[set[str], list[BucketObject]]:
    """The blobs the manifests name, and the manifests damaged or naming a blob gone (problems noted)."""
    named: set[str] = set()
    bad: list[BucketObject] = []
    for obj, named_blob in _manifests(engine, objects):
        if named_blob is None:
            report.problems.append((obj.name, "damaged manifest"))
            bad.append(obj)
            continue
        digest, size = named_blob
        blob = url_path(BLOBS, digest)
        named.add(blob)
        held = objects.get(blob)
        if held is None:
            report.problems.append((obj.name, f"its blob {blob} is missing"))
            bad.append(obj)
        elif held.size != size and not 0 < held.size <= room(size):  # a framed blob: smaller, or larger than raw
            report.problems.append((blob, f"{held.size:,} bytes, not the {size:,} its manifest names"))
        elif hash_blobs:
            try:
                engine.get(blob, limit=size, digest=digest)
            except StoreFailure as exc:
                if exc.outage:
                    raise
                report.problems.append((blob, f"{exc.kind}: {exc.detail}"))
    report.orphan_blobs = sum(1 for o in objects.values() if o.kind == "blobs" and o.name not in named)
    return named, bad


def bucket_verify(address: str) -> BucketFound:
    """Every manifest and blob of the store at ``address`` checked; nothing is written."""
    engine, report, objects = _survey(address)
    _check_manifests(engine, objects, report, hash_blobs=True)
    return report


def bucket_gc(address: str, *, grace_s: float, dry_run: bool = False) -> BucketFound:
    """Remove the store's garbage written more than ``grace_s`` ago; what was removed."""
    engine, report, objects = _survey(address)
    named, bad = _check_manifests(engine, objects, report, hash_blobs=False)
    old = time.time() - grace_s
    doomed = [o for o in bad if o.written < old]
    doomed += [o for o in objects.values() if o.kind == "blobs" and o.name not in named and o.written < old]
    for obj in objects.values():
        # A live lease is rewritten every third of its lifetime: one untouched for the grace is expired. Asked
        # again before it goes (a node may have taken it over since the listing).
        name = obj.name[len(LEASES) + 1 :]
        if obj.kind == "leases" and obj.written < old and engine.lease(name, 0, take=False) == "":
            doomed.append(obj)
    for obj in doomed:
        report.removed.append(obj.name)
        report.bytes_removed += obj.size
        if not dry_run:
            engine.remove(obj.name)
    return report


def bucket_repack(address: str) -> BucketFound:
    """Every entry of the store at ``address`` into one new pack; the packs and loose manifests it replaces go."""
    from cuda_program_cas._base.config import env_max_entry_size
    from cuda_program_cas._base.frame import verified
    from cuda_program_cas._disk.pack import RETIRED, PackInput, Stored
    from cuda_program_cas._disk.packpublish import StorePacks
    from cuda_program_cas._disk.packset import is_pack_name

    engine, report, objects = _survey(address)
    packs = StorePacks(engine)
    packed = packs.entries()
    old_packs = [name for name in engine.names("packs") if is_pack_name(name)]

    def ranged(pack: str, offset: int, size: int, digest: str) -> bytes | None:
        """The entry's bytes as the pack holds them, decoded and verified: the new pack takes them as they are."""
        why = "not there"
        try:
            data = engine.get_range(f"packs/{pack}", offset, size)
            if data is not None:
                return Stored(data, len(verified(f"packs/{pack}", data, digest, env_max_entry_size())))
        except StoreFailure as exc:
            if exc.outage:
                raise
            why = exc.detail
        report.problems.append((f"packs/{pack}", f"the blob of {digest} at {offset}: {why}: left out"))
        return None

    def loose(blob: str, size: int, digest: str) -> bytes | None:
        try:
            return engine.get(blob, limit=size, digest=digest)
        except StoreFailure as exc:
            if exc.outage:
                raise
            report.problems.append((blob, f"{exc.kind}: left out"))
            return None

    inputs: list[PackInput] = []
    manifests: list[str] = []
    for obj, named_blob in _manifests(engine, objects):
        if named_blob is None:
            continue  # damaged: gc's
        digest, size = named_blob
        manifests.append(obj.name)
        # Each input's bytes are asked when the pack is written: one blob in memory at a time.
        inputs.append(
            (obj.key_id, digest, partial(loose, url_path(BLOBS, digest), size, digest), int(obj.written * 1e9))
        )
    for kid, pe in packed.items():
        e = pe.entry
        inputs.append((kid, e.digest, partial(ranged, pe.pack, e.offset, e.size, e.digest), e.time_ns))
    if not inputs:
        return report
    stats: dict[str, int] = {}
    written = packs.write(inputs, stats)  # uploaded and read back; listed below, once the old packs are retired
    if written is None:
        return report
    for name in old_packs:
        source = quote(f"/{engine.bucket}/{engine.prefix + '/' if engine.prefix else ''}packs/{name}")
        copied = engine._send("PUT", f"packs/{RETIRED}/{name}", None, {"x-amz-copy-source": source})
        engine._refuse(f"packs/{RETIRED}/{name}", copied, "PUT (copy)")
        engine.remove(f"packs/{name}")
        report.removed.append(f"packs/{name}")
    packs.entries()  # the packs listed now: the new one (and any a publisher added meanwhile)
    packs.finish(True)  # packs/summary for publishers, packs/list (from the listing) for nodes
    for name in manifests:
        engine.remove(name)
        report.removed.append(name)
    report.bytes_removed = stats.get("bytes", 0)
    return report
