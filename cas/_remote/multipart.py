"""Several ranges of one file in one request: the ``Range`` header asked, and the ``multipart/byteranges`` answer read.

The answer (RFC 9110, 14.6) is read strictly, by the lengths the parts' ``Content-Range``
headers give, never by looking for the boundary inside the bytes (a blob may hold any).
Each part must be one of the ranges asked, at most once, of one file size; anything else
makes the whole answer unusable (:func:`parse` returns None, and the caller reads those
entries the ordinary way). The parts are views of the body, never copies.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = ["PART_OVERHEAD", "coalesce", "header", "parse"]

#: Bytes a part's framing may take besides its data.
PART_OVERHEAD = 256
#: Ranges this close together are asked as one (a few KiB read for nothing beats another part).
_GAP = 4096
_BOUNDARY = re.compile(r'multipart/byteranges;\s*boundary=("?)([0-9A-Za-z\'()+_,\-./:=?]{1,70})\1', re.IGNORECASE)
_CONTENT_RANGE = re.compile(rb"bytes (\d+)-(\d+)/(\d+)")


def coalesce(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, size)`` spans merged where they touch or lie within a few KiB, sorted by offset."""
    merged: list[tuple[int, int]] = []
    for offset, size in sorted(spans):
        if merged and offset <= merged[-1][0] + merged[-1][1] + _GAP:
            first, length = merged[-1]
            merged[-1] = (first, max(length, offset + size - first))
        else:
            merged.append((offset, size))
    return merged


def header(spans: Sequence[tuple[int, int]], tail: int = 0) -> str:
    """The ``Range`` value asking ``(offset, size)`` spans (each size at least 1), and the last ``tail`` bytes."""
    asked = [f"{offset}-{offset + size - 1}" for offset, size in spans] + ([f"-{tail}"] if tail else [])
    return "bytes=" + ",".join(asked)


def parse(
    content_type: str, body: bytes, spans: Sequence[tuple[int, int]], tail: int = 0
) -> tuple[Mapping[int, memoryview], int] | None:
    """Offset -> bytes of each span asked (views of ``body``: no copy), from a ``multipart/byteranges`` body, and the
    file's size; the last ``tail`` bytes, where asked, at their offset. None when it is not exactly that."""
    m = _BOUNDARY.fullmatch(content_type.strip())
    if m is None:
        return None
    delimiter = b"--" + m.group(2).encode()
    asked = dict(spans)
    whole = memoryview(body)
    got: dict[int, memoryview] = {}
    total: int | None = None
    pos = 0
    if body.startswith(b"\r\n"):
        pos = 2  # nginx begins with the CRLF that precedes every delimiter
    while True:
        if not body.startswith(delimiter, pos):
            return None
        pos += len(delimiter)
        if body.startswith(b"--", pos):
            pos += 2
            break
        if not body.startswith(b"\r\n", pos):
            return None
        end = body.find(b"\r\n\r\n", pos + 2)
        if end < 0 or end - pos > 1024:
            return None
        span = _part_range(body[pos + 2 : end].split(b"\r\n"))
        if span is None:
            return None
        first, last, size = span
        length = last - first + 1
        wanted = asked.get(first) == length or (tail and length == tail and last == size - 1)
        if not wanted or first in got or (total is not None and size != total) or last >= size:
            return None  # a range not asked for, twice, or of another file
        total = size
        start = end + 4
        if start + length > len(body) or not body.startswith(b"\r\n", start + length):
            return None
        got[first] = whole[start : start + length]
        pos = start + length + 2
    if body[pos:] not in (b"", b"\r\n") or len(got) != len(asked) + (1 if tail else 0) or total is None:
        return None
    return got, total


def _part_range(lines: list[bytes]) -> tuple[int, int, int] | None:
    """The ``Content-Range`` of a part's header lines (exactly one), as ``(first, last, size)``."""
    found = None
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon:
            return None
        if name.strip().lower() == b"content-range":
            m = _CONTENT_RANGE.fullmatch(value.strip())
            if m is None or found is not None:
                return None
            found = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
    return found
