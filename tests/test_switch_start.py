"""The switch's ``.pth`` at interpreter start: silent where it cannot work, and the flags that stop it.

``site`` runs ``cuda_program_cas-switch.pth`` at every start of every interpreter of
the environment, pip's included. Where the package cannot be found (an editable
checkout moved away, a module or an empty folder of that name shadowing it, a copy
without the start-up hook, an uninstalled package whose ``.pth`` was left behind),
it must do nothing and say nothing. Each case runs a real interpreter, in the
suite's own environment or in a bare virtual environment made for the test with
the ``.pth`` (and, where a case needs it, pip's editable finder) copied in.

Which interpreter flags stop ``site`` from running the ``.pth``: each is run with a
real compile, and the cache's counters say whether the compile went through it.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, SAXPY

PTH = REPO / "cas" / "_cuda" / "cuda_program_cas-switch.pth"
#: This environment's site-packages (where the suite's install put the .pth).
SITE_PACKAGES = Path(site.getsitepackages()[0])
#: The interpreter this environment was made from.
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)

#: What the start left behind: output, and whether the switch's hook is waiting for cuda.core.
_HOOKED = "import sys; print(any(getattr(f, 'cpcas_switch_hook', False) for f in sys.meta_path))"


def editable_finder() -> tuple[Path, Path]:
    """pip's editable finder of this environment and the .pth that installs it (the suite runs editable)."""
    finders = sorted(SITE_PACKAGES.glob("__editable___cuda_program_cas_*_finder.py"))
    pths = sorted(SITE_PACKAGES.glob("__editable__.cuda_program_cas-*.pth"))
    if not finders or not pths:
        pytest.skip("the package is not installed editable here: no editable finder to move")
    return finders[0], pths[0]


def start(python: str | Path, *args: str, env: dict[str, str | None], code: str = _HOOKED) -> tuple[str, str]:
    """stdout and stderr of ``python [args] -c code`` with ``CUDA_PROGRAM_CAS=1``."""
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    full["CUDA_PROGRAM_CAS"] = "1"
    for key, value in env.items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    done = subprocess.run(
        [str(python), *args, "-c", code], capture_output=True, text=True, env=full, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A virtual environment without the package, with the switch's .pth: its python and site-packages."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    found = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    )
    packages = Path(found.stdout.strip())
    shutil.copy(PTH, packages / PTH.name)
    return python, packages


def install_finder(packages: Path, root: Path) -> None:
    """pip's editable finder in ``packages``, mapping the package to a checkout at ``root`` (``cas``, ``index``)."""
    finder, pth = editable_finder()
    text = finder.read_text()
    for old, sub in ((REPO / "cas", "cas"), (REPO / "index", "index")):
        assert repr(str(old)) in text, f"{finder} does not map {old}"
        text = text.replace(repr(str(old)), repr(str(root / sub)))
    (packages / finder.name).write_text(text)
    shutil.copy(pth, packages / pth.name)


# -- a package that cannot be found: nothing happens, nothing is said -----------------------------


def test_uninstalled_with_the_pth_left_behind(bare: tuple[Path, Path]) -> None:
    python, _ = bare
    assert start(python, env={}) == ("False\n", "")


def test_an_editable_checkout_moved_away(bare: tuple[Path, Path], tmp_path: Path) -> None:
    python, packages = bare
    try:
        install_finder(packages, REPO)
        assert start(python, env={}) == ("True\n", "")  # found: the hook waits for cuda.core
        install_finder(packages, tmp_path / "moved away")
        assert start(python, env={}) == ("False\n", "")
    finally:
        for path in packages.glob("__editable__*"):
            path.unlink()


def test_a_copy_of_the_package_without_the_start_up_hook(bare: tuple[Path, Path], tmp_path: Path) -> None:
    python, _ = bare
    old = tmp_path / "old" / "cuda_program_cas"
    (old / "_cuda").mkdir(parents=True)
    (old / "__init__.py").write_text("")
    assert start(python, env={"PYTHONPATH": str(tmp_path / "old")}) == ("False\n", "")


@pytest.mark.parametrize("shadow", ["module", "empty folder"])
def test_a_module_or_an_empty_folder_on_pythonpath_shadowing_the_package(tmp_path: Path, shadow: str) -> None:
    # In the suite's own environment, where the package is installed (editable: pip's finder comes
    # after the PYTHONPATH entries, so both shadow it), for python and for pip.
    if shadow == "module":
        (tmp_path / "cuda_program_cas.py").write_text("")
    else:
        (tmp_path / "cuda_program_cas").mkdir()
    env = {"PYTHONPATH": str(tmp_path)}
    assert start(sys.executable, env=env) == ("False\n", "")
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "--version"],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "CUDA_PROGRAM_CAS": "1"},
        timeout=120,
        check=False,
    )
    assert pip.returncode == 0 and pip.stdout.startswith("pip ") and pip.stderr == "", pip.stderr


