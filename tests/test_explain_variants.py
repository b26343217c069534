"""``explain`` compares each miss with its own earlier variant, and names what the front door's check found.

Real NVRTC compiles into a real cache, real header trees; the journal they write is
what ``explain`` reads. A miss is compared with the same code's earlier compile, not
with another kernel's miss of the same run that differs in as few places; a front
door miss whose variant failed its check (a header changed, a guard directory's
listing changed) is put down to the path the check found, never to an entry removed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cuda.core import Program, ProgramOptions
from hypothesis import given, settings
from hypothesis import strategies as st

from cuda_program_cas import ContentAddressedProgramCache, MissExplanation, explain
from cuda_program_cas._local.journal import MissRecord
from cuda_program_cas._local.why import DIRECTORY_CHANGED, HEADER_CHANGED
from cuda_program_cas._verbs.explain import explain_one

KERNELS = 12
#: An option added to every kernel, and the words ``explain`` must name it with.
ADDED = {
    "lineinfo": (True, "option --generate-line-info added: (set)"),
    "max_register_count": (32, "option --maxrregcount added: 32"),
}


def _kernel(i: int, header: bool = False) -> str:
    head = "#include <v.h>\n" if header else "#define V 0\n"  # angled: the working directory is not searched
    return head + f'extern "C" __global__ void k{i}(int* x) {{ *x = {i} + V; }}\n'


def _arch(i: int) -> str:
    return ("sm_80", "sm_90", "sm_86")[i % 3]  # each kernel's own earlier -arch, a mix across kernels


def _misses(root: object, last: int) -> list[MissExplanation]:
    return explain(str(root), last=last).misses


@pytest.mark.parametrize("option", sorted(ADDED))
@pytest.mark.parametrize("via", ["plain", "front"])
def test_one_option_added_to_twelve_kernels_is_named_for_each(tmp_path: Path, via: str, option: str) -> None:
    value, words = ADDED[option]
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "v.h").write_text("#define V 3\n")
    with ContentAddressedProgramCache(tmp_path / "c") as cache:

        def run(i: int, **extra: object) -> None:
            if via == "plain":
                opts = ProgramOptions(arch=_arch(i), **extra)  # type: ignore[arg-type]
                Program(_kernel(i), "c++", options=opts).compile("cubin", cache=cache)
            else:
                opts = ProgramOptions(arch=_arch(i), include_path=[str(tmp_path / "inc")], **extra)  # type: ignore[arg-type]
                cache.compile(_kernel(i, header=True), "c++", opts, "cubin")

        for i in range(KERNELS):
            run(i)
        for i in range(KERNELS):
            run(i, **{option: value})
        misses = _misses(cache.path, KERNELS)
    assert len(misses) == KERNELS
    assert [(m.via, m.verdict, m.inputs, m.summary) for m in misses] == [(via, "changed", ("option",), words)] * KERNELS


def test_through_the_switch_the_added_option_is_named_and_a_file_in_the_include_directory_too(tmp_path: Path) -> None:
    """The switch sends header-free kernels to ``Program.compile(cache=)``, the others to the front door."""
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "v.h").write_text("#define V 3\n")
    job = (
        "import sys\n"
        "from cuda.core import Program, ProgramOptions\n"
        "from test_explain_variants import KERNELS, _arch, _kernel\n"
        "extra = {'lineinfo': True} if sys.argv[2] == 'lineinfo' else {}\n"
        "for i in range(KERNELS):\n"
        "    front = i % 2 == 1\n"
        "    opts = ProgramOptions(arch=_arch(i), include_path=[sys.argv[1]] if front else None, **extra)\n"
        "    Program(_kernel(i, header=front), 'c++', options=opts).compile('cubin')\n"
    )
    tests = str(Path(__file__).parent)  # where the job imports this file's kernels from
    env = {**os.environ, "CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "c"), "PYTHONPATH": tests}

    def run(extra: str) -> None:
        args = [sys.executable, "-c", job, str(inc), extra]
        subprocess.run(args, env=env, check=True, timeout=300, cwd=tmp_path)

    run("")
    run("lineinfo")
    misses = _misses(tmp_path / "c", KERNELS)
    assert sorted(m.via for m in misses) == ["front"] * 6 + ["plain"] * 6
    assert {(m.verdict, m.inputs, m.summary) for m in misses} == {("changed", ("option",), ADDED["lineinfo"][1])}, (
        misses
    )
    (inc / "new.txt").write_text("")  # a file no lookup would find: nothing NVRTC reads can change
    run("lineinfo")  # every kernel hits, the front door's too
    assert len(_misses(tmp_path / "c", KERNELS * 3)) == KERNELS * 2  # the first two runs' misses only
    (inc / "v.h").write_text("#define V 4\n")  # an edit: every front variant fails on it
    time.sleep(0.02)  # a header's ctime must be older than the compile that reads it (else not stored)
    run("lineinfo")  # the plain kernels hit; the front door's recompile
    misses = _misses(tmp_path / "c", 6)
    want = ("front", "changed", ("header",), str(inc / "v.h"))
    assert [(m.via, m.verdict, m.inputs, m.path) for m in misses] == [want] * 6
    assert all("removed since" not in m.summary and str(inc) in m.summary for m in misses), misses


HEADER_KERNEL = '#include "a.h"\nextern "C" __global__ void k(int* x) { *x = A; }\n'
#: The same kernel naming its header through a macro: the record cannot see the name, so it guards directories.
COMPUTED_KERNEL = '#define HEADER "a.h"\n#include HEADER\nextern "C" __global__ void k(int* x) { *x = A; }\n'


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    work, inc0, inc1 = tmp_path / "work", tmp_path / "inc0", tmp_path / "inc1"
    for d in (work, inc0, inc1):
        d.mkdir()
    (inc1 / "a.h").write_text("#define A 1\n")
    monkeypatch.chdir(work)  # the quoted include searches the source's directory, the working directory, first
    return {"work": work, "inc0": inc0, "inc1": inc1, "root": tmp_path}


def _front(cache: ContentAddressedProgramCache, tree: dict[str, Path], code: str = HEADER_KERNEL) -> None:
    opts = ProgramOptions(arch="sm_80", include_path=[str(tree["inc0"]), str(tree["inc1"])])
    cache.compile(code, "c++", opts, "cubin")


@pytest.mark.parametrize("where", ["inc0", "work"])
def test_a_guard_miss_names_the_directory_whose_listing_changed_never_a_removed_entry(
    tree: dict[str, Path], where: str
) -> None:
    with ContentAddressedProgramCache(tree["root"] / "c") as cache:
        _front(cache, tree)
        (tree[where] / "unrelated.txt").write_text("")  # a name no lookup tries: a hit
        _front(cache, tree)
        assert cache.counters()["hits"] == 1
        _front(cache, tree, COMPUTED_KERNEL)
        _front(cache, tree, COMPUTED_KERNEL)
        assert cache.counters()["hits"] == 2
        (tree[where] / "unrelated2.txt").write_text("")  # nothing read moves: the directory guard alone fails
        _front(cache, tree, COMPUTED_KERNEL)
        assert cache.counters()["misses"] == 3
    miss = _misses(cache.path, 1)[0]
    directory = str(tree[where])
    assert (miss.verdict, miss.inputs, miss.path) == ("changed", ("directory",), directory), miss
    listing = "an entry was added, removed or renamed (the headers read are the same)"
    assert miss.summary == f"directory {directory}: {listing}"
    assert miss.reason == f"directory {directory} changed (a header may now be found elsewhere)"
    out = json.loads(
        subprocess.run(
            [sys.executable, "-m", "cuda_program_cas", "explain", cache.path, "--json", "--last", "1"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    (shown,) = out["misses"]
    assert (shown["inputs"], shown["path"], shown["summary"], shown["reason"]) == (
        ["directory"],
        directory,
        miss.summary,
        miss.reason,
    )


def test_a_guard_miss_that_found_a_new_header_names_the_path_that_appeared(tree: dict[str, Path]) -> None:
    with ContentAddressedProgramCache(tree["root"] / "c") as cache:
        _front(cache, tree)
        (tree["inc0"] / "a.h").write_text("#define A 1\n")  # the same bytes, found first now
        time.sleep(0.02)  # a header's ctime must be older than the compile that reads it (else not stored)
        _front(cache, tree)
    miss = _misses(cache.path, 1)[0]
    inc0, inc1 = tree["inc0"], tree["inc1"]
    assert (miss.verdict, miss.inputs, miss.path) == ("changed", ("header",), f"{inc0}/a.h")
    assert miss.summary == f"header a.h: now found at {inc0}/a.h, was {inc1}/a.h (same content)"
    assert miss.reason == f"{inc0}/a.h appeared, where NVRTC looks before a header it read"


def test_a_header_changed_back_to_a_content_pushed_out_of_its_record_is_named_not_removed(
    tree: dict[str, Path],
) -> None:
    """Five contents fill the record's four variants; the first again misses on the header, as the front door found."""
    header = tree["inc1"] / "a.h"
    with ContentAddressedProgramCache(tree["root"] / "c") as cache:
        for value in (1, 2, 3, 4, 5, 1):
            header.write_text(f"#define A {value}\n")
            time.sleep(0.02)  # a header's ctime must be older than the compile that reads it (else not stored)
            _front(cache, tree)
    miss = _misses(cache.path, 1)[0]
    assert (miss.verdict, miss.inputs, miss.path) == ("changed", ("header",), str(header)), miss
    assert miss.summary == f"header {header}: content changed"
    assert miss.reason == f"header {header} changed"


