"""Why a compile missed: for each recent miss, the one input that differed from its own earlier variant.

:func:`explain` reads the miss journal (:mod:`cuda_program_cas._local.journal`) and nothing
else. An input is the code, its code type, the target, the compiler's version, the name
expressions, the working directory, each option (by its name: ``-arch``,
``--define-macro=NAME``...) and each header (by its file name: found in another directory,
it moved). Each miss is compared with one earlier record of the same way in (``plain``,
``front``, ``nvvm``, ``compute``): for a front door miss whose record held but a variant's
check failed, the latest earlier record of the same key; else its own nearest earlier
variant (same code, code type and name expressions; fewest differences, the latest winning
a tie), and only when that code was never compiled before, the nearest of all.

The verdict: ``changed`` (one input differed: ``option -arch: sm_80 -> sm_90``), ``several``,
``same`` (the same inputs compiled before: their entry was removed since), or ``new``
(nothing earlier like it, or the nearest of all differs in more than two places). Where the
front door's check failed and the inputs are the same, what the check found is the change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cuda_program_cas._disk.layout import Layout
from cuda_program_cas._local.journal import MissRecord, read_journal
from cuda_program_cas._local.why import (
    DIRECTORY_CHANGED,
    HEADER_CHANGED,
    HEADER_GONE,
    NOT_A_CHECK,
    SHADOWED,
    UNCACHEABLE,
)

from .common import Report, cache_root, iso_utc, not_created, open_cache

__all__ = ["ExplainReport", "MissExplanation", "explain"]

#: Inputs compared as one value each, and how a change of each is named.
_SCALARS = {
    "code": "code",
    "code_type": "code type",
    "target": "target",
    "nvrtc": "nvrtc",
    "nvvm": "nvvm",
    "libdevice": "libdevice",
    "names": "name expressions",
    "cwd": "working directory",
    "extra": "extra digest",
}
#: A miss whose nearest earlier compile differs in more places than this is new.
_NEAR = 2
#: The inputs that make a compile "the same source": its own earlier variants share them.
_OWN = ("code", "code_type", "names")


@dataclass(frozen=True, slots=True)
class MissExplanation:
    #: The id of the entry the miss stored (``key_id(key)``; a ``cache.compile`` entry's record id).
    key_id: str
    #: ISO 8601, UTC.
    time: str
    compile_seconds: float
    #: ``plain`` (``Program.compile(cache=)``), ``front`` (``cache.compile``), ``nvvm`` or ``compute``.
    via: str
    #: ``changed``, ``several``, ``same``, ``new``, or ``uncacheable`` (a build ran uncached: ``reason``).
    verdict: str
    #: What kind of input changed (``option``, ``header``, ``nvrtc``, ``code``, ``directory``...), one per difference.
    inputs: tuple[str, ...]
    #: The differences, one line each (``option -arch: sm_80 -> sm_90``).
    changes: tuple[str, ...]
    #: The key id of the nearest earlier compile, or None.
    nearest: str | None
    #: One line: what ``explain`` prints.
    summary: str
    #: Why the front door's lookup missed, as it logs it at DEBUG (None for a plain key).
    reason: str | None = None
    #: The path whose check failed (a header changed or gone, a directory's listing, a shadowing file).
    path: str | None = None


@dataclass(slots=True)
class ExplainReport(Report):
    """The explained misses of one cache, oldest first."""

    max_listed: ClassVar[int | None] = None

    path: str
    exists: bool = True
    #: Misses the journal holds (the ones explained are the last of them).
    recorded: int = 0
    misses: list[MissExplanation] = field(default_factory=list)


def _option_groups(options: list[str]) -> dict[str, list[str]]:
    """Options by name: ``--define-macro=N=V`` is named by N, others by what precedes ``=``."""
    groups: dict[str, list[str]] = {}
    for token in options:
        name, eq, value = token.partition("=")
        if name in ("--define-macro", "-D") and eq:
            macro, _, value = value.partition("=")
            name = f"{name}={macro}"
        groups.setdefault(name, []).append(value if eq else "")
    return groups


def _show(values: list[str]) -> str:
    return ", ".join(v or "(set)" for v in values) or "(none)"


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str]]:
    """``(input kind, what changed)`` for each place two journal inputs differ."""
    found: list[tuple[str, str]] = []
    for key, label in _SCALARS.items():
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if key == "code":
            found.append(("code", "code changed"))
        elif key == "cwd":
            if a and b:  # keyed on one side only: another input (an option, the code) made it count
                found.append(("working directory", f"working directory: {a} -> {b}"))
        else:
            found.append((label, f"{label}: {a} -> {b}"))
    a_opts, b_opts = _option_groups(list(old.get("options", []))), _option_groups(list(new.get("options", [])))
    for name in sorted(a_opts.keys() | b_opts.keys()):
        a, b = a_opts.get(name), b_opts.get(name)
        if a == b:
            continue
        kind = "search directory" if name == "--include-path" else "option"
        if a is None:
            found.append((kind, f"option {name} added: {_show(b or [])}"))
        elif b is None:
            found.append((kind, f"option {name} removed (was {_show(a)})"))
        else:
            found.append((kind, f"option {name}: {_show(a)} -> {_show(b)}"))
    old_headers = old.get("headers")
    a_cwd, b_cwd = old.get("cwd"), new.get("cwd")
    if isinstance(old_headers, dict) and a_cwd and b_cwd and a_cwd != b_cwd:
        # Headers found through the working directory moved with it: that is the one change.
        prefix = a_cwd.rstrip(os.sep) + os.sep
        moved = b_cwd.rstrip(os.sep) + os.sep
        old_headers = {(moved + p[len(prefix) :] if p.startswith(prefix) else p): d for p, d in old_headers.items()}
    found.extend(_header_differences(old_headers, new.get("headers")))
    return found


def _header_differences(old: object, new: object) -> list[tuple[str, str]]:
    if old == new:
        return []
    if not isinstance(old, dict) or not isinstance(new, dict):
        return [("header", "headers: recorded for one compile only")]
    if "*" in old or "*" in new:
        return [("header", "headers changed (too many to list)")]
    found = []
    gone = {p: d for p, d in old.items() if p not in new}
    came = {p: d for p, d in new.items() if p not in old}
    for path in sorted(p for p in old.keys() & new.keys() if old[p] != new[p]):
        found.append(("header", f"header {path}: content changed"))
    by_name: dict[str, list[str]] = {}
    for path in gone:
        by_name.setdefault(os.path.basename(path), []).append(path)
    for path in sorted(came):
        was = by_name.get(os.path.basename(path))
        if was:
            before = was.pop(0)
            same = " (same content)" if gone.pop(before) == came[path] else " (other content)"
            found.append(("header", f"header {os.path.basename(path)}: now found at {path}, was {before}{same}"))
        else:
            found.append(("header", f"header {path}: newly read"))
    for path in sorted(gone):
        found.append(("header", f"header {path}: no longer read (removed, or no longer included)"))
    return found


#: What a failed check found, where the recompile read the same inputs: ``(input kind, what changed)``.
_CHECK_CHANGES = {
    DIRECTORY_CHANGED: (
        "directory",
        "directory {}: an entry was added, removed or renamed (the headers read are the same)",
    ),
    HEADER_CHANGED: ("header", "header {}: changed since it was compiled (re-hashed: its content differed)"),
    HEADER_GONE: ("header", "header {}: gone since it was compiled"),
    SHADOWED: ("header", "{}: appeared where NVRTC looks before a header it read (it may now be found first)"),
}


def _failed_check_change(why: dict[str, str]) -> tuple[str, str]:
    path = why.get("path", "")
    if why.get("kind") in _CHECK_CHANGES:
        kind, text = _CHECK_CHANGES[why["kind"]]
        return kind, text.format(path)
    return "header" if path else "record", why.get("text", "") or "a variant's check failed"


def _nearest(
    record: MissRecord, earlier: list[MissRecord], check: dict[str, str] | None
) -> tuple[list[tuple[str, str]], MissRecord, bool] | None:
    """The earlier record ``record`` is compared with, how they differ, and whether it is its own variant."""
    candidates = [other for other in earlier if other.via == record.via]
    if check is not None:
        # The variant whose check failed: the one the same record key stored last.
        for other in reversed(candidates):
            if other.key_id == record.key_id:
                return _differences(other.inputs, record.inputs), other, True
    own = [other for other in candidates if all(other.inputs.get(k) == record.inputs.get(k) for k in _OWN)]
    best: tuple[list[tuple[str, str]], MissRecord, bool] | None = None
    for other in reversed(own or candidates):  # the latest wins a tie
        diffs = _differences(other.inputs, record.inputs)
        if best is None or len(diffs) < len(best[0]):
            best = (diffs, other, bool(own))
            if not diffs:
                break
    return best


def explain_one(record: MissRecord, earlier: list[MissRecord]) -> MissExplanation:
    """Why ``record`` missed, given the records before it (oldest first)."""
    why = record.why or {}
    verdict, summary, diffs, nearest = _verdict(record, earlier, why)
    return MissExplanation(
        key_id=record.key_id,
        time=iso_utc(record.time),
        compile_seconds=record.compile_seconds,
        via=record.via,
        verdict=verdict,
        inputs=tuple(d[0] for d in diffs),
        changes=tuple(d[1] for d in diffs),
        nearest=nearest,
        summary=summary,
        reason=why.get("text") or None,
        path=why.get("path") or None,
    )


def _verdict(
    record: MissRecord, earlier: list[MissRecord], why: dict[str, Any]
) -> tuple[str, str, list[tuple[str, str]], str | None]:
    """``explain_one``'s verdict, summary, differences and nearest earlier key id."""
    if why.get("kind") == UNCACHEABLE:  # not a miss: a build that cannot be keyed soundly ran uncached
        return "uncacheable", f"not cached: {why.get('text', '')}", [], None
    # A front door miss whose record held but a variant failed its check.
    check = None if record.why is None or record.why.get("kind") in NOT_A_CHECK else record.why
    best = _nearest(record, earlier, check)
    diffs = [] if best is None else best[0]
    nearest = None if best is None else best[1].key_id
    if check is not None and not diffs:
        # The front door's check found the change; the compile read what it read before.
        diffs = [_failed_check_change(check)]
    if not diffs and check is None and best is not None:
        return (
            "same",
            "the same inputs compiled before: their entry was removed since (evicted, cleared or collected)",
            diffs,
            nearest,
        )
    if (best is not None and not best[2] and len(diffs) > _NEAR) or (best is None and check is None):
        # Nothing earlier of the same code, and the nearest of others is far (or there is none).
        summary = "new: no earlier compile of anything like it"
        if best is not None:
            summary += f" (the nearest differs in {len(diffs)} inputs)"
        return "new", summary, [], None
    if len(diffs) == 1:
        return "changed", diffs[0][1], diffs, nearest
    return "several", "several inputs differed: " + "; ".join(d[1] for d in diffs), diffs, nearest


def explain(path: str | os.PathLike[str] | None = None, *, last: int = 10) -> ExplainReport:
    """Why the last ``last`` misses of the cache at ``path`` (None: the default directory) missed; reads only.

    Raises :class:`cuda_program_cas.LayoutError` for a file or a foreign directory.
    """
    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        raise ValueError(f"last must be a positive int, got {last!r}")
    root = os.path.abspath(cache_root(path))
    if not_created(root):
        return ExplainReport(root, exists=False)
    lay: Layout = open_cache(root, write=False, allow_damaged=True).lay
    report = ExplainReport(lay.root)
    records = read_journal(lay)
    report.recorded = len(records)
    start = max(0, len(records) - last)
    report.misses = [explain_one(records[i], records[:i]) for i in range(start, len(records))]
    return report
