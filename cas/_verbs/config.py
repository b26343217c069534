"""The settings a cache gets, and the cap it stores (``ccache -M``).

:func:`config` says every effective setting of a cache and where it came from, and every
environment variable the package reads (:data:`cuda_program_cas._base.config.VARIABLES`):
its value (a secret only as ``set``), its source, and whether it was accepted. Each value
or part of one that the package ignores is a problem.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import ClassVar, cast

import cuda_program_cas._base.config as _registry
from cuda_program_cas._base.config import NOT_GIVEN, collecting
from cuda_program_cas._disk.layout import Layout, create_layout
from cuda_program_cas._disk.settings import (
    MAX_SIZE,
    SETTING_NAMES,
    Setting,
    effective_settings,
    settings_path,
    store_setting,
)

from .common import Report, cache_root, check_writable

__all__ = [
    "MAX_SIZE",
    "SETTING_NAMES",
    "ConfigReport",
    "Reading",
    "Setting",
    "config",
    "read_variables",
    "settings_path",
]


@dataclass(frozen=True, slots=True)
class Reading:
    """What one variable of :data:`VARIABLES` reads in this environment."""

    name: str
    meaning: str
    #: ``environment`` when set and not empty, else ``default``.
    source: str
    #: The value as the package uses it, in words: ``set`` for a secret, the default's words when unset.
    value: str
    #: False when the value, or a part of it, is refused.
    accepted: bool
    #: False when the whole value is refused (the package reads as if it were unset).
    used: bool = True
    #: Why each refused value or part is ignored, one line each.
    problems: tuple[str, ...] = ()
    #: What else to know about an accepted value (a relative path made absolute).
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k != "name"}


#: Warnings a reader gives about a value it still uses: notes, not refusals.
_NOTE_KINDS = frozenset({"env-relative"})


def read_variables() -> list[Reading]:
    """Every variable of :data:`VARIABLES` as this environment sets it, read by its own parser."""
    out = []
    for var in _registry.VARIABLES:  # read when called: the registry's tuple as it is then
        text = os.environ.get(var.name) or ""
        if not text:
            out.append(Reading(var.name, var.meaning, "default", f"unset: {var.default}", True))
            continue
        with collecting() as said:
            value, why = var.read()
        problems = [why] if why else []
        # A reader's keys are tuples that start with their kind.
        kinds = [(cast("tuple[str, ...]", key)[0], text_.removeprefix("cuda-program-cas: ")) for key, text_ in said]
        problems += [text_ for kind, text_ in kinds if kind not in _NOTE_KINDS]
        notes = [text_ for kind, text_ in kinds if kind in _NOTE_KINDS]
        if var.secret:
            shown = "set"
        elif why is not None:
            shown = repr(text)
        elif isinstance(value, (list, tuple)):
            shown = " ".join(map(str, value)) or "none"
        else:
            shown = str(value)
        # A list with every part refused is used as if unset.
        accepted, used = not problems, why is None and not (isinstance(value, list) and not value and problems)
        out.append(Reading(var.name, var.meaning, "environment", shown, accepted, used, tuple(problems), tuple(notes)))
    return out


@dataclass(slots=True)
class ConfigReport(Report):
    """The effective settings of a cache; ``problems``: values the library ignores, and why."""

    max_listed: ClassVar[int | None] = None

    path: str
    #: Every setting asked for, in the order the library reads them.
    settings: list[Setting] = field(default_factory=list)
    #: What this call stored in the cache (name -> value, None: removed), or None.
    stored: dict[str, int | None] | None = None
    #: Every environment variable the package reads, as read here (none when one setting was asked for).
    variables: list[Reading] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        out = Report.as_dict(self)
        if self.stored is None:
            del out["stored"]
        out["settings"] = {s.name: s.as_dict() for s in self.settings}
        out["variables"] = {v.name: v.as_dict() for v in self.variables}
        return out


def config(
    path: str | os.PathLike[str] | None = None,
    *,
    name: str | None = None,
    max_size: int | None = NOT_GIVEN,
) -> ConfigReport:
    """The settings a cache opened at ``path`` (None: the default directory) gets with no arguments.

    ``name``: only that setting (``"max_size_bytes"``, ``"directory"``, ``"shared"``, ``"log_file"``), and
    no variables. ``max_size``: first store that cap in the cache's ``settings.json`` (None removes
    it), creating the cache if missing: every process that opens it honours it unless
    ``max_size_bytes=`` or ``$CUDA_PROGRAM_CAS_MAX_SIZE`` says otherwise.
    """
    given = os.path.abspath(path) if path else None
    root = cache_root(path)
    stored: dict[str, int | None] | None = None
    if max_size is not NOT_GIVEN:
        create_layout(root)  # a cache set up before its first job: as a first open would
        check_writable(Layout(root), "store a setting")
        store_setting(root, MAX_SIZE, max_size)
        stored = {MAX_SIZE: max_size}
    settings = effective_settings(given)
    if name is not None:
        settings = [s for s in settings if s.name == name]
    report = ConfigReport(root, settings, stored, [] if name is not None else read_variables())
    if stored is None:  # a store that succeeded is not failed by a bad variable elsewhere
        for s in settings:
            if s.problem:
                report.problem(s.problem)
        for v in report.variables:
            for text in v.problems:
                if not any(text in said for said in report.problems):  # the cap's is said with its setting
                    report.problem(text)
        if name is None:
            from cuda_program_cas._base.signing import key_problems

            shared = next((s.value for s in settings if s.name == "shared"), None)
            writable = isinstance(shared, list) and any(str(e).endswith("|write") for e in shared)
            for text in key_problems(writable):
                report.problem(text)
    return report
