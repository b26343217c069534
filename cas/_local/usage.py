"""The usage ledger: how long each entry took to compile, and how much time its hits saved.

``<root>/usage`` holds lines in the counters file's form (:func:`.lifetime.encode_line`), each
naming an entry by the first 16 hex digits of its key id as a decimal integer::

    t1 <key> <compile microseconds> <crc>     written by the miss that stored the entry
    u1 <key> <hits> <saved microseconds> <crc> a process's hits of it since its last flush
    s1 <bytes> <crc>                           the file's size when it was last compacted

A hit writes nothing: the counters' flush appends one ``u1`` line per key hit, under
``counters.lock``. Past twice its compacted size (and :data:`COMPACT_BYTES`) it is folded to one
``t1`` and one ``u1`` line per key, the latest :data:`MAX_KEYS` kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

from cuda_program_cas._base.log import LOGGER as _log
from cuda_program_cas._disk.atomic import atomic_write
from cuda_program_cas._disk.layout import Layout

from .lifetime import Busy, encode_line, locked_append, read_log, split_lines
from .stats import Counters

__all__ = [
    "COMPACT_BYTES",
    "compile_seconds_of",
    "compile_us_of",
    "key_number",
    "read_usage",
    "record_compile",
    "settle_hits",
]


#: The ledger is compacted no sooner than this size.
COMPACT_BYTES = 256 * 1024
#: Keys a compaction keeps (about 50 bytes each).
MAX_KEYS = 50_000
#: How long a write waits for ``counters.lock``.
_WAIT_S = 0.5


def key_number(kid: str) -> int:
    """The number that names key id ``kid`` in the ledger: its first 16 hex digits."""
    return int(kid[:16], 16)


class Usage(NamedTuple):  # not a dataclass: built at the exit of a process with hits (0.3 ms against 0.04)
    #: Key number -> compile time in microseconds (the latest recorded).
    compile_us: dict[int, int]
    #: Key number -> (hits, saved microseconds), summed.
    saved: dict[int, tuple[int, int]]
    #: The file's size when it was last compacted (0: never).
    compacted_bytes: int = 0


def _parse(data: bytes) -> Usage:
    times: dict[int, int] = {}
    saved: dict[int, tuple[int, int]] = {}
    compacted = 0
    for line in split_lines(data):
        if line is None:
            continue
        tag, values = line
        if tag == b"t1" and len(values) == 2:
            times.pop(values[0], None)  # re-inserted: the dict's order is the order of the latest compiles
            times[values[0]] = values[1]
        elif tag == b"u1" and len(values) == 3:
            hits, us = saved.get(values[0], (0, 0))
            saved[values[0]] = (hits + values[1], us + values[2])
        elif tag == b"s1" and len(values) == 1:
            compacted = values[0]
    return Usage(times, saved, compacted)


def read_usage(lay: Layout) -> Usage:
    """The ledger of the cache ``lay`` (empty when it has none); takes no lock."""
    return _parse(read_log(lay.usage))


#: The ledger's compile times as this process last read them, by path, with the file's identity then.
#: No lock: a thread that stores an older read leaves a stamp the next call finds stale.
_KNOWN: dict[str, tuple[tuple[int, int, int], dict[int, int]]] = {}


def compile_us_of(lay: Layout, numbers: list[int]) -> dict[int, int]:
    """The recorded compile times of the keys ``numbers`` (those known); the file is read again only when changed."""
    try:
        st = os.stat(lay.usage)
    except OSError:
        return {}
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    known = _KNOWN.get(lay.usage)
    if known is None or known[0] != stamp:
        known = _KNOWN[lay.usage] = (stamp, _parse(read_log(lay.usage)).compile_us)
    times = known[1]
    return {n: times[n] for n in numbers if n in times}


def compile_seconds_of(lay: Layout, kid: str) -> float | None:
    """The recorded compile time of key id ``kid`` in seconds, or None."""
    us = compile_us_of(lay, [key_number(kid)])
    return None if not us else next(iter(us.values())) / 1e6


def _write(lay: Layout, lines: bytes) -> bool:
    def compact_if_due(size: int) -> None:
        if size > COMPACT_BYTES:
            try:
                usage = read_usage(lay)
                if size > 2 * usage.compacted_bytes:
                    _compact(lay, usage)
            except OSError as exc:  # the lines are appended: a failure here must not put them back
                _log.debug("cuda-program-cas: %s: usage ledger not folded: %r", lay.root, exc)

    try:
        return locked_append(lay, lay.usage, lines, _WAIT_S, compact_if_due)
    except (Busy, OSError) as exc:
        _log.debug("cuda-program-cas: %s: usage ledger not written: %r", lay.root, exc)
        return False


def _compact(lay: Layout, usage: Usage) -> None:
    """Fold the ledger (the caller holds the lock)."""
    keep = list(usage.compile_us)[-MAX_KEYS:]
    kept = set(keep)
    body = [encode_line("t1", [n, usage.compile_us[n]]) for n in keep]
    body += [encode_line("u1", [n, h, us]) for n, (h, us) in usage.saved.items() if n in kept]
    data = b"".join(body)
    head = encode_line("s1", [len(data) + 40])  # about its own length, added
    atomic_write(lay.usage, head + data, lay.tmp)


def record_compile(lay: Layout, kid: str, seconds: float) -> bool:
    """Record that the entry ``kid`` took ``seconds`` to compile; False when it could not be recorded."""
    return _write(lay, encode_line("t1", [key_number(kid), max(0, round(seconds * 1e6))]))


def record_hits(lay: Layout, hits: Mapping[str, int]) -> tuple[int, bool]:
    """Record ``hits`` (key id -> hits) of entries whose compile time is known: microseconds saved, and if recorded."""
    numbers = {kid: key_number(kid) for kid in hits}
    times = compile_us_of(lay, list(numbers.values()))
    lines = []
    saved = 0
    for kid, n in numbers.items():
        us = times.get(n)
        if us is not None:
            lines.append(encode_line("u1", [n, hits[kid], hits[kid] * us]))
            saved += hits[kid] * us
    if not lines:
        return 0, True
    return (saved, True) if _write(lay, b"".join(lines)) else (0, False)


def settle_hits(lay: Layout, hits: dict[str, int], counters: Counters) -> None:
    """Turn a store's tally of hits per key id into saved time, in the ledger and ``saved_us``.

    ``hits`` is emptied; what cannot be recorded now is put back for the next flush.
    """
    taken = dict(hits)
    hits.clear()  # the same dict: the store holds it
    saved, recorded = record_hits(lay, taken)
    if not recorded:
        for kid, n in taken.items():
            hits[kid] = hits.get(kid, 0) + n
    elif saved:
        counters.add("saved_us", saved)
