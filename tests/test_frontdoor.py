"""``cache.compile(...)``: header-aware keys and name expressions, with real NVRTC.

Every hit is checked against an uncached compile of the same inputs (bytes, name
and symbol mapping) and proven not to run NVRTC (cuda-core's compile seam counts
every real compile). Headers are small files in ``tmp_path``; the CCCL test uses
the ``nvidia-cuda-cccl`` wheel's headers (or the toolkit's), and skips without them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import Compiles, cccl_or_skip
from cuda.core import Program, ProgramOptions
from testkit.common import CUB_SOURCE

from cuda_program_cas import ContentAddressedProgramCache

SOURCE = r"""
#include "config.h"
extern "C" __global__ void fill(int *out) { *out = CONFIG_VALUE + PRE_VALUE; }
template <class T> __global__ void twice(T *p) { *p = *p + *p; }
"""
NAMES = ("twice<float>", "twice<int>")


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """Two include directories (``first`` is searched before ``second``) and a pre-include file."""
    first, second, pre = tmp_path / "first", tmp_path / "second", tmp_path / "pre"
    for d in (first, second, pre):
        d.mkdir()
    (second / "config.h").write_text("#pragma once\n#define CONFIG_VALUE 1\n")
    (pre / "pre.h").write_text("#define PRE_VALUE 10\n")
    return {"first": first, "second": second, "pre": pre / "pre.h"}


def options(tree: dict[str, Path], **extra: object) -> ProgramOptions:
    return ProgramOptions(
        arch="sm_80",
        include_path=[str(tree["first"]), str(tree["second"])],
        pre_include=str(tree["pre"]),
        **extra,
    )


def uncached(tree: dict[str, Path], names: tuple[str, ...] = NAMES, **extra: object):
    return Program(SOURCE, "c++", options=options(tree, **extra)).compile("cubin", names)


def settle(path: Path) -> None:
    """Wait until the file system's clock is past the ctime of ``path`` and of its directory.

    The front door does not store a result whose headers or guard directories changed
    at or after the moment its compile began (NVRTC may have read other bytes, or
    searched before an entry came); an edit made in the same clock tick as the compile
    is such a change. Tests that edit a header and compile at once wait for the next
    tick (a few ms), as a person editing does. The clock is read from a probe file that
    already exists elsewhere on the same file system (its own directory does not change):
    a probe made next to the header would change that directory, a guard, at the last moment.
    """
    target = max(path.stat().st_ctime_ns, path.parent.stat().st_ctime_ns)
    probe = _clock_probe(path.parent)
    for _ in range(100_000):
        os.utime(probe)
        if probe.stat().st_mtime_ns > target:
            return
    raise AssertionError("the file system clock did not advance")


_PROBES: dict[int, Path] = {}


def _clock_probe(near: Path) -> Path:
    """A file on the file system of ``near``, made once per device and process, in a directory of its own."""
    device = near.stat().st_dev
    probe = _PROBES.get(device)
    if probe is None or not probe.exists():
        base = Path(tempfile.gettempdir())
        if base.stat().st_dev != device:
            base = near.parent if near.parent.stat().st_dev == device else near
        made = tempfile.mkdtemp(prefix="cpcas-test-clock-", dir=base)
        atexit.register(shutil.rmtree, made, True)
        probe = Path(made) / "clock"
        probe.write_bytes(b"")
        _PROBES[device] = probe
    return probe


def assert_same(obj, reference) -> None:
    assert bytes(obj.code) == bytes(reference.code)
    assert obj.name == reference.name
    assert obj.symbol_mapping == reference.symbol_mapping
    assert obj.code_type == reference.code_type


def test_a_hit_equals_the_uncached_compile_and_runs_no_nvrtc(
    tmp_path: Path, tree: dict[str, Path], compiles: Compiles
) -> None:
    reference = uncached(tree)
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    first = cache.compile(SOURCE, "c++", options(tree), "cubin", name_expressions=NAMES)
    assert compiles.count == 2  # the reference and the miss
    assert_same(first, reference)
    fresh = ContentAddressedProgramCache(tmp_path / "cas")  # a new instance: nothing in memory
    hit = fresh.compile(SOURCE, "c++", options(tree), "cubin", name_expressions=NAMES)
    assert compiles.count == 2
    assert_same(hit, reference)
    assert hit.symbol_mapping["twice<float>"] == reference.symbol_mapping["twice<float>"]


def test_one_process_tells_apart_inputs_that_differ_in_one_thing(
    tmp_path: Path, tree: dict[str, Path], compiles: Compiles
) -> None:
    # Within a process the front door remembers the keys of inputs it met; a change
    # of any one input (an option, even on the same options object, the target,
    # the name expressions' type, the code) must still find that input's own entry.
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    opts = options(tree, define_macro=[("EXTRA", "1")])
    cases = [
        (SOURCE, opts, "cubin", NAMES),
        (SOURCE, options(tree, define_macro=[("EXTRA", "2")]), "cubin", NAMES),
        (SOURCE, options(tree, define_macro=[("EXTRA", "1")], std="c++17"), "cubin", NAMES),
        (SOURCE, opts, "ltoir", NAMES),
        (SOURCE, opts, "cubin", tuple(n.encode() for n in NAMES)),
        (SOURCE + "\n// another kernel text\n", opts, "cubin", NAMES),
    ]
    references = [Program(code, "c++", options=o).compile(t, n) for code, o, t, n in cases]
    for _ in range(2):  # misses, then hits, each against its own uncached compile
        for (code, o, t, n), reference in zip(cases, references, strict=True):
            assert_same(cache.compile(code, "c++", o, t, name_expressions=n), reference)
    assert compiles.count == 2 * len(cases)  # the references and one miss each
    opts.define_macro = [("EXTRA", "2")]  # the same object, changed: the entry of case 2
    assert_same(cache.compile(SOURCE, "c++", opts, "cubin", name_expressions=NAMES), references[1])
    assert compiles.count == 2 * len(cases)


def test_editing_a_header_misses_even_with_size_and_mtime_put_back(
    tmp_path: Path, tree: dict[str, Path], compiles: Compiles
) -> None:
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    cache.compile(SOURCE, "c++", options(tree), "cubin")
    header = tree["second"] / "config.h"
    st = header.stat()
    header.write_text("#pragma once\n#define CONFIG_VALUE 2\n")  # same size
    os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert header.stat().st_size == st.st_size and header.stat().st_mtime_ns == st.st_mtime_ns
    settle(header)
    edited = cache.compile(SOURCE, "c++", options(tree), "cubin")
    assert compiles.count == 2
    assert_same(edited, uncached(tree, ()))
    again = cache.compile(SOURCE, "c++", options(tree), "cubin")  # now a hit of the new variant
    assert compiles.count == 3  # the reference above only
    assert bytes(again.code) == bytes(edited.code)


def test_touching_a_header_with_the_same_bytes_still_hits(
    tmp_path: Path, tree: dict[str, Path], compiles: Compiles
) -> None:
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    first = cache.compile(SOURCE, "c++", options(tree), "cubin")
    header = tree["second"] / "config.h"
    header.write_bytes(header.read_bytes())  # rewritten in place, same bytes
    os.utime(header, ns=(1, 1))
    hit = ContentAddressedProgramCache(tmp_path / "cas").compile(SOURCE, "c++", options(tree), "cubin")
    assert compiles.count == 1
    assert bytes(hit.code) == bytes(first.code)


def test_a_new_header_in_an_earlier_include_directory_is_seen(
    tmp_path: Path, tree: dict[str, Path], compiles: Compiles
) -> None:
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    old = cache.compile(SOURCE, "c++", options(tree), "cubin")
    (tree["first"] / "config.h").write_text("#pragma once\n#define CONFIG_VALUE 7\n")  # found first now
    new = cache.compile(SOURCE, "c++", options(tree), "cubin")
    assert compiles.count == 2
    assert bytes(new.code) != bytes(old.code)
    assert_same(new, uncached(tree, ()))


def test_editing_the_pre_include_file_is_seen(tmp_path: Path, tree: dict[str, Path], compiles: Compiles) -> None:
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    old = cache.compile(SOURCE, "c++", options(tree), "cubin")
    tree["pre"].write_text("#define PRE_VALUE 20\n")
    new = cache.compile(SOURCE, "c++", options(tree), "cubin")
    assert compiles.count == 2
    assert bytes(new.code) != bytes(old.code)
    assert_same(new, uncached(tree, ()))


def test_headers_next_to_a_named_source_are_keyed(tmp_path: Path, compiles: Compiles) -> None:
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    (src_dir / "config.h").write_text("#define CONFIG_VALUE 3\n#define PRE_VALUE 0\n")
    opts = ProgramOptions(arch="sm_80", name=str(src_dir / "kernel.cu"))
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    old = cache.compile(SOURCE, "c++", opts, "cubin")
    cache.compile(SOURCE, "c++", opts, "cubin")
    assert compiles.count == 1
    (src_dir / "config.h").write_text("#define CONFIG_VALUE 4\n#define PRE_VALUE 0\n")
    new = cache.compile(SOURCE, "c++", opts, "cubin")
    assert compiles.count == 2 and bytes(new.code) != bytes(old.code)


def test_a_deleted_header_or_directory_misses_with_the_compile_error(
    tmp_path: Path, tree: dict[str, Path], compiles: Compiles
) -> None:
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    cache.compile(SOURCE, "c++", options(tree), "cubin")
    (tree["second"] / "config.h").unlink()
    with pytest.raises(Exception) as uncached_error:
        uncached(tree, ())
    with pytest.raises(type(uncached_error.value)) as cached_error:
        cache.compile(SOURCE, "c++", options(tree), "cubin")
    assert "config.h" in str(cached_error.value)
    for path in tree["second"].iterdir():
        path.unlink()
    tree["second"].rmdir()
    with pytest.raises(type(uncached_error.value)):
        cache.compile(SOURCE, "c++", options(tree), "cubin")


def test_name_expressions_keep_their_type_and_share_the_blob_with_program_compile(
    tmp_path: Path, tree: dict[str, Path], compiles: Compiles
) -> None:
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    as_bytes = (b"twice<float>",)
    obj = cache.compile(SOURCE, "c++", options(tree), "cubin", name_expressions=as_bytes)
    hit = ContentAddressedProgramCache(tmp_path / "cas").compile(
        SOURCE, "c++", options(tree), "cubin", name_expressions=as_bytes
    )
    assert compiles.count == 1
    assert list(hit.symbol_mapping) == [b"twice<float>"] and hit.symbol_mapping == obj.symbol_mapping
    # Program.compile(cache=) of a source with no headers, and the front door, share equal bytes.
    plain = 'extern "C" __global__ void k(int *p) { *p = 11; }'
    opts = ProgramOptions(arch="sm_80")
    Program(plain, "c++", options=opts).compile("cubin", cache=cache)
    blobs = cache.stats().blobs
    front = cache.compile(plain, "c++", opts, "cubin")
    assert cache.stats().blobs == blobs + 1  # its record; the binary is the same blob
    assert cache.stats().dedup_writes >= 1
    assert bytes(front.code) == bytes(Program(plain, "c++", options=opts).compile("cubin").code)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("pch", True),
        ("use_pch", "x.pch"),
        ("pch_dir", "pchs"),
        ("create_pch", "x.pch"),
        ("time", "times.csv"),
        ("fdevice_time_trace", "trace"),
    ],
)
def test_options_that_cannot_be_keyed_are_refused_naming_the_option(
    tmp_path: Path, option: str, value: object, compiles: Compiles
) -> None:
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    with pytest.raises(ValueError, match=option):
        cache.compile(SOURCE, "c++", ProgramOptions(arch="sm_80", **{option: value}), "cubin")
    assert compiles.count == 0
    assert cache.stats().entries == 0


@pytest.mark.parametrize(
    ("args", "error"),
    [
        pytest.param(("c++", "cubin", (bytearray(b"twice<int>"),)), TypeError, id="bytearray-name-expression"),
        pytest.param(("fortran", "cubin", ()), ValueError, id="unknown-code-type"),
        pytest.param(("c++", "elf", ()), ValueError, id="unknown-target"),
    ],
)
def test_bad_input_gets_the_errors_program_would_raise(tmp_path: Path, args: tuple, error: type) -> None:
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    code_type, target, names = args
    with pytest.raises(error):
        cache.compile(SOURCE, code_type, ProgramOptions(arch="sm_80"), target, name_expressions=names)
    with pytest.raises(TypeError, match="ProgramOptions"):
        cache.compile(SOURCE, "c++", {"arch": "sm_80"}, "cubin")
    assert cache.stats().entries == 0


def test_a_read_only_cache_compiles_and_stores_nothing(tmp_path: Path, tree: dict[str, Path]) -> None:
    root = tmp_path / "cas"
    ContentAddressedProgramCache(root)
    before = sorted(str(p) for p in root.rglob("*"))
    obj = ContentAddressedProgramCache(root, read_only=True).compile(SOURCE, "c++", options(tree), "cubin")
    assert len(bytes(obj.code)) > 0
    assert sorted(str(p) for p in root.rglob("*")) == before


def test_entries_are_published_and_found_by_a_node(tmp_path: Path, tree: dict[str, Path], compiles: Compiles) -> None:
    from cuda_program_cas import publish, verify

    builder = ContentAddressedProgramCache(tmp_path / "builder")
    reference = builder.compile(SOURCE, "c++", options(tree), "cubin", name_expressions=NAMES)
    publish([tmp_path / "builder"], tmp_path / "store")
    assert verify(tmp_path / "store").problems == []
    node = ContentAddressedProgramCache(tmp_path / "node", shared=[tmp_path / "store"])
    hit = node.compile(SOURCE, "c++", options(tree), "cubin", name_expressions=NAMES)
    assert compiles.count == 1
    assert_same(hit, reference)
    assert node.stats().shared_hits == 1  # one compile, one count (its record and binary are internal)


@pytest.mark.slow
def test_a_cub_kernel_through_include_path(tmp_path: Path, compiles: Compiles) -> None:
    inc = cccl_or_skip()
    opts = ProgramOptions(arch="sm_80", std="c++17", include_path=[inc])
    cache = ContentAddressedProgramCache(tmp_path / "cas")
    first = cache.compile(CUB_SOURCE, "c++", opts, "cubin")
    hit = ContentAddressedProgramCache(tmp_path / "cas").compile(CUB_SOURCE, "c++", opts, "cubin")
    assert compiles.count == 1
    assert bytes(hit.code) == bytes(first.code) == bytes(Program(CUB_SOURCE, "c++", options=opts).compile("cubin").code)


_RACER = textwrap.dedent(
    """
    import sys
    from cuda.core import ProgramOptions
    from cuda_program_cas import ContentAddressedProgramCache
    root, first, second, pre, n = sys.argv[1:6]
    source = open(sys.argv[6]).read()
    opts = ProgramOptions(arch="sm_80", include_path=[first, second], pre_include=pre)
    cache = ContentAddressedProgramCache(root)
    import os
    for _ in range(int(n)):
        path = second + "/config.h"
        st = os.stat(path)
        ino, header = (st.st_ino, st.st_ctime_ns), open(path).read()
        obj = cache.compile(source, "c++", opts, "cubin")
        # The header is replaced whole (a new inode) each time: the same inode and ctime after the call
        # means it did not change at all while this process looked it up or compiled it.
        st = os.stat(path)
        same = (st.st_ino, st.st_ctime_ns) == ino and open(path).read() == header
        print(same and "same" or "changed", bytes(obj.code).hex(), header.split()[-1], flush=True)
    """
)


def test_processes_compiling_while_a_header_changes_never_get_a_result_of_other_headers(
    tmp_path: Path, tree: dict[str, Path]
) -> None:
    values = ("1", "2", "3")
    reference = {}
    for v in values:
        (tree["second"] / "config.h").write_text(f"#pragma once\n#define CONFIG_VALUE {v}\n")
        reference[v] = bytes(uncached(tree, ()).code).hex()
    assert len(set(reference.values())) == 3
    source = tmp_path / "source.cu"
    source.write_text(SOURCE)
    args = [str(tmp_path / "cas"), str(tree["first"]), str(tree["second"]), str(tree["pre"]), "6", str(source)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACER, *args], stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    lines: list[str] = []
    try:
        # The writer changes the header each time a racer reports a result: the
        # changes land while other racers compile, look up or store.
        for n in range(len(procs) * 6):
            proc = procs[n % len(procs)]
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, "a racer died"
            lines.append(line)
            value = values[n % 3]
            # Replaced whole, as an editor saves: a racer never reads half a header.
            staged = tmp_path / "config.h.new"
            staged.write_text(f"#pragma once\n#define CONFIG_VALUE {value}\n")
            os.replace(staged, tree["second"] / "config.h")
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            lines.extend(out.splitlines())
            assert proc.returncode == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()  # reaps it and closes its pipe
    for line in lines:
        state, code, value = line.split()
        if state == "same":  # the header did not change around the call: the result must be built from it
            assert code == reference[value], line
        else:
            assert code in reference.values(), line  # built from one of the headers, never a mix
    (tree["second"] / "config.h").write_text("#pragma once\n#define CONFIG_VALUE 2\n")
    final = ContentAddressedProgramCache(tmp_path / "cas").compile(SOURCE, "c++", options(tree), "cubin")
    assert bytes(final.code).hex() == reference["2"]
