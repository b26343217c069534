"""A warm set's entries fetched from one store in batches, each kept only where the key's own entry names its bytes.

A set's line decides which keys a cold node fetches, never which bytes a key gets: what it
says is checked against what the store says of each key, in the same requests.

- **A packed entry** (HTTP, S3): one request per batch asks the blobs' ranges, each line's
  pack index entry and the pack's trailer; kept when that index entry names the line's
  digest, offset and stored length and the range decodes to bytes that hash to the digest.
- **A loose entry**: the key's manifest and the blob in one ``get_many``; the manifest is
  judged as a lookup's and must name the digest and size, the blob must hash to it.

A blob stored compressed is decoded, bounded by the largest entry this node reads, before it is hashed.

Anything else is not fetched: the key's lookup finds it the ordinary way. A fetch holds at
most ``max(BATCH_BYTES, the largest entry it keeps)`` at once: claimed sizes are bounded by
:meth:`Tier.fits`, the same bytes are asked once, and a batch goes before the next is asked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar

from cuda_program_cas._base.frame import room
from cuda_program_cas._disk.layout import BLOBS, INDEX, url_path
from cuda_program_cas._disk.pack import ENTRY_SIZE, TRAILER_SIZE, entry_at
from cuda_program_cas.index import MAX_MANIFEST_BYTES

if TYPE_CHECKING:
    from cuda_program_cas._base.engine import Engine
    from cuda_program_cas._base.signing import Trust
    from cuda_program_cas._remote.httppacks import HttpPacks, Ranges

__all__ = ["Keep", "RangedPacks", "Source", "Wanted", "fetch"]

_T = TypeVar("_T")

#: The claimed bytes one batch asks at most (an entry larger than this is a batch alone).
BATCH_BYTES = 8 << 20
#: A request's framing per range it asks (multipart headers; cf. ``multipart.PART_OVERHEAD``).
_PER_RANGE = 256

#: ``keep(key id, bytes, digest)``: copy one verified entry in (the bytes may be a view of a batch's answer).
Keep = Callable[[str, "bytes | memoryview", str], None]
#: The packs of a remote store, read by ranges.
RangedPacks: TypeAlias = "HttpPacks"
#: ``ranged(pack, spans, tail)``: the spans and last bytes of a pack in one request (HTTP's packs).
_Ranged = Callable[[str, Sequence[tuple[int, int]], int], "Ranges | None"]


class Wanted(Protocol):
    """An entry a set's line names: key id, digest, size; the pack, offset, stored length and index entry (``at``)
    where known."""

    @property
    def kid(self) -> str: ...
    @property
    def digest(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def pack(self) -> str | None: ...
    @property
    def offset(self) -> int | None: ...
    @property
    def length(self) -> int | None: ...
    @property
    def at(self) -> int | None: ...


class Source(Protocol):
    """The store fetched from (a :class:`~cuda_program_cas._shared.tier.Tier`): its engine, packs and judgments."""

    @property
    def engine(self) -> Engine: ...
    @property
    def packs(self) -> object | None: ...
    def ranged_packs(self) -> RangedPacks | None: ...
    @property
    def trust(self) -> Trust | None: ...
    def fits(self, size: int, kid: str) -> bool: ...
    def judge(self, kid: str, data: bytes) -> tuple[str, int] | None: ...
    def raw_of(self, e: Wanted, data: bytes | memoryview) -> bytes | memoryview | None: ...


def batched(units: Sequence[_T], cost: Callable[[_T], int]) -> Iterator[list[_T]]:
    """``units`` in runs whose ``cost`` sums to at most :data:`BATCH_BYTES` (or one unit alone)."""
    batch: list[_T] = []
    total = 0
    for unit in units:
        n = cost(unit)
        if batch and total + n > BATCH_BYTES:
            yield batch
            batch, total = [], 0
        batch.append(unit)
        total += n
    if batch:
        yield batch


def fetch(tier: Source, entries: Sequence[Wanted], keep: Keep) -> None:
    """Fetch ``entries`` from ``tier``, calling ``keep`` for each one verified."""
    packs = tier.ranged_packs() if tier.trust is None else None
    ranged: _Ranged | None = None if packs is None else packs.fetch_ranges
    by_pack: dict[str, list[Wanted]] = {}
    loose: list[Wanted] = []
    for e in entries:
        if not tier.fits(e.size, e.kid):
            continue
        placed = e.offset is not None and e.length is not None and e.at is not None
        # Stored framed, an entry's bytes may be more than its raw ones, never more than their room.
        if ranged is not None and e.pack is not None and placed and e.length and e.length <= room(e.size):
            by_pack.setdefault(e.pack, []).append(e)
        else:
            loose.append(e)
    for pack, lines in by_pack.items():
        assert ranged is not None
        _packed(tier, ranged, pack, lines, keep)
    _loose(tier, loose, keep)


def _packed(tier: Source, ranged: _Ranged, pack: str, lines: list[Wanted], keep: Keep) -> None:
    spans: dict[tuple[int, int], list[Wanted]] = {}
    for e in lines:
        assert e.offset is not None and e.length is not None
        spans.setdefault((e.offset, e.length), []).append(e)
    for batch in batched(list(spans.items()), lambda unit: unit[0][1] + len(unit[1]) * (ENTRY_SIZE + _PER_RANGE)):
        asked = [span for span, _ in batch] + [(e.at, ENTRY_SIZE) for _, named in batch for e in named if e.at]
        got = ranged(pack, asked, TRAILER_SIZE)
        if got is None or got.tail is None:
            return  # refused (said once): the rest of this pack's entries are read the ordinary way
        trailer = bytes(got.tail)
        for span, named in batch:
            mine = [e for e in named if _index_names(got, trailer, pack, e)]
            blob = got.spans.get(span)
            raw = tier.raw_of(mine[0], blob) if mine and blob is not None else None
            if raw is not None:
                for e in mine:
                    keep(e.kid, raw, e.digest)
        got = blob = raw = None  # the batch's answer goes before the next is asked (blob: a view of its last range)


def _index_names(got: Ranges, trailer: bytes, pack: str, e: Wanted) -> bool:
    """Whether the pack's own index entry for ``e.kid`` (where the line says it lies) names the line's bytes."""
    assert e.at is not None
    raw = got.spans.get((e.at, ENTRY_SIZE))
    entry = None if raw is None else entry_at(bytes(raw), e.at, trailer, got.size, pack)
    line = (e.kid, e.digest, e.offset, e.length)
    return entry is not None and (entry.key_id, entry.digest, entry.offset, entry.size) == line


def _loose(tier: Source, lines: list[Wanted], keep: Keep) -> None:
    blobs: dict[tuple[str, int], list[Wanted]] = {}
    for e in lines:
        blobs.setdefault((e.digest, e.size), []).append(e)
    for batch in batched(list(blobs.items()), lambda unit: unit[0][1] + len(unit[1]) * MAX_MANIFEST_BYTES):
        named = [e for _, es in batch for e in es]
        names = [url_path(INDEX, e.kid) for e in named] + [url_path(BLOBS, digest) for (digest, _), _ in batch]
        limits = [MAX_MANIFEST_BYTES] * len(named) + [room(size) for (_, size), _ in batch]  # a blob stored framed
        found = tier.engine.get_many(names, limit=limits)
        manifests = dict(zip((e.kid for e in named), found[: len(named)], strict=True))
        for ((digest, size), es), blob in zip(batch, found[len(named) :], strict=True):
            # The key's own manifest must name these bytes: else gone, or the key names another entry now.
            mine = [e for e in es if (m := manifests[e.kid]) is not None and tier.judge(e.kid, m) == (digest, size)]
            raw = tier.raw_of(mine[0], blob) if mine and blob is not None else None
            if raw is not None:
                for e in mine:
                    keep(e.kid, raw, digest)
        del found, manifests, blob, raw  # the batch goes before the next is asked (blob: its last entry)
