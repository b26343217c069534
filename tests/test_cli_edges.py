"""The console script at its edges: each bad use one line and its documented exit status, never a traceback.

Exit status 2 is bad usage, 1 a command that could not do its work or found problems it did not fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ChildLines, is_root

import cuda_program_cas
from cuda_program_cas import CacheStore, parse_duration, publish
from cuda_program_cas._cli.main import main


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str, command: str) -> str:
    """The last line of ``err``, checked to be the command's one-line error."""
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"cuda-program-cas {command}: error: "), err
    return last


def a_cache(root: Path, n: int = 3) -> CacheStore:
    store = CacheStore(root)
    for i in range(n):
        store.put(f"k{i}", bytes([i]) * 2000)
    return store


# -- gc on a shared store ---------------------------------------------------------------------


def test_a_short_grace_on_a_published_store_is_bad_usage_saying_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    publish([a_cache(tmp_path / "node").root], tmp_path / "store")
    before = sorted(os.walk(tmp_path / "store"))
    code, out, err = cli(capsys, "gc", str(tmp_path / "store"), "--grace", "10m")
    line = one_line_error(err, "gc")
    assert code == 2 and out == ""
    assert "is a shared store (publish marked it" in line and "--grace 1h or more" in line
    assert "--shared was given" not in line
    assert sorted(os.walk(tmp_path / "store")) == before
    # Told it is not shared after all, gc takes the short grace.
    assert cli(capsys, "gc", str(tmp_path / "store"), "--grace", "10m", "--no-shared", "--dry-run")[0] == 0


def test_a_short_grace_with_shared_on_a_private_cache_says_shared_was_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = a_cache(tmp_path / "cas")
    code, out, err = cli(capsys, "gc", store.root, "--shared", "--grace", "1s")
    line = one_line_error(err, "gc")
    assert code == 2 and out == ""
    assert "--shared was given" in line and "is a shared store (publish" not in line
    assert cli(capsys, "gc", store.root, "--shared", "--grace", "1h", "--dry-run")[0] == 0


# -- ages and sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["gc", "--max-age", "7"], "a duration needs a unit: '7' (write 7s for seconds"),
        (["gc", "--grace", "90"], "write 90s for seconds"),
        (["gc", "--max-age", "0d"], "an age must be more than zero, got '0d'"),
        (["gc", "--max-age", "-1d"], "an age must not be negative, got '-1d'"),
        (["gc", "--max-age=-1d"], "an age must not be negative, got '-1d'"),
        (["gc", "--max-age", "-1"], "an age must not be negative, got '-1'"),
        (["gc", "--grace", "-1h"], "an age must not be negative, got '-1h'"),
        (["gc", "--wait", "-5"], "a wait must not be negative, got '-5'"),
        (["gc", "--max-size", "-5M"], "a size must be more than zero, got '-5M'"),
        (["gc", "--max-size=-5M"], "a size must be more than zero, got '-5M'"),
        (["gc", "--max-size", "0"], "a size must be more than zero, got '0'"),
        (["stats", "--max-size", "-1G"], "a size must be more than zero, got '-1G'"),
    ],
)
def test_ages_need_a_unit_and_ages_and_sizes_must_be_positive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    store = a_cache(tmp_path / "cas")
    before = sorted(os.walk(store.root))
    code, out, err = cli(capsys, *argv, store.root)
    assert code == 2 and out == ""
    assert needle in one_line_error(err, argv[0])
    assert "expected one argument" not in err
    assert sorted(os.walk(store.root)) == before


def test_ages_with_units_and_waits_in_plain_seconds_are_taken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = a_cache(tmp_path / "cas")
    code, out, _ = cli(capsys, "gc", store.root, "--max-age", "7d", "--grace", "0s", "--wait", "5", "--json")
    assert code == 0 and json.loads(out)["entries_removed"] == 0
    # The library keeps reading plain numbers as seconds; only the command line asks for the unit.
    assert parse_duration("7") == 7.0 and parse_duration("2m") == 120.0
    with pytest.raises(ValueError, match="needs a unit"):
        parse_duration("7", require_unit=True)


