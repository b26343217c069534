"""What the switch's ``.pth`` costs an interpreter's start-up, off and on.

    python tools/startup_cost.py [--runs 200] [--json]

Off (``CUDA_PROGRAM_CAS`` unset), the ``.pth`` in site-packages must cost every
Python process of the environment nothing measurable. This measures it three ways:

1. ``python -c pass`` in two bare virtual environments made for the run from the
   same interpreter, one with the ``.pth`` in its site-packages and one without,
   run alternately (in a random order per pair) ``--runs`` times each: the median
   of each, the median of the paired differences and a bootstrap 95 % interval of
   it. Twice: bare, and with another ``.pth`` in both (as nearly every environment
   has one, setuptools' ``distutils-precedence.pth``: ``site`` then pays for the
   first ``.pth`` file already);
2. the ``.pth`` line itself, executed as ``site`` executes it, many times in this
   process: its cost per start-up, without the noise of starting processes;
3. on: ``python -c pass`` of this environment with ``CUDA_PROGRAM_CAS=1`` against
   unset (the hook is installed; nothing of the package or of ``cuda.core`` is
   imported), and ``python -c "import cuda.core"`` on against off (the package is
   imported and the classes rebound when ``cuda.core`` is).

Children run without ``PYTHONDONTWRITEBYTECODE``, as users' processes do: with it,
every module (the switch's start-up hook too) is compiled from source at each start.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PTH = REPO / "cas" / "_cuda" / "cuda_program_cas-switch.pth"


def site_packages(venv: Path) -> Path:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def run_once(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter_ns()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return (time.perf_counter_ns() - t0) / 1e6


def paired(a: tuple[list[str], dict[str, str]], b: tuple[list[str], dict[str, str]], runs: int) -> dict[str, float]:
    """Alternate ``a`` and ``b`` (random order per pair); milliseconds, and b - a with a 95 % interval."""
    times_a, times_b = [], []
    for _ in range(runs):
        if random.random() < 0.5:
            times_a.append(run_once(*a))
            times_b.append(run_once(*b))
        else:
            times_b.append(run_once(*b))
            times_a.append(run_once(*a))
    diffs = [y - x for x, y in zip(times_a, times_b, strict=True)]
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(2000))
    return {
        "median_a_ms": statistics.median(times_a),
        "median_b_ms": statistics.median(times_b),
        "median_diff_ms": statistics.median(diffs),
        "diff_ci95_low_ms": boots[int(0.025 * len(boots))],
        "diff_ci95_high_ms": boots[int(0.975 * len(boots)) - 1],
        "mean_diff_ms": statistics.fmean(diffs),
        "runs": runs,
    }


def line_cost_us(line: str, env_value: str | None, n: int = 100_000) -> float:
    """Microseconds per execution of the .pth line, executed as site executes it (``exec`` in a function)."""
    saved = os.environ.pop("CUDA_PROGRAM_CAS", None)
    if env_value is not None:
        os.environ["CUDA_PROGRAM_CAS"] = env_value
    try:
        code = compile(line, "pth", "exec")

        def addpackage() -> None:
            exec(code)

        t0 = time.perf_counter_ns()
        for _ in range(n):
            addpackage()
        return (time.perf_counter_ns() - t0) / n / 1e3
    finally:
        os.environ.pop("CUDA_PROGRAM_CAS", None)
        if saved is not None:
            os.environ["CUDA_PROGRAM_CAS"] = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="process starts per variant (default 200)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--skip-on", action="store_true", help="measure only the cost when off")
    args = parser.parse_args(argv)

    base = os.environ.copy()
    base.pop("CUDA_PROGRAM_CAS", None)
    base.pop("PYTHONDONTWRITEBYTECODE", None)
    result: dict[str, object] = {"python": sys.version.split()[0]}
    line = PTH.read_text().splitlines()[0]
    result["pth_line_us_off"] = line_cost_us(line, None)

    with tempfile.TemporaryDirectory(prefix="startup-cost-") as tmp:
        for key, other_pth in (("off_pth_vs_none", False), ("off_pth_vs_none_with_another_pth", True)):
            without, with_pth = Path(tmp, key, "without"), Path(tmp, key, "with")
            for venv in (without, with_pth):
                subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
                if other_pth:
                    (site_packages(venv) / "another.pth").write_text("import os\n")
            (site_packages(with_pth) / PTH.name).write_bytes(PTH.read_bytes())
            a, b = ([str(v / "bin" / "python"), "-c", "pass"] for v in (without, with_pth))
            result[key] = paired((a, base), (b, base), args.runs)
    if not args.skip_on:
        on = {**base, "CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": tempfile.mkdtemp(prefix="startup-cost-cas-")}
        py = sys.executable
        for _ in range(3):  # warm: the hook's bytecode is written on first use
            run_once([py, "-c", "import cuda.core"], on)
        result["on_vs_off_pass"] = paired(([py, "-c", "pass"], base), ([py, "-c", "pass"], on), args.runs)
        imp = ["-c", "import cuda.core"]
        result["on_vs_off_import_cuda_core"] = paired(([py, *imp], base), ([py, *imp], on), max(20, args.runs // 10))

    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"Python {result['python']}; the .pth line itself, off: {result['pth_line_us_off']:.2f} us per start-up")
    labels = {
        "off_pth_vs_none": "off: python -c pass, .pth present vs absent",
        "off_pth_vs_none_with_another_pth": "off: the same, another .pth in both",
        "on_vs_off_pass": "on:  python -c pass, CUDA_PROGRAM_CAS=1 vs unset",
        "on_vs_off_import_cuda_core": "on:  python -c 'import cuda.core', =1 vs unset",
    }
    for key, label in labels.items():
        r = result.get(key)
        if not isinstance(r, dict):
            continue
        print(
            f"{label}: {r['median_a_ms']:.2f} -> {r['median_b_ms']:.2f} ms (medians of {r['runs']}); "
            f"paired difference {r['median_diff_ms']:+.2f} ms, 95% CI [{r['diff_ci95_low_ms']:+.2f}, "
            f"{r['diff_ci95_high_ms']:+.2f}], mean {r['mean_diff_ms']:+.2f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
