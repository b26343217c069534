"""No stale binary from the front door on a file system whose times are whole seconds (issue 43, item 3).

On ext4 made with 128-byte inodes (as on ext2, ext3, FAT or a coarse NFS export) a
change within the second of the last one leaves every stat field as it was. Each
test makes one of the patterns that served the pre-edit binary, on a real such file
system on a loop device (``one_second_fs`` in conftest), with the cache on the
temporary directory's file system of nanosecond times, and compares what
``cache.compile`` gives, in this process and in a fresh one, with an uncached compile
of the files as they are then (real NVRTC; the kernel stores a header's constant,
so another constant gives other cubin bytes):

- a header rewritten, same size, while NVRTC compiles;
- a header edited in the same second as a compile that read it;
- a header created earlier on the include path in the same second as that
  directory's last change;
- a header rewritten with its own bytes, looked up (a hit), then edited in the same
  second: the per-process memory of digests and the header watch must see it.

The second and third run with the cache beside the headers too (its clock is then the
headers' own: the age is measured by touching the cache's ``tmp``); of those, the second
passed before the fix as well (its header then carried the compile's own second), and
stays as a guard of that path.

Each waits for the start of a second on the file system's own clock (a probe file's
mtime) so that the pattern fits in one second, and tries again, a few times, when
the machine was too slow for that.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import select
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Compiles, run_python
from cuda.core import Program, ProgramOptions
from hypothesis import given
from hypothesis import strategies as st

from cuda_program_cas import ContentAddressedProgramCache

KERNEL = '#include "val.h"\nextern "C" __global__ void k(int *out) { *out = VAL; }\n'
#: Reads val.h at once, then takes most of a second in ptxas (a loop of 600 unrolled steps).
SLOW_KERNEL = (
    '#include "val.h"\nextern "C" __global__ void k(int *out, const int *in) { int s = VAL;\n'
    "#pragma unroll\nfor (int i = 0; i < 600; ++i) s = s * in[i] + (s >> 3);\n*out = s; }\n"
)
TRIES = 5
#: The step docs/guarantees.md says the front door assumes of a clock whose times are whole seconds.
WHOLE_SECOND_STEP_S = 2
WHERE = ("same process", "fresh process")

#: Where the cache is: on a file system of ns times (its clock then is not the headers'), or beside the headers.
CACHE_ON = ("ns fs", "one-second fs")


def cache_dir(cache_on: str, one_second_fs: Path, tmp_path: Path) -> Path:
    base = tmp_path if cache_on == "ns fs" else Path(tempfile.mkdtemp(prefix="cas-", dir=one_second_fs))
    return base / "cas"


#: A look from a fresh interpreter: argv is the cache, the source file, then the include directories.
LOOK = """
import hashlib, sys
from cuda.core import ProgramOptions
from cuda_program_cas import ContentAddressedProgramCache
cache = ContentAddressedProgramCache(sys.argv[1])
opts = ProgramOptions(arch="sm_80", include_path=sys.argv[3:])
code = open(sys.argv[2]).read()
print(hashlib.sha256(bytes(cache.compile(code, "c++", opts, "cubin").code)).hexdigest())
"""


def sha(obj) -> str:
    return hashlib.sha256(bytes(obj.code)).hexdigest()


def uncached(code: str, opts: ProgramOptions) -> str:
    return sha(Program(code, "c++", options=opts).compile("cubin"))


class Tree:
    """On the one-second file system: ``first/`` (searched first, empty), ``later/val.h``, and a clock probe."""

    def __init__(self, fs: Path, cache_dir: Path, code: str = KERNEL) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="tree-", dir=fs))
        self.first, self.later, clock = self.root / "first", self.root / "later", self.root / "clock"
        for d in (self.first, self.later, clock):
            d.mkdir()
        self.probe = clock / "probe"  # in a directory of its own: touching it changes no searched directory
        self.probe.write_bytes(b"")
        self.header = self.later / "val.h"
        self.header.write_text("#define VAL 10\n")
        self.base_code = self.code = code
        self.dirs = [str(self.first), str(self.later)]
        self.opts = ProgramOptions(arch="sm_80", include_path=self.dirs)
        self.cache_dir = cache_dir
        self.cache = ContentAddressedProgramCache(cache_dir)
        self.source = self.root / "kernel.cu"  # for a fresh process
        self.source.write_text(code)
        uncached(code, self.opts)  # NVRTC loaded in this process: a compile then takes a fraction of a second
        self.wait_until_old()

    def attempt(self, attempt: int) -> None:
        """Compile other inputs from now on (a record of their own): what an earlier try stored stays apart."""
        self.code = self.base_code + f"// try {attempt}\n"
        self.source.write_text(self.code)

    def now_s(self) -> int:
        """The file system's own clock, in whole seconds: the mtime a touch gives."""
        os.utime(self.probe)
        return self.probe.stat().st_mtime_ns // 10**9

    def wait_until_old(self) -> None:
        """Until all of the tree is older than the step the front door assumes of whole-second times."""
        newest = max(p.stat().st_ctime_ns for p in (self.root, self.first, self.later, self.header)) // 10**9
        while self.now_s() < newest + WHOLE_SECOND_STEP_S + 1:
            time.sleep(0.01)

    def second_start(self) -> int:
        """Wait until a new second begins on the file system's clock; that second."""
        first = self.now_s()
        while (now := self.now_s()) == first:
            time.sleep(0.001)
        return now

    def cached(self) -> str:
        return sha(self.cache.compile(self.code, "c++", self.opts, "cubin"))

    def look(self, where: str) -> str:
        """What ``cache.compile`` gives now: through this process's cache, or from a fresh interpreter."""
        if where == "same process":
            return self.cached()
        done = run_python(LOOK, str(self.cache_dir), str(self.source), *self.dirs)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def uncached(self) -> str:
        return uncached(self.code, self.opts)


