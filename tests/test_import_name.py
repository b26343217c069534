"""The ``index/`` folder is installed as ``cuda_program_cas_index``, so a user's ``index`` cannot break ``cas``.

Each test runs a fresh interpreter whose working directory (first on ``sys.path``
for ``python -c``) holds a user's ``index.py`` module or ``index/`` package that
raises when imported, as a project directory might. The repository root is on
``PYTHONPATH`` (as an installed or editable package is seen), not the working
directory. The child imports ``cas``, uses a cache, and checks that the index
package is found under its installed name and that no top-level ``index`` module
was imported at all.
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

_CHILD = textwrap.dedent(
    """
    import importlib.util, os, sys

    root = sys.argv[1]
    assert os.getcwd() != sys.argv[2], "precondition: the child must not run in the repository"

    import cas
    store = cas.CacheStore(os.path.join(root, "store"), max_size_bytes=1 << 20)
    assert store.put("k", b"value")
    assert store.put(b"k2", b"value")
    assert store.get(b"k") == store.get("k2") == b"value"
    assert store.get("absent") is None
    store.delete("k2")
    assert len(store) == 1
    assert store.stats().entries == 1
    report = cas.verify(os.path.join(root, "store"))
    assert not report.problems, report.problems
    store.clear()
    assert len(store) == 0

    try:
        import cuda.core
    except ImportError:
        pass
    else:
        cache = cas.ContentAddressedProgramCache(os.path.join(root, "program-cache"))
        cache["k"] = b"cubin bytes"
        assert cache["k"] == cache.get(b"k") == b"cubin bytes"
        del cache["k"]
        assert cache.get("k") is None

    spec = importlib.util.find_spec("cuda_program_cas_index")
    assert spec is not None, "cuda_program_cas_index is not installed"
    assert spec.origin and not os.path.realpath(spec.origin).startswith(os.path.realpath(os.getcwd())), spec.origin
    assert "index" not in sys.modules, f"cas imported a top-level index: {sys.modules['index']!r}"
    print("ok")
    """
)


def shadow(workdir: Path, how: str) -> None:
    """Put a user's ``index`` that raises on import into ``workdir``."""
    if how == "module":
        (workdir / "index.py").write_text(_USER_INDEX)
    elif how == "package":
        (workdir / "index").mkdir()
        (workdir / "index" / "__init__.py").write_text(_USER_INDEX)


def run_child(workdir: Path, data: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
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
def test_user_index_does_not_break_cas(tmp_path: Path, how: str) -> None:
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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
    env.pop("PYTHONSAFEPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", "import index"], cwd=workdir, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode != 0
    assert "user's index.py was imported" in result.stderr
