"""Publishing local caches into a shared store, and collecting it, while nodes read it.

Reader processes hammer the store with every key the test knows and check each
hit byte for byte against the values that key may have; they report through
their exit status. Publishers are the real console script in other processes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ChildLines, run_python

from cuda_program_cas import CacheStore, digest_of, publish
from cuda_program_cas._cli.main import main as cli_main

READER = r"""
import json, os, random, signal, sys
from cuda_program_cas import CacheStore
shared, local, expected_path, stop, gone, copy = sys.argv[1:7]
expected = {k: {bytes.fromhex(v) for v in vs} for k, vs in json.load(open(expected_path)).items()}
# The parent marks a point with SIGUSR1; "round N" says a round begun after the N-th mark is done.
epoch = reported = 0
def on_mark(signum, frame):
    global epoch
    epoch += 1
signal.signal(signal.SIGUSR1, on_mark)
def round_done(begun):
    global reported
    if begun >= reported:
        print("round", begun, flush=True)
        reported = begun + 1
if copy == "check":
    # No collector runs: a manifest whose blob is absent means publish broke its order.
    from cuda_program_cas._disk.files import scan_sharded
    from cuda_program_cas.index import parse_manifest
    print("ready", flush=True)
    checked = 0
    while not os.path.exists(stop):
        begun = epoch
        for kid, path, _st in scan_sharded(os.path.join(shared, "index")):
            try:
                manifest = parse_manifest(open(path, "rb").read(), kid)
            except FileNotFoundError:
                continue
            if manifest is None:
                sys.exit("a partial manifest: " + path)
            blob = os.path.join(shared, "blobs", manifest.digest[:2], manifest.digest[2:])
            if not os.path.exists(blob):
                sys.exit("a manifest before its blob: " + path)
            checked += 1
        round_done(begun)
    print(json.dumps({"checked": checked}))
    sys.exit(0)
cache = CacheStore(local, shared=[shared], copy_shared_hits=copy == "1")
keys = sorted(expected)
hits = rounds = 0
seen = set()
print("ready", flush=True)
while not os.path.exists(stop):
    begun = epoch  # before looking at `gone`: a round begun after a mark sees what came before it
    gone_now = os.path.exists(gone)
    random.shuffle(keys)
    for key in keys:
        data = cache.get(key)
        if data is None:
            continue
        if data not in expected[key]:
            print("wrong bytes for", key, flush=True)
            sys.exit(3)
        if gone_now:
            print("a hit after the store was collected:", key, flush=True)
            sys.exit(4)
        hits += 1
        seen.add(key)
    rounds += 1
    round_done(begun)
