"""Packed shared stores end to end: publish --pack, nodes reading packs, repack, gc, verify, stats.

Real files and real processes; every hit is checked byte for byte against what
was published.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import pytest
from conftest import run_python

import cuda_program_cas._disk.packset
from cuda_program_cas import CacheStore, collect, publish, verify
from cuda_program_cas._cli.main import main as cli

N = 100


def value(i: int, gen: str = "g") -> bytes:
    return (f"{gen}:{i}:".encode() * 200)[: 500 + 7 * (i % 50)]


def source(path: Path, gen: str = "g", n: int = N, start: int = 0) -> Path:
    store = CacheStore(path)
    for i in range(start, start + n):
        store.put(f"{gen}{i}", value(i, gen))
    return path


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_a_packed_store_holds_a_handful_of_files_and_nodes_read_it(tmp_path: Path) -> None:
    report = publish([source(tmp_path / "src")], tmp_path / "store", pack=True)
    assert report.published == N and len(report.packs) == 1
    # layout.json, CACHEDIR.TAG, the pack, packs/summary, packs/list, keys (the key list)
    assert len(files_under(tmp_path / "store")) <= 6
    node = CacheStore(tmp_path / "node", shared=[tmp_path / "store"])
    assert all(node.get(f"g{i}") == value(i) for i in range(N))
    assert node.stats().shared_hits == N
    assert len(CacheStore(tmp_path / "node")) == N  # shared hits copied locally
    lean = CacheStore(tmp_path / "lean", shared=[tmp_path / "store"], copy_shared_hits=False)
    assert all(lean.get(f"g{i}") == value(i) for i in range(N))
    assert len(lean) == 0
    again = publish([tmp_path / "src"], tmp_path / "store", pack=True)
    assert again.published == 0 and again.unchanged == N and again.packs == []  # nothing new: no pack


_OPENS = textwrap.dedent(
    """
    import os, sys
    store, local, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    opened = []
    def hook(event, args):
        if event == "open" and isinstance(args[0], str) and args[0].startswith(store):
            opened.append(args[0])
    sys.addaudithook(hook)
    from cuda_program_cas import CacheStore
    node = CacheStore(local, shared=[store])
    hits = sum(node.get(f"g{i}") is not None for i in range(n))
    print(hits, len(opened))
    """
)


def test_first_hits_in_a_fresh_process_open_a_handful_of_files(tmp_path: Path) -> None:
    loose = publish([source(tmp_path / "src")], tmp_path / "loose")
    assert loose.published == N
    publish([tmp_path / "src"], tmp_path / "packed", pack=True)
    counts = {}
    for kind in ("loose", "packed"):
        proc = run_python(_OPENS, str(tmp_path / kind), str(tmp_path / f"node-{kind}"), str(N))
        assert proc.returncode == 0, proc.stderr
        hits, opens = map(int, proc.stdout.split())
        assert hits == N
        counts[kind] = opens
    assert counts["packed"] <= 5, counts
    assert counts["loose"] >= 2 * N, counts


def test_publish_and_repack_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source(tmp_path / "a", "a")
    source(tmp_path / "b", "b", n=10)
    assert cli(["publish", "--pack", "--json", str(tmp_path / "a"), str(tmp_path / "store")]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["published"] == N and len(first["packs"]) == 1
    assert cli(["publish", str(tmp_path / "b"), str(tmp_path / "store")]) == 0  # loose beside the pack
    capsys.readouterr()
    assert cli(["repack", "--json", str(tmp_path / "store")]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["entries"] == N + 10 and len(rep["retired"]) == 1
    assert len(cuda_program_cas._disk.packset.list_packs(str(tmp_path / "store" / "packs"))) == 1
    node = CacheStore(tmp_path / "node", shared=[tmp_path / "store"], copy_shared_hits=False)
    assert all(node.get(f"a{i}") == value(i, "a") for i in range(N))
    assert all(node.get(f"b{i}") == value(i, "b") for i in range(10))
    assert cli(["stats", "--json", str(tmp_path / "store")]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["packs"], stats["packed_entries"], stats["retired_packs"]) == (1, N + 10, 1)


def test_a_running_process_picks_up_a_new_generation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    publish([source(tmp_path / "g1", "one", n=5)], tmp_path / "store", pack=True)
    node = CacheStore(tmp_path / "node", shared=[tmp_path / "store"], copy_shared_hits=False)
    assert node.get("one0") == value(0, "one")
    assert node.get("two0") is None
    publish([source(tmp_path / "g2", "two", n=5)], tmp_path / "store", pack=True)
    assert node.get("two0") is None  # the listing is trusted for RELIST_S
    monkeypatch.setattr(cuda_program_cas._disk.packset, "RELIST_S", 0.0)
    assert node.get("two0") == value(0, "two")


def test_gc_removes_what_repack_replaced_only_after_the_grace_period(tmp_path: Path) -> None:
    store = tmp_path / "store"
    publish([source(tmp_path / "src", n=20)], store, pack=True)
    publish([source(tmp_path / "more", "m", n=5)], store)  # loose
    from cuda_program_cas._verbs.repack import repack

    report = repack(store)
    retired = Path(report.retired[0])
    first = collect(store, grace_s=3600)  # in the run after the repack: nothing it replaced goes
    assert retired.exists() and first.packs["retired_removed"] == 0 and first.packs["loose_removed"] == 0
    assert len(CacheStore(store, read_only=True)) == 5
    age(retired, 2 * 3600)
    age(Path(report.pack), 2 * 3600)  # the covering pack, listed by every node long ago
    second = collect(store, grace_s=3600)
    assert not retired.exists() and second.packs["retired_removed"] == 1
    assert second.packs["loose_removed"] == 5
    node = CacheStore(tmp_path / "node", shared=[store], copy_shared_hits=False)
    assert all(node.get(f"g{i}") == value(i) for i in range(20))
    assert all(node.get(f"m{i}") == value(i, "m") for i in range(5))  # from the pack now


def test_gc_max_age_on_a_packed_store_repacks_without_the_old_entries(tmp_path: Path) -> None:
    store = tmp_path / "store"
    src = source(tmp_path / "src", n=10)
    for p in (src / "index").rglob("*"):
        if p.is_file():
            age(p, 30 * 86400)  # published a month after their last use: their time comes along
    publish([src], store, pack=True)
    publish([source(tmp_path / "new", "n", n=4)], store, pack=True)
    report = collect(store, grace_s=3600, max_age_s=7 * 86400)
    assert report.packs["entries_dropped"] == 10 and report.packs["repacked_into"]
    node = CacheStore(tmp_path / "node", shared=[store], copy_shared_hits=False)
    assert all(node.get(f"g{i}") is None for i in range(10))
    assert all(node.get(f"n{i}") == value(i, "n") for i in range(4))


def test_verify_finds_a_bad_pack_and_repair_moves_it_aside(tmp_path: Path) -> None:
    store = tmp_path / "store"
    pack = Path(publish([source(tmp_path / "src", n=10)], store, pack=True).packs[0])
    data = bytearray(pack.read_bytes())
    data[20] ^= 0x01  # a flipped bit in the first blob
    pack.write_bytes(bytes(data))
    node = CacheStore(tmp_path / "node", shared=[store], copy_shared_hits=False)
    got = [node.get(f"g{i}") for i in range(10)]
    assert got.count(None) == 1 and all(g == value(i) for i, g in enumerate(got) if g is not None)
    assert node.stats().corrupt >= 1
    found = verify(store)
    assert [p.kind for p in found.problems] == ["bad_pack"]
    fixed = verify(store, repair=True)
    assert fixed.problems[0].fixed and not pack.exists()
    assert len(os.listdir(store / "quarantine")) == 1
    assert verify(store).problems == []


_READER = textwrap.dedent(
    """
    import json, sys
    import cuda_program_cas._disk.packset
    cuda_program_cas._disk.packset.RELIST_S = 0.0  # see every new pack at once: the hardest case for the reader
    from cuda_program_cas import CacheStore
    store, local, gens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    node = CacheStore(local, shared=[store], copy_shared_hits=False)
    def value(i, gen):
        return (f"{gen}:{i}:".encode() * 200)[: 500 + 7 * (i % 50)]
    hits = rounds = 0
    print("ready", flush=True)
    while sys.stdin.readline().strip() != "stop":
        for gen, n in gens.items():
            for i in range(n):
                data = node.get(f"{gen}{i}")
                if data is not None and data != value(i, gen):
                    print("WRONG", gen, i, flush=True)
                    sys.exit(3)
                hits += data is not None
        rounds += 1
        print("round", rounds, flush=True)
    print("hits", hits, flush=True)
    """
)


def test_readers_while_publish_pack_repack_and_gc_run(tmp_path: Path) -> None:
    store = tmp_path / "store"
    gens = {"a": 30, "b": 30, "c": 30}
    publish([source(tmp_path / "a", "a", 30)], store, pack=True)
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", _READER, str(store), str(tmp_path / f"r{k}"), json.dumps(gens)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for k in range(2)
    ]

    def step() -> None:
        for r in readers:
            assert r.stdin is not None and r.stdout is not None
            r.stdin.write("go\n")
            r.stdin.flush()
        for r in readers:
            assert r.stdout is not None
            line = r.stdout.readline()
            assert line.startswith("round"), line

    try:
        for r in readers:
            assert r.stdout is not None and r.stdout.readline().strip() == "ready"
        step()
        publish([source(tmp_path / "b", "b", 30)], store, pack=True)
        step()
        publish([source(tmp_path / "c", "c", 30)], store)  # loose
        step()
        from cuda_program_cas._verbs.repack import repack

        repack(store)
        step()
        for retired in (store / "packs" / "retired").iterdir():
            age(retired, 7200)
        collect(store, grace_s=3600)  # retired packs go under the readers' open descriptors
        step()
        outs = []
        for r in readers:
            out, _ = r.communicate("stop\n", timeout=60)
            outs.append(out)
            assert r.returncode == 0, out
    finally:
        for r in readers:
            if r.poll() is None:
                r.kill()
    assert all(int(o.split()[-1]) > 0 for o in outs)
    node = CacheStore(tmp_path / "check", shared=[store], copy_shared_hits=False)
    assert all(node.get(f"{g}{i}") == value(i, g) for g, n in gens.items() for i in range(n))


def test_two_publishers_at_once_and_a_killed_one(tmp_path: Path) -> None:
    store = tmp_path / "store"
    source(tmp_path / "x", "x", 40)
    source(tmp_path / "y", "y", 40)
    code = "import sys; from cuda_program_cas import publish; publish([sys.argv[1]], sys.argv[2], pack=True)"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / s), str(store)]) for s in ("x", "y")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    node = CacheStore(tmp_path / "node", shared=[store], copy_shared_hits=False)
    assert all(node.get(f"{g}{i}") == value(i, g) for g in "xy" for i in range(40))
    # A publisher killed while it writes its pack leaves only a temp file: the store reads as before.
    source(tmp_path / "z", "z", 40)
    killed = code.replace("publish([", "import cuda_program_cas._disk.pack as P, os, signal\n"
                          "orig = P.pack_chunks\n"
                          "def chunks(*a, **k):\n"
                          "    for i, c in enumerate(orig(*a, **k)):\n"
                          "        yield c\n"
                          "        if i == 3: os.kill(os.getpid(), signal.SIGKILL)\n"
                          "P.pack_chunks = chunks\npublish([")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", killed, str(tmp_path / "z"), str(store)], check=False)
    assert proc.returncode == -9
    assert len(cuda_program_cas._disk.packset.list_packs(str(store / "packs"))) == 2
    assert node.get("z0") is None
    assert verify(store).problems == []
    assert publish([tmp_path / "z"], store, pack=True).published == 40  # the next run completes it
    fresh = CacheStore(tmp_path / "fresh", shared=[store], copy_shared_hits=False)
    assert all(fresh.get(f"z{i}") == value(i, "z") for i in range(40))


# -- issue 32: stats counts packed entries, repack says what it left -------------------------------


def test_stats_counts_packed_entries_as_entries_and_says_which_are_packed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    publish([source(tmp_path / "src", n=20)], store, pack=True)
    assert cli(["stats", "--json", str(store)]) == 0
    report = json.loads(capsys.readouterr().out)
    # Before: entries 0, and the summary said "0 entries in 0 blobs" for a store that serves 20.
    assert (report["entries"], report["packed_entries"], report["loose_entries"]) == (20, 20, 0)
    publish([source(tmp_path / "more", "m", n=5)], store)  # loose beside the pack
    assert cli(["stats", str(store)]) == 0
    out = capsys.readouterr().out
    assert "entries      25: 20 packed, 5 loose (" in out
    assert out.splitlines()[-1].startswith("25 entries (20 packed) in 5 loose blobs and 1 pack, ")

    from cuda_program_cas._verbs.repack import repack

    repack(store)  # the 5 loose ones are packed too now, and stay loose until gc: each is counted once
    assert cli(["stats", "--json", str(store)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["entries"], report["packed_entries"], report["loose_entries"]) == (25, 25, 5)
    assert report["loose_also_packed"] == 5
    assert cli(["stats", str(store)]) == 0
    out = capsys.readouterr().out
    assert "5 of the loose ones are packed too (left by a repack: gc removes them once --grace has passed" in out
    node = CacheStore(tmp_path / "node", shared=[store], copy_shared_hits=False)
    assert sum(node.get(k) is not None for k in [*(f"g{i}" for i in range(20)), *(f"m{i}" for i in range(5))]) == 25


def test_repack_says_what_it_left_loose_and_when_gc_removes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    publish([source(tmp_path / "src", n=20)], store, pack=True)
    publish([source(tmp_path / "more", "m", n=5)], store)
    assert cli(["repack", "--json", str(store)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["loose_left"], report["loose_packed"], len(report["retired"])) == (5, 5, 1)
    pack = Path(report["pack"])
    after = datetime.fromisoformat(report["gc_removes_after"]).timestamp()
    assert abs(after - (pack.stat().st_mtime + 3600)) < 2
    # What it says is what gc does: a minute before that time nothing goes, a minute after it all does.
    retired = Path(report["retired"][0])
    for path in (pack, retired):
        age(path, 3600 - 60)
    early = collect(store, grace_s=3600)
    assert (early.packs["loose_removed"], early.packs["retired_removed"]) == (0, 0)
    for path in (pack, retired):
        age(path, 3600 + 60)
    late = collect(store, grace_s=3600)
    assert (late.packs["loose_removed"], late.packs["retired_removed"]) == (5, 1)

    publish([source(tmp_path / "more2", "x", n=2)], store)
    assert cli(["repack", str(store)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        "left 2 loose entries now also in the pack and 1 retired pack for nodes that may be reading them: gc "
        "removes them once its --grace has passed (1h by default: from "
    ), lines


def test_repack_of_a_store_with_nothing_loose_leaves_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    publish([source(tmp_path / "src", n=3)], store, pack=True)
    for _ in range(2):  # the second one: every entry packed, none loose
        assert cli(["repack", "--json", str(store)]) == 0
        report = json.loads(capsys.readouterr().out)
    assert (report["loose_left"], report["loose_packed"], len(report["retired"])) == (0, 0, 1)
    assert cli(["repack", str(store)]) == 0
    assert "left 1 retired pack for nodes that may be reading them" in capsys.readouterr().out
