"""The one list of what the cache puts on disk (``FILES`` in cas/_disk/layout.py), held to the disk and to the docs.

Real compiles (``Program.compile(cache=)``, the front door with a header, a link through
nvJitLink), a write in flight, a claim, a damaged blob read, write-back to a writable
directory store, ``publish`` loose and packed, ``repack``, ``verify --repair`` of a damaged
pack, ``gc`` and a stored setting each leave their files; every path they leave must match
a pattern of the list, and every pattern must be met by one of them (or be named below as
not made here, with why), so that neither the list nor the disk drifts. docs/design.md's
layout specification names exactly the list's patterns, in its order.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from conftest import REPO, SAXPY, compile_program
from cuda.core import LinkerOptions, Program, ProgramOptions

import cuda_program_cas
from cuda_program_cas import CacheStore, ContentAddressedProgramCache, digest_of
from cuda_program_cas._disk.atomic import atomic_write
from cuda_program_cas._disk.layout import FILES, Layout
from cuda_program_cas._local import journal
from cuda_program_cas.index import key_id


def _pattern_re(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"(<\d+ hex>|<digits>|\*)", pattern)
    out = []
    for part in parts:
        if part == "<digits>":
            out.append("[0-9]+")
        elif part == "*":
            out.append("[^/]*")
        elif (m := re.fullmatch(r"<(\d+) hex>", part)) is not None:
            out.append(f"[0-9a-f]{{{m.group(1)}}}")
        else:
            out.append(re.escape(part))
    return re.compile("".join(out))


_FILE_RES = tuple((_pattern_re(pattern), pattern) for pattern, _ in FILES)


def file_kind(relpath: str) -> str | None:
    """The pattern of :data:`FILES` that ``relpath`` (``/`` separated, a directory ending in ``/``) matches, or None."""
    for regex, pattern in _FILE_RES:
        if regex.fullmatch(relpath):
            return pattern
    return None


#: Patterns of FILES that no step here makes, each with why (none today).
NOT_MADE_HERE: dict[str, str] = {}

CALLER = r'extern "C" __device__ int f(int x); extern "C" __global__ void k(int *p) { p[0] = f(p[1]); }'
CALLEE = r'extern "C" __device__ int f(int x) { return x * 3 + 1; }'


def paths_under(root: Path) -> set[str]:
    """Every path below ``root``, ``/`` separated, directories ending in ``/``."""
    found = set()
    for here, dirs, files in os.walk(root):
        rel = Path(here).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        found.update(prefix + d + "/" for d in dirs)
        found.update(prefix + f for f in files)
    return found


class Seen:
    """What the steps left, root by root, and which patterns those paths matched."""

    def __init__(self) -> None:
        self.unmatched: list[str] = []
        self.kinds: set[str] = set()

    def look(self, root: Path) -> None:
        for rel in sorted(paths_under(root)):
            kind = file_kind(rel)
            if kind is None:
                self.unmatched.append(f"{root.name}/{rel}")
            else:
                self.kinds.add(kind)


def ltoir(source: str) -> object:
    options = ProgramOptions(arch="sm_80", relocatable_device_code=True, link_time_optimization=True)
    return Program(source, "c++", options=options).compile("ltoir")


def test_every_file_real_operations_leave_is_in_the_list_and_every_entry_is_met(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_PROGRAM_CAS_JOB", "layout")  # the write-back below leaves the job's warm set
    seen = Seen()
    local, store, packed = tmp_path / "local", tmp_path / "store", tmp_path / "packed"
    CacheStore(store).close()  # a directory store, laid out, that nodes write back to
    headers = tmp_path / "include"
    headers.mkdir()
    (headers / "twice.h").write_text("#define TWICE(x) (2 * (x))\n")
    source = '#include "twice.h"\nextern "C" __global__ void k(int *p) { p[0] = TWICE(p[1]); }\n'

    with ContentAddressedProgramCache(local, shared=[f"{store}|write"]) as cache:
        saxpy = bytes(compile_program(SAXPY, cache=cache).code)  # a plain entry
        compile_program(SAXPY, cache=cache, arch="sm_90")
        options = ProgramOptions(arch="sm_80", include_path=[str(headers)])
        cache.compile(source, "c++", options, "cubin")  # a front-door record and its result
        cache.link([ltoir(CALLER), ltoir(CALLEE)], LinkerOptions(arch="sm_80", link_time_optimization=True), "cubin")
        lay = Layout(str(local))

        # A write in flight: the writer's temp file, seen from inside the write.
        def chunks():
            yield b"part one"
            seen.look(local)
            yield b"part two"

        assert atomic_write(os.path.join(lay.root, "counters-copy-target"), chunks(), lay.tmp)
        os.unlink(os.path.join(lay.root, "counters-copy-target"))  # the test's own file, not the cache's
        # A claim held: another process of the node compiling the key meanwhile would wait on it.
        with cache.store.inner.claim(key_id(b"being compiled")):
            seen.look(local)
    # A blob damaged on disk: the read moves it to quarantine/.
    digest = digest_of(saxpy)
    blob = local / "blobs" / digest[:2] / digest[2:]
    blob.write_bytes(b"\0" + blob.read_bytes()[1:])
    with ContentAddressedProgramCache(local) as cache:
        for _ in range(2):
            compile_program(SAXPY, cache=cache)
            compile_program(SAXPY, cache=cache, arch="sm_90")
    # The miss journal rotating (misses.1): its bound lowered so that the next miss passes it.
    monkeypatch.setattr(journal, "MAX_BYTES", 1)
    with ContentAddressedProgramCache(local) as cache:
        compile_program(SAXPY, cache=cache, arch="sm_75")
    monkeypatch.undo()
    cuda_program_cas.config(local, max_size=10 << 30)  # settings.json
    cuda_program_cas.collect(local)
    assert list((local / "quarantine").iterdir()), "the damaged blob was not quarantined"

    # A packed store: two publishes, a repack (the replaced packs retire), a damaged pack repaired.
    for _ in range(2):
        cuda_program_cas.publish([local, store], packed, pack=True)
        with ContentAddressedProgramCache(store) as writer:  # a new entry for the next pack
            compile_program(SAXPY, cache=writer, arch=f"sm_{86 + len(list((packed / 'packs').glob('*.cpk')))}")
    cuda_program_cas.repack(packed)
    cuda_program_cas.publish([local], tmp_path / "loose")  # a loose shared store
    cuda_program_cas.publish([store], packed, pack=True)
    newest = sorted((packed / "packs").glob("pack-*.cpk"))[-1]
    with open(newest, "r+b") as f:
        f.seek(40)
        f.write(b"\xff" * 16)
    cuda_program_cas.verify(packed, repair=True)
    cuda_program_cas.collect(packed, grace_s=3600.0)

    for root in (local, store, packed, tmp_path / "loose"):
        seen.look(root)
    assert seen.unmatched == [], "paths the list in cas/_disk/layout.py does not name"
    patterns = [pattern for pattern, _ in FILES]
    assert set(NOT_MADE_HERE) <= set(patterns)
    missing = [p for p in patterns if p not in seen.kinds and p not in NOT_MADE_HERE]
    assert missing == [], "entries of the list that no step made: stale, or the test lacks a step"


def test_the_list_matches_only_its_own_shapes() -> None:
    assert file_kind("blobs/ab/" + "c" * 62) == "blobs/<2 hex>/<62 hex>"
    assert file_kind("blobs/ab/" + "c" * 61) is None
    assert file_kind("blobs/AB/" + "c" * 62) is None  # lowercase hex only
    assert file_kind("tmp/123-0123456789abcdef.tmp") == "tmp/<digits>-<16 hex>.tmp"
    assert file_kind("tmp/x-0123456789abcdef.tmp") is None
    assert file_kind("index/ab") is None and file_kind("index/ab/") == "index/<2 hex>/"
    assert file_kind("notes.txt") is None and file_kind("entries/") is None  # a FileStream directory's


def spec_patterns() -> list[str]:
    """The patterns docs/design.md's layout specification names: the first column of its block."""
    text = (REPO / "docs" / "design.md").read_text()
    section = text.split("\n## The layout on disk\n", 1)[1]
    block = re.search(r"\n```text\n(.*?)\n```\n", section, re.DOTALL)
    assert block is not None, "docs/design.md: no layout block under 'The layout on disk'"
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    assert lines[0].strip() == "<root>/"
    return [re.split(r"\s{2,}", line.strip(), maxsplit=1)[0] for line in lines[1:]]


def test_the_design_s_layout_specification_names_exactly_the_list() -> None:
    assert spec_patterns() == [pattern for pattern, _ in FILES]