# -- publish ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("missing", "no cache at"),
        ("filestream", "it looks like a FileStreamProgramCache"),
        ("dangling", "is a symlink to"),
        ("store", "is the store itself"),
    ],
)
def test_publish_usage_errors_exit_2_with_the_prefix_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str, needle: str
) -> None:
    (tmp_path / "filestream" / "entries").mkdir(parents=True)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    store = tmp_path / "store"
    code, out, err = cli(capsys, "publish", str(tmp_path / source), str(store))
    assert code == 2 and out == ""
    assert needle in one_line_error(err, "publish")
    assert not store.exists()  # nothing created for a run that could not publish anything


def test_every_command_reports_problems_as_a_list_with_a_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = a_cache(tmp_path / "node")
    fs = tmp_path / "fs"
    (fs / "entries" / "ab").mkdir(parents=True)
    (fs / "entries" / "ab" / ("c" * 62)).write_bytes(b"a FileStream entry")
    runs = {
        "publish": ["publish", node.root, str(tmp_path / "store")],
        "repack": ["repack", str(tmp_path / "store")],
        "gc": ["gc", node.root],
        "stats": ["stats", node.root],
        "verify": ["verify", node.root],
        "import-filestream": ["import-filestream", str(fs), node.root],
    }
    for command, argv in runs.items():
        code, out, err = cli(capsys, *argv, "--json")
        report = json.loads(out)
        assert code == 0, (command, err)
        assert report["problems"] == [] and report["problem_count"] == 0, command


# -- stats and verify on files this user cannot read ---------------------------------------------


