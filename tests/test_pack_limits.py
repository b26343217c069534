"""Packed stores at their limits: thousands of packs, damaged store blobs, two repacks at once.

Real files and real processes. Children report through what they print and their
exit status; a parent waits for a child's line (a pipe), never for a duration.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import filelock
import pytest
from blake3 import blake3
from conftest import ChildLines, run_python

import cuda_program_cas._disk.pack
import cuda_program_cas._disk.packfile
import cuda_program_cas._disk.packset
from cuda_program_cas import CacheStore, publish
from cuda_program_cas._cli.main import main as cli
from cuda_program_cas._disk.layout import Layout, create_layout
from cuda_program_cas._disk.pack import write_pack
from cuda_program_cas._disk.writer import Writer
from cuda_program_cas._verbs.repack import repack
from cuda_program_cas.index import key_id


def value(i: int, gen: str = "g") -> bytes:
    return (f"{gen}:{i}:".encode() * 40)[: 100 + i % 50]


def source(path: Path, gen: str = "g", n: int = 20, start: int = 0) -> Path:
    store = CacheStore(path)
    for i in range(start, start + n):
        store.put(f"{gen}{i}", value(i, gen))
    return path


def child_env() -> dict[str, str]:
    return dict(os.environ)


# -- one repack at a time ---------------------------------------------------------------------

#: A repack that stops while it writes its pack (holding the lock) until the parent says go on stdin.
_HELD_REPACK = r"""
import sys
from cuda_program_cas._disk.packpublish import StorePacks as R
from cuda_program_cas._cli.main import main
orig = R.write
def write(*args, **kwargs):
    print("writing", flush=True)
    if sys.stdin.readline() != "go\n":
        sys.exit("the parent gave up")
    return orig(*args, **kwargs)
R.write = write
sys.exit(main(["repack", sys.argv[1]]))
"""


def test_a_second_repack_while_one_runs_changes_nothing_and_exits_0(tmp_path: Path) -> None:
    store = tmp_path / "store"
    for gen in "abc":
        publish([source(tmp_path / gen, gen)], store, pack=True)
    before = cuda_program_cas._disk.packset.list_packs(str(store / "packs"))
    assert len(before) == 3
    first = ChildLines(
        subprocess.Popen(
            [sys.executable, "-c", _HELD_REPACK, str(store)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
    )
    try:
        first.wait("writing")
        second = subprocess.run(
            [sys.executable, "-m", "cuda_program_cas", "repack", str(store)],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=120,
            check=False,
        )
        assert second.returncode == 0, second.stderr
        assert "another repack or a gc" in second.stdout and "nothing was changed" in second.stdout
        assert cuda_program_cas._disk.packset.list_packs(str(store / "packs")) == before  # the second changed nothing
        assert first.proc.stdin is not None
        first.proc.stdin.write("go\n")
        first.proc.stdin.flush()
        assert first.finish(timeout=120) == 0, first.output()
    finally:
        first.kill()
    assert "retired 3 packs" in first.lines[-1]
    assert len(cuda_program_cas._disk.packset.list_packs(str(store / "packs"))) == 1
    node = CacheStore(tmp_path / "node", shared=[store], copy_shared_hits=False)
    assert all(node.get(f"{g}{i}") == value(i, g) for g in "abc" for i in range(20))


def test_repack_json_says_busy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    publish([source(tmp_path / "a", "a")], store, pack=True)
    with filelock.FileLock(str(store / "evict.lock"), timeout=0):
        assert cli(["repack", "--json", str(store)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["busy"] is True and out["problem_count"] == 0
    assert cli(["repack", "--json", str(store)]) == 0  # free again: it repacks
    assert json.loads(capsys.readouterr().out)["entries"] == 20


# -- thousands of packs -----------------------------------------------------------------------


def many_packs(store: Path, n: int, gen: str = "p") -> None:
    """A store of ``n`` packs of one entry each, written by the real pack writer (no fsync: a test's speed)."""
    create_layout(str(store))
    lay = Layout(str(store))
    writer = Writer(lay, file_mode=0o644, exact_mode=True)
    for i in range(n):
        data = value(i, gen)
        write_pack(lay, [(key_id(f"{gen}{i}"), blake3(data).hexdigest(), data, i)], writer.write_file)


#: A node under a soft limit of 1024 descriptors reads every entry of the store, then opens other files.
_UNDER_1024 = r"""
import os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
from cuda_program_cas import CacheStore
store, local, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
def value(i):
    return (f"p:{i}:".encode() * 40)[: 100 + i % 50]
node = CacheStore(local, shared=[store], copy_shared_hits=False)
hits = sum(node.get(f"p{i}") == value(i) for i in range(n))
again = sum(node.get(f"p{i}") == value(i) for i in range(0, n, 7))
fds = len(os.listdir("/proc/self/fd"))
# The process can still open files: a new cache, and 200 more files at once.
fresh = CacheStore(local + "-fresh")
fresh.put("k", b"v")
held = [os.open(store, os.O_RDONLY) for _ in range(200)]
print(hits, again, fds, fresh.get("k") == b"v", flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd (Linux)")
def test_1100_packs_under_a_soft_limit_of_1024_descriptors_every_entry_hits(tmp_path: Path) -> None:
    n = 1100
    many_packs(tmp_path / "store", n)
    proc = run_python(_UNDER_1024, str(tmp_path / "store"), str(tmp_path / "node"), str(n), timeout=120)
    assert proc.returncode == 0, proc.stderr
    hits, again, fds, fresh_ok = proc.stdout.split()
    assert (int(hits), int(again), fresh_ok) == (n, len(range(0, n, 7)), "True")
    assert int(fds) <= cuda_program_cas._disk.packfile.MAX_OPEN_PACKS + 16, (
        fds
    )  # the bound, plus stdio, the node's own files


def open_files_under(directory: Path) -> list[str]:
    """The files under ``directory`` that this process holds open (from /proc/self/fd)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory) + os.sep):
            held.append(target)
    return held


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd (Linux)")
def test_packs_retired_by_a_repack_still_read_until_relisted_then_are_closed(tmp_path: Path) -> None:
    store = tmp_path / "store"
    n = cuda_program_cas._disk.packfile.MAX_OPEN_PACKS + 8
    many_packs(store, n)
    packs = cuda_program_cas._disk.packset.PackSet(str(store))
    assert all(packs.lookup(key_id(f"p{i}")) is not None for i in range(n))
    assert len(open_files_under(store)) <= cuda_program_cas._disk.packfile.MAX_OPEN_PACKS
    repack(store)  # every pack moves to packs/retired/, most of them closed here meanwhile
    assert len(cuda_program_cas._disk.packset.list_packs(str(store / "packs"))) == 1
    # Within the listing this process still trusts, every entry reads from the retired packs.
    assert all(packs.lookup(key_id(f"p{i}")) == (value(i, "p"), blake3(value(i, "p")).hexdigest()) for i in range(n))
    assert any("/retired/" in path for path in open_files_under(store))
    packs._listed_at = float("-inf")  # as if RELIST_S had passed
    assert all(packs.lookup(key_id(f"p{i}")) is not None for i in range(n))
    assert [path for path in open_files_under(store) if "/retired/" in path] == []  # retired packs closed


