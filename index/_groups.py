"""Entries that live and die together: a front-door record and the results it names.

Every planner that removes live entries treats a group as one unit, whose last
use is its most recent member's. A grouped key id is ``group (24 hex) + member
(32 hex) + tag (8 hex)``; a sha256 key id ends in the tag once in 2**32 keys,
and even then grouping only makes entries leave together.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

__all__ = ["group_of", "grouped_id", "is_record", "lru_units", "partners_of"]

#: The last 8 hex digits of every grouped key id.
GROUP_TAG = "fd0c6a1e"
#: The member part of a group's record.
RECORD_MEMBER = "0" * 32


class _Entry(Protocol):
    @property
    def key_id(self) -> str: ...


_Info = TypeVar("_Info", bound=_Entry)


def grouped_id(group: bytes, member: bytes | None) -> str:
    """The key id of ``member`` of ``group`` (``member`` None: the group's record)."""
    head = hashlib.sha256(group).hexdigest()[:24]
    tail = RECORD_MEMBER if member is None else hashlib.sha256(member).hexdigest()[:32]
    return head + tail + GROUP_TAG


def group_of(kid: str) -> str | None:
    """The group of key id ``kid``, or None when it belongs to none."""
    return kid[:24] if kid.endswith(GROUP_TAG) else None


def is_record(kid: str) -> bool:
    """Whether key id ``kid`` names a group's record (a front door's list of headers), not a binary."""
    return kid.endswith(GROUP_TAG) and kid[24:56] == RECORD_MEMBER


def lru_units(infos: Iterable[_Info], last_use: Callable[[_Info], int]) -> list[list[_Info]]:
    """``infos`` as units of removal, least recently used first: each group one unit, each other entry its own."""
    units: list[list[_Info]] = []
    groups: dict[str, list[_Info]] = {}
    for info in infos:
        group = group_of(info.key_id)
        if group is None:
            units.append([info])
        elif group in groups:
            groups[group].append(info)
        else:
            groups[group] = unit = [info]
            units.append(unit)
    units.sort(key=lambda unit: max(last_use(i) for i in unit))
    return units


def partners_of(removed: Iterable[_Entry], candidates: Sequence[_Info]) -> list[_Info]:
    """The entries of ``candidates`` whose group loses a member in ``removed`` (and that are not in it)."""
    gone = {i.key_id for i in removed}
    groups = {g for g in (group_of(k) for k in gone) if g is not None}
    if not groups:
        return []
    return [i for i in candidates if i.key_id not in gone and group_of(i.key_id) in groups]