def within_one_second(tree: Tree, pattern: Callable[[int], Path], prepare: Callable[[int], None] | None = None) -> None:
    """Run ``pattern(attempt)`` from the start of a second until what it changed last carries that second.

    Each try compiles inputs of its own (:meth:`Tree.attempt`), after ``prepare(attempt)``.
    """
    for attempt in range(TRIES):
        tree.attempt(attempt)
        if prepare is not None:
            prepare(attempt)
        second = tree.second_start()
        changed = pattern(attempt)
        if changed.stat().st_ctime_ns // 10**9 == second:
            return
    pytest.fail(f"the pattern never fit in one second in {TRIES} tries (a machine far too loaded)")


@pytest.mark.mount
@pytest.mark.slow
@pytest.mark.parametrize("where", WHERE)
def test_a_header_rewritten_while_nvrtc_compiles_is_not_recorded(
    one_second_fs: Path, tmp_path: Path, where: str
) -> None:
    tree = Tree(one_second_fs, tmp_path / "cas", SLOW_KERNEL)
    libc = ctypes.CDLL(None, use_errno=True)
    served: list[str] = []

    def pattern(attempt: int) -> Path:
        fd = libc.inotify_init1(os.O_CLOEXEC)
        assert fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(tree.header), 0x10) >= 0  # IN_CLOSE_NOWRITE
        rewritten, returned = threading.Event(), threading.Event()

        def rewrite_once_read() -> None:
            while not select.select([fd], [], [], 0.05)[0]:
                if returned.is_set():
                    return  # val.h was never read: the assertion below says so
            # NVRTC opened, read and closed val.h: the compile goes on in ptxas for most of a second.
            _wd, mask, _cookie, _size = struct.unpack_from("iIII", os.read(fd, 4096))
            assert mask & 0x10
            with open(tree.header, "r+") as f:  # in place, the same size
                f.write(f"#define VAL {21 + attempt}\n")
            rewritten.set()

        thread = threading.Thread(target=rewrite_once_read)
        thread.start()
        try:
            served.append(tree.cached())
        finally:
            returned.set()
            thread.join()
            os.close(fd)
        assert rewritten.is_set()
        return tree.header

    within_one_second(tree, pattern)
    want = tree.uncached()
    assert served[-1] != want  # NVRTC compiled the bytes from before the rewrite
    assert tree.look(where) == want