def _record(i: int, t: float, code: str, options: list[str], why: dict[str, str] | None = None) -> MissRecord:
    inputs = {"code": code, "code_type": "c++", "target": "cubin", "options": options, "names": [], "nvrtc": "13.0"}
    return MissRecord(f"{i:04x}", t, 0.1, "plain", inputs, why)


_ARCHES = ["-arch=sm_80", "-arch=sm_86", "-arch=sm_90"]
_EXTRA = ["--generate-line-info", "--maxrregcount=32", "-ftz=true", "--std=c++17", "--define-macro=FOO"]


@settings(max_examples=200, deadline=None)
@given(
    arches=st.lists(st.sampled_from(_ARCHES), min_size=2, max_size=12),
    added=st.sampled_from(_EXTRA),
    order=st.randoms(use_true_random=False),
)
def test_property_each_kernel_is_compared_with_its_own_earlier_compile(
    arches: list[str], added: str, order: object
) -> None:
    """Kernels compiled once each (any -arch mix), then again with one option added, in any order: that option."""
    earlier = [_record(i, i, f"code{i}", [arch]) for i, arch in enumerate(arches)]
    again = [_record(100 + i, 100 + i, f"code{i}", [arch, added]) for i, arch in enumerate(arches)]
    order.shuffle(again)  # type: ignore[attr-defined]
    records = earlier + again
    name = added if added.startswith("--define-macro=") else added.partition("=")[0]  # a macro is named by its name
    for at in range(len(earlier), len(records)):
        miss = explain_one(records[at], records[:at])
        assert (miss.verdict, miss.inputs) == ("changed", ("option",)), miss
        assert miss.summary.startswith(f"option {name} added"), miss


