"""What the NFS scenarios, the claims scenario and the harness share: this checkout's package, the
mounts' figures, the summary of a run.

Imported first by both (``tools/nfs/`` is first on ``sys.path`` when either runs), so that
``cuda_program_cas`` is this checkout's whatever the interpreter has installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


class _ThisCheckout:
    """Import ``cuda_program_cas`` from this checkout, whatever the interpreter has installed.

    An editable install names the folders of the checkout it was made from. The VM
    sees only this checkout, and the figures must be this checkout's code's.
    """

    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None) -> Any:
        folder = {"cuda_program_cas": "cas", "cuda_program_cas.index": "index"}.get(fullname)
        if folder is None:
            return None
        init = os.path.join(REPO, folder, "__init__.py")
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[os.path.dirname(init)]
        )


if os.path.isfile(os.path.join(REPO, "cas", "__init__.py")):
    sys.meta_path.insert(0, _ThisCheckout)


def mountstats(mount: str) -> dict[str, int] | None:
    """Operation counts of the NFS mount at ``mount`` from ``/proc/self/mountstats``; None off NFS."""
    counts: dict[str, int] | None = None
    try:
        with open("/proc/self/mountstats") as fh:
            text = fh.read()
    except OSError:
        return counts
    inside = ops = False
    for line in text.splitlines():
        if line.startswith("device "):
            inside = f" mounted on {mount} with fstype nfs" in line
            ops = False
            if inside:
                counts = {}
            continue
        if not inside:
            continue
        if line.strip() == "per-op statistics":
            ops = True
            continue
        if ops and ":" in line:
            name, _, rest = line.strip().partition(":")
            fields = rest.split()
            if counts is not None and name.isupper() and fields and fields[0].isdigit():
                counts[name] = int(fields[0])
    return counts


def ops_between(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int]:
    if before is None or after is None:
        return {}
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


def mount_options(paths: list[str]) -> dict[str, str]:
    found = {}
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if parts[1] in paths:
                    found[parts[1]] = f"{parts[2]} {parts[3]}"
    except OSError:
        pass
    return {p: found.get(p, "(not a mount point)") for p in paths}


def format_summary(result: dict[str, Any]) -> str:
    lines = [f"NFS scenarios on Linux {result['kernel']} ({result['seconds']} s)"]
    for path, opts in result["mounts"].items():
        lines.append(f"  mount {path}: {opts}")
    for sc in result["scenarios"]:
        lines.append(f"{'ok    ' if sc['ok'] else 'FAILED'} {sc['name']} ({sc['seconds']} s)")
        for key, value in sc["figures"].items():
            if isinstance(value, list) and value and isinstance(value[0], dict):
                for item in value:
                    lines.append("         " + ", ".join(f"{k}={v}" for k, v in item.items()))
            else:
                lines.append(f"         {key}: {value}")
        for failure in sc["failures"]:
            lines.append(f"  !! {failure}")
    lines.append(f"{'PASSED' if result['ok'] else 'FAILED'}: {sum(s['ok'] for s in result['scenarios'])} of "
                 f"{len(result['scenarios'])} scenarios passed")  # fmt: skip
    return "\n".join(lines)
