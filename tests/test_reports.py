"""Every verb is a library function of the package with a report of one shape.

- every verb's report has ``problems`` (a list), ``problem_count`` (at least its
  length) and ``as_dict()``, which ``json.dumps`` accepts and which holds both:
  on healthy caches and on caches with problems;
- ``cuda_program_cas.stats(path)`` says what a real cache holds, and ``stats --json``
  prints its ``as_dict()``;
- ``cuda_program_cas.repack``, ``clear`` and ``config`` from the top level;
- ``PackError`` is a ``CacheError``;
- ``import cuda_program_cas`` imports none of the verbs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import run_python
from test_code_layout import VERB_FUNCTIONS

import cuda_program_cas
from cuda_program_cas import CacheError, CacheStore, PackError, Report
from cuda_program_cas._cli.main import main

KEYS = {f"key-{i}": f"binary {i % 3}".encode() * (i + 1) for i in range(6)}


def local_cache(root: Path, *, damaged: bool = False) -> Path:
    """A real cache with a few entries.

    ``damaged``: one blob's bytes flipped in place, one manifest garbled, a counters
    file that is a directory, a settings file that is not JSON and a pack that is not a pack.
    """
    store = CacheStore(root)
    for key, value in KEYS.items():
        store.put(key, value)
    store.close()
    if damaged:
        blob = Path(store.inner.blobs.path_for(cuda_program_cas.digest_of(KEYS["key-5"])))
        blob.write_bytes(b"X" * blob.stat().st_size)
        manifest = next(p for p in (root / "index").rglob("*") if p.is_file())
        manifest.write_bytes(b"cpcas1 garbled\n")
        counters = Path(store.inner.layout.counters)
        counters.unlink(missing_ok=True)
        counters.mkdir()
        (root / "settings.json").write_text("{not json")
        (root / "packs").mkdir(exist_ok=True)
        (root / "packs" / f"pack-{'0' * 16}.cpk").write_bytes(b"not a pack")
    return root


def filestream_dir(root: Path) -> Path:
    """A FileStreamProgramCache directory as cuda.core lays it out: ``entries/<2 hex>/<62 hex>``, raw bytes."""
    for key, value in KEYS.items():
        kid = hashlib.sha256(key.encode()).hexdigest()
        path = root / "entries" / kid[:2] / kid[2:]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(value)
    (root / "entries" / "zz-not-an-entry").mkdir()
    (root / "entries" / "ab").mkdir(exist_ok=True)
    (root / "entries" / "ab" / "misnamed").write_bytes(b"x")
    return root


def shared_store(tmp: Path) -> Path:
    store = tmp / "store"
    cuda_program_cas.publish([local_cache(tmp / "node")], store, pack=True)
    cuda_program_cas.publish([local_cache(tmp / "node2")], store)
    return store


#: (id, the verb's function name, a run of it on a real cache under a fresh directory).
CASES: list[tuple[str, str, Callable[[Path], Report]]] = [
    ("collect", "collect", lambda t: cuda_program_cas.collect(local_cache(t / "c"))),
    ("collect-damaged", "collect", lambda t: cuda_program_cas.collect(local_cache(t / "c", damaged=True), verify=True)),
    ("verify", "verify", lambda t: cuda_program_cas.verify(local_cache(t / "c"))),
    ("verify-damaged", "verify", lambda t: cuda_program_cas.verify(local_cache(t / "c", damaged=True))),
    ("publish", "publish", lambda t: cuda_program_cas.publish([local_cache(t / "c")], t / "store")),
    (
        "publish-damaged",
        "publish",
        lambda t: cuda_program_cas.publish([local_cache(t / "c", damaged=True), t / "absent"], t / "store"),
    ),
    ("import", "import_filestream", lambda t: cuda_program_cas.import_filestream(filestream_dir(t / "fs"), t / "c")),
    ("stats", "stats", lambda t: cuda_program_cas.stats(local_cache(t / "c"))),
    ("stats-damaged", "stats", lambda t: cuda_program_cas.stats(local_cache(t / "c", damaged=True))),
    ("stats-no-cache", "stats", lambda t: cuda_program_cas.stats(t / "nothing")),
    ("explain", "explain", lambda t: cuda_program_cas.explain(local_cache(t / "c"))),
    ("explain-no-cache", "explain", lambda t: cuda_program_cas.explain(t / "nothing")),
    ("repack", "repack", lambda t: cuda_program_cas.repack(shared_store(t))),
    ("repack-damaged", "repack", lambda t: cuda_program_cas.repack(local_cache(t / "c", damaged=True))),
    ("clear", "clear", lambda t: cuda_program_cas.clear(local_cache(t / "c"))),
    ("clear-dry-run", "clear", lambda t: cuda_program_cas.clear(local_cache(t / "c"), dry_run=True)),
    ("config", "config", lambda t: cuda_program_cas.config(local_cache(t / "c"))),
    ("config-damaged", "config", lambda t: cuda_program_cas.config(local_cache(t / "c", damaged=True))),
    ("config-store", "config", lambda t: cuda_program_cas.config(t / "new", max_size=10 << 20)),
]


def test_every_verb_has_a_case() -> None:
    assert {verb for _, verb, _ in CASES} == set(VERB_FUNCTIONS.values())


@pytest.mark.parametrize(("case", "verb", "run"), CASES, ids=[c[0] for c in CASES])
def test_every_report_has_one_shape(tmp_path: Path, case: str, verb: str, run: Callable[[Path], Report]) -> None:
    report = run(tmp_path)
    assert isinstance(report, Report)
    assert type(report).__name__ in cuda_program_cas.__all__
    assert isinstance(report.problems, list)
    assert isinstance(report.problem_count, int) and report.problem_count >= len(report.problems)
    if case.endswith("-damaged"):
        assert report.problems, f"{verb} found nothing wrong in a damaged cache"
    out = report.as_dict()
    again = json.loads(json.dumps(out))
    assert isinstance(again["problems"], list) and len(again["problems"]) == len(report.problems)
    assert again["problem_count"] == report.problem_count


def test_reports_of_damaged_caches_list_their_problems(tmp_path: Path) -> None:
    found = cuda_program_cas.verify(local_cache(tmp_path / "v", damaged=True))
    assert {p.kind for p in found.problems} >= {"corrupt_blob", "invalid_manifest"}
    assert found.problem_count == len(found.problems) and found.as_dict()["problems_found"] == found.problem_count
    published = cuda_program_cas.publish(
        [local_cache(tmp_path / "p", damaged=True), tmp_path / "absent"], tmp_path / "s"
    )
    assert published.problem_count == len(published.problems) >= 3
    assert any(line.startswith("bad blob (skipped): ") for line in published.problems)
    assert any(line.startswith("error: ") and "absent" in line for line in published.problems)


def test_stats_of_a_real_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cas"
    store = CacheStore(root, max_size_bytes=1 << 20)
    for key, value in KEYS.items():
        store.put(key, value)
    store.put("same", KEYS["key-0"])  # deduplicated
    assert store.get("key-1") == KEYS["key-1"]
    assert store.get("absent") is None
    store.close()
    mine = store.stats()

    report = cuda_program_cas.stats(root, max_size=1 << 20)
    assert isinstance(report, cuda_program_cas.StatsReport)
    assert report.exists and report.path == str(root)
    assert (report.entries, report.blobs) == (len(KEYS) + 1, len(set(KEYS.values())))
    assert report.logical_bytes == sum(map(len, KEYS.values())) + len(KEYS["key-0"]) == mine.logical_bytes
    assert report.blob_bytes == sum(map(len, set(KEYS.values()))) == mine.blob_bytes
    assert report.stored_bytes == mine.stored_bytes == report.blob_bytes + report.manifest_bytes
    assert report.dedup_ratio == round(report.logical_bytes / report.blob_bytes, 3)
    assert report.max_size_bytes == 1 << 20 and report.max_size_source == "argument"
    assert report.counters is not None
    assert (report.counters["writes"], report.counters["dedup_writes"]) == (len(KEYS) + 1, 1)
    assert (report.counters["hits"], report.counters["misses"]) == (1, 1) and report.hit_rate == 0.5
    assert report.problems == [] and report.problem_count == 0

    # The command line prints the same report.
    capsys.readouterr()
    assert main(["stats", str(root), "--json", "--max-size", str(1 << 20)]) == 0
    printed = json.loads(capsys.readouterr().out)
    mine_dict = report.as_dict()
    shared = set(printed) & set(mine_dict)
    assert shared == set(printed), set(printed) ^ set(mine_dict)
    assert {k: printed[k] for k in shared} == json.loads(json.dumps({k: mine_dict[k] for k in shared}))

    # Without max_size: the cap stored in the cache, as a cache opened there gets it.
    cuda_program_cas.config(root, max_size=2 << 20)
    capped = cuda_program_cas.stats(root)
    assert (capped.max_size_bytes, capped.max_size_source) == (2 << 20, "cache")


def test_stats_of_a_path_without_a_cache_is_an_empty_cache(tmp_path: Path) -> None:
    report = cuda_program_cas.stats(tmp_path / "nothing")
    assert not report.exists and report.entries == 0 and report.problem_count == 0
    with pytest.raises(cuda_program_cas.LayoutError):
        cuda_program_cas.stats(Path(__file__))


def test_repack_from_the_top_level(tmp_path: Path) -> None:
    store = shared_store(tmp_path)
    report = cuda_program_cas.repack(store)
    assert isinstance(report, cuda_program_cas.RepackReport)
    assert report.pack is not None and report.entries == len(KEYS) and len(report.retired) == 1
    assert report.problems == [] and report.as_dict()["unreadable"] == []
    assert cuda_program_cas.verify(store).problems == []


def test_clear_and_config_from_the_top_level(tmp_path: Path) -> None:
    root = local_cache(tmp_path / "cas")
    stored = cuda_program_cas.config(root, max_size=5 << 20)
    assert stored.stored == {"max_size_bytes": 5 << 20} and stored.as_dict()["stored"] == stored.stored
    shown = cuda_program_cas.config(root, name="max_size_bytes")
    assert [(s.value, s.source) for s in shown.settings] == [(5 << 20, "cache")]
    assert "stored" not in shown.as_dict()
    report = cuda_program_cas.clear(root)
    assert isinstance(report, cuda_program_cas.ClearReport)
    assert report.entries_before == len(KEYS) and report.entries_after == 0 and report.bytes_freed > 0
    assert len(CacheStore(root)) == 0
    assert cuda_program_cas.config(root, name="max_size_bytes").settings[0].value == 5 << 20  # settings kept
    shared = shared_store(tmp_path)
    with pytest.raises(cuda_program_cas.LayoutError, match="is a shared store"):
        cuda_program_cas.clear(shared)


def test_pack_error_is_a_cache_error(tmp_path: Path) -> None:
    assert isinstance(PackError("x"), CacheError) and isinstance(PackError("x"), ValueError)
    from cuda_program_cas._disk.pack import PackReader

    bad = tmp_path / "bad.cpk"
    bad.write_bytes(b"not a pack")
    with pytest.raises(CacheError):
        PackReader(str(bad))


def test_importing_the_package_imports_no_verb() -> None:
    code = (
        "import sys, cuda_program_cas\n"
        "loaded = [m for m in sys.modules if m.startswith(('cuda_program_cas._verbs', 'cuda_program_cas._cli'))]\n"
        "assert loaded == [], loaded\n"
        "assert cuda_program_cas.stats and cuda_program_cas.repack and cuda_program_cas.PackError\n"
        "assert 'cuda_program_cas._verbs.stats' in sys.modules\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
