"""The pack format on its own: what is written reads back, and no damage yields wrong bytes or an exception.

A pack holds each blob framed (zstd, :mod:`cuda_program_cas._base.frame`) or raw; a
reader tells them apart by the object's header, decodes bounded, and verifies the raw
digest: a bad frame is a miss (one line), the rest of the pack still reads.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from blake3 import blake3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_compressed import BAD

from cuda_program_cas._base import frame
from cuda_program_cas._disk.layout import Layout, create_layout
from cuda_program_cas._disk.pack import STREAM_ABOVE, PackError, PackReader, Stored, pack_chunks, write_pack
from cuda_program_cas._disk.packset import PackSet, list_packs
from cuda_program_cas._disk.writer import Writer
from cuda_program_cas._verbs.packs import verify_packs
from cuda_program_cas.index import key_id

ENTRIES = {f"k{i}": bytes([i % 7]) * (100 + 13 * (i % 7)) for i in range(300)}  # 7 distinct blobs


def entries() -> list[tuple[str, str, bytes]]:
    return [
        (key_id(k), blake3(v).hexdigest(), v, 1_700_000_000_000_000_000 + i) for i, (k, v) in enumerate(ENTRIES.items())
    ]


@pytest.fixture
def pack(tmp_path: Path) -> str:
    root = str(tmp_path / "store")
    create_layout(root)
    return write_pack(Layout(root), entries(), Writer(Layout(root), fsync=True).write_file)


def test_every_entry_reads_back_and_blobs_are_stored_once(pack: str) -> None:
    reader = PackReader(pack)
    assert reader.count == len(ENTRIES)
    assert reader.index_ok()
    for key, value in ENTRIES.items():
        entry = reader.find(key_id(key))
        assert entry is not None
        assert reader.read(entry) == value
    assert reader.find(key_id("absent")) is None
    assert os.path.getsize(pack) < 7 * 100 + len(ENTRIES) * 96 + 1024 + 64  # 7 blobs, not 300, each compressed
    assert sorted(e.key_id for e in reader.entries()) == sorted(key_id(k) for k in ENTRIES)


def test_only_complete_packs_are_visible(pack: str, tmp_path: Path) -> None:
    assert list_packs(os.path.dirname(pack)) == [pack]
    assert os.listdir(tmp_path / "store" / "tmp") == []


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x40]))


def test_a_flipped_bit_in_a_blob_is_a_miss_not_wrong_bytes(pack: str) -> None:
    reader = PackReader(pack)
    entry = reader.find(key_id("k1"))
    assert entry is not None
    flip(pack, entry.offset + 5)
    reader = PackReader(pack)
    with pytest.raises(PackError, match="the blob of " + key_id("k1")):
        reader.read(reader.find(key_id("k1")))  # type: ignore[arg-type]
    assert reader.read(reader.find(key_id("k2"))) == ENTRIES["k2"]  # type: ignore[arg-type]  # other blobs read
    assert reader.index_ok()  # the index itself is intact


def test_a_damaged_index_entry_is_a_miss_and_the_rest_of_the_pack_reads(pack: str) -> None:
    size = os.path.getsize(pack)
    index_offset = struct.unpack("<Q", Path(pack).read_bytes()[size - 24 : size - 16])[0]
    first_entry = index_offset + 1024
    flip(pack, first_entry + 40)  # inside the first entry's digest
    reader = PackReader(pack)
    assert not reader.index_ok()
    missing = [k for k in ENTRIES if reader.find(key_id(k)) is None]
    assert len(missing) == 1
    for key, value in ENTRIES.items():
        entry = reader.find(key_id(key))
        if entry is not None:
            assert reader.read(entry) == value


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage-trailer", "garbage-fanout", "not-a-pack"])
def test_a_garbage_pack_is_refused_at_open(pack: str, damage: str) -> None:
    data = bytearray(Path(pack).read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    elif damage == "garbage-trailer":
        data[-8:] = b"notmagic"
    elif damage == "garbage-fanout":
        index_offset = struct.unpack("<Q", bytes(data[-24:-16]))[0]
        data[index_offset : index_offset + 4] = struct.pack("<I", 10**6)
    else:
        data[:8] = b"PK\x03\x04zip!"
    Path(pack).write_bytes(bytes(data))
    with pytest.raises(PackError):
        PackReader(pack)


def test_a_pack_set_reads_packs_newest_first_and_survives_vanishing_and_truncation(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    create_layout(root)
    lay = Layout(root)
    writer = Writer(lay)
    old = write_pack(lay, [(key_id("a"), blake3(b"old").hexdigest(), b"old", 1)], writer.write_file)
    damaged: list[str] = []
    packs = PackSet(root, on_damage=lambda path, _why: damaged.append(path))
    assert packs.lookup(key_id("a")) == (b"old", blake3(b"old").hexdigest())
    new = write_pack(
        lay,
        [(key_id("a"), blake3(b"new").hexdigest(), b"new", 2), (key_id("b"), blake3(b"bb").hexdigest(), b"bb", 2)],
        writer.write_file,
    )
    packs._listed_at = float("-inf")  # as if RELIST_S had passed
    assert packs.lookup(key_id("a"))[0] == b"new"  # type: ignore[index]
    os.unlink(new)  # a reader keeps its descriptor: the pack still reads
    assert packs.lookup(key_id("b"))[0] == b"bb"  # type: ignore[index]
    os.truncate(old, 10)  # a pack truncated in place under a reader: short reads, misses
    packs._listed_at = float("-inf")
    assert packs.lookup(key_id("a")) is None
    assert damaged == [old]
    assert PackSet(root).lookup(key_id("a")) is None  # a fresh process cannot open either: no exception


# -- framed entries -------------------------------------------------------------------------


def _write(tmp_path: Path, entries: list[tuple[str, str, bytes, int]]) -> str:
    root = str(tmp_path / "store")
    create_layout(root)
    return write_pack(Layout(root), entries, Writer(Layout(root)).write_file)


def test_entries_are_stored_framed_and_the_index_names_the_stored_bytes(tmp_path: Path) -> None:
    blob = b"a cubin's section " * 2000  # 36 KB of what compresses
    pack = _write(tmp_path, [(key_id("k"), blake3(blob).hexdigest(), blob, 1)])
    reader = PackReader(pack)
    entry = reader.find(key_id("k"))
    assert entry is not None and entry.digest == blake3(blob).hexdigest()  # the digest of the RAW bytes
    stored = Path(pack).read_bytes()[entry.offset : entry.offset + entry.size]
    assert frame.is_framed(stored) and entry.size < len(blob) // 20
    assert reader.raw_size(entry) == len(blob)
    assert reader.read(entry) == blob
    assert reader.read_stored(entry) == stored and reader.read_stored(entry).raw_size == len(blob)


def test_raw_and_framed_entries_read_back_and_a_version_1_pack_is_refused_naming_its_fix(
    tmp_path: Path,
) -> None:
    framed, raw = b"compresses " * 500, os.urandom(3000)  # random bytes stay raw: framing is no smaller
    kept = b"kept raw by a writer " * 50
    entries = [
        (key_id("framed"), blake3(framed).hexdigest(), framed, 1),
        (key_id("raw"), blake3(raw).hexdigest(), raw, 1),
        (key_id("kept"), blake3(kept).hexdigest(), Stored(kept, len(kept)), 1),  # as an old pack held it
    ]
    pack = _write(tmp_path, entries)
    reader = PackReader(pack)
    got = {k: reader.read(reader.find(key_id(k))) for k in ("framed", "raw", "kept")}  # type: ignore[arg-type]
    assert got == {"framed": framed, "raw": raw, "kept": kept}
    stored = {k: reader.read_stored(reader.find(key_id(k))) for k in got}  # type: ignore[arg-type]
    assert frame.is_framed(stored["framed"]) and stored["raw"] == raw and stored["kept"] == kept
    # Version 1 (every blob raw, never released): its header and trailer say 1; refused, naming the fix.
    v1 = tmp_path / "v1" / "packs" / os.path.basename(pack)
    create_layout(str(tmp_path / "v1"))
    v1.parent.mkdir(exist_ok=True)
    data = bytearray(b"".join(pack_chunks([(k, d, Stored(b, len(b)), t) for k, d, b, t in entries[1:]])))
    data[7] = 1
    data[-12:-8] = struct.pack("<I", 1)
    v1.write_bytes(bytes(data))
    with pytest.raises(PackError, match=r"format 1, .*`cuda-program-cas verify --repair STORE`"):
        PackReader(str(v1))
    verify = verify_packs(Layout(str(tmp_path / "v1")), repair=True)  # what the message names moves it aside
    assert [(kind, fixed) for kind, _path, _detail, fixed in verify] == [("bad_pack", True)] and not v1.exists()


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_bad_frame_in_a_pack_is_a_miss_said_in_one_line_and_the_rest_reads(tmp_path: Path, case: str) -> None:
    make, reason = BAD[case]
    good = b"a good entry " * 300
    lied = b"what the frame was to hold " * 300
    entries = [
        (key_id("bad"), blake3(lied).hexdigest(), Stored(make(), len(lied)), 1),
        (key_id("good"), blake3(good).hexdigest(), good, 1),
    ]
    _write(tmp_path, entries)
    said: list[str] = []
    packs = PackSet(str(tmp_path / "store"), on_damage=lambda _path, why: said.append(why), max_entry=lambda: 10_000)
    assert packs.lookup(key_id("bad")) is None
    assert packs.lookup(key_id("good")) == (good, blake3(good).hexdigest())
    assert len(said) == 1 and "\n" not in said[0] and key_id("bad") in said[0], said
    assert reason in said[0], said


def test_a_large_entry_that_lies_is_refused_holding_a_chunk_not_the_entry(tmp_path: Path) -> None:
    """Over STREAM_ABOVE raw, a frame is decoded and hashed in chunks before it is held whole."""
    import tracemalloc

    big = os.urandom(64) * (8 * STREAM_ABOVE // 64)  # 8 MiB that compresses to little
    other = b"\0" + big[1:]
    _write(tmp_path, [(key_id("k"), blake3(other).hexdigest(), big, 1)])  # the index names other bytes
    reader = PackReader(str(next((tmp_path / "store" / "packs").glob("*.cpk"))))
    entry = reader.find(key_id("k"))
    assert entry is not None and entry.size < STREAM_ABOVE
    tracemalloc.start()
    try:
        with pytest.raises(PackError, match="do not hash"):
            reader.read(entry, 16 * STREAM_ABOVE)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * STREAM_ABOVE, peak  # never the 8 MiB


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.binary(max_size=3000), st.binary(max_size=40).map(lambda b: frame.MAGIC + b * 50))))
def test_a_pack_of_any_blobs_reads_each_back_exactly(
    tmp_path_factory: pytest.TempPathFactory, blobs: list[bytes]
) -> None:
    root = str(tmp_path_factory.mktemp("prop"))
    create_layout(root)
    entries = [(key_id(f"k{i}"), blake3(b).hexdigest(), b, i) for i, b in enumerate(blobs)]
    reader = PackReader(write_pack(Layout(root), entries, Writer(Layout(root)).write_file))
    for i, b in enumerate(blobs):
        entry = reader.find(key_id(f"k{i}"))
        assert entry is not None and reader.read(entry, max(len(b), 1)) == b
    reader.close()