@pytest.fixture
def unreadable_cache() -> Iterator[Path]:
    """A cache whose files only root can read, in a directory everyone can enter."""
    base = Path(tempfile.mkdtemp(prefix="cas-unreadable-"))
    try:
        base.chmod(0o755)
        a_cache(base / "cas")
        yield base / "cas"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m cuda_program_cas ARGV`` as user 65534 (skips when this machine cannot run that)."""
    if not is_root() or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as a user who cannot read the cache (as root every file reads)")
    command = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        sys.executable,
        "-m",
        "cuda_program_cas",
        *argv,
    ]
    env = dict(os.environ)
    probe = subprocess.run(
        [*command[:5], "-c", "import cuda_program_cas"], capture_output=True, text=True, env=env, check=False
    )
    if probe.returncode != 0:
        pytest.skip(f"this interpreter cannot run as user 65534 here: {probe.stderr.strip()[:200]}")
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=False)


def test_stats_says_what_it_cannot_read_and_exits_1(unreadable_cache: Path) -> None:
    res = as_nobody("stats", str(unreadable_cache))
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "this user cannot read" in res.stdout and "cannot be read" in res.stdout
    assert res.stdout.strip().splitlines()[-1].endswith("could not be read")
    report = json.loads(as_nobody("stats", str(unreadable_cache), "--json").stdout)
    assert report["problem_count"] == len(report["problems"]) >= 3
    assert report["counters"] is None  # unknown, not zero


def test_verify_does_not_offer_repair_for_files_it_cannot_read(unreadable_cache: Path) -> None:
    res = as_nobody("verify", str(unreadable_cache))
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    last = res.stdout.strip().splitlines()[-1]
    assert "this user cannot read" in last and "fix with --repair" not in last
    assert "--repair does not change permissions" in last


def test_import_into_a_directory_this_user_cannot_write_gives_cli_advice(unreadable_cache: Path) -> None:
    fs = unreadable_cache.parent / "fs"
    (fs / "entries" / "ab").mkdir(parents=True)
    (fs / "entries" / "ab" / ("c" * 62)).write_bytes(b"entry")
    for dirpath, _dirs, files in os.walk(fs):
        os.chmod(dirpath, 0o755)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o644)
    res = as_nobody("import-filestream", str(fs), str(unreadable_cache.parent / "new"))
    assert res.returncode == 1, res.stderr
    line = one_line_error(res.stderr, "import-filestream")
    assert "give a DEST this user can write" in line and "read_only" not in line


# -- the script itself ------------------------------------------------------------------------


def test_version_from_the_script_the_module_and_the_package(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert cuda_program_cas.__version__ == version("cuda-program-cas")
    code, out, _ = cli(capsys, "--version")
    assert code == 0 and out.strip() == f"cuda-program-cas {cuda_program_cas.__version__}"
    res = subprocess.run(
        [sys.executable, "-m", "cuda_program_cas", "--version"], capture_output=True, text=True, check=False
    )
    assert res.returncode == 0 and res.stdout.strip() == f"cuda-program-cas {cuda_program_cas.__version__}"


def test_version_without_installed_metadata_says_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cuda_program_cas._base.config.installed_version() == "0+unknown"


def test_python_m_cas_is_the_same_script(tmp_path: Path) -> None:
    store = a_cache(tmp_path / "cas")
    res = subprocess.run(
        [sys.executable, "-m", "cuda_program_cas", "stats", store.root, "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0 and json.loads(res.stdout)["entries"] == 3
    res = subprocess.run(
        [sys.executable, "-m", "cuda_program_cas", "gc", "--max-age", "7"], capture_output=True, text=True
    )
    assert res.returncode == 2 and "needs a unit" in res.stderr


def test_extra_arguments_get_the_subcommands_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = a_cache(tmp_path / "cas")
    code, out, err = cli(capsys, "stats", store.root, "extra")
    assert code == 2 and out == ""
    assert err.startswith("usage: cuda-program-cas stats ")
    assert one_line_error(err, "stats").endswith("unrecognized arguments: extra")


def test_import_filestream_help_names_its_destination_dest(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "import-filestream", "--help")
    assert code == 0 and "SRC [DEST]" in out and "PATH" not in out


@pytest.mark.parametrize("command", ["stats", "verify", "gc", "repack"])
def test_a_dangling_symlink_is_reported_as_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    code, _, err = cli(capsys, command, str(link))
    assert code == 2
    assert f"is a symlink to {str(tmp_path / 'gone')!r}, which does not exist" in one_line_error(err, command)


def test_a_dangling_symlink_as_the_filestream_source_is_reported_as_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    code, _, err = cli(capsys, "import-filestream", str(link), str(tmp_path / "cas"))
    assert code == 2 and "is a symlink to" in one_line_error(err, "import-filestream")
    assert not (tmp_path / "cas").exists()


def test_stats_text_says_what_the_dedup_ratio_compares(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = CacheStore(tmp_path / "cas")
    for i in range(4):
        store.put(f"k{i}", b"same bytes" * 300)
    code, out, _ = cli(capsys, "stats", store.root)
    assert code == 0
    assert "dedup ratio  4.00x (11.7 KiB of entries in 2.9 KiB of unique blobs; manifests not counted)" in out


# -- issue 21: the CLI and demo edges ----------------------------------------------------------


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_stats_on_a_path_with_no_cache_yet_reports_an_empty_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """Not bad usage: a node that has stored nothing yet. Said in words, and ``exists`` false."""
    path = tmp_path / where
    if where == "empty":
        path.mkdir()
    code, out, err = cli(capsys, "stats", str(path))
    assert code == 0 and err == ""
    assert out.splitlines()[0] == f"cache        {path} (no cache here yet: nothing has been stored)"
    assert out.strip().splitlines()[-1] == "0 entries in 0 blobs, 0 B stored, dedup 1.00x"
    code, out, _ = cli(capsys, "stats", str(path), "--json")
    report = json.loads(out)
    assert code == 0 and report["exists"] is False and report["entries"] == 0 and report["problem_count"] == 0
    assert os.path.exists(path) == (where == "empty") and (where == "missing" or os.listdir(path) == [])
    # A file or a foreign directory is still bad usage.
    (tmp_path / "file").write_text("x")
    assert cli(capsys, "stats", str(tmp_path / "file"))[0] == 2


@pytest.mark.parametrize("where", ["missing", "empty"])
@pytest.mark.parametrize(
    ("argv", "nothing"),
    [
        (["gc"], "nothing to collect"),
        (["gc", "--dry-run", "--max-size", "1M", "--max-age", "1d", "--verify"], "nothing to collect"),
        (["gc", "--shared", "--grace", "2h"], "nothing to collect"),
        (["verify"], "nothing to check"),
        (["verify", "--repair"], "nothing to check"),
        (["clear"], "nothing to clear"),
        (["clear", "--dry-run"], "nothing to clear"),
    ],
)
def test_maintenance_on_a_path_with_no_cache_yet_reports_an_empty_cache(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    *,
    where: str,
    argv: list[str],
    nothing: str,
) -> None:
    """Issue 32: a nightly gc on a fresh node exits 0, as stats does, and creates nothing."""
    path = tmp_path / where
    if where == "empty":
        path.mkdir()
    code, out, err = cli(capsys, *argv, str(path))
    assert (code, err) == (0, "")
    assert out == f"no cache at {path} yet (nothing has been stored): {nothing}\n"
    code, out, err = cli(capsys, *argv, str(path), "--json")
    report = json.loads(out)
    assert (code, err) == (0, "") and report["exists"] is False and report["problem_count"] == 0
    assert report.get("entries", report.get("entries_before")) == 0
    assert report["root"] == str(path)
    assert os.path.exists(path) == (where == "empty") and (where == "missing" or os.listdir(path) == [])
    # The default directory too, through $CUDA_PROGRAM_CAS_DIR.
    monkeypatch.setenv("CUDA_PROGRAM_CAS_DIR", str(path))
    assert cli(capsys, *argv) == (0, f"no cache at {path} yet (nothing has been stored): {nothing}\n", "")
    monkeypatch.delenv("CUDA_PROGRAM_CAS_DIR")
    # A cache that exists is reported as one: exists is true.
    CacheStore(tmp_path / "cas").put("k", b"v")
    code, out, _ = cli(capsys, *argv, str(tmp_path / "cas"), "--json")
    assert code == 0 and json.loads(out)["exists"] is True


@pytest.mark.parametrize(
    ("argv", "status", "needle"),
    [
        (["gc", "--max-age", "7", "{cache}"], 2, "a duration needs a unit"),
        (["stats", "{file}"], 2, "exists and is not a directory"),
        (["verify", "{file}"], 2, "exists and is not a directory"),
        (["gc", "{file}"], 2, "exists and is not a directory"),
        (["repack", "{cache}"], 2, "is not a shared store"),
        (["clear", "{store}"], 2, "is a shared store"),
        (["stats", "--zero", "{missing}"], 2, "no such directory"),
        (["config", "{cache}", "max-size", "0"], 2, "a size must be more than zero"),
    ],
)
def test_json_errors_are_one_json_object_on_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], status: int, needle: str
) -> None:
    cache = a_cache(tmp_path / "cas")
    publish([cache.root], tmp_path / "store")
    (tmp_path / "file").write_text("x")
    paths = {"cache": cache.root, "file": tmp_path / "file", "missing": tmp_path / "nope", "store": tmp_path / "store"}
    code, out, err = cli(capsys, *(a.format(**paths) for a in argv), "--json")
    assert code == status
    report = json.loads(out)  # before: nothing on stdout
    assert report["exit_status"] == status and report["command"] == argv[0]
    assert needle in report["error"] and report["problems"] == [report["error"]] and report["problem_count"] == 1
    assert needle in err  # and the one line on stderr, as without --json


def test_import_filestream_of_a_file_says_it_is_not_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "fs.tar").write_bytes(b"not a directory")
    code, out, err = cli(capsys, "import-filestream", str(tmp_path / "fs.tar"), str(tmp_path / "cas"))
    line = one_line_error(err, "import-filestream")
    assert code == 2 and out == ""
    assert f"{str(tmp_path / 'fs.tar')!r} is not a directory" in line and "no such directory" not in line
    assert not (tmp_path / "cas").exists()


def test_the_command_line_honours_cuda_program_cas_log(tmp_path: Path) -> None:
    """As the library does: the records of what a command did are appended to that file."""
    store = a_cache(tmp_path / "cas")
    log = tmp_path / "cas.log"
    env = {**os.environ, "CUDA_PROGRAM_CAS_LOG": str(log)}
    res = subprocess.run(
        [sys.executable, "-m", "cuda_program_cas", "gc", store.root, "--grace", "0s"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert f"cuda-program-cas: {store.root}: gc removed 0 entries and 0 blobs" in log.read_text()


def test_repack_refuses_a_nodes_local_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It would hold every entry twice, loose and packed, until a gc: refused, nothing written."""
    store = a_cache(tmp_path / "cas")
    before = sorted(os.walk(store.root))
    code, out, err = cli(capsys, "repack", store.root)
    line = one_line_error(err, "repack")
    assert code == 2 and out == ""
    assert "is not a shared store (publish marks the stores it writes)" in line
    assert sorted(os.walk(store.root)) == before
    # A published store is repacked as before.
    publish([store.root], tmp_path / "store")
    assert cli(capsys, "repack", str(tmp_path / "store"))[0] == 0


