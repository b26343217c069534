"""A watched front-door hit (cuda_program_cas._cuda.watch) is never stale: each edit is a miss on the very next call.

Each test compiles until the variant is *watched* (its hits read the inotify queue,
no stat: ``watched_hits`` grows), changes the tree under it with real files, renames
and mounts, and requires the very next ``cache.compile`` to return what an uncached
compile of the tree as it is now returns. A watch that missed the change would
serve the old binary: the comparison fails.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import is_root
from cuda.core import ProgramOptions
from test_frontdoor_sound import cached, uncached, write

from cuda_program_cas import ContentAddressedProgramCache

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/mountinfo"), reason="inotify watch is Linux only")

KERNEL = r"""
#include <val.h>
extern "C" __global__ void k(int *out) { *out = VAL; }
"""

_values = iter(range(10, 10_000))


def body() -> str:
    return f"#define VAL {next(_values)}\n"


class Tree:
    """``T/first`` (searched first, empty) and ``T/inc/val.h``, a cache, and the compile the tests repeat."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.first = root / "first"
        self.inc = root / "inc"
        self.first.mkdir()
        write(self.inc / "val.h", body())
        self.opts = ProgramOptions(arch="sm_80", include_path=[str(self.first), str(self.inc)])
        self.cache = ContentAddressedProgramCache(root / "cas")

    def watched_hits(self) -> int:
        door = self.cache._front_door
        return 0 if door is None else int(door.watched_hits)

    def until_watched(self) -> bytes:
        """Compile until a hit is answered by the watch; the binary is the uncached one."""
        got = cached(self.cache, KERNEL, self.opts)
        for _ in range(4):
            before = self.watched_hits()
            again = cached(self.cache, KERNEL, self.opts)
            assert again == got
            if self.watched_hits() > before:
                assert got == uncached(KERNEL, self.opts)
                return got
        raise AssertionError("the variant was never watched: these tests prove nothing here")

    def next_call_is_fresh(self, old: bytes) -> None:
        got = cached(self.cache, KERNEL, self.opts)
        assert got == uncached(KERNEL, self.opts) != old


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    return Tree(tmp_path)


def _replace(path: Path) -> None:
    new = path.with_name(path.name + ".new")
    write(new, body())
    os.replace(new, path)


def _hard_link_write(path: Path) -> None:
    other = path.parent.parent / "elsewhere.h"
    os.link(path, other)
    with open(other, "w") as fh:  # the same inode, written through another directory's name
        fh.write(body())


EDITS: dict[str, Callable[[Tree], None]] = {
    "in place": lambda t: write(t.inc / "val.h", body()),
    "rename over": lambda t: _replace(t.inc / "val.h"),
    "write through a hard link": lambda t: _hard_link_write(t.inc / "val.h"),
    "a new header that shadows it": lambda t: write(t.first / "val.h", body()),
    "its directory moved, another put in its place": lambda t: (
        os.rename(t.inc, t.root / "inc.old"),
        write(t.inc / "val.h", body()),
    ),
    "a parent directory renamed over": lambda t: (
        write(t.root / "inc2" / "val.h", body()),
        os.rename(t.inc, t.root / "inc.gone"),
        os.rename(t.root / "inc2", t.inc),
    ),
    "removed": lambda t: (t.inc / "val.h").unlink(),
    "made unreadable to NVRTC by a new file type": lambda t: (
        (t.inc / "val.h").unlink(),
        (t.inc / "val.h").mkdir(),
    ),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_under_a_watched_variant_is_a_miss_on_the_next_call(tree: Tree, edit: str) -> None:
    old = tree.until_watched()
    EDITS[edit](tree)
    try:
        got = cached(tree.cache, KERNEL, tree.opts)
    except Exception as exc:  # a compile the tree now breaks must break the same way uncached
        with pytest.raises(type(exc)):
            uncached(KERNEL, tree.opts)
        return
    assert got == uncached(KERNEL, tree.opts) != old


def test_a_symlink_flip_under_a_watched_variant_is_a_miss(tmp_path: Path) -> None:
    write(tmp_path / "one" / "val.h", body())
    write(tmp_path / "two" / "val.h", body())
    (tmp_path / "link").symlink_to("one")
    opts = ProgramOptions(arch="sm_80", include_path=[str(tmp_path / "link")])
    t = Tree.__new__(Tree)
    t.root, t.opts, t.cache = tmp_path, opts, ContentAddressedProgramCache(tmp_path / "cas")
    old = t.until_watched()
    (tmp_path / "link.new").symlink_to("two")
    os.replace(tmp_path / "link.new", tmp_path / "link")
    t.next_call_is_fresh(old)


def test_a_flood_that_overflows_the_queue_is_a_miss_of_nothing_stale(tree: Tree) -> None:
    # fs.inotify.max_queued_events (16,384 by default): past that many queued events the
    # kernel drops the rest and queues IN_Q_OVERFLOW. The flood is of events the watch
    # reads and ignores (another entry of a directory on the way), so that the header's
    # own edit, made once the queue is full, is dropped: only the overflow tells.
    old = tree.until_watched()
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    fd = os.open(tree.root / "noise", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        # An IN_MODIFY then an IN_ATTRIB: the kernel merges an event only into an identical
        # one queued just before it.
        for _ in range(limit // 2 + 10):
            os.pwrite(fd, b"#", 0)
            os.fchmod(fd, 0o644)
    finally:
        os.close(fd)
    with open(tree.inc / "val.h", "r+") as fh:  # in place, no new entry: an event of val.h alone
        fh.write(body())
    tree.next_call_is_fresh(old)
    assert tree.until_watched() == uncached(KERNEL, tree.opts)  # watched again after the overflow


def test_an_untouched_tree_stays_watched_across_unrelated_changes(tree: Tree) -> None:
    # The other side: changes elsewhere (a new entry of a directory on the way that is not
    # searched, a file outside) do not cost the watch. (A new entry of a search directory
    # does: it changes that directory's mtime, which the stat check reads too.)
    old = tree.until_watched()
    write(tree.root / "unrelated" / "x.h", body())
    (tree.root / "unrelated" / "x.h").write_text(body())
    before = tree.watched_hits()
    assert cached(tree.cache, KERNEL, tree.opts) == old
    assert tree.watched_hits() == before + 1


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    made: list[Path] = []
    yield made
    for target in reversed(made):
        subprocess.run(["umount", "-l", str(target)], check=False)


needs_root = pytest.mark.skipif(not is_root(), reason="mounts need root")


@needs_root
def test_a_bind_mount_over_an_include_directory_is_a_miss(tree: Tree, mounts: list[Path]) -> None:
    old = tree.until_watched()
    write(tree.root / "other" / "val.h", body())
    subprocess.run(["mount", "--bind", str(tree.root / "other"), str(tree.inc)], check=True)
    mounts.append(tree.inc)
    tree.next_call_is_fresh(old)


@needs_root
def test_a_tmpfs_mounted_over_an_include_directory_is_a_miss(tree: Tree, mounts: list[Path]) -> None:
    old = tree.until_watched()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tree.first)], check=True)
    mounts.append(tree.first)
    write(tree.first / "val.h", body())  # on the tmpfs: it shadows inc/val.h
    tree.next_call_is_fresh(old)
    old = tree.until_watched()  # tmpfs is watched too
    subprocess.run(["umount", str(tree.first)], check=True)
    mounts.remove(tree.first)
    tree.next_call_is_fresh(old)  # the unmount shows inc/val.h again