@pytest.mark.mount
@pytest.mark.slow
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("cache_on", CACHE_ON)
def test_a_header_edited_in_the_second_of_a_compile_that_read_it_is_not_served_stale(
    one_second_fs: Path, tmp_path: Path, where: str, cache_on: str
) -> None:
    tree = Tree(one_second_fs, cache_dir(cache_on, one_second_fs, tmp_path))
    served: list[str] = []

    def pattern(attempt: int) -> Path:
        tree.header.write_text(f"#define VAL {30 + 2 * attempt}\n")
        served.append(tree.cached())
        tree.header.write_text(f"#define VAL {31 + 2 * attempt}\n")  # the same size, the same second
        return tree.header

    within_one_second(tree, pattern)
    want = tree.uncached()
    assert served[-1] != want
    assert tree.look(where) == want


@pytest.mark.mount
@pytest.mark.slow
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("cache_on", CACHE_ON)
def test_a_header_made_earlier_on_the_path_in_the_second_of_that_directorys_last_change_is_found(
    one_second_fs: Path, tmp_path: Path, where: str, cache_on: str
) -> None:
    tree = Tree(one_second_fs, cache_dir(cache_on, one_second_fs, tmp_path))
    shadow = tree.first / "val.h"
    served: list[str] = []

    def pattern(attempt: int) -> Path:
        if shadow.exists():
            shadow.unlink()
        (tree.first / f"other-{attempt}.h").write_text("")  # first/ changes in this second
        served.append(tree.cached())  # val.h found in later/
        shadow.write_text("#define VAL 40\n")  # found first from now on; first/ changes in the same second
        return tree.first

    within_one_second(tree, pattern)
    want = tree.uncached()
    assert served[-1] != want
    assert tree.look(where) == want


@pytest.mark.mount
@pytest.mark.slow
def test_a_same_second_edit_after_a_hit_on_a_young_header_is_seen_by_the_memory_and_the_watch(
    one_second_fs: Path, tmp_path: Path, compiles: Compiles
) -> None:
    tree = Tree(one_second_fs, tmp_path / "cas")
    served: list[str] = []

    door = None

    def prepare(attempt: int) -> None:
        nonlocal door
        if attempt:
            tree.header.write_text("#define VAL 10\n")
            tree.wait_until_old()
        served[:] = [tree.cached()]  # stored: val.h is old
        assert tree.cached() == served[0]  # a hit; the next looks arm the header watch
        door = tree.cache._front_door

    def pattern(attempt: int) -> Path:
        tree.header.write_text(tree.header.read_text())  # its own bytes: new stat data, the same digest
        count = compiles.count
        served.append(tree.cached())
        assert compiles.count == count, "a header rewritten with its own bytes is a hit"
        served.append(tree.cached())  # armed again (the rewrite made the watch dirty), and a hit
        watched = door.watched_hits
        served.append(tree.cached())  # answered by the watch: nothing changed since it was armed
        assert door.watched_hits == watched + 1
        tree.header.write_text(f"#define VAL {50 + attempt}\n")  # the same size, the same second
        return tree.header

    within_one_second(tree, pattern, prepare)
    first = served[0]
    assert served == [first] * 4
    want = tree.uncached()
    assert want != first
    assert tree.cached() == want
    assert tree.look("fresh process") == want


# -- the step of a clock, from its times ------------------------------------------------------------------

STEPS = [10**k for k in range(10)] + [2 * 10**9]


@given(step=st.sampled_from(STEPS), ticks=st.integers(1, 2 * 10**9))
def test_the_step_read_from_a_time_is_never_finer_than_the_clock_that_gave_it(step: int, ticks: int) -> None:
    """Any time a clock of ``step`` gives is read as of that step or coarser (a young file is never thought old)."""
    from cuda_program_cas._disk.fskind import time_step_ns

    assert time_step_ns(ticks * step) >= step