def test_dash_capital_v_is_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "-V")
    assert code == 0 and out.strip() == f"cuda-program-cas {cuda_program_cas.__version__}"


def test_verify_on_a_packed_store_says_it_checked_the_packs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node = a_cache(tmp_path / "node")
    publish([node.root], tmp_path / "store", pack=True)
    code, out, _ = cli(capsys, "verify", str(tmp_path / "store"))
    assert code == 0
    assert out.startswith("checked 0 loose entries and 0 blobs (0 B), and 1 pack holding 3 entries ("), out
    code, out, _ = cli(capsys, "verify", str(tmp_path / "store"), "--json")
    report = json.loads(out)
    (pack,) = (tmp_path / "store" / "packs").glob("pack-*.cpk")
    assert report["packs"] == 1 and report["packed_entries"] == 3 and report["pack_bytes"] == pack.stat().st_size


def test_a_str_key_with_a_lone_surrogate_is_a_type_error_naming_it(tmp_path: Path) -> None:
    store = a_cache(tmp_path / "cas")
    key = "kernel-\udc80"
    calls = (lambda: store.get(key), lambda: store.put(key, b"x"), lambda: store.delete(key))
    for call in calls:
        with pytest.raises(TypeError, match=r"'kernel-\\udc80' has '\\udc80' at index 7") as info:
            call()
        assert not isinstance(info.value, UnicodeError)
    assert len(store) == 3