# -- publish --pack at 1 and 1,100 packs --------------------------------------------------------

#: One publish --pack in a fresh process; prints its report and the files it opened under packs/.
_PUBLISH_OPENS = r"""
import json, sys
packs = sys.argv[2] + "/packs/"
opened = []
def hook(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].startswith(packs):
        opened.append(args[0])
sys.addaudithook(hook)
from cuda_program_cas import publish
report = publish([sys.argv[1]], sys.argv[2], pack=True, fsync=False)
print(json.dumps({"published": report.published, "unchanged": report.unchanged, "opened": opened}))
"""


def publish_counting_opens(src: Path, store: Path) -> dict[str, object]:
    proc = run_python(_PUBLISH_OPENS, str(src), str(store))
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def test_publish_pack_reads_the_summary_not_every_pack(tmp_path: Path) -> None:
    store = tmp_path / "store"
    n = 1100
    many_packs(store, n)  # written without a summary: the first publish reads every pack, once
    first = publish_counting_opens(source(tmp_path / "a", "a", n=1), store)
    assert first["published"] == 1 and len(first["opened"]) >= n  # type: ignore[arg-type]
    # Later ones read packs/summary and the packs they need, whatever the number of packs.
    src = CacheStore(tmp_path / "b")
    src.put("b0", value(0, "b"))
    src.put("p7", value(7, "p"))  # already packed: verified in its pack, not published again
    second = publish_counting_opens(tmp_path / "b", store)
    assert (second["published"], second["unchanged"]) == (1, 1)
    opened = [os.path.basename(p) for p in second["opened"]]  # type: ignore[attr-defined]
    assert len(opened) <= 4, opened  # the summary, the pack of p7, the new pack
    assert "summary" in opened


