"""The garbage collector (cuda_program_cas._verbs.gc.collect and tools/gc.py): what goes, what stays, under load."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, ChildLines, StartGate, run_python, write_manifest, write_orphan

from cuda_program_cas import CacheStore, CollectorBusyError, collect, digest_of, verify
from cuda_program_cas.index import key_id

DAY = 86400


def content(tag: str) -> bytes:
    """Deterministic bytes of 2-6 KB for a tag (so another process can recompute them)."""
    seed = hashlib.sha256(tag.encode()).digest()
    return (seed * 200)[: 2000 + seed[0] * 16]


def age(path: str | Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def age_tree(root: str | Path, seconds: float) -> None:
    for sub in ("index", "blobs"):
        for dirpath, _dirs, files in os.walk(os.path.join(root, sub)):
            for name in files:
                age(os.path.join(dirpath, name), seconds)


def listing(root: str | Path) -> dict[str, tuple[int, int, int, int, int]]:
    """Every file and directory under root with what any change would alter."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return out


def orphan(store: CacheStore, data: bytes) -> str:
    """A blob that no manifest names (a writer died between blob and manifest)."""
    return store.inner.blobs.path_for(write_orphan(store.root, data))


def garbage_cache(root: Path) -> tuple[CacheStore, dict[str, str]]:
    """A cache with live entries and one of each kind of garbage; returns the paths of the garbage."""
    store = CacheStore(root)
    for i in range(5):
        store.put(f"live{i}", content(f"live{i}"))
    paths = {}
    paths["old_orphan"] = orphan(store, content("old orphan"))
    age(paths["old_orphan"], 2 * 3600)
    paths["young_orphan"] = orphan(store, content("young orphan"))
    store.put("dangling", content("dangling"))
    os.unlink(store.inner.blobs.path_for(digest_of(content("dangling"))))
    paths["dangling"] = store.inner.layout.manifest_path(key_id("dangling"))
    paths["garbled"] = store.inner.layout.manifest_path(key_id("garbled"))
    os.makedirs(os.path.dirname(paths["garbled"]), exist_ok=True)
    Path(paths["garbled"]).write_bytes(b"cpcas1 not a digest\n")
    # A manifest whose size disagrees with its (shared, good) blob.
    write_manifest(root, "mismatch", digest_of(content("live0")), 7)
    paths["mismatch"] = store.inner.layout.manifest_path(key_id("mismatch"))
    paths["old_tmp"] = os.path.join(root, "tmp", "123-dead.tmp")
    Path(paths["old_tmp"]).write_bytes(b"x" * 100)
    age(paths["old_tmp"], 2 * 3600)
    paths["young_tmp"] = os.path.join(root, "tmp", "456-busy.tmp")
    Path(paths["young_tmp"]).write_bytes(b"y" * 100)
    return store, paths


def test_collect_removes_each_kind_of_garbage_and_keeps_the_rest(tmp_path: Path) -> None:
    store, paths = garbage_cache(tmp_path / "cas")
    report = collect(store.root)
    assert not report.problems and not report.dry_run
    for gone in ("old_orphan", "dangling", "garbled", "mismatch", "old_tmp"):
        assert not os.path.lexists(paths[gone]), gone
    for kept in ("young_orphan", "young_tmp"):
        assert os.path.exists(paths[kept]), kept
    assert report.entries_before == 8 and report.entries_removed == 3 and report.entries_after == 5
    assert report.blobs_removed == 1 and report.temp_files_removed == 1
    plan = report.plan
    assert plan["invalid_manifests"]["count"] == plan["dangling_manifests"]["count"] == 1
    assert plan["size_mismatch_manifests"]["count"] == plan["orphan_blobs"]["count"] == 1
    assert plan["unreferenced_blobs"]["count"] == 0  # live0's blob is still named by live0
    assert report.bytes_freed == sum(v["bytes"] for k, v in plan.items() if k != "temp_files")
    for i in range(5):
        assert store.get(f"live{i}") == content(f"live{i}")
    again = collect(store.root)
    assert again.entries_removed == again.blobs_removed == again.temp_files_removed == 0


