"""``import cuda_program_cas``, the blob store, the index and the maintenance code work without CUDA.

Each test runs a fresh interpreter in which importing ``cuda.core`` fails, either
because a ``cuda`` package that raises ``ImportError`` shadows the real one on
``sys.path`` (as on a storage server with no CUDA installed), or because
``sys.modules["cuda.core"]`` is ``None``. The child reports through its exit
status: any exception, any import of ``cuda.core``, is a failure.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import run_python

_BLOCKERS = {
    "shadow-package": "",  # the shadowing package is put on PYTHONPATH by the test
    "sys-modules-none": "import sys; sys.modules['cuda.core'] = None; sys.modules['cuda.core.utils'] = None\n",
}

_CHILD = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    root = sys.argv[1]

    try:
        import cuda.core
    except ImportError:
        pass
    else:
        sys.exit("precondition: cuda.core must not be importable in this child")

    import cuda_program_cas
    from cuda_program_cas import BlobStore, CacheStore, digest_of, parse_size
    from cuda_program_cas.index import Manifest, key_id, parse_manifest

    # The store: write, dedup, read, delete, cap, clear.
    store = CacheStore(root, max_size_bytes=parse_size("20K"))
    assert store.put("k", b"x" * 1000)
    assert store.put(b"k2", b"x" * 1000)
    assert store.get(b"k") == b"x" * 1000
    assert store.get("absent") is None
    stats = store.stats()
    assert (stats.entries, stats.blobs, stats.dedup_writes, stats.hits) == (2, 1, 1, 1), stats
    store.delete("k2")
    for i in range(40):
        store.put(f"fill{i}", bytes([i]) * 1000)
    assert store.stats().stored_bytes <= 20 * 1024
    assert store.stats().evictions > 0
    store.clear()
    assert len(store) == 0

    # The index and the blob store on their own.
    m = Manifest(digest_of(b"abc"), 3, key_id("k"))
    assert parse_manifest(m.encode()) == m
    assert len(key_id("k")) == 64 and key_id("k") == key_id(b"k")
    assert isinstance(store.inner.blobs, BlobStore)
    assert "index" not in sys.modules  # the index is cuda_program_cas.index, never a bare "index"

    # Every maintenance module imports, and the console script runs.
    for info in pkgutil.walk_packages(cuda_program_cas.__path__, "cuda_program_cas."):
        if not info.name.startswith("cuda_program_cas._cuda."):  # the only importers of cuda.core
            importlib.import_module(info.name)
    from cuda_program_cas._cli.main import main
    assert main(["stats", root]) == 0
    assert main(["verify", root]) == 0

    # Only touching the adapter needs CUDA, and then it says so.
    try:
        cuda_program_cas.ContentAddressedProgramCache
    except ImportError:
        pass
    else:
        sys.exit("the adapter imported without cuda.core")

    loaded = sorted(name for name in sys.modules if name == "cuda.core" or name.startswith("cuda.core."))
    if any(sys.modules[name] is not None for name in loaded):
        sys.exit(f"cuda.core was imported: {loaded}")
    print("ok")
    """
)


@pytest.mark.parametrize("how", list(_BLOCKERS))
def test_storage_and_maintenance_work_without_cuda(tmp_path: Path, how: str) -> None:
    env = {}
    if how == "shadow-package":
        shadow = tmp_path / "no-cuda"
        (shadow / "cuda").mkdir(parents=True)
        (shadow / "cuda" / "__init__.py").write_text("raise ImportError('no CUDA on this machine')\n")
        env["PYTHONPATH"] = str(shadow)
    result = run_python(_BLOCKERS[how] + _CHILD, str(tmp_path / "cache"), env=env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")


def test_import_cas_does_not_import_cuda_core() -> None:
    # Even where CUDA is installed, importing cas alone must not pay for cuda.core.
    code = textwrap.dedent(
        """
        import sys
        import cuda_program_cas, index
        cuda_program_cas.CacheStore, cuda_program_cas.BlobStore, cuda_program_cas.default_cache_dir
        sys.exit(1 if "cuda.core" in sys.modules else 0)
        """
    )
    result = run_python(code, timeout=60)
    assert result.returncode == 0, result.stderr


def test_touching_the_adapter_imports_cuda_core() -> None:
    # The control for the test above: the check can fail.
    code = textwrap.dedent(
        """
        import sys
        import cuda_program_cas
        cuda_program_cas.ContentAddressedProgramCache
        sys.exit(0 if "cuda.core" in sys.modules else 1)
        """
    )
    result = run_python(code, timeout=60)
    assert result.returncode == 0, result.stderr