def test_the_summary_follows_packs_added_retired_and_damaged(tmp_path: Path) -> None:
    store = tmp_path / "store"
    publish([source(tmp_path / "a", "a")], store, pack=True)
    publish([source(tmp_path / "b", "b")], store, pack=True)
    # A pack the summary does not know (a publisher killed before writing it, or an older one).
    lay = Layout(str(store))
    data = value(0, "x")
    write_pack(lay, [(key_id("x0"), blake3(data).hexdigest(), data, 1)], Writer(lay).write_file)
    src = CacheStore(tmp_path / "x")
    src.put("x0", data)
    src.put("a3", value(3, "a"))
    again = publish([tmp_path / "x"], store, pack=True)
    assert (again.published, again.unchanged, again.packs) == (0, 2, [])
    repack(store)  # the summary now covers only the repack's pack
    assert publish([tmp_path / "a", tmp_path / "b"], store, pack=True).unchanged == 40
    summary = store / "packs" / "summary"
    raw = bytearray(summary.read_bytes())
    raw[40] ^= 0x40
    summary.write_bytes(bytes(raw))  # damaged: ignored, the packs are read instead
    assert publish([tmp_path / "a", tmp_path / "x"], store, pack=True).unchanged == 22
    summary.unlink()
    assert publish([tmp_path / "b"], store, pack=True).unchanged == 20
    assert summary.is_file()
    summary.unlink()
    summary.mkdir()  # not a file: ignored, and not written over; publish goes on
    assert publish([tmp_path / "b"], store, pack=True).unchanged == 20


def test_publish_replaces_an_entry_whose_blob_is_damaged_in_its_pack(tmp_path: Path) -> None:
    store = tmp_path / "store"
    publish([source(tmp_path / "a", "a")], store, pack=True)
    (pack,) = cuda_program_cas._disk.packset.list_packs(str(store / "packs"))
    reader = cuda_program_cas._disk.pack.PackReader(pack)
    entry = reader.find(key_id("a5"))
    reader.close()
    assert entry is not None
    with open(pack, "r+b") as fh:  # one byte of a5's blob, in place
        fh.seek(entry.offset + 3)
        byte = fh.read(1)
        fh.seek(entry.offset + 3)
        fh.write(bytes([byte[0] ^ 0x01]))
    node = CacheStore(tmp_path / "node", shared=[store], copy_shared_hits=False)
    assert node.get("a5") is None
    report = publish([tmp_path / "a"], store, pack=True)
    assert (report.published, report.unchanged, report.blobs_repaired) == (1, 19, 1)
    fresh = CacheStore(tmp_path / "fresh", shared=[store], copy_shared_hits=False)
    assert all(fresh.get(f"a{i}") == value(i, "a") for i in range(20))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_child_forked_while_another_thread_holds_the_descriptor_pool_reads_packs(tmp_path: Path) -> None:
    store = tmp_path / "store"
    many_packs(store, 3)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with cuda_program_cas._disk.packfile._POOL._lock:
            held.set()
            release.wait(60)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(60)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads: what this test is about
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(30)  # a hang is the failure: SIGALRM ends the child
                packs = cuda_program_cas._disk.packset.PackSet(str(store))
                code = 0 if all(packs.lookup(key_id(f"p{i}")) is not None for i in range(3)) else 1
            finally:
                os._exit(code)
    finally:
        release.set()
        thread.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


#: A node that runs out of descriptors (for other files) while it first opens the store's packs.
_OUT_OF_DESCRIPTORS = r"""
import errno, os, resource, sys
import cuda_program_cas._disk.packset
from cuda_program_cas import CacheStore
store, local = sys.argv[1], sys.argv[2]
node = CacheStore(local, shared=[store], copy_shared_hits=False)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError as exc:
    assert exc.errno == errno.EMFILE
os.close(held.pop())  # one free: enough to list packs/ and open the newer pack, not the older one
node.get("p0")  # a hit or a miss, never an exception
for fd in held:
    os.close(fd)
cuda_program_cas._disk.packset.RELIST_S = 0.0
print(node.get("p0") == (b"p:0:" * 40)[:100], node.get("p1") == (b"p:1:" * 40)[:101])
"""


def test_packs_that_could_not_be_opened_for_want_of_descriptors_are_tried_again(tmp_path: Path) -> None:
    many_packs(tmp_path / "store", 2)
    proc = run_python(_OUT_OF_DESCRIPTORS, str(tmp_path / "store"), str(tmp_path / "node"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]


def test_threads_reading_through_a_small_pool_while_packs_are_retired_get_only_right_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    n = 60
    many_packs(store, n)
    monkeypatch.setattr(
        cuda_program_cas._disk.packfile, "MAX_OPEN_PACKS", 4
    )  # far fewer than the packs: descriptors churn
    monkeypatch.setattr(cuda_program_cas._disk.packset, "RELIST_S", 0.0)  # every lookup lists packs/ again
    damaged: list[str] = []  # no pack is damaged: a report would mean a descriptor closed under a reader
    packs = cuda_program_cas._disk.packset.PackSet(str(store), on_damage=damaged.append)
    expected = {key_id(f"p{i}"): value(i, "p") for i in range(n)}
    wrong: list[str] = []
    rounds = [0] * 8
    done = threading.Condition()
    stop = threading.Event()

    def read(me: int) -> None:
        while not stop.is_set():
            for kid, data in expected.items():
                found = packs.lookup(kid)
                if found is not None and found != (data, blake3(data).hexdigest()):
                    wrong.append(kid)  # a miss is allowed while packs move; wrong bytes are not
            with done:
                rounds[me] += 1
                done.notify_all()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(rounds))]
    for thread in threads:
        thread.start()
    try:
        for target in (1, 3, 5):  # a repack after every thread has read a whole round more
            with done:
                assert done.wait_for(lambda t=target: min(rounds) >= t, timeout=120), rounds
            repack(store)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert wrong == [] and damaged == []
    assert cuda_program_cas._disk.packfile.open_packs() <= 4
    assert all(packs.lookup(kid) == (data, blake3(data).hexdigest()) for kid, data in expected.items())


