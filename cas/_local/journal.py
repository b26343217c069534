"""The miss journal: what each recent compile that missed was made of, for ``explain``.

Each miss that stores a new entry appends ``m1 <JSON object> <crc>`` to ``<root>/misses`` (the
CRC as the counters'; a torn or failing line is skipped). The object holds the key id (``k``),
when (``t``), the compile's seconds (``s``), ``via`` (``plain``, ``front`` or ``nvvm``), the inputs
(``in``) and, for a front door miss, ``why`` (a :class:`.why.Why` as a dict). A line is one
``O_APPEND`` write, without a lock; one over :data:`MAX_LINE` keeps a digest of its headers, not
their list. Past :data:`MAX_BYTES` the file becomes ``misses.1``. A failed write is counted, never raised.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cuda_program_cas._disk.atomic import append_line
from cuda_program_cas._disk.layout import Layout

from .lifetime import read_log
from .why import Why

__all__ = ["DROPPED", "MAX_BYTES", "MAX_LINE", "MissRecord", "read_journal", "record_miss"]

_log = logging.getLogger("cuda_program_cas")

#: The journal file is rotated once past this size.
MAX_BYTES = 1 << 20
#: The longest line kept whole; a longer one lists no headers.
MAX_LINE = 64 * 1024
_TAG = b"m1 "


class _Dropped:
    count = 0


DROPPED = _Dropped()


@dataclass(frozen=True, slots=True)
class MissRecord:
    """One line of the journal."""

    key_id: str
    time: float
    compile_seconds: float
    via: str
    inputs: dict[str, Any]
    #: Why its lookup missed (``kind``, ``path``, ``text``), when the front door knew.
    why: dict[str, str] | None = None


def _encode(body: dict[str, Any]) -> bytes:
    text = _TAG + json.dumps(body, separators=(",", ":"), ensure_ascii=True, sort_keys=True).encode()
    return b"%s %08x\n" % (text, zlib.crc32(text))


def record_miss(
    lay: Layout, kid: str, seconds: float, via: str, inputs: Mapping[str, Any], *, why: str | None = None
) -> bool:
    """Append a miss of key id ``kid``, and ``why`` it missed when known; False when dropped."""
    try:
        body: dict[str, Any] = {
            "k": kid,
            "t": round(time.time(), 3),
            "s": round(seconds, 6),
            "via": via,
            "in": dict(inputs),
        }
        if why is not None:
            body["why"] = why.as_dict() if isinstance(why, Why) else {"kind": "", "path": "", "text": str(why)}
        line = _encode(body)
        if len(line) > MAX_LINE and isinstance(body["in"].get("headers"), dict):
            headers = body["in"]["headers"]
            listed = json.dumps(sorted(headers.items())).encode()
            body["in"]["headers"] = {"*": f"{len(headers)} headers, digest {zlib.crc32(listed):08x}"}
            line = _encode(body)
        if len(line) > MAX_LINE:
            raise ValueError(f"a journal line of {len(line)} bytes")
        if append_line(lay.misses, line) > MAX_BYTES:
            os.replace(lay.misses, lay.misses_old)  # two rotating at once lose one file's lines: a bound, not a bug
    except Exception as exc:  # never a compile's failure
        DROPPED.count += 1
        _log.debug("cuda-program-cas: %s: miss journal not written: %r", lay.root, exc)
        return False
    return True


def _parse(data: bytes) -> list[MissRecord]:
    found = []
    for raw in data.split(b"\n"):
        if not raw.startswith(_TAG) or len(raw) < len(_TAG) + 10 or raw[-9:-8] != b" ":
            continue
        text = raw[:-9]
        try:
            if zlib.crc32(text) != int(raw[-8:], 16):
                continue
            body = json.loads(text[len(_TAG) :])
            why = body.get("why")
            found.append(
                MissRecord(
                    str(body["k"]),
                    float(body["t"]),
                    float(body["s"]),
                    str(body["via"]),
                    dict(body["in"]),
                    {str(k): str(v) for k, v in why.items()} if isinstance(why, dict) else None,
                )
            )
        except (ValueError, KeyError, TypeError):
            continue
    return found


def read_journal(lay: Layout) -> list[MissRecord]:
    """Every readable record of the journal of ``lay``, oldest first (empty when there is none)."""
    records: list[MissRecord] = []
    for path in (lay.misses_old, lay.misses):
        try:
            records.extend(_parse(read_log(path)))
        except OSError:
            continue
    return records
