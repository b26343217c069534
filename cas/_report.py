"""What the maintenance reports (gc, import) have in common: a bounded list of problems."""

from __future__ import annotations

import dataclasses

__all__ = ["ProblemLog"]

#: At most this many problems are listed one by one (all are counted).
MAX_LISTED = 100


class ProblemLog:
    """Mixin for a report dataclass with ``problems``, ``problem_count`` and ``elapsed_s`` fields."""

    problems: list[str]
    problem_count: int
    elapsed_s: float

    def problem(self, text: str) -> None:
        """Count a problem; list it while fewer than :data:`MAX_LISTED` are listed."""
        self.problem_count += 1
        if len(self.problems) < MAX_LISTED:
            self.problems.append(text)

    def as_dict(self) -> dict[str, object]:
        """Every field, for ``--json`` (the elapsed time rounded to milliseconds)."""
        assert dataclasses.is_dataclass(self)
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["elapsed_s"] = round(self.elapsed_s, 3)
        return out