@settings(max_examples=100, deadline=None)
@given(
    kind=st.sampled_from([DIRECTORY_CHANGED, HEADER_CHANGED, "shadowed"]),
    path=st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1, max_size=30).map(lambda p: "/" + p),
    before=st.integers(0, 4),
)
def test_property_a_failed_check_with_the_same_inputs_is_never_a_removed_entry(
    kind: str, path: str, before: int
) -> None:
    """Whatever earlier records hold the same inputs, a failed check is reported by its path."""
    why = {"kind": kind, "path": path, "text": f"{kind} {path}"}
    records = [_record(0, t, "code", ["-arch=sm_80"]) for t in range(before)]
    miss = explain_one(_record(0, before, "code", ["-arch=sm_80"], why), records)
    assert miss.verdict == "changed" and miss.path == path, miss
    assert "removed since" not in miss.summary and path in miss.summary, miss


def test_three_options_changed_on_the_same_code_are_named_not_new() -> None:
    """Against its own earlier variant, any number of differences is named; ``new`` is for code never compiled."""
    before = _record(0, 0, "code", ["-arch=sm_80"])
    miss = explain_one(_record(1, 1, "code", ["-arch=sm_90", "--std=c++17", "--define-macro=FOO"]), [before])
    assert (miss.verdict, miss.inputs, miss.nearest) == ("several", ("option",) * 3, before.key_id), miss
    other = explain_one(_record(2, 2, "other", ["-arch=sm_90", "--std=c++17", "--define-macro=FOO"]), [before])
    assert other.verdict == "new", other
