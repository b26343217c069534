"""``cache.compile(...)`` against an uncached ``Program.compile``, under generated header trees and edits.

The differential property: after any sequence of edits, same-bytes touches, copies
renamed over a header (same or other bytes), symlink moves, new headers that shadow old
ones, deleted headers, files of other names created and removed in the working
directory and every include directory, and changes of working directory,
``cache.compile`` returns exactly what an uncached compile of the files as they are at
that moment returns (bytes, ``name``, ``symbol_mapping``), or raises what it raises,
in this process and in a child process over the same cache. A hit where the bytes
differ is a failure of soundness. A miss where the bytes are the same as the previous
compile of the same inputs, which was stored, is a failure of precision: the test
allows neither (a compile whose write the age rule dropped is not stored, and the next
one may miss). Only the public API and the cache's counters are used, so the test
runs unchanged on any implementation of the front door.

Why a ``RuleBasedStateMachine`` rather than ``@given`` over a list of steps: the bugs it
hunts are about history (an entry stored under one state of the file system, served
under another), and hypothesis's stateful runner generates the steps, replays them and
shrinks a failure to the shortest sequence, printed as the calls that reproduce it. One
cache serves all steps of an example (so earlier entries can be served stale); each
example has its own directory tree and cache. An example draws one to three spellings
(:class:`Spelling`) at the start and compiles only with those, so that the same inputs
come back after a change (a stale hit needs a compile, a change, the same compile).
Every step ends with a compile, compared at once with an uncached one.

The tree of an example (``T`` is its own temporary directory)::

    T/projA/include/val.h        V_val;  #include "sub/deep.h" (quoted: next to the includer)
    T/projA/include/sub/deep.h   V_deep; #include <leaf.h>     (angled: the include path)
    T/projA/local.h              V_local (quoted, found in the working directory)
    T/projA/src/near.h           V_near  (quoted, next to a source named src/kernel.cu)
    T/projA/pre.h                V_pre   (pre_include)
    T/projB/...                  the same relative layout, other values
    T/shared/one/leaf.h, T/shared/two/leaf.h    V_leaf
    T/link -> shared/one         a symlinked include directory (moved to shared/two)
    T/cur -> projA               a symlinked project (moved to projB)
    T/first/                     an include directory searched first, empty at the start

and headers that do not exist at the start but would be found first once written
(``first/val.h``, ``projX/src/val.h``, ``projX/val.h``, ``projX/include/leaf.h``...).
Every header defines one ``V_<slot>`` value; the kernel writes each slot to memory,
so other bytes in any header it reads give another cubin. Each write of a header
takes a new value.

The same machine runs on a file system whose times are whole seconds (ext4 made with
128-byte inodes, on a loop device; root only), with the cache on one of ns times and no
wait after a change (:class:`OneSecondMachine`): edits, touches and new headers then fall
in the second of the compile before them, and ``edit_twice_in_one_second`` makes that
likely. It found the stale binaries of issue 43 (item 3) before the front door measured
how old stat data are on their file system's clock.

The CI configuration is the defaults below; ten times the examples, with another seed
(see docs/frontdoor-proof.md)::

    CPCAS_PROPERTY_EXAMPLES=200 CPCAS_PROPERTY_SEED=7 python -m pytest -q tests/test_frontdoor_property.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cuda.core import Program, ProgramOptions
from hypothesis import HealthCheck, event, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test
from testkit.forks import ForkServer

from cuda_program_cas import ContentAddressedProgramCache

#: The CI configuration: examples, steps per example and the seed (about 60-90 s on 2 cores).
EXAMPLES = int(os.environ.get("CPCAS_PROPERTY_EXAMPLES", "20"))
STEPS = int(os.environ.get("CPCAS_PROPERTY_STEPS", "25"))
SEED = int(os.environ.get("CPCAS_PROPERTY_SEED", "20"))

PROJECTS = ("projA", "projB")
SLOTS = ("val", "deep", "leaf", "local", "near", "pre")
NAMES = ("tmpl<int>", "tmpl<float>")

#: Every header file the machine may write, relative to ``T``, and the slot it defines.
HEADERS: dict[str, str] = {}
for _p in PROJECTS:
    HEADERS.update(
        {
            f"{_p}/include/val.h": "val",
            f"{_p}/include/sub/deep.h": "deep",
            f"{_p}/local.h": "local",
            f"{_p}/src/near.h": "near",
            f"{_p}/pre.h": "pre",
            # Absent at the start; each would be found before the header of its slot.
            f"{_p}/src/val.h": "val",  # next to a source named src/kernel.cu
            f"{_p}/val.h": "val",  # in the working directory, for a source named without a directory
            f"{_p}/include/leaf.h": "leaf",  # in the project's include directory, when searched before the leaf's
            f"{_p}/include/sub/leaf.h": "leaf",  # next to deep.h: never found by its angled include
        }
    )
HEADERS.update(
    {
        "shared/one/leaf.h": "leaf",
        "shared/two/leaf.h": "leaf",
        "first/val.h": "val",
        "first/leaf.h": "leaf",
    }
)
#: What exists at the start: the rest is written by the machine, and would be found first.
INITIAL = (
    *(f"{p}/{h}" for p in PROJECTS for h in ("include/val.h", "include/sub/deep.h", "local.h", "src/near.h", "pre.h")),
    "shared/one/leaf.h",
    "shared/two/leaf.h",
)
#: What each header includes besides its own value (only the project's val.h and deep.h include others).
INCLUDES = {"val": '#include "sub/deep.h"\n', "deep": "#include <leaf.h>\n"}
LINKS = {"link": ("shared/one", "shared/two"), "cur": PROJECTS}

#: How the project's include directory is spelled, from the working directory ``P`` (None: not searched).
INCLUDE_SPELLINGS = ("abs", "rel", "dot", "dotdot", "inner-dotdot", "cur-link", "cur-link-rel", None)
#: How the leaf's directory is spelled.
LEAF_SPELLINGS = ("link-abs", "link-rel", "one-abs", "two-rel")
#: How options.name is spelled (a directory in it: quoted includes are looked for there, not in the cwd).
NAME_SPELLINGS = (None, "plain", "rel", "abs", "dotdot")


@dataclasses.dataclass(frozen=True)
class Spelling:
    """How one compile names its inputs; ``options`` spells them from the working directory of the moment."""

    include: str | None  # the project's include directory (INCLUDE_SPELLINGS)
    leaf: str  # the leaf's directory (LEAF_SPELLINGS)
    leaf_first: bool  # the leaf's directory searched before the project's
    first: str | None  # T/first searched before both: "abs", "rel" or not at all
    pre: str | None  # pre_include: "rel" (pre.h), "abs" or none
    name: str | None  # options.name (NAME_SPELLINGS)
    names: bool  # name_expressions given (a template kernel, so symbol_mapping is compared)

    @property
    def name_has_dir(self) -> bool:
        return self.name in ("rel", "abs", "dotdot")


SPELLINGS = st.builds(
    Spelling,
    include=st.sampled_from(INCLUDE_SPELLINGS),
    leaf=st.sampled_from(LEAF_SPELLINGS),
    leaf_first=st.booleans(),
    first=st.sampled_from((None, "abs", "rel")),
    pre=st.sampled_from((None, "rel", "abs")),
    name=st.sampled_from(NAME_SPELLINGS),
    names=st.booleans(),
)


def header_text(slot: str, value: int, path: str) -> str:
    includes = INCLUDES.get(slot, "") if path.endswith(("include/val.h", "include/sub/deep.h")) else ""
    return f"#ifndef V_{slot}\n#define V_{slot} {value}\n{includes}#endif\n"


def source_for(name_has_dir: bool) -> str:
    neighbour = "near.h" if name_has_dir else "local.h"
    defaults = "".join(f"#ifndef V_{s}\n#define V_{s} 0\n#endif\n" for s in SLOTS)
    stores = " ".join(f"out[{i}] = V_{s};" for i, s in enumerate(SLOTS))
    return (
        f'#include "val.h"\n#include "{neighbour}"\n{defaults}'
        f'extern "C" __global__ void k(int *out) {{ {stores} }}\n'
        "template <class T> __global__ void tmpl(T *out) { *out = (T)(V_val * 1000 + V_leaf); }\n"
    )


def settle(path: Path, clock_dir: Path) -> None:
    """Wait until the file system's clock is past the ctime of ``path`` (when it exists) and of its directory.

    The front door does not store a compile whose headers changed at or after the moment it
    began (see tests/test_frontdoor.py); a change in the same clock tick as the next compile
    would only make that compile uncached, so the test waits a tick after each change. The
    clock is read by writing a file in ``clock_dir``, a directory no compile searches: a
    probe next to a header would change its directory, which the front door may watch, and
    hide the very staleness the test looks for.
    """
    targets = [path.parent.stat().st_ctime_ns]
    try:
        targets.append(path.lstat().st_ctime_ns)
    except FileNotFoundError:
        pass
    probe = clock_dir / ".clock"
    for _ in range(100_000):
        probe.write_bytes(b"")
        now = probe.stat().st_mtime_ns
        if now > max(targets):
            return
    raise AssertionError("the file system clock did not advance")


def outcome(compile_once) -> tuple[str, object]:
    """``("ok", (bytes, name, symbol_mapping))`` or ``("error", (type, message))`` of one compile."""
    try:
        obj = compile_once()
    except Exception as exc:
        return "error", (type(exc), str(exc))
    mapping = dict(obj.symbol_mapping) if obj.symbol_mapping else {}
    return "ok", (bytes(obj.code), obj.name, mapping)


def describe(result: tuple[str, object]) -> str:
    kind, value = result
    if kind == "error":
        err_type, message = value  # type: ignore[misc]
        return f"{err_type.__name__}: {message.strip().splitlines()[-3:]}"
    code, name, mapping = value  # type: ignore[misc]
    return f"cubin sha256 {hashlib.sha256(code).hexdigest()[:12]}, name {name!r}, symbols {mapping}"


#: Which of the example's spellings a step compiles with (modulo their number).
THEN = st.integers(0, 2)

#: Directories a job may write other files into: every working and include directory, and the tree's root.
OTHER_DIRS = (
    ".",
    "first",
    "shared/one",
    "shared/two",
    *(f"{p}{s}" for p in PROJECTS for s in ("", "/include", "/include/sub", "/src")),
)
#: Names no lookup of the kernel tries (a trailing slash: a directory).
OTHER_NAMES = ("metrics.json", "out.log", "val.hpp", "leaf.h.orig", "build/")
#: The compile of ``compile_in_a_child``: run in a child forked from a server that imported these
#: (testkit.forks): a process with nothing in its memory, without an interpreter's start and
#: imports for each (a second a call on a loaded 2-core machine).
CHILD_PRELOAD = "import cuda.core\nfrom cuda_program_cas import ContentAddressedProgramCache\n"
CHILD = """
from cuda_program_cas import ContentAddressedProgramCache