print(json.dumps({"hits": hits, "keys": len(seen), "rounds": rounds, "stats": str(cache.stats())}))
"""


class Readers:
    """Reader processes over ``shared``; ``stop()`` returns their reports and checks their exit status.

    ``mark()`` waits until every reader has done a whole round begun after it was called.
    """

    def __init__(self, tmp: Path, shared: Path, expected: dict[str, set[bytes]], copies: list[bool | str]) -> None:
        self.dir = tmp / "readers"
        self.dir.mkdir()
        (self.dir / "expected.json").write_text(json.dumps({k: [v.hex() for v in vs] for k, vs in expected.items()}))
        self.stop_file = self.dir / "stop"
        self.gone_file = self.dir / "gone"
        self.marks = 0
        self.procs: list[ChildLines] = []
        for n, copy in enumerate(copies):
            args = [str(shared), str(self.dir / f"local{n}"), str(self.dir / "expected.json")]
            args += [str(self.stop_file), str(self.gone_file), copy if isinstance(copy, str) else "1" if copy else "0"]
            self.procs.append(
                ChildLines(
                    subprocess.Popen(
                        [sys.executable, "-c", READER, *args],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                )
            )
        try:
            for proc in self.procs:
                proc.wait("ready", timeout=60)
        except BaseException:
            self.kill()
            raise

    def mark(self) -> None:
        """Return once every reader has done a whole round begun after this call (it saw what came before)."""
        self.marks += 1
        for proc in self.procs:
            proc.proc.send_signal(signal.SIGUSR1)
        for proc in self.procs:
            proc.wait("round", at_least=self.marks)

    def gone(self) -> None:
        """From now on every lookup must miss; returns once every reader has done a whole round so."""
        self.gone_file.touch()
        self.mark()

    def stop(self) -> list[dict[str, object]]:
        self.stop_file.touch()
        reports = []
        for proc in self.procs:
            code = proc.finish(timeout=60)
            assert code == 0, f"reader exited {code}: {proc.output()}"
            reports.append(json.loads(proc.lines[-1]))
        return reports

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()


def node_cache(root: Path, values: dict[str, bytes]) -> Path:
    store = CacheStore(root)
    for key, value in values.items():
        store.put(key, value)
    return root


def publish_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cuda_program_cas", "publish", "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"publish exited {proc.returncode}: {out}{err}"
    return json.loads(out)


def listing(root: Path) -> dict[str, tuple[int, int, int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (
                st.st_ino,
                st.st_mode,
                st.st_size,
                st.st_mtime_ns,
            )
    return out


@pytest.mark.slow
def test_two_nodes_publish_while_readers_hammer(tmp_path: Path) -> None:
    rng = random.Random(5)

    def blob(n: int) -> bytes:
        return rng.randbytes(rng.choice([300, 5000, 20000, 70000]) + n)

    a = {f"a{i}": blob(i) for i in range(60)}
    b = {f"b{i}": blob(i) for i in range(60)}
    same = {f"same{i}": blob(i) for i in range(20)}
    a.update(same)
    b.update(same)
    for i in range(8):  # the same key, different bytes on the two nodes
        a[f"conflict{i}"] = blob(i)
        b[f"conflict{i}"] = blob(i)
    # Large enough that the publish below is still writing blobs when the test kills it.
    c = {f"c{i}": rng.randbytes(2 * 1024 * 1024 + i) for i in range(24)}
    expected: dict[str, set[bytes]] = {}
    for values in (a, b, c):
        for key, value in values.items():
            expected.setdefault(key, set()).add(value)
    node_a, node_b, node_c = (node_cache(tmp_path / n, v) for n, v in (("a", a), ("b", b), ("c", c)))
    shared = tmp_path / "shared"
    # The store exists (one key) before the readers start, so they hammer it from the
    # first publish on (a store that appears later is picked up within 5 s: test_cluster.py).
    seed = {"seed": b"seed bytes"}
    expected["seed"] = {seed["seed"]}
    publish([node_cache(tmp_path / "seed", seed)], shared)
    readers = Readers(tmp_path, shared, expected, copies=[False, True, "check"])
    try:
        # Two publishers at once.
        procs = [publish_cli(str(node_a), str(shared)), publish_cli(str(node_b), str(shared))]
        first = [finish(p) for p in procs]
        assert all(r["problem_count"] == 0 for r in first)
        # Every key of each source was accounted for exactly once by its publisher.
        outcomes = ("published", "unchanged", "conflicts", "replaced")
        assert sum(r[o] for r in first for o in outcomes) == len(a) + len(b)

        # A publish killed half way, then run again to completion.
        killed = publish_cli(str(node_c), str(shared))
        temp_seen: list[tuple[int, int]] = []
        while killed.poll() is None and not temp_seen:
            try:
                with os.scandir(shared / "tmp") as it:
                    for entry in it:
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        temp_seen.append((stat.S_IMODE(st.st_mode), st.st_size))
            except FileNotFoundError:
                pass
        killed.send_signal(signal.SIGKILL)
        killed.communicate()
        assert temp_seen, "the publish ended before any temp file was seen"
        final_sizes = {len(v) for v in c.values()}
        # Temp files are private until complete (their final mode is set just before the rename).
        assert all(mode == 0o600 or size in final_sizes for mode, size in temp_seen), temp_seen
        resumed = finish(publish_cli(str(node_c), str(shared)))
        assert resumed["problem_count"] == 0
        assert resumed["published"] + resumed["unchanged"] == len(c)

        # Publishing again changes nothing: not a byte, not an mtime.
        before = listing(shared)
        again = [publish([n], shared) for n in (node_a, node_b, node_c)]
        assert [(r.published, r.replaced, r.blobs_published) for r in again] == [(0, 0, 0)] * 3
        assert sum(r.conflicts for r in again) == 8
        after = listing(shared)
        assert {k: v for k, v in after.items() if not k.startswith("tmp")} == {
            k: v for k, v in before.items() if not k.startswith("tmp")
        }
        readers.mark()  # every reader has read the finished store
    except BaseException:
        readers.kill()
        raise
    reports = readers.stop()
    assert all(r["keys"] > len(seed) for r in reports[:2]), reports  # they read what was being published
    assert reports[2]["checked"] > 0
    # The store holds every key, each with bytes one of the nodes had.
    check = CacheStore(tmp_path / "check", shared=[shared], copy_shared_hits=False)
    for key, values in expected.items():
        assert check.get(key) in values, key
    # What the killed publisher left in tmp/ is private.
    for entry in os.scandir(shared / "tmp"):
        assert stat.S_IMODE(entry.stat().st_mode) == 0o600 or entry.stat().st_size in final_sizes


def _collected_while_reading(tmp_path: Path, collect_first: bool) -> None:
    values = {f"k{i}": random.Random(i).randbytes(1000 + 37 * i) for i in range(150)}
    shared = tmp_path / "shared"
    assert publish([node_cache(tmp_path / "node", values)], shared).published == len(values)
    readers = Readers(tmp_path, shared, {k: {v} for k, v in values.items()}, copies=[False, False])
    try:
        readers.mark()  # every reader has read the whole store once
        if collect_first:
            from cuda_program_cas import collect

            with pytest.raises(ValueError, match="shared store"):
                collect(shared, grace_s=0, max_size=0)  # publish marked it: a short grace is refused
            report = collect(shared, max_size=0)
            assert report.shared and report.entries_removed == len(values)
            # A node may have read a manifest just before it went: every blob stays
            # (freshened), to be collected as an orphan a grace period later.
            assert report.blobs_removed == 0 and report.blobs_deferred == len(set(values.values()))
            assert len(list((shared / "blobs").glob("*/*"))) == len(set(values.values()))
            readers.gone()  # from now on, every lookup must miss: each reader has done a round so
        shutil.rmtree(shared)
        readers.gone()
    except BaseException:
        readers.kill()
        raise
    reports = readers.stop()
    assert all(r["hits"] > 0 for r in reports)


def test_shared_store_collected_then_removed_while_readers_run(tmp_path: Path) -> None:
    _collected_while_reading(tmp_path, collect_first=True)


def test_shared_store_removed_while_readers_run(tmp_path: Path) -> None:
    _collected_while_reading(tmp_path, collect_first=False)


# -- publish semantics, one process ---------------------------------------------------------


def test_publish_creates_the_store_and_is_idempotent(tmp_path: Path) -> None:
    values = {f"k{i}": os.urandom(50 + i) for i in range(30)}
    values["dup"] = values["k0"]  # two keys, one blob
    node = node_cache(tmp_path / "node", values)
    shared = tmp_path / "deep" / "shared"
    report = publish([node], shared)
    assert report.created and report.problems == [] and report.problem_count == 0
    assert (report.published, report.blobs_published) == (31, 30)
    assert report.bytes_published == sum(len(v) for k, v in values.items() if k != "dup")
    reader = CacheStore(tmp_path / "local", shared=[shared])
    assert all(reader.get(k) == v for k, v in values.items())
    before = listing(shared)
    again = publish([node], shared)
    assert (again.published, again.unchanged, again.blobs_published, again.created) == (0, 31, 0, False)
    assert listing(shared) == before
    # A publish of the store into itself is refused for that source.
    assert publish([shared], shared).errors


def test_dry_run_writes_nothing_and_reports_what_publish_would_do(tmp_path: Path) -> None:
    node = node_cache(tmp_path / "node", {f"k{i}": os.urandom(64) for i in range(10)})
    shared = tmp_path / "shared"
    dry = publish([node], shared, dry_run=True)
    assert not shared.exists()
    assert (dry.created, dry.published, dry.blobs_published) == (True, 10, 10)
    real = publish([node], shared)
    assert (real.published, real.blobs_published, real.bytes_published) == (10, 10, dry.bytes_published)
    more = node_cache(tmp_path / "more", {"new": b"new bytes"})
    before = listing(shared)
    dry2 = publish([more, node], shared, dry_run=True)
    assert (dry2.published, dry2.unchanged, dry2.created) == (1, 10, False)
    assert listing(shared) == before


def test_bad_sources_are_skipped_and_reported(tmp_path: Path) -> None:
    node = tmp_path / "node"
    store = CacheStore(node)
    for key in ("good", "garbage", "missing", "shared-blob", "symlink"):
        store.put(key, f"content of {key}".encode())
    # A blob that is a symlink to a file outside the cache, with the right bytes: not followed.
    outside = tmp_path / "outside"
    outside.write_bytes(b"content of symlink")
    link = Path(store.inner.blobs.path_for(digest_of(b"content of symlink")))
    link.unlink()
    link.symlink_to(outside)
    Path(store.inner.blobs.path_for(digest_of(b"content of garbage"))).write_bytes(b"X" * len(b"content of garbage"))
    os.unlink(store.inner.blobs.path_for(digest_of(b"content of missing")))
    Path(store.inner.layout.manifest_path("ab" * 32)).parent.mkdir(exist_ok=True)
    Path(store.inner.layout.manifest_path("ab" * 32)).write_bytes(b"cpcas1 garbled\n")
    shared = tmp_path / "shared"
    report = publish([node, tmp_path / "absent", tmp_path], shared)
    assert sorted(b.split(": ")[1] for b in report.bad_blobs) == sorted(
        digest_of(f"content of {k}".encode()) for k in ("garbage", "symlink")
    )
    assert len(report.missing_blobs) == 1 and digest_of(b"content of missing") in report.missing_blobs[0]
    assert len(report.invalid_manifests) == 1
    assert len(report.errors) == 2  # absent, and a directory that is not a cache
    assert report.published == 2 and report.skipped == 3 and report.problem_count == len(report.problems) == 6
    reader = CacheStore(tmp_path / "local", shared=[shared])
    assert reader.get("good") == b"content of good"
    assert reader.get("garbage") is None and reader.get("missing") is None and reader.get("symlink") is None
    # Nothing of the bad entries reached the store; the source was not changed.
    assert len(CacheStore(shared, read_only=True)) == 2
    assert Path(store.inner.blobs.path_for(digest_of(b"content of garbage"))).read_bytes().startswith(b"XXX")


def test_conflicts_keep_what_was_published_and_broken_entries_are_replaced(tmp_path: Path) -> None:
    first = node_cache(tmp_path / "first", {"k": b"first bytes", "broken": b"v1", "dangling": b"d1"})
    second = node_cache(tmp_path / "second", {"k": b"second bytes", "broken": b"v2", "dangling": b"d2"})
    shared = tmp_path / "shared"
    publish([first], shared)
    store = CacheStore(shared, read_only=True)
    from cuda_program_cas.index import key_id

    Path(store.inner.layout.manifest_path(key_id("broken"))).write_bytes(b"garbage")
    os.unlink(store.inner.blobs.path_for(digest_of(b"d1")))
    report = publish([second], shared)
    assert (report.conflicts, report.replaced, report.published) == (1, 2, 0)
    reader = CacheStore(tmp_path / "local", shared=[shared], copy_shared_hits=False)
    assert reader.get("k") == b"first bytes"
    assert reader.get("broken") == b"v2" and reader.get("dangling") == b"d2"
    # Among the sources of one run, the first listed wins.
    both = publish([second, first], tmp_path / "other")
    assert both.conflicts == 3
    other = CacheStore(tmp_path / "l2", shared=[tmp_path / "other"], copy_shared_hits=False)
    assert other.get("k") == b"second bytes"


def test_a_corrupt_blob_in_the_store_is_repaired_when_a_new_key_names_it(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    publish([node_cache(tmp_path / "a", {"k1": b"payload"})], shared)
    blob = Path(CacheStore(shared, read_only=True).inner.blobs.path_for(digest_of(b"payload")))
    blob.write_bytes(b"PAYLOAD")
    report = publish([node_cache(tmp_path / "b", {"k2": b"payload"})], shared)
    assert (report.published, report.blobs_published) == (1, 1)
    assert blob.read_bytes() == b"payload"


def test_a_store_blob_damaged_in_place_is_repaired_by_the_next_publish(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = {"k1": b"payload one", "k2": b"payload two", "k3": b"payload two"}
    node = node_cache(tmp_path / "a", values)
    shared = tmp_path / "shared"
    publish([node], shared)
    blob = Path(CacheStore(shared, read_only=True).inner.blobs.path_for(digest_of(b"payload two")))
    blob.write_bytes(b"PAYLOAD TWO")  # same size: only its hash tells
    reader = CacheStore(tmp_path / "local", shared=[shared], copy_shared_hits=False)
    assert reader.get("k2") is None
    trusting = publish([node], shared, verify_existing=False)  # a copy of the right size is trusted
    assert (trusting.unchanged, trusting.blobs_repaired) == (3, 0) and blob.read_bytes() == b"PAYLOAD TWO"
    assert cli_main(["publish", str(node), str(shared)]) == 0
    assert "1 damaged blob repaired" in capsys.readouterr().out
    assert blob.read_bytes() == b"payload two"
    assert reader.get("k2") == reader.get("k3") == b"payload two"
    again = publish([node], shared)
    assert (again.unchanged, again.blobs_published, again.blobs_repaired) == (3, 0, 0)


def test_resume_after_interruption_and_stale_temp_files(tmp_path: Path) -> None:
    values = {f"k{i}": os.urandom(100) for i in range(20)}
    node = node_cache(tmp_path / "node", values)
    shared = tmp_path / "shared"
    publish([node], shared)
    # As if interrupted: some manifests not written yet, one blob not either, a stale temp file.
    store = CacheStore(shared, read_only=True)
    from cuda_program_cas.index import key_id

    for i in range(5):
        os.unlink(store.inner.layout.manifest_path(key_id(f"k{i}")))
    os.unlink(store.inner.blobs.path_for(digest_of(values["k7"])))
    stale = shared / "tmp" / "publish-1-deadbeef.tmp"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    young = shared / "tmp" / "publish-2-cafe.tmp"
    young.write_bytes(b"in flight")
    report = publish([node], shared)
    assert (report.published, report.blobs_published, report.unchanged) == (5, 1, 15)
    assert not stale.exists() and young.exists()  # another publisher's temp file is left alone
    reader = CacheStore(tmp_path / "local", shared=[shared])
    assert all(reader.get(k) == v for k, v in values.items())


@pytest.mark.parametrize(("umask", "group_shared"), [(0o022, False), (0o077, False), (0o077, True), (0o002, True)])
def test_modes_follow_the_umask_or_group_shared(tmp_path: Path, umask: int, group_shared: bool) -> None:
    node = node_cache(tmp_path / "node", {"k": b"bytes", "j": b"other"})
    shared = tmp_path / "shared"
    old = os.umask(umask)
    try:
        publish([node], shared, group_shared=group_shared)
    finally:
        os.umask(old)
    want_file = 0o644 & ~umask
    want_dir = 0o777 & ~umask
    if group_shared:
        want_file |= 0o640
        want_dir |= 0o2750
    for dirpath, dirnames, filenames in os.walk(shared):
        for name in filenames:
            mode = stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode)
            assert mode == want_file, (dirpath, name, oct(mode))
        for name in dirnames:
            mode = stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode)
            want = (want_dir if group_shared else 0o700) if name == "tmp" else want_dir
            assert mode == want, (dirpath, name, oct(mode), oct(want))
    root_mode = stat.S_IMODE(os.lstat(shared).st_mode)
    assert root_mode == want_dir
    if group_shared:
        assert root_mode & stat.S_ISGID


def test_cli_exit_codes_json_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node = node_cache(tmp_path / "node", {"k": b"bytes"})
    shared = tmp_path / "shared"
    assert cli_main(["publish", str(node), str(shared)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("published 1 entry and 1 blob (5 B) from 1 cache into ")
    assert out[-1].endswith("store created, 0 already there")
    assert cli_main(["publish", "--json", "--dry-run", str(node), str(shared)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["dry_run"], report["unchanged"], report["published"]) == (True, 1, 0)
    # A problem found: exit 1, the problem named, the summary last.
    bad = tmp_path / "bad"
    store = CacheStore(bad)
    store.put("x", b"xxxx")
    Path(store.inner.blobs.path_for(digest_of(b"xxxx"))).write_bytes(b"yyyy")
    assert cli_main(["publish", str(bad), str(shared)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("bad blob (skipped): ") and "1 problem" in out[-1]
    # A destination that is not a cache is bad usage: one line, exit 2; so is a missing argument.
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "data.txt").write_text("x")
    assert cli_main(["publish", str(node), str(tmp_path / "foreign")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a cuda-program-cas cache" in err[0]
    proc = run_python(
        "from cuda_program_cas._cli.main import main; raise SystemExit(main(['publish', 'only-one-path']))"
    )
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_tmp_and_shard_directories_removed_between_runs_are_recreated(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    publish([node_cache(tmp_path / "a", {"k": b"first"})], shared)
    shutil.rmtree(shared / "tmp")
    shutil.rmtree(shared / "blobs")
    report = publish([node_cache(tmp_path / "b", {"j": b"second", "k": b"first"})], shared)
    assert (report.published, report.blobs_published, report.unchanged) == (1, 2, 1)
    assert stat.S_IMODE(os.lstat(shared / "tmp").st_mode) == 0o700
    reader = CacheStore(tmp_path / "local", shared=[shared])
    assert (reader.get("j"), reader.get("k")) == (b"second", b"first")


def test_two_publishers_create_one_store_at_once(tmp_path: Path) -> None:
    a = node_cache(tmp_path / "a", {f"a{i}": os.urandom(200) for i in range(30)} | {"same": b"same bytes"})
    b = node_cache(tmp_path / "b", {f"b{i}": os.urandom(200) for i in range(30)} | {"same": b"same bytes"})
    shared = tmp_path / "new" / "shared"
    reports = [finish(p) for p in [publish_cli(str(a), str(shared)), publish_cli(str(b), str(shared))]]
    assert all(r["problem_count"] == 0 for r in reports)
    assert sum(r["published"] + r["unchanged"] for r in reports) == 62
    reader = CacheStore(tmp_path / "local", shared=[shared])
    assert reader.get("same") == b"same bytes"
    assert len(CacheStore(shared, read_only=True)) == 61


def test_verify_repair_keeps_the_shared_mark_of_a_damaged_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cuda_program_cas import collect, verify
    from cuda_program_cas._disk.layout import is_shared_store

    shared = tmp_path / "shared"
    publish([node_cache(tmp_path / "node", {"k": b"v" * 100})], shared)
    layout = shared / "layout.json"
    whole = layout.read_bytes()
    mark = whole.index(b'"shared": true') + len(b'"shared": true')
    # Cut anywhere (a torn write, a disk that lost the tail): the mark is kept once it is whole in what is left.
    assert whole.endswith(b"}\n")  # cut before the newline, it is whole
    for cut in range(len(whole) - 1):
        layout.write_bytes(whole[:cut])
        report = verify(shared, repair=True)
        assert [p.kind for p in report.problems] == ["damaged_layout"] and report.problems[0].fixed
        assert is_shared_store(str(shared)) is (cut >= mark), (cut, whole[:cut])
        detail = report.problems[0].detail
        assert ("with its shared mark" in detail) is (cut >= mark) and ("--shared for a published" in detail) is (
            cut < mark
        )
    # Valid JSON with a bad field still says it; so a short grace stays refused.
    layout.write_text('{"layout": "cuda-program-cas", "version": "two", "shared": true}')
    assert verify(shared, repair=True).problems[0].fixed and is_shared_store(str(shared))
    with pytest.raises(ValueError, match="shared store"):
        collect(shared, grace_s=60)
    # Nothing left to read: the operator says it.
    for args, marked in ((["--repair", "--shared"], True), (["--repair", "--no-shared"], False)):
        layout.write_bytes(b"")
        capsys.readouterr()
        assert cli_main(["verify", str(shared), *args]) == 0
        assert is_shared_store(str(shared)) is marked
    layout.write_text('{"layout": "cuda-program-cas", "version": 0, "shared": true}')
    assert cli_main(["verify", str(shared), "--repair", "--no-shared"]) == 0 and not is_shared_store(str(shared))
    capsys.readouterr()
    assert cli_main(["verify", str(shared), "--shared"]) == 2
    assert "give --repair" in capsys.readouterr().err