def test_last_manifest_takes_its_blob_unless_the_blob_was_freshened(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "cas")
    store.put("a", content("X"))
    store.put("b", content("X"))  # shares a's blob
    store.put("c", content("Y"))
    store.put("d", content("Z"))
    store.put("e", content("fresh"))
    age_tree(store.root, 2 * DAY)
    for key in ("b", "e"):
        age(store.inner.layout.manifest_path(key_id(key)), 60)  # used recently
    z = digest_of(content("Z"))

    def freshen_z_after_the_scan(phase: str, done: int, total: int) -> None:
        if phase == "removing":  # the plan is made: a writer now deduplicates against Z
            os.utime(store.inner.blobs.path_for(z))

    report = collect(store.root, max_age_s=DAY, progress=freshen_z_after_the_scan)

    assert report.plan["expired_entries"]["count"] == 3  # a, c, d
    assert report.entries_removed == 3
    assert store.get("b") == content("X")  # X stays: b still names it
    assert not store.inner.blobs.exists(digest_of(content("Y")))  # Y goes at once, no grace
    assert store.inner.blobs.exists(z)  # Z was freshened: kept
    assert report.blobs_removed == 1 and report.kept_changed == 1
    assert store.get("e") == content("fresh")


def test_verify_moves_corrupt_blobs_to_quarantine_and_drops_their_manifests(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "cas")
    for key in ("a", "b"):
        store.put(key, content("X"))
    store.put("c", content("Y"))
    bad = store.inner.blobs.path_for(digest_of(content("X")))
    data = bytearray(Path(bad).read_bytes())
    data[100] ^= 0xFF  # same size, wrong bytes
    Path(bad).write_bytes(bytes(data))

    plain = collect(store.root)
    assert plain.entries_removed == 0 and os.path.exists(bad)  # not detected without hashing

    report = collect(store.root, verify=True)
    assert report.plan["corrupt_blobs"]["count"] == 1
    assert report.plan["corrupt_blob_manifests"]["count"] == 2
    assert report.entries_removed == 2 and report.blobs_removed == 1
    assert not os.path.exists(bad)
    moved = os.listdir(tmp_path / "cas" / "quarantine")
    assert len(moved) == 1 and moved[0].startswith(digest_of(content("X")))
    assert store.get("a") is None and store.get("c") == content("Y")
    assert verify(store.root).problems == []


def test_max_size_evicts_least_recently_used_and_counts_shared_blobs_once(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "cas")
    for i in range(10):
        store.put(f"k{i}", content(f"k{i}"))
    store.put("twin", content("k9"))  # shares k9's blob
    age_tree(store.root, DAY)
    for i in range(10):  # k0 least recently used ... k9 most
        age(store.inner.layout.manifest_path(key_id(f"k{i}")), 1000 - i * 10)
    age(store.inner.layout.manifest_path(key_id("twin")), 5000)  # oldest, but its blob is shared with k9
    before = store.inner.snapshot().stored_bytes
    sizes = {i: len(content(f"k{i}")) for i in range(10)}
    target = before - sizes[0] - sizes[1] - 100

    report = collect(store.root, max_size=target)

    assert report.bytes_after <= target
    assert store.inner.snapshot().stored_bytes == report.bytes_after
    gone = {k for k in ["twin", *(f"k{i}" for i in range(10))] if store.get(k) is None}
    # twin goes first (frees only its manifest: k9 still names its blob), then k0 and k1.
    assert gone == {"twin", "k0", "k1"}
    assert store.get("k9") == content("k9")
    assert report.plan["evicted_entries"]["count"] == 3 and report.blobs_removed == 2


def test_max_size_never_evicts_entries_written_after_the_scan_began(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "cas")
    for i in range(4):
        store.put(f"k{i}", content(f"k{i}"))
    age_tree(store.root, DAY)
    future = time.time() + 30  # stands for "written while the collector runs"
    os.utime(store.inner.layout.manifest_path(key_id("k3")), (future, future))
    report = collect(store.root, max_size=0)
    assert report.entries_removed == 3
    assert store.get("k3") == content("k3")


