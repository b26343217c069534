"""Packed stores at their limits: thousands of packs, damaged store blobs, two repacks at once.

Real files and real processes. Children report through what they print and their
exit status; a parent waits for a child's line (a pipe), never for a duration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import filelock
import pytest
from conftest import REPO, ChildLines

import cas._pack
from cas import CacheStore, publish
from cas._cli import main as cli


def value(i: int, gen: str = "g") -> bytes:
    return (f"{gen}:{i}:".encode() * 40)[: 100 + i % 50]


def source(path: Path, gen: str = "g", n: int = 20, start: int = 0) -> Path:
    store = CacheStore(path)
    for i in range(start, start + n):
        store.put(f"{gen}{i}", value(i, gen))
    return path


def child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))


# -- one repack at a time ---------------------------------------------------------------------

#: A repack that stops while it writes its pack (holding the lock) until the parent says go on stdin.
_HELD_REPACK = r"""
import sys
import cas._repack as R
from cas._cli import main
orig = R.write_pack
def write_pack(*args, **kwargs):
    print("writing", flush=True)
    if sys.stdin.readline() != "go\n":
        sys.exit("the parent gave up")
    return orig(*args, **kwargs)
R.write_pack = write_pack
sys.exit(main(["repack", sys.argv[1]]))
"""


def test_a_second_repack_while_one_runs_changes_nothing_and_exits_0(tmp_path: Path) -> None:
    store = tmp_path / "store"
    for gen in "abc":
        publish([source(tmp_path / gen, gen)], store, pack=True)
    before = cas._pack.list_packs(str(store / "packs"))
    assert len(before) == 3
    first = ChildLines(
        subprocess.Popen(
            [sys.executable, "-c", _HELD_REPACK, str(store)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
    )
    try:
        first.wait("writing")
        second = subprocess.run(
            [sys.executable, "-m", "cas", "repack", str(store)],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=120,
            check=False,
        )
        assert second.returncode == 0, second.stderr
        assert "another repack or a gc" in second.stdout and "nothing was changed" in second.stdout
        assert cas._pack.list_packs(str(store / "packs")) == before  # the second one changed nothing
        assert first.proc.stdin is not None
        first.proc.stdin.write("go\n")
        first.proc.stdin.flush()
        assert first.finish(timeout=120) == 0, first.output()
    finally:
        first.kill()
    assert "retired 3 packs" in first.lines[-1]
    assert len(cas._pack.list_packs(str(store / "packs"))) == 1
    node = CacheStore(tmp_path / "node", shared=[store], copy_shared_hits=False)
    assert all(node.get(f"{g}{i}") == value(i, g) for g in "abc" for i in range(20))


def test_repack_json_says_busy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    publish([source(tmp_path / "a", "a")], store, pack=True)
    with filelock.FileLock(str(store / "evict.lock"), timeout=0):
        assert cli(["repack", "--json", str(store)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["busy"] is True and out["problem_count"] == 0
    assert cli(["repack", "--json", str(store)]) == 0  # free again: it repacks
    assert json.loads(capsys.readouterr().out)["entries"] == 20
