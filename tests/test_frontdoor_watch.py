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
from collections.abc import Callable
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


def test_a_forked_child_never_trusts_its_parents_watch(tree: Tree) -> None:
    # A child shares its parent's inotify queue: what one reads, the other never sees. Here
    # the child edits the header and the parent then reads the queue (a watched hit of
    # another kernel): the child's next call must still be a miss.
    import warnings

    write(tree.root / "inc2" / "other.h", "#define OTHER 1\n")
    other = '#include <other.h>\nextern "C" __global__ void k(int *out) { *out = OTHER; }\n'
    other_opts = ProgramOptions(arch="sm_80", include_path=[str(tree.root / "inc2")])
    old = tree.until_watched()
    for _ in range(3):
        cached(tree.cache, other, other_opts)  # watched too
    to_parent, from_child = os.pipe()
    to_child, from_parent = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(to_parent)
            os.close(from_parent)
            write(tree.inc / "val.h", body())
            os.write(from_child, b"e")
            if os.read(to_child, 1) == b"d":  # the parent has read the queue
                fresh = cached(tree.cache, KERNEL, tree.opts) == uncached(KERNEL, tree.opts) != old
                os.write(from_child, b"1" if fresh else b"0")
                code = 0
        finally:
            os._exit(code)
    os.close(from_child)  # the child's ends: its exit is an end of file here
    os.close(to_child)
    try:
        assert os.read(to_parent, 1) == b"e"
        before = tree.watched_hits()
        cached(tree.cache, other, other_opts)
        assert tree.watched_hits() == before + 1  # the parent read the queue, the child's events with it
        os.write(from_parent, b"d")
        said = os.read(to_parent, 1)
    finally:
        os.close(to_parent)
        os.close(from_parent)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and said == b"1"


_FULL_TABLE = r"""
import json, os, sys
from pathlib import Path
from cuda.core import Program, ProgramOptions
from cuda_program_cas import ContentAddressedProgramCache
from cuda_program_cas._cuda import watch
watch._budget = lambda: 5  # a full watch table: this process may hold 5 watches, a variant needs about 10

tmp = Path(sys.argv[1])
kernel = '#include <val.h>\nextern "C" __global__ void k(int *out) { *out = VAL; }\n'
opts = ProgramOptions(arch="sm_80", include_path=[str(tmp / "inc")])
cache = ContentAddressedProgramCache(tmp / "cas")
got = [bytes(cache.compile(kernel, "c++", opts, "cubin").code) for _ in range(4)]
(tmp / "inc" / "val.h").write_text("#define VAL 99\n")
edited = bytes(cache.compile(kernel, "c++", opts, "cubin").code)
print(json.dumps({"watched": cache._front_door.watched_hits, "hits": cache.counters()["hits"],
                  "fresh": edited == bytes(Program(kernel, "c++", options=opts).compile("cubin").code) != got[0]}))
"""


def test_a_variant_that_cannot_be_watched_keeps_the_stat_check(tmp_path: Path) -> None:
    import json

    from conftest import run_python

    write(tmp_path / "inc" / "val.h", "#define VAL 1\n")
    done = run_python(_FULL_TABLE, str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"watched": 0, "hits": 3, "fresh": True}


@needs_root
def test_an_include_directory_on_overlayfs_is_not_watched(tmp_path: Path, mounts: list[Path]) -> None:
    # overlayfs raises no event for a change in a lower layer: the stat check stays.
    for d in ("lower", "upper", "work", "merged"):
        (tmp_path / d).mkdir()
    write(tmp_path / "lower" / "val.h", body())
    options = f"lowerdir={tmp_path / 'lower'},upperdir={tmp_path / 'upper'},workdir={tmp_path / 'work'}"
    done = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(tmp_path / "merged")], check=False)
    if done.returncode != 0:
        pytest.skip("no overlayfs here")
    mounts.append(tmp_path / "merged")
    t = Tree.__new__(Tree)
    t.root, t.cache = tmp_path, ContentAddressedProgramCache(tmp_path / "cas")
    t.opts = ProgramOptions(arch="sm_80", include_path=[str(tmp_path / "merged")])
    first = cached(t.cache, KERNEL, t.opts)
    for _ in range(3):
        assert cached(t.cache, KERNEL, t.opts) == first
    assert t.watched_hits() == 0
    write(tmp_path / "merged" / "val.h", body())
    t.next_call_is_fresh(first)


def test_the_watch_answers_from_the_third_hit_after_the_miss_that_stored_it(tree: Tree) -> None:
    # The first hit stats alone, the second arms the watch before its stats, the third reads
    # the queue. The record read back after this process stored it is another bytes object
    # with the same bytes: what was proved of it holds.
    first = cached(tree.cache, KERNEL, tree.opts)
    seen = []
    for _ in range(3):
        assert cached(tree.cache, KERNEL, tree.opts) == first
        seen.append(tree.watched_hits())
    assert seen == [0, 0, 1]


def test_a_write_through_a_shared_mmap_is_seen_once_the_mapping_is_gone(tree: Tree) -> None:
    # The documented gap: a write through a mapping raises no event, so a watched variant may
    # be served stale while the mapping lives (not asserted: that is the gap). Unmapping
    # drops the file's last reference, which raises IN_CLOSE_WRITE: the next call misses.
    import mmap

    old = tree.until_watched()
    path = tree.inc / "val.h"
    text = path.read_bytes()
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, len(text))
    finally:
        os.close(fd)  # the mapping holds the file now
    mapping[len(text) - 2 : len(text) - 1] = b"7" if text[-2:-1] != b"7" else b"8"  # VAL's last digit
    cached(tree.cache, KERNEL, tree.opts)
    mapping.close()
    tree.next_call_is_fresh(old)
