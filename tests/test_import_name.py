"""One import name of the project's own: ``cuda_program_cas``, with the index as ``cuda_program_cas.index``.

The folders ``cas/`` and ``index/`` are installed under that name, so a user's
``cas`` or ``index`` cannot break the package, and nothing else is installed at
the top level. Each shadowing test runs a fresh interpreter whose working
directory (first on ``sys.path`` for ``python -c``) holds a user's module or
package of such a name that raises when imported, as a project directory might.
The child uses a cache, and checks that the index is found under its installed
name and that no top-level ``index`` or ``cas`` was imported at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

_USER_INDEX = 'raise RuntimeError("user\'s index.py was imported")\n'
_USER_CAS = 'raise RuntimeError("user\'s cas.py was imported")\n'

_CHILD = textwrap.dedent(
    """
    import importlib.util, os, sys

    root = sys.argv[1]
    assert os.getcwd() != sys.argv[2], "precondition: the child must not run in the repository"

    import cuda_program_cas
    store = cuda_program_cas.CacheStore(os.path.join(root, "store"), max_size_bytes=1 << 20)
    assert store.put("k", b"value")
    assert store.put(b"k2", b"value")
    assert store.get(b"k") == store.get("k2") == b"value"
    assert store.get("absent") is None
    store.delete("k2")
    assert len(store) == 1
    assert store.stats().entries == 1
    report = cuda_program_cas.verify(os.path.join(root, "store"))
    assert not report.problems, report.problems
    store.clear()
    assert len(store) == 0

    try:
        import cuda.core
    except ImportError:
        pass
    else:
        cache = cuda_program_cas.ContentAddressedProgramCache(os.path.join(root, "program-cache"))
        cache["k"] = b"cubin bytes"
        assert cache["k"] == cache.get(b"k") == b"cubin bytes"
        del cache["k"]
        assert cache.get("k") is None

    spec = importlib.util.find_spec("cuda_program_cas.index")
    assert spec is not None, "cuda_program_cas.index is not installed"
    assert spec.origin and not os.path.realpath(spec.origin).startswith(os.path.realpath(os.getcwd())), spec.origin
    for name in ("index", "cas"):
        assert name not in sys.modules, f"the package imported a top-level {name}: {sys.modules[name]!r}"
    print("ok")
    """
)


def shadow(workdir: Path, how: str) -> None:
    """Put a user's ``index`` and ``cas`` that raise on import into ``workdir``."""
    for name, body in (("index", _USER_INDEX), ("cas", _USER_CAS)):
        if how == "module":
            (workdir / f"{name}.py").write_text(body)
        elif how == "package":
            (workdir / name).mkdir()
            (workdir / name / "__init__.py").write_text(body)


def run_child(workdir: Path, data: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("PYTHONSAFEPATH", None)  # keep the working directory first on sys.path, as users have it
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(data), str(REPO)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("how", ["none", "module", "package"])
def test_a_users_index_or_cas_does_not_break_the_package(tmp_path: Path, how: str) -> None:
    workdir = tmp_path / "project"
    workdir.mkdir()
    data = tmp_path / "data"
    data.mkdir()
    shadow(workdir, how)
    result = run_child(workdir, data)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")


def test_the_shadow_really_shadows(tmp_path: Path) -> None:
    # The control for the test above: in that working directory, `import index` gets the user's file.
    workdir = tmp_path / "project"
    workdir.mkdir()
    shadow(workdir, "module")
    env = dict(os.environ)
    env.pop("PYTHONSAFEPATH", None)
    for name in ("index", "cas"):
        result = subprocess.run(
            [sys.executable, "-c", f"import {name}"], cwd=workdir, env=env, capture_output=True, text=True, check=False
        )
        assert result.returncode != 0
        assert f"user's {name}.py was imported" in result.stderr


def test_only_cuda_program_cas_is_installed_at_the_top_level(tmp_path: Path) -> None:
    # The distribution declares one top-level name, and the old ones are not importable from a
    # directory that holds neither (the repository's folders are not on sys.path).
    from importlib.metadata import distribution

    top = distribution("cuda-program-cas").read_text("top_level.txt")
    assert top is not None and top.split() == ["cuda_program_cas"]
    probe = (
        "import importlib.util as u\n"
        "for name in ('cas', 'cuda_program_cas_index', 'index'):\n"
        "    assert u.find_spec(name) is None, (name, u.find_spec(name))\n"
        "import cuda_program_cas.index, cuda_program_cas.__main__\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr


def test_python_m_runs_the_console_script(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-I", "-m", "cuda_program_cas", "--version"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.startswith("cuda-program-cas "), result.stdout + result.stderr