_HOSTILE_DIR_NODE = """
import json, resource, sys
from cuda_program_cas import CacheStore

resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))

def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith("VmHWM:"))

store = CacheStore(sys.argv[1], shared=[sys.argv[2]])
assert store.get("warm") is None  # the store opened, its packs listed
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
start = peak()
got = {key: store.get(key) for key in sys.argv[3].split(",")}
print(json.dumps({"grew": peak() - start, "hits": [k for k, v in got.items() if v is not None],
                  "corrupt": store.counters()["corrupt"]}))
"""


def _sparse_pack(store: Path, entries: dict[str, tuple[int, bytes]]) -> None:
    """A pack file whose index maps each key to ``size`` bytes of zeros (a sparse hole), claiming ``digest``."""
    from cuda_program_cas._disk import pack as packmod

    body, offset = [], len(packmod._HEADER)
    fanout = [0] * 256
    rows = []
    for kid, (size, digest) in sorted(entries.items()):
        rows.append((bytes.fromhex(kid), digest, offset, size))
        offset += size
    for raw_kid, digest, off, size in rows:
        head = packmod._ENTRY.pack(raw_kid, digest, off, size, 1, b"")[: packmod._BODY]
        body.append(head + packmod._entry_check(head))
        for b in range(raw_kid[0], 256):
            fanout[b] += 1
    index = packmod._FANOUT.pack(*fanout) + b"".join(body)
    path = store / "packs" / packmod.pack_name()
    path.parent.mkdir(exist_ok=True)
    with open(path, "wb") as f:
        f.write(packmod._HEADER)
        f.seek(offset)  # the blobs: a hole the size of every claim
        f.write(index)
        f.write(packmod._TRAILER.pack(blake3(index).digest(), offset, len(body), packmod.VERSION, b"cpcasidx"))


def test_a_node_reading_a_lying_pack_in_a_shared_directory_stays_within_its_memory_bound(tmp_path: Path) -> None:
    """A pack's entries claim 200 MiB (under the ceiling) and 10 GiB (over it) of a sparse file.

    A pread of what an entry claims would allocate it: 200 MiB held for a blob that does not
    verify, and the 10 GiB one past the 3 GiB address space (a MemoryError). Each is a miss
    counted corrupt, and the node's peak memory grows by less than a few MiB.
    """
    store = tmp_path / "store"
    CacheStore(store).close()
    claims = {"claims-200MiB": 200 << 20, "claims-10GiB": 10 << 30}
    _sparse_pack(store, {key_id(k): (size, blake3(k.encode()).digest()) for k, size in claims.items()})
    done = run_python(_HOSTILE_DIR_NODE, str(tmp_path / "node"), str(store), ",".join(claims), timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["hits"] == [] and out["corrupt"] == 2, out
    assert out["grew"] < 8 << 20, out
    print(f"\npeak memory grew by {out['grew'] / 2**20:.1f} MiB")


def test_a_node_reading_a_lying_loose_entry_in_a_shared_directory_stays_within_its_memory_bound(
    tmp_path: Path,
) -> None:
    """A manifest naming 200 MiB (under the ceiling) over a sparse blob file of 200 MiB that is not those bytes.

    Read whole before it was hashed, the node held the 200 MiB; hashed in chunks first, a miss counted
    corrupt, and the node's peak memory grows by a few MiB.
    """
    from conftest import write_manifest

    from cuda_program_cas._disk.layout import url_path

    store = tmp_path / "store"
    CacheStore(store).close()
    size = 200 << 20
    digest = blake3(b"what the manifest claims").hexdigest()
    write_manifest(store, "claims-200MiB", digest, size)
    blob = store / url_path("blobs", digest)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with open(blob, "wb") as f:
        f.truncate(size)  # a hole: 200 MiB of zeros that take no disk
    done = run_python(_HOSTILE_DIR_NODE, str(tmp_path / "node"), str(store), "claims-200MiB", timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["hits"] == [] and out["corrupt"] == 1, out
    assert out["grew"] < 8 << 20, out
    print(f"\npeak memory grew by {out['grew'] / 2**20:.1f} MiB")