def test_the_package_found_is_hooked_without_a_word() -> None:
    """The control: in this environment, unshadowed, the same start installs the hook (silently)."""
    assert start(sys.executable, env={}) == ("True\n", "")


# -- interpreter flags ------------------------------------------------------------------------------

#: Compiles SAXPY without cache= and says whether the switch sent it through the cache. argv[1]:
#: a folder to put on sys.path (under -S or -s, cuda.core's; appending runs no .pth there).
_COMPILE = textwrap.dedent(
    f"""
    import json, sys
    sys.path.append(sys.argv[1])
    from cuda.core import Program, ProgramOptions
    Program({SAXPY!r}, "c++", options=ProgramOptions(arch="sm_80")).compile("cubin")
    sw = sys.modules.get("cuda_program_cas._cuda.switch")
    cache = sw._S.cache if sw is not None else None
    print(json.dumps({{"routed": sw.routed() if sw else 0, "misses": cache.counters()["misses"] if cache else 0}}))
    """
)


def compiled(python: str | Path, flags: list[str], env: dict[str, str | None], cache: Path) -> bool:
    """Whether a compile of a process started with ``flags`` went through the cache at ``cache``."""
    # Started without this environment's site (-S, or another interpreter), cuda.pathfinder does not
    # look for NVRTC in its site-packages: the loader is told where it is.
    from cuda.pathfinder import load_nvidia_dynamic_lib

    libs = os.path.dirname(load_nvidia_dynamic_lib("nvrtc").abs_path)
    search = os.pathsep.join(p for p in (libs, os.environ.get("LD_LIBRARY_PATH")) if p)
    full = {**env, "CUDA_PROGRAM_CAS_DIR": str(cache), "LD_LIBRARY_PATH": search}
    done = subprocess.run(
        [str(python), *flags, "-c", _COMPILE, str(SITE_PACKAGES)],
        capture_output=True,
        text=True,
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "CUDA_PROGRAM_CAS": "1", **full},
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["routed"] == out["misses"], out  # one compile: routed and missed, or neither
    return bool(out["routed"])


@pytest.mark.parametrize(
    ("flags", "on"),
    [([], True), (["-E"], True), (["-s"], True), (["-I"], True), (["-S"], False)],
    ids=["no flag", "-E", "-s", "-I", "-S"],
)
def test_in_site_packages_only_dash_S_stops_the_switch(tmp_path: Path, flags: list[str], on: bool) -> None:
    """-E ignores PYTHON* variables (CUDA_PROGRAM_CAS is not one); -s only the user site; -I is -E -s -P."""
    assert compiled(sys.executable, flags, {}, tmp_path / "cas") is on


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="a POSIX user site")
@pytest.mark.parametrize(
    ("flags", "env", "on"),
    [
        ([], {}, True),
        (["-E"], {}, True),
        (["-s"], {}, False),
        ([], {"PYTHONNOUSERSITE": "1"}, False),
        (["-E"], {"PYTHONNOUSERSITE": "1"}, True),
        (["-I"], {}, False),
        (["-S"], {}, False),
    ],
    ids=["no flag", "-E", "-s", "PYTHONNOUSERSITE", "-E PYTHONNOUSERSITE", "-I", "-S"],
)
def test_in_the_user_site_dash_s_and_dash_I_stop_the_switch_too(
    tmp_path: Path, flags: list[str], env: dict[str, str], on: bool
) -> None:
    """As ``pip install --user`` leaves it: the package and the .pth in ~/.local's site-packages."""
    home = tmp_path / "home"
    probe = subprocess.run(
        [BASE_PYTHON, "-c", "import site; print(site.getusersitepackages())"],
        capture_output=True,
        text=True,
        env={**os.environ, "HOME": str(home)},
        check=True,
    )
    user_site = Path(probe.stdout.strip())
    if not user_site.is_relative_to(home):
        pytest.skip(f"the user site {user_site} is not under HOME")
    user_site.mkdir(parents=True)
    install_finder(user_site, REPO)
    shutil.copy(PTH, user_site / PTH.name)
    # HOME, not PYTHONUSERBASE, names the user site: -E would ignore PYTHONUSERBASE, not HOME.
    assert compiled(BASE_PYTHON, flags, {"HOME": str(home), **env}, tmp_path / "cas") is on
