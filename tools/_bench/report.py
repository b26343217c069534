"""The report: the machine a run measured on, the verdicts against the targets, and the table."""

from __future__ import annotations

import os
import platform
from typing import Any

from testkit.common import cpu_model, git_state


def _mount_of(path: str) -> dict[str, str]:
    path = os.path.realpath(path)
    best: dict[str, str] = {}
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                dev, mnt, fstype, opts = line.split()[:4]
                mnt = mnt.replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best.get("mount", "")):
                    best = {"device": dev, "mount": mnt, "fstype": fstype, "options": opts}
    except OSError:
        pass
    return best


def machine_info(bench_dir: str) -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for dist in ("cuda-core", "cuda-bindings", "blake3", "filelock", "cuda-program-cas"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    commit, dirty = git_state()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = None
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1) if mem else None,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "filesystem": _mount_of(bench_dir),
        "versions": versions,
        "git": f"{commit}{' (cas/ or index/ modified)' if dirty else ''}",
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _fmt_num(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    if unit in ("count", "bytes", "ops/s"):
        return f"{x:,.0f}"
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    fs = m["filesystem"]
    lines = [
        f"cuda-program-cas benchmark ({'quick' if report['quick'] else 'full'}), {report['elapsed_s']:.0f} s",
        f"machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']}, Python {m['python']}",
        f"filesystem: {fs.get('fstype', '?')} on {fs.get('device', '?')} ({fs.get('mount', '?')}), dir {report['dir']}",
        "versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + f"; git {m['git']}",
        f"load average at start {m['loadavg_start']}, at end {report['loadavg_end']}",
        "",
    ]
    header = ("metric", "unit", "ours", "FileStream", "ours/FS", "target", "met")
    table: list[tuple[str, ...]] = []
    for name, w in report["workloads"].items():
        table.append((f"[{name}]", "", "", "", "", "", ""))
        for r in w["rows"]:
            met = "" if r["met"] is None else ("met" if r["met"] else "NOT MET")
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
            figures = (_fmt_num(r["ours"], r["unit"]), _fmt_num(r["filestream"], r["unit"]), ratio)
            table.append(("  " + r["metric"], r["unit"], *figures, r["target"] or "", met))
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    right = {2, 3, 4}

    def line(row: tuple[str, ...]) -> str:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)]
        return "  ".join(cells).rstrip()

    lines.append(line(header))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(line(row) for row in table)
    lines.append("")
    for name, w in report["workloads"].items():
        for note in w["notes"]:
            lines.append(f"{name}: {note}")
    unmet = report["targets_not_met"]
    lines.append("")
    lines.append(
        f"targets: {report['targets_met']} met, {len(unmet)} not met" + (": " + "; ".join(unmet) if unmet else "")
    )
    return "\n".join(lines)


def tally(report: dict[str, Any]) -> None:
    """Count the rows whose target was met, and name the ones whose target was not, into ``report``."""
    unmet = []
    met = 0
    for name, w in report["workloads"].items():
        for r in w["rows"]:
            if r["met"] is False:
                unmet.append(f"{name}: {r['metric']}")
            elif r["met"]:
                met += 1
    report["targets_met"] = met
    report["targets_not_met"] = unmet