def test_dry_run_changes_nothing_and_predicts_the_real_run(tmp_path: Path) -> None:
    store, paths = garbage_cache(tmp_path / "cas")
    bad = store.inner.blobs.path_for(digest_of(content("live4")))
    Path(bad).write_bytes(b"\0" * len(content("live4")))
    # Older than the clock slack, younger than the grace: the real run then sees what the plan saw.
    age_tree(store.root, 600)
    age(paths["old_orphan"], 2 * 3600)
    age(store.inner.layout.manifest_path(key_id("live1")), 3 * DAY)
    options = {"verify": True, "max_age_s": DAY, "max_size": 5000}
    before = listing(store.root)

    plan = collect(store.root, dry_run=True, **options)

    assert listing(store.root) == before  # not a file added, removed, touched, nor the lock created
    assert not os.path.exists(tmp_path / "cas" / "evict.lock")
    assert plan.dry_run and plan.entries_removed > 0 and plan.blobs_removed > 0
    real = collect(store.root, **options)
    for name in ("entries_removed", "blobs_removed", "bytes_freed", "temp_files_removed", "plan"):
        assert getattr(real, name) == getattr(plan, name), name


_HOLD_LOCK = """
import sys, filelock
lock = filelock.FileLock(sys.argv[1]); lock.acquire()
print("locked", flush=True); sys.stdin.read()
"""


def test_busy_lock_changes_nothing(tmp_path: Path) -> None:
    store, paths = garbage_cache(tmp_path / "cas")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, os.path.join(store.root, "evict.lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        before = listing(store.root)
        with pytest.raises(CollectorBusyError, match="evict.lock"):
            collect(store.root)
        res = subprocess.run(
            [sys.executable, str(REPO / "tools" / "gc.py"), store.root],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert res.returncode == 1 and res.stdout == ""
        assert res.stderr.count("\n") == 1 and "busy" in res.stderr and "Traceback" not in res.stderr
        assert listing(store.root) == before
        t0 = time.monotonic()
        with pytest.raises(CollectorBusyError):
            collect(store.root, wait_s=0.3)
        assert time.monotonic() - t0 >= 0.3
    finally:
        holder.communicate("", timeout=30)
    assert collect(store.root).entries_removed == 3  # free again


_WORKER = r"""
import hashlib, os, random, signal, sys, time
from cuda_program_cas import CacheStore

role, root, wid, npre, stop, out = sys.argv[1:]
wid, npre = int(wid), int(npre)

def content(tag):
    seed = hashlib.sha256(tag.encode()).digest()
    return (seed * 200)[: 2000 + seed[0] * 16]

def source(w, n):
    # Every other write stores bytes equal to a pre-existing blob that the collector is removing.
    return f"pre{(n * 7 + w) % npre}" if n % 2 == 0 else f"w{w}-{n}"

# The parent marks a point with SIGUSR1; "mark N" says an operation begun after the N-th mark is done.
epoch = reported = 0
def on_mark(signum, frame):
    global epoch
    epoch += 1
signal.signal(signal.SIGUSR1, on_mark)
def done(begun):
    global reported
    if begun >= reported:
        print("mark", begun, flush=True)
        reported = begun + 1

store = CacheStore(root)
print("ready", flush=True)
if os.read(0, 1) != b"g":
    sys.exit(5)  # the parent gave up before the start
if role == "writer":
    lines, n = [], 0
    while not os.path.exists(stop):
        begun = epoch
        key = f"w{wid}-{n}"
        t = time.time_ns()
        if not store.put(key, content(source(wid, n))):
            sys.exit(3)
        lines.append(f"{key} {source(wid, n)} {t}\n")
        n += 1
        done(begun)
    with open(out, "w") as fh:
        fh.writelines(lines)
    sys.exit(0)
rng = random.Random(wid)
while not os.path.exists(stop):
    begun = epoch
    if rng.random() < 0.5:
        j = 2 * rng.randrange(npre // 2)  # only even ones: the odd ones are sure to expire, however fast this runs
        key, want = f"pre{j}", content(f"pre{j}")
    else:
        w, n = rng.randrange(2), rng.randrange(400)
        key, want = f"w{w}-{n}", content(source(w, n))
    got = store.get(key)
    if got is not None and got != want:
        sys.exit(4)
    done(begun)
sys.exit(0)
"""


@pytest.mark.slow
def test_collection_is_safe_while_other_processes_write_and_read(tmp_path: Path) -> None:
    root = str(tmp_path / "cas")
    npre = 600
    store = CacheStore(root)
    for j in range(npre):
        store.put(f"pre{j}", content(f"pre{j}"))
    age_tree(root, 2 * DAY)
    stop = str(tmp_path / "stop")
    env = dict(os.environ)
    gate = StartGate()
    workers = []
    for role, wid in (("writer", 0), ("writer", 1), ("reader", 2)):
        args = [role, root, str(wid), str(npre), stop, str(tmp_path / f"log{wid}")]
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, *args], env=env, stdin=gate.fd, stdout=subprocess.PIPE, text=True
        )
        workers.append(ChildLines(proc))
    try:
        for worker in workers:
            worker.wait("ready", timeout=60)
        gate.open(len(workers))
        for worker in workers:
            worker.wait("mark", at_least=0)  # each has done an operation: they are running
        # Every pre-existing entry has expired; new ones are written (half of them
        # deduplicating against blobs this run is removing) while it runs.
        report = collect(root, max_age_s=DAY, verify=True, max_size=100_000)
        ended = time.time_ns()
        for worker in workers:
            worker.proc.send_signal(signal.SIGUSR1)
        for worker in workers:
            worker.wait("mark", at_least=1)  # and one more, begun after the collection ended
    finally:
        Path(stop).touch()
        gate.close()  # if they never started, they read end of file and exit
        codes = [worker.finish(timeout=60) for worker in workers]
    assert codes == [0, 0, 0], "a worker failed (3: write dropped, 4: wrong bytes read)"
    # Readers keep some pre-existing entries in use; the rest expire.
    assert report.plan["expired_entries"]["count"] > 0 and not report.problems
    print(f"collection: {report.elapsed_s:.2f} s, {report.entries_removed} entries removed")

    fresh = CacheStore(root)
    during = after_start = 0
    for wid in (0, 1):
        for line in Path(tmp_path / f"log{wid}").read_text().splitlines():
            key, src, t = line.split()
            got = fresh.get(key)
            if int(t) >= report.started_ns:
                after_start += 1
                during += int(t) <= ended
                assert got == content(src), f"{key}, written during the collection, was lost"
            else:
                assert got in (None, content(src))
    assert during > 0, "no write overlapped the collection: the test proved nothing"
    print(f"{after_start} keys written after the collection began, {during} of them while it ran")
    assert verify(root).problems == []