def main(path, code, options, names):
    cache = ContentAddressedProgramCache(path)
    try:
        obj = cache.compile(code, "c++", options, "cubin", name_expressions=names)
        got = ("ok", (bytes(obj.code), obj.name, dict(obj.symbol_mapping) if obj.symbol_mapping else {}))
    except Exception as exc:
        got = ("error", (type(exc), str(exc)))
    counters = cache.counters()
    return got, counters["hits"] > 0, counters["dropped_writes"] == 0
"""


@pytest.fixture
def forks() -> Iterator[ForkServer]:
    with ForkServer(CHILD_PRELOAD) as server:
        yield server


class FrontDoorMachine(RuleBasedStateMachine):
    """One directory tree, one cache, a sequence of file-system changes and compiles."""

    def __init__(self, base: Path, forks: ForkServer) -> None:
        super().__init__()
        self.forks = forks
        self.root = Path(tempfile.mkdtemp(prefix="ex-", dir=base))
        self.home = os.getcwd()
        self.cache_dir = self.root / "cas"
        self.clock = self.root / "clock"
        self.cache = ContentAddressedProgramCache(self.cache_dir)
        self.values: dict[str, int] = {}
        self.next_value = 1
        self.cwd = "projA"
        self.spellings: list[Spelling] = []
        #: The previous compared compile: its inputs, its binary, and whether it was stored (or hit).
        self.previous: tuple[object, bytes, bool] | None = None

    @initialize(spellings=st.lists(SPELLINGS, min_size=1, max_size=3))
    def build_tree(self, spellings: list[Spelling]) -> None:
        """The tree, and the few spellings this example compiles with (few, so that they repeat)."""
        self.spellings = spellings
        for d in (
            "clock",
            "first",
            "shared/one",
            "shared/two",
            *(f"{p}/{s}" for p in PROJECTS for s in ("include/sub", "src")),
        ):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        for path in INITIAL:
            self._write(path)
        for link, targets in LINKS.items():
            os.symlink(targets[0], self.root / link)
        os.chdir(self.root / self.cwd)
        self._settle(self.root / "shared" / "one" / "leaf.h")

    def teardown(self) -> None:
        os.chdir(self.home)
        shutil.rmtree(self.root, ignore_errors=True)

    def _settle(self, path: Path) -> None:
        """After a change: wait a tick of the clock (see :func:`settle`)."""
        settle(path, self.clock)

    def _write(self, path: str, replace: bool = False) -> None:
        value = self.next_value
        self.next_value += 1
        self.values[path] = value
        target = self.root / path
        text = header_text(HEADERS[path], value, path)
        if replace:  # as an editor saves: a new file renamed over the old one
            staged = target.with_name(target.name + ".new")
            staged.write_text(text)
            os.replace(staged, target)
        else:
            target.write_text(text)

    # -- changes ----------------------------------------------------------------------------------

    # Each change is followed by a compile of one of the example's spellings (``then``): hypothesis
    # enables a random subset of the rules in each example, and a change with no compile after it
    # proves nothing.

    @rule(path=st.sampled_from(sorted(HEADERS)), replace=st.booleans(), then=THEN)
    def write_header(self, path: str, replace: bool, then: int) -> None:
        """New bytes: an edit of an existing header, or a new one (which may now be found first)."""
        self._write(path, replace)
        self._settle(self.root / path)
        self._compare(then)

    @rule(path=st.sampled_from(sorted(HEADERS)), then=THEN)
    def touch_header(self, path: str, then: int) -> None:
        """The same bytes, rewritten, with a new mtime."""
        target = self.root / path
        if target.exists():
            target.write_bytes(target.read_bytes())
            os.utime(target)
            self._settle(target)
        self._compare(then)

    @rule(path=st.sampled_from(sorted(HEADERS)), then=THEN)
    def delete_header(self, path: str, then: int) -> None:
        """Gone: the compile may now fail (and the cache must fail alike) or find another header."""
        target = self.root / path
        if target.exists():
            target.unlink()
            self.values.pop(path, None)
            self._settle(target)
        self._compare(then)

    @rule(path=st.sampled_from(sorted(HEADERS)), same=st.booleans(), then=THEN)
    def copy_renamed_over(self, path: str, same: bool, then: int) -> None:
        """``cp h.h t && mv t h.h``, as editors and checkouts do: a new inode, ``same`` bytes or new ones."""
        target = self.root / path
        if target.exists():
            staged = target.with_name(target.name + ".cp")
            if same:
                shutil.copyfile(target, staged)
            else:
                value = self.next_value
                self.next_value += 1
                self.values[path] = value
                staged.write_text(header_text(HEADERS[path], value, path))
            os.replace(staged, target)
            self._settle(target)
        self._compare(then)

    @rule(where=st.sampled_from(OTHER_DIRS), name=st.sampled_from(OTHER_NAMES), then=THEN)
    def other_file(self, where: str, name: str, then: int) -> None:
        """A file or directory of a name no lookup tries, created (or removed when there), as a job's outputs are."""
        target = self.root / where / name
        if target.is_dir():
            target.rmdir()
        elif target.exists():
            target.unlink()
        elif name.endswith("/"):
            target.mkdir()
        else:
            target.write_text("{}")
        self._settle(target)
        self._compare(then)

    @rule(which=THEN)
    def compile_in_a_child(self, which: int) -> None:
        """The compile in another process over the same cache and working directory (nothing in its memory)."""
        self._compare(which, child=True)

    @rule(link=st.sampled_from(sorted(LINKS)), then=THEN)
    def move_link(self, link: str, then: int) -> None:
        """Point a symlinked directory at its other target (replaced whole, as ``ln -sfn`` does)."""
        current = os.readlink(self.root / link)
        one, other = LINKS[link]
        staged = self.root / (link + ".new")
        os.symlink(other if current == one else one, staged)
        os.replace(staged, self.root / link)
        self._settle(self.root / link)
        self._compare(then)

    @rule(project=st.sampled_from(PROJECTS), then=THEN)
    def change_directory(self, project: str, then: int) -> None:
        self.cwd = project
        os.chdir(self.root / project)
        self._compare(then)

    # -- the property ------------------------------------------------------------------------------

    def _options(self, spelling: Spelling) -> ProgramOptions:
        t, p = str(self.root), self.cwd
        project_dir = {
            "abs": f"{t}/{p}/include",
            "rel": "include",
            "dot": "./include",
            "dotdot": f"../{p}/include",
            "inner-dotdot": "include/sub/..",
            "cur-link": f"{t}/cur/include",
            "cur-link-rel": "../cur/include",
            None: None,
        }[spelling.include]
        leaf_dir = {
            "link-abs": f"{t}/link",
            "link-rel": "../link",
            "one-abs": f"{t}/shared/one",
            "two-rel": "../shared/two",
        }[spelling.leaf]
        dirs = [leaf_dir, project_dir] if spelling.leaf_first else [project_dir, leaf_dir]
        if spelling.first is not None:
            dirs.insert(0, f"{t}/first" if spelling.first == "abs" else "../first")
        pre_include = {None: None, "rel": "pre.h", "abs": f"{t}/{p}/pre.h"}[spelling.pre]
        source_name = {
            None: None,
            "plain": "kernel.cu",
            "rel": "src/kernel.cu",
            "abs": f"{t}/{p}/src/kernel.cu",
            "dotdot": f"../{p}/src/kernel.cu",
        }[spelling.name]
        extra = {} if source_name is None else {"name": source_name}
        return ProgramOptions(
            arch="sm_80", include_path=[d for d in dirs if d is not None], pre_include=pre_include, **extra
        )

    @rule(which=THEN, fresh=st.booleans())
    def compile_again(self, which: int, fresh: bool) -> None:
        """A compile with nothing changed since the last step; ``fresh``: through a new cache instance."""
        if fresh:  # a new instance over the same directory: nothing remembered in memory
            self.cache = ContentAddressedProgramCache(self.cache_dir)
        self._compare(which)

    def _options_and_code(self, which: int) -> tuple[Spelling, ProgramOptions, str, tuple[str, ...]]:
        spelling = self.spellings[which % len(self.spellings)]
        names = NAMES if spelling.names else ()
        return spelling, self._options(spelling), source_for(spelling.name_has_dir), names

    def _cached_only(self, which: int) -> None:
        """A compile through the cache, not compared (the next step's compile is): it may store a record."""
        _spelling, options, code, name_expressions = self._options_and_code(which)
        outcome(lambda: self.cache.compile(code, "c++", options, "cubin", name_expressions=name_expressions))
        self.previous = None

    def _cached(self, code: str, options: ProgramOptions, names: tuple[str, ...], child: bool) -> tuple:
        """``(outcome, hit, stored)`` of ``cache.compile``: here, or in a child process over the same cache."""
        if not child:
            before = self.cache.counters()
            got = outcome(lambda: self.cache.compile(code, "c++", options, "cubin", name_expressions=names))
            after = self.cache.counters()
            return got, after["hits"] > before["hits"], after["dropped_writes"] == before["dropped_writes"]
        return self.forks.call(CHILD, str(self.cache_dir), code, options, names)  # type: ignore[no-any-return]

    def _compare(self, which: int, child: bool = False) -> None:
        """``cache.compile`` gives what an uncached compile of the files as they are now gives; the same bytes hit."""
        spelling, options, code, name_expressions = self._options_and_code(which)
        got, hit, stored = self._cached(code, options, name_expressions, child)
        want = outcome(lambda: Program(code, "c++", options=options).compile("cubin", name_expressions))
        event(f"the uncached compile: {want[0]}")
        inputs = (spelling, self.cwd)
        code_got = got[1][0] if got[0] == "ok" else None  # type: ignore[index]
        previous, self.previous = self.previous, None if code_got is None else (inputs, code_got, hit or stored)
        if got == want:
            same = previous is not None and previous[0] == inputs and previous[1] == code_got
            if same and previous[2] and not hit:  # type: ignore[index]
                self.precision_failure(spelling, options)
            return
        links = {k: os.readlink(self.root / k) for k in LINKS}
        detail = (
            f"\n  cache.compile gave {describe(got)}\n  Program.compile gives {describe(want)}\n"
            f"  {spelling}, cwd {self.cwd}, include_path {options.include_path}, "
            f"pre_include {options.pre_include}, name {options.name}\n"
            f"  links {links}, header values {self.values}"
        )
        # Raised, not asserted (pytest would print both binaries whole), each kind from its own
        # line: hypothesis reports (and shrinks) a failure per line, so one run shows each kind.
        if got[0] != want[0]:
            raise AssertionError("cache.compile and Program.compile disagree on whether it compiles" + detail)
        if got[0] == "error":
            raise AssertionError("cache.compile raised another error than Program.compile" + detail)
        if got[1][0] != want[1][0]:  # type: ignore[index]
            raise AssertionError("cache.compile returned other bytes (a stale binary)" + detail)
        raise AssertionError("cache.compile returned the bytes with another name or symbol mapping" + detail)

    def precision_failure(self, spelling: Spelling, options: ProgramOptions) -> None:
        raise AssertionError(
            "cache.compile missed where the previous compile of the same inputs, stored, gave the same bytes"
            f" (a failure of precision)\n  {spelling}, cwd {self.cwd}, include_path {options.include_path}"
        )


SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.slow
def test_cache_compile_equals_an_uncached_compile_under_generated_edits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forks: ForkServer
) -> None:
    monkeypatch.chdir(tmp_path)  # restored after the test, whatever the machine did

    def machine() -> FrontDoorMachine:
        return FrontDoorMachine(tmp_path, forks)

    run_state_machine_as_test(seed(SEED)(machine), settings=SETTINGS)


# -- the same property on a file system whose times are whole seconds (issue 43, item 3) ---------------------

ONE_SECOND_EXAMPLES = int(os.environ.get("CPCAS_PROPERTY_ONE_SECOND_EXAMPLES", "6"))
ONE_SECOND_STEPS = int(os.environ.get("CPCAS_PROPERTY_ONE_SECOND_STEPS", "15"))


class OneSecondMachine(FrontDoorMachine):
    """The tree on a file system of one-second times, the cache on one of ns times; no wait after a change.

    A change and the compiles around it then mostly fall in one second: same-second edits,
    touches, shadowing headers and directory changes, after a compile that read the file
    or its directory, which leave every stat field as it was. ``let_time_pass`` lets the
    tree grow old, so that compiles are stored and later same-second changes can be
    served stale if the front door trusted those stat fields.
    """

    def __init__(self, base: Path, cache_base: Path, forks: ForkServer) -> None:
        super().__init__(base, forks)
        self.cache_dir = Path(tempfile.mkdtemp(prefix="cas-", dir=cache_base))
        self.cache = ContentAddressedProgramCache(self.cache_dir)
        self.probe = self.clock / "probe"  # its directory is searched by no compile

    def _settle(self, path: Path) -> None:
        pass  # the point: the next compile comes in the same second as the change

    def _now_s(self) -> int:
        self.probe.write_bytes(b"")
        return self.probe.stat().st_mtime_ns // 10**9

    @rule(path=st.sampled_from(sorted(HEADERS)), near=st.integers(0, 3), then=THEN)
    def edit_twice_in_one_second(self, path: str, near: int, then: int) -> None:
        """An edit and a compile through the cache, then at once an edit of the same header or of one in its directory.

        Both edits are in place (same inode) and mostly of the same size: the second falls
        in the second of the compile, often with every stat field of the header, or of the
        directory a new header appears in, as the compile left it.
        """
        self._write(path)
        self._cached_only(then)  # no uncached compile after it: that would take the second away
        neighbours = sorted(p for p in HEADERS if os.path.dirname(p) == os.path.dirname(path))
        self._write(neighbours[near % len(neighbours)])
        self._compare(then)

    @rule(which=THEN)
    def let_time_pass(self, which: int) -> None:
        """Three seconds of the file system's clock (past the 2 s step assumed of whole seconds), then a compile."""
        until = self._now_s() + 3
        while self._now_s() < until:
            time.sleep(0.02)
        self._compare(which)

    def teardown(self) -> None:
        super().teardown()
        shutil.rmtree(self.cache_dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.mount
def test_cache_compile_equals_an_uncached_compile_under_same_second_edits(
    one_second_fs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forks: ForkServer
) -> None:
    monkeypatch.chdir(tmp_path)

    def machine() -> FrontDoorMachine:
        return OneSecondMachine(one_second_fs, tmp_path, forks)

    run_state_machine_as_test(
        seed(SEED)(machine),
        settings=settings(SETTINGS, max_examples=ONE_SECOND_EXAMPLES, stateful_step_count=ONE_SECOND_STEPS),
    )


# -- findings 1 and 2 of issue 20, as examples ---------------------------------------------------------

VAL_SOURCE = '#include "val.h"\nextern "C" __global__ void k(int *out) { *out = VAL; }\n'


def summary(obj) -> tuple[str, str, dict]:
    """What a compile returned, as plain values: the binary's sha256, ``name`` and ``symbol_mapping``.

    An assertion never names an ``ObjectCode``: pytest would print its repr, which loads
    the binary through the CUDA driver (and waits forever on a machine without a GPU).
    """
    return hashlib.sha256(bytes(obj.code)).hexdigest(), obj.name, dict(obj.symbol_mapping or {})


@pytest.mark.parametrize(
    ("header_dir", "include_path"),
    [
        ("work/hdr", ["hdr"]),
        ("work/hdr", ["./hdr"]),
        ("hdr", ["../hdr"]),
        ("work", None),  # a quoted header in the working directory, no include_path
    ],
    ids=["hdr", "dot-hdr", "dotdot-hdr", "cwd"],
)
def test_an_edited_header_found_through_a_relative_spelling_is_not_served_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, header_dir: str, include_path: list[str] | None
) -> None:
    clock = tmp_path / "clock"
    for d in ("work", header_dir, "clock"):
        (tmp_path / d).mkdir(exist_ok=True)
    header = tmp_path / header_dir / "val.h"
    header.write_text("#define VAL 1\n")
    monkeypatch.chdir(tmp_path / "work")
    opts = ProgramOptions(arch="sm_80", include_path=include_path)
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    settle(header, clock)
    old = summary(cache.compile(VAL_SOURCE, "c++", opts, "cubin"))
    header.write_text("#define VAL 2\n")
    settle(header, clock)
    new = summary(cache.compile(VAL_SOURCE, "c++", opts, "cubin"))
    reference = summary(Program(VAL_SOURCE, "c++", options=opts).compile("cubin"))
    assert reference != old
    assert new == reference


def test_two_projects_with_the_same_relative_layout_get_their_own_binaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = tmp_path / "clock"
    clock.mkdir()
    for project, value in (("projA", 1), ("projB", 2)):
        (tmp_path / project / "include").mkdir(parents=True)
        (tmp_path / project / "include" / "val.h").write_text(f"#define VAL {value}\n")
    settle(tmp_path / "projB" / "include" / "val.h", clock)
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    opts = ProgramOptions(arch="sm_80", include_path=["include"])
    results = {}
    for project in ("projA", "projB"):
        monkeypatch.chdir(tmp_path / project)
        results[project] = (
            summary(cache.compile(VAL_SOURCE, "c++", opts, "cubin")),
            summary(Program(VAL_SOURCE, "c++", options=opts).compile("cubin")),
        )
    assert results["projA"][1] != results["projB"][1]
    got_b, want_b = results["projB"]
    assert got_b == want_b, "project B got project A's binary"
    got_a, want_a = results["projA"]
    assert got_a == want_a
