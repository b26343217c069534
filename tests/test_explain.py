"""``explain``: every miss of a matrix of single-input changes is put down to the input that changed.

Real NVRTC compiles, through ``Program.compile(cache=)`` and ``cache.compile``, into
a real cache; the journal they write is what ``explain`` reads. This environment
has one NVRTC (13, from the cu13 extra), so a version change is injected where
each key takes NVRTC's version: cuda-core's own probe for a plain key (the key
made changes as with a real upgrade), the front door's ``nvrtcver`` for its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cuda.core import Program, ProgramOptions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuda_program_cas
from cuda_program_cas import ContentAddressedProgramCache, explain
from cuda_program_cas._local.journal import DROPPED

KERNEL = 'extern "C" __global__ void k(int* x) { *x = 1; }'


def _plain(cache: ContentAddressedProgramCache, code: str = KERNEL, **options: object) -> None:
    opts = ProgramOptions(**{"arch": "sm_80", **options})  # type: ignore[arg-type]
    Program(code, "c++", options=opts).compile("cubin", cache=cache)


def _last(cache: ContentAddressedProgramCache) -> cuda_program_cas.MissExplanation:
    report = explain(cache.path, last=1)
    assert report.misses, "no miss was journaled"
    return report.misses[-1]


@pytest.mark.parametrize(
    ("change", "kind", "words"),
    [
        ({"define_macro": "FOO"}, "option", "--define-macro=FOO added"),
        ({"define_macro": ("FOO", "2")}, "option", "--define-macro=FOO"),
        ({"arch": "sm_90"}, "option", "-arch: sm_80 -> sm_90"),
        ({"std": "c++17"}, "option", "--std added: c++17"),
        ({"lineinfo": True}, "option", "--generate-line-info added"),
        ({"code": KERNEL.replace("1;", "2;")}, "code", "code changed"),
    ],
)
def test_a_plain_miss_names_the_one_option_or_the_code_that_changed(
    tmp_path: Path, change: dict[str, object], kind: str, words: str
) -> None:
    with ContentAddressedProgramCache(tmp_path / "c") as cache:
        _plain(cache)
        _plain(cache)  # a hit: journals nothing
        assert explain(cache.path).recorded == 1
        _plain(cache, **change)  # type: ignore[arg-type]
        miss = _last(cache)
    assert miss.verdict == "changed", miss
    assert miss.inputs == (kind,)
    assert words in miss.summary, miss.summary
    assert miss.via == "plain"
    assert miss.compile_seconds > 0


def test_a_plain_miss_after_an_nvrtc_upgrade_names_the_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda.core.utils._program_cache import _keys

    with ContentAddressedProgramCache(tmp_path / "c") as cache:
        _plain(cache)
        real = _keys._nvrtc_version()
        monkeypatch.setattr(_keys, "_nvrtc_version", lambda: (real[0], real[1] + 1))  # the key's probe
        _plain(cache)
        miss = _last(cache)
    assert miss.inputs == ("nvrtc",)
    assert f"nvrtc: {real[0]}.{real[1]} -> {real[0]}.{real[1] + 1}" == miss.summary


def test_a_first_compile_is_new_and_the_same_inputs_again_say_their_entry_went(tmp_path: Path) -> None:
    with ContentAddressedProgramCache(tmp_path / "c") as cache:
        _plain(cache)
        first = _last(cache)
        cache.clear()
        _plain(cache)
        again = _last(cache)
        _plain(cache, code=KERNEL.replace("1;", "3;"), arch="sm_90", std="c++17", define_macro="X")
        unlike = _last(cache)
    assert first.verdict == "new" and first.nearest is None
    assert again.verdict == "same" and again.nearest == first.key_id
    assert unlike.verdict == "new" and "differs in 4 inputs" in unlike.summary


def test_two_changes_at_once_are_both_named(tmp_path: Path) -> None:
    with ContentAddressedProgramCache(tmp_path / "c") as cache:
        _plain(cache)
        _plain(cache, arch="sm_90", std="c++17")
        miss = _last(cache)
    assert miss.verdict == "several"
    assert sorted(miss.inputs) == ["option", "option"]
    assert "-arch: sm_80 -> sm_90" in miss.summary and "--std added" in miss.summary


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    inc0, inc1, extra = tmp_path / "inc0", tmp_path / "inc1", tmp_path / "extra"
    for d in (inc0, inc1, extra):
        d.mkdir()
    (inc1 / "a.h").write_text("#define A 1\n")
    (inc1 / "b.h").write_text("#define B 2\n")
    return {"inc0": inc0, "inc1": inc1, "extra": extra, "root": tmp_path}


HEADER_KERNEL = (
    '#include "a.h"\n#if __has_include("b.h")\n#include "b.h"\n#else\n#define B 0\n#endif\n'
    'extern "C" __global__ void k(int* x) { *x = A + B; }\n'
)


def _front(cache: ContentAddressedProgramCache, includes: list[str], **options: object) -> None:
    opts = ProgramOptions(**{"arch": "sm_80", "include_path": includes, **options})  # type: ignore[arg-type]
    cache.compile(HEADER_KERNEL, "c++", opts, "cubin")


def _edit(path: Path, text: str) -> None:
    path.write_text(text)
    time.sleep(0.02)  # a header's ctime must be older than the compile that reads it (else not stored)


def test_front_door_misses_name_each_header_option_and_version_change(
    tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cuda_program_cas._cuda import frontdoor, nvrtcver

    inc0, inc1, extra = str(tree["inc0"]), str(tree["inc1"]), str(tree["extra"])
    includes = [inc0, inc1]
    with ContentAddressedProgramCache(tree["root"] / "c") as cache:
        _front(cache, includes)
        _front(cache, includes)  # a hit
        seen = []

        def step() -> cuda_program_cas.MissExplanation:
            miss = _last(cache)
            seen.append(miss)
            return miss

        _edit(tree["inc1"] / "a.h", "#define A 5\n")
        _front(cache, includes)
        miss = step()
        assert (miss.inputs, miss.summary) == (("header",), f"header {inc1}/a.h: content changed")

        _edit(tree["inc0"] / "a.h", "#define A 7\n")  # found first now: shadows inc1/a.h
        _front(cache, includes)
        miss = step()
        assert miss.inputs == ("header",)
        assert miss.summary == f"header a.h: now found at {inc0}/a.h, was {inc1}/a.h (other content)"

        (tree["inc1"] / "b.h").unlink()
        time.sleep(0.02)
        _front(cache, includes)
        miss = step()
        assert (miss.inputs, miss.summary) == (
            ("header",),
            f"header {inc1}/b.h: no longer read (removed, or no longer included)",
        )

        _front(cache, [*includes, extra])  # a search directory added that holds nothing read
        miss = step()
        assert miss.inputs == ("search directory",)
        assert miss.summary.startswith("option --include-path: ")

        _front(cache, includes, define_macro="FOO")
        miss = step()
        assert (miss.inputs, miss.summary) == (("option",), "option --define-macro=FOO added: (set)")

        loaded = nvrtcver.loaded_version()
        major, minor = loaded.split(".")
        other = f"{major}.{int(minor) + 1}"
        monkeypatch.setattr(frontdoor, "nvrtc_version", lambda store: other)  # what the front door keys with
        monkeypatch.setattr(frontdoor, "loaded_nvrtc_version", lambda: other)  # and checks after compiling
        _front(cache, includes)
        miss = step()
        assert (miss.inputs, miss.summary) == (("nvrtc",), f"nvrtc: {loaded} -> {other}")
    assert all(m.via == "front" and m.verdict == "changed" for m in seen)


def test_a_front_door_miss_in_another_working_directory_names_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for project in ("p1", "p2"):  # the same relative tree, the same bytes
        (tmp_path / project / "inc").mkdir(parents=True)
        (tmp_path / project / "inc" / "a.h").write_text("#define A 1\n#define B 0\n")
    code = '#include "a.h"\nextern "C" __global__ void k(int* x) { *x = A + B; }\n'
    with ContentAddressedProgramCache(tmp_path / "c") as cache:
        for project in ("p1", "p2"):
            monkeypatch.chdir(tmp_path / project)
            cache.compile(code, "c++", ProgramOptions(arch="sm_80", include_path=["inc"]), "cubin")
        miss = _last(cache)
    assert miss.inputs == ("working directory",)
    assert miss.summary == f"working directory: {tmp_path}/p1 -> {tmp_path}/p2"


_OPTION_CHANGES = {
    "arch": st.sampled_from(["sm_75", "sm_86", "sm_90"]),
    "std": st.sampled_from(["c++11", "c++14", "c++17", "c++20"]),
    "define_macro": st.sampled_from(["FOO", ("FOO", "1"), "BAR"]),
    "lineinfo": st.just(True),
    "device_as_default_execution_space": st.just(True),
    "max_register_count": st.integers(16, 255),
    "ftz": st.booleans(),
}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_a_random_single_option_change_is_named(tmp_path: Path, data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(_OPTION_CHANGES)))
    value = data.draw(_OPTION_CHANGES[name])
    root = tmp_path / f"c{time.monotonic_ns()}"
    with ContentAddressedProgramCache(root) as cache:
        _plain(cache)
        _plain(cache, **{name: value})
        miss = _last(cache)
    assert miss.verdict == "changed" and miss.inputs == ("option",), (name, value, miss)
    shutil.rmtree(root)


def test_a_journal_that_cannot_be_written_costs_no_compile(tmp_path: Path) -> None:
    with ContentAddressedProgramCache(tmp_path / "c") as cache:
        os.mkdir(os.path.join(cache.path, "misses"))  # a directory where the journal goes
        before = DROPPED.count
        _plain(cache)
        assert cache.get is not None and cache.counters()["writes"] == 1
        assert DROPPED.count == before + 1
        os.rmdir(os.path.join(cache.path, "misses"))
    assert explain(cache.path).recorded == 0


def test_the_journal_is_bounded_and_kept_by_the_maintenance_verbs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cuda_program_cas._local import journal

    monkeypatch.setattr(journal, "MAX_BYTES", 600)
    with ContentAddressedProgramCache(tmp_path / "c") as cache:
        for i in range(6):
            _plain(cache, define_macro=("N", str(i)))
    root = Path(cache.path)
    assert (root / "misses.1").is_file()
    sizes = [(root / name).stat().st_size for name in ("misses", "misses.1") if (root / name).exists()]
    assert sum(sizes) <= 2 * 600 + 600
    report = explain(root, last=100)
    assert 2 <= report.recorded < 6
    for verb in ("gc", "verify", "stats"):
        done = subprocess.run(
            [sys.executable, "-m", "cuda_program_cas", verb, str(root), "--json"], capture_output=True, text=True
        )
        assert done.returncode == 0, (verb, done.stdout, done.stderr)
        assert "misses" not in json.dumps(json.loads(done.stdout).get("problems", [])), verb
    assert (root / "misses.1").is_file()
    # The journal is one of the cache's own names: a cache whose layout.json was damaged
    # is repaired by a writable open, not refused as another program's directory.
    (root / "layout.json").write_text("{garbled")
    ContentAddressedProgramCache(root).close()
    assert json.loads((root / "layout.json").read_text())
    assert explain(root, last=100).recorded == report.recorded


def test_the_command_line_prints_each_miss_and_json(tmp_path: Path) -> None:
    with ContentAddressedProgramCache(tmp_path / "c") as cache:
        _plain(cache)
        _plain(cache, arch="sm_90")
    text = subprocess.run(
        [sys.executable, "-m", "cuda_program_cas", "explain", cache.path], capture_output=True, text=True, check=True
    ).stdout
    assert "new: no earlier compile of anything like it" in text
    assert "option -arch: sm_80 -> sm_90" in text
    assert text.splitlines()[-1].startswith("explained 2 misses of 2 recorded")
    out = json.loads(
        subprocess.run(
            [sys.executable, "-m", "cuda_program_cas", "explain", cache.path, "--json", "--last", "1"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert [m["inputs"] for m in out["misses"]] == [["option"]]


def test_a_compile_the_switch_sends_through_the_cache_is_explained(tmp_path: Path) -> None:
    job = (
        "import sys\n"
        "from cuda.core import Program, ProgramOptions\n"
        "Program(sys.argv[1], 'c++', options=ProgramOptions(arch=sys.argv[2])).compile('cubin')\n"
    )
    env = {**os.environ, "CUDA_PROGRAM_CAS": "1", "CUDA_PROGRAM_CAS_DIR": str(tmp_path / "c")}
    for arch in ("sm_80", "sm_86"):
        subprocess.run([sys.executable, "-c", job, KERNEL, arch], env=env, check=True, timeout=120)
    miss = _last_of(tmp_path / "c")
    assert (miss.via, miss.inputs, miss.summary) == ("plain", ("option",), "option -arch: sm_80 -> sm_86")


def _last_of(root: Path) -> cuda_program_cas.MissExplanation:
    return explain(root, last=1).misses[-1]
