"""The pack format on its own: what is written reads back, and no damage yields wrong bytes or an exception."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from blake3 import blake3

from cuda_program_cas._disk.layout import Layout, create_layout
from cuda_program_cas._disk.pack import PackError, PackReader, write_pack
from cuda_program_cas._disk.packset import PackSet, list_packs
from cuda_program_cas._disk.writer import Writer
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
    assert os.path.getsize(pack) < 2 * 7 * 200 + len(ENTRIES) * 96 + 1024 + 64  # 7 blobs, not 300
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
    assert reader.read(reader.find(key_id("k1"))) is None  # type: ignore[arg-type]
    assert reader.read(reader.find(key_id("k2"))) == ENTRIES["k2"]  # other blobs still read
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
    packs = PackSet(root, on_damage=damaged.append)
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