# -- clear ------------------------------------------------------------------------------------


def test_clear_empties_a_local_cache_and_keeps_its_counters_and_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = a_cache(tmp_path / "cas", n=5)
    assert store.get("k1") is not None
    store.close()
    assert cli(capsys, "config", store.root, "max-size", "1G")[0] == 0
    code, out, _ = cli(capsys, "clear", store.root, "--dry-run")
    assert code == 0 and out.startswith("would remove 5 entries and 5 blobs, freeing ")
    assert len(CacheStore(store.root)) == 5
    code, out, _ = cli(capsys, "clear", store.root)
    assert code == 0 and out.startswith(f"cleared {store.root}: removed 5 entries and 5 blobs, freed ")
    after = CacheStore(store.root)
    assert len(after) == 0 and after.get("k1") is None
    assert after.max_size_bytes == 1 << 30
    code, out, _ = cli(capsys, "stats", store.root, "--json")
    report = json.loads(out)
    assert report["entries"] == report["blobs"] == 0 and report["counters"]["hits"] == 1
    code, out, _ = cli(capsys, "clear", store.root, "--json")
    report = json.loads(out)
    assert code == 0 and report["entries_before"] == 0 and report["problem_count"] == 0


def test_clear_while_another_process_uses_the_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The other process keeps working: its later write lands and hits, what it had is a miss."""
    store = a_cache(tmp_path / "cas")
    child = ChildLines(
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys\n"
                "from cuda_program_cas import CacheStore\n"
                "store = CacheStore(sys.argv[1])\n"
                "store.put('mine', b'before' * 100)\n"
                "print('ready', flush=True)\n"
                "sys.stdin.readline()\n"
                "print('old', store.get('mine'), flush=True)\n"
                "store.put('mine', b'after' * 100)\n"
                "print('new', store.get('mine') == b'after' * 100, flush=True)\n",
                store.root,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )
    try:
        child.wait("ready")
        code, out, _ = cli(capsys, "clear", store.root, "--json")
        assert code == 0 and json.loads(out)["entries_after"] == 0
        assert child.proc.stdin is not None
        child.proc.stdin.write("go\n")
        child.proc.stdin.flush()
        assert child.finish() == 0, child.output()
    finally:
        child.kill()
    assert child.lines[-2:] == ["old None", "new True"]
    assert CacheStore(store.root).get("mine") == b"after" * 100


def test_clear_refuses_a_shared_store_and_what_is_not_a_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    publish([a_cache(tmp_path / "node").root], tmp_path / "store")
    before = sorted(os.walk(tmp_path / "store"))
    code, out, err = cli(capsys, "clear", str(tmp_path / "store"))
    assert code == 2 and out == ""
    assert "is a shared store (publish marked it in its layout.json)" in one_line_error(err, "clear")
    assert sorted(os.walk(tmp_path / "store")) == before
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    for name in ("foreign", "file"):
        code, _, err = cli(capsys, "clear", str(tmp_path / name))
        assert code == 2 and "Traceback" not in err
    assert os.listdir(tmp_path / "foreign") == ["notes.txt"]