_NO_CUDA = r"""
import sys
sys.modules["cuda.core"] = None  # `import cuda.core` now raises ImportError
try:
    import cuda.core
except ImportError:
    pass
else:
    sys.exit("cuda.core is still importable: the test would prove nothing")
from cuda_program_cas._cli.main import main
root = sys.argv[1]
codes = [
    main(["gc", root, "--verify", "--max-age", "1d", "--max-size", "1M", "--json"]),
    main(["stats", root, "--json"]),
    main(["verify", root, "--json"]),
]
assert sys.modules["cuda.core"] is None
sys.exit(max(codes))
"""


def test_gc_runs_where_cuda_core_cannot_be_imported(tmp_path: Path) -> None:
    store, paths = garbage_cache(tmp_path / "cas")
    res = run_python(_NO_CUDA, store.root)
    assert res.returncode == 0, res.stderr
    assert not os.path.exists(paths["old_orphan"])

    # The documented entry point, with a `cuda` package that shadows the real one.
    shadow = tmp_path / "shadow" / "cuda"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no CUDA on this storage server')\n")
    check = subprocess.run(
        [sys.executable, "-c", "import cuda.core"],
        env=dict(os.environ, PYTHONPATH=str(shadow.parent)),
        capture_output=True,
        check=False,
    )
    assert check.returncode != 0, "the shadow package does not hide cuda.core"
    orphan_path = orphan(store, content("another orphan"))
    age(orphan_path, 2 * 3600)
    res2 = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gc.py"), store.root],
        env=dict(os.environ, PYTHONPATH=str(shadow.parent)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res2.returncode == 0, res2.stderr
    assert res2.stdout.splitlines()[-1].startswith("removed 0 entries and 1 blob, freed ")
    assert not os.path.exists(orphan_path)


#: collect(), saying "removed 100" once it has unlinked 100 manifests (and going on).
_COLLECT_SAYING_REMOVED = r"""
import os, sys
from cuda_program_cas import collect
root = sys.argv[1]
index = os.path.realpath(os.path.join(root, "index"))
unlink, removed = os.unlink, 0
def counting_unlink(path, *args, **kwargs):
    global removed
    unlink(path, *args, **kwargs)
    if os.path.realpath(os.path.dirname(os.path.dirname(os.fspath(path)))) == index:
        removed += 1
        if removed == 100:
            print("removed", removed, flush=True)
os.unlink = counting_unlink
collect(root, max_age_s=86400, verify=True)
"""


def test_gc_killed_midway_leaves_a_consistent_cache(tmp_path: Path) -> None:
    """A collector killed at any point leaves no manifest without its blob."""
    root = str(tmp_path / "cas")
    store = CacheStore(root)
    n = 2500
    for j in range(100):
        store.put(f"k{j}", content(f"c{j}"))
    for j in range(100, n):  # many keys, few blobs: what dedup gives (written as a deduplicating put would)
        data = content(f"c{j % 100}")
        write_manifest(root, f"k{j}", digest_of(data), len(data))
    age_tree(root, 2 * DAY)
    proc = subprocess.Popen(
        [sys.executable, "-c", _COLLECT_SAYING_REMOVED, root],
        stdout=subprocess.PIPE,
        text=True,
    )
    collector = ChildLines(proc)
    try:
        collector.wait("removed", at_least=100, timeout=30)  # it runs on: the kill lands wherever it is then
        assert proc.poll() is None, "the collector finished before it could be interrupted"
    finally:
        proc.send_signal(signal.SIGKILL)
        collector.finish(timeout=30)
    left = len(store)
    assert 0 < left < n
    assert verify(root).problems == []  # no manifest without its blob, nothing half-done
    for j in range(n):
        assert store.get(f"k{j}") in (None, content(f"c{j % 100}"))


def test_a_shared_store_keeps_the_blobs_of_removed_entries_for_a_grace_period(tmp_path: Path) -> None:
    from cuda_program_cas import collect, publish
    from cuda_program_cas._disk.layout import is_shared_store
    from cuda_program_cas._verbs.common import SHARED_MIN_GRACE_S

    def age_all(seconds: float) -> list[Path]:
        files = [*(shared / "blobs").glob("*/*"), *(shared / "index").glob("*/*")]
        for f in files:
            os.utime(f, (time.time() - seconds,) * 2)
        return [f for f in files if f.parent.parent.name == "blobs"]

    node = CacheStore(tmp_path / "node")
    for i in range(5):
        node.put(f"k{i}", os.urandom(300 + i))
    shared = tmp_path / "shared"
    publish([node.root], shared)
    assert is_shared_store(str(shared))
    with pytest.raises(ValueError, match="at least"):
        collect(shared, grace_s=SHARED_MIN_GRACE_S - 1)

    age_all(600)  # published ten minutes ago
    report = collect(shared, max_size=0)
    assert report.entries_removed == 5 and report.blobs_removed == 0 and report.blobs_deferred == 5
    blobs = sorted((shared / "blobs").glob("*/*"))
    assert len(blobs) == 5 and all(time.time() - b.stat().st_mtime < 60 for b in blobs)  # freshened
    assert collect(shared).blobs_removed == 0  # orphans now, but young ones

    age_all(SHARED_MIN_GRACE_S + 60)
    assert collect(shared).blobs_removed == 5  # a grace period later they go

    # An operator can still collect it as a private cache, explicitly.
    publish([node.root], shared)
    age_all(600)
    assert collect(shared, grace_s=0, max_size=0, shared=False).blobs_removed == 5
