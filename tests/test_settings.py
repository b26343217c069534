"""Settings that belong to the cache (``config``, ``settings.json``) and environment values that never fail a job.

The cap stored in a cache holds for every process that opens it, unless an argument or
the environment says otherwise. A bad environment value, or a settings file that cannot
be used, is one WARNING per process and is ignored: never an exception, never a hang.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_python

from cuda_program_cas import CacheStore
from cuda_program_cas._base.config import default_cache_dir
from cuda_program_cas._cli.main import main
from cuda_program_cas._disk.layout import LayoutState, check_layout

CAP = 40 * 1024


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def stored_bytes(root: str | Path) -> int:
    return CacheStore(root, max_size_bytes=None).stats().stored_bytes


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cuda_program_cas" and r.levelno == logging.WARNING]


# -- the cap stored in the cache ------------------------------------------------------------


def test_a_cap_stored_with_config_holds_for_a_job_that_sets_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: a job without CUDA_PROGRAM_CAS_MAX_SIZE took a 40 KiB-capped cache to 349 % of it."""
    root = tmp_path / "cas"
    code, out, _ = cli(capsys, "config", str(root), "max-size", "40K")
    assert code == 0 and "stored max-size 40.0 KiB (40,960 bytes)" in out
    assert json.loads((root / "settings.json").read_text()) == {"max_size_bytes": CAP}
    # A job in its own process, with no argument and no environment variable: the cache's cap holds.
    job = run_python(
        "import sys\n"
        "from cuda_program_cas import ContentAddressedProgramCache\n"
        "cache = ContentAddressedProgramCache(sys.argv[1])\n"
        "assert cache.store.max_size_bytes == 40960, cache.store.max_size_bytes\n"
        "for i in range(70):\n"
        "    cache[f'k{i}'] = bytes([i]) * 2000\n",
        str(root),
        env={"CUDA_PROGRAM_CAS_MAX_SIZE": ""},
    )
    assert job.returncode == 0, job.stderr
    assert stored_bytes(root) <= CAP  # 70 entries of 2,000 bytes would be 349 % of it


def test_the_argument_then_the_environment_then_the_cache_then_no_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cuda_program_cas import ContentAddressedProgramCache

    root = str(tmp_path / "cas")
    assert cli(capsys, "config", root, "max-size", "40K")[0] == 0
    assert CacheStore(root).max_size_bytes == CAP
    assert CacheStore(root, max_size_bytes=None).max_size_bytes is None  # an argument says otherwise
    assert CacheStore(root, max_size_bytes=1 << 20).max_size_bytes == 1 << 20
    assert ContentAddressedProgramCache(root).store.max_size_bytes == CAP
    monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_SIZE", "1M")
    assert ContentAddressedProgramCache(root).store.max_size_bytes == 1 << 20
    assert ContentAddressedProgramCache(root, max_size_bytes=2 << 20).store.max_size_bytes == 2 << 20
    assert ContentAddressedProgramCache(root, max_size_bytes=None).store.max_size_bytes is None
    monkeypatch.delenv("CUDA_PROGRAM_CAS_MAX_SIZE")
    code, out, _ = cli(capsys, "config", root, "max-size", "none")
    assert code == 0 and "removed the cap" in out
    assert ContentAddressedProgramCache(root).store.max_size_bytes is None
    assert json.loads((tmp_path / "cas" / "settings.json").read_text()) == {}


def test_explicit_bad_max_size_arguments_still_raise(tmp_path: Path) -> None:
    from cuda_program_cas import ContentAddressedProgramCache

    for bad, kind in ((0, ValueError), (-1, ValueError), (True, TypeError), ("10G", TypeError)):
        with pytest.raises(kind, match="max_size_bytes"):
            ContentAddressedProgramCache(tmp_path / "cas", max_size_bytes=bad)
    assert not (tmp_path / "cas").exists()


def test_a_cache_with_a_settings_file_is_still_recognised_as_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cas"
    assert cli(capsys, "config", str(root), "max-size", "1G")[0] == 0
    (root / "layout.json").unlink()  # settings.json is one of the cache's own names: not a foreign directory
    assert check_layout(str(root)) is LayoutState.MISSING
    assert CacheStore(root).max_size_bytes == 1 << 30


# -- a settings file that cannot be used ------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{not json", "not a JSON object"),
        (b"[" * 20_000, "not a JSON object"),  # deep nesting: RecursionError in json
        (b"[1, 2]", "not a JSON object"),
        (b'{"max_size_bytes": 0}', "max_size_bytes is 0"),
        (b'{"max_size_bytes": "10G"}', "max_size_bytes is '10G'"),
        (b'{"max_size_bytes": true}', "max_size_bytes is True"),
        (b"\xff\xfe", "not a JSON object"),
        (b"{}" + b" " * 70_000, "larger than 65,536 bytes"),
    ],
)
def test_a_damaged_settings_file_is_one_warning_and_no_cap(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, why: str
) -> None:
    root = tmp_path / "cas"
    CacheStore(root).put("k", b"v")
    (root / "settings.json").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
        for _ in range(3):
            store = CacheStore(root)
            assert store.max_size_bytes is None
            assert store.get("k") == b"v"
            assert store.put("k2", b"w")
    [warning] = warnings_of(caplog)
    assert f"{root / 'settings.json'} is ignored: {why}" in warning


def test_a_settings_file_that_is_a_directory_a_symlink_or_unreadable_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cases = {"directory": "not a regular file", "symlink": "cannot be opened"}
    for case, why in cases.items():
        root = tmp_path / case
        CacheStore(root)
        target = root / "settings.json"
        if case == "directory":
            target.mkdir()
        else:
            (tmp_path / "elsewhere.json").write_text('{"max_size_bytes": 1000}')
            target.symlink_to(tmp_path / "elsewhere.json")
        with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
            assert CacheStore(root).max_size_bytes is None
        assert any(f"{target} is ignored: {why}" in w for w in warnings_of(caplog)), warnings_of(caplog)


def test_a_fifo_in_place_of_the_settings_file_does_not_hang_an_open(tmp_path: Path) -> None:
    root = tmp_path / "cas"
    CacheStore(root)
    os.mkfifo(root / "settings.json")
    # In a child: an open that hangs on the FIFO (no writer ever comes) fails this by its timeout.
    res = run_python(
        "import sys\nfrom cas import CacheStore\nprint(CacheStore(sys.argv[1]).max_size_bytes)\n",
        str(root),
        timeout=60,
    )
    assert res.returncode == 0 and res.stdout.strip() == "None", res.stderr
    assert res.stderr.count("is ignored: not a regular file") == 1


# -- bad environment values never fail a job ----------------------------------------------------


@pytest.mark.parametrize("value", ["0", "abc", "-5M", "10Q"])
def test_a_bad_max_size_in_the_environment_is_one_warning_and_the_job_runs(tmp_path: Path, value: str) -> None:
    """Before: ``ValueError`` from every ``ContentAddressedProgramCache()``, so every job failed."""
    res = run_python(
        "import sys\n"
        "from conftest import compile_program\n"
        "from cuda_program_cas import ContentAddressedProgramCache\n"
        "for _ in range(3):\n"
        "    with ContentAddressedProgramCache(sys.argv[1]) as cache:\n"
        "        assert cache.store.max_size_bytes is None\n"
        "        compile_program(cache=cache)\n"
        "print(cache.counters()['hits'])\n",
        str(tmp_path / "cas"),
        env={"CUDA_PROGRAM_CAS_MAX_SIZE": value, "PYTHONPATH": str(Path(__file__).parent)},
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "1"  # the program was compiled, stored, then hit
    assert res.stderr.count(f"CUDA_PROGRAM_CAS_MAX_SIZE={value!r} is ignored") == 1, res.stderr


def test_a_relative_cache_dir_is_made_absolute_with_one_warning(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    code = (
        "import os\n"
        "from cuda_program_cas import CacheStore, default_cache_dir\n"
        "first = default_cache_dir()\n"
        "os.chdir('sub')\n"
        "again = default_cache_dir()\n"
        "print(first, again, CacheStore(first).root, sep='\\n')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_PROGRAM_CAS_DIR": "rel/cas"},
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    first, again, root = res.stdout.split()
    assert first == root == str(tmp_path / "rel" / "cas")
    assert again == str(tmp_path / "sub" / "rel" / "cas")  # what a relative value means: said, not hidden
    assert res.stderr.count("CUDA_PROGRAM_CAS_DIR='rel/cas' is a relative path") == 1, res.stderr


def test_default_cache_dir_is_absolute_for_a_relative_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_PROGRAM_CAS_DIR", "somewhere/cas")
    with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
        assert default_cache_dir() == tmp_path / "somewhere" / "cas"
        assert default_cache_dir().is_absolute()
    assert any("CUDA_PROGRAM_CAS_DIR='somewhere/cas' is a relative path" in w for w in warnings_of(caplog))


def test_relative_shared_paths_are_made_absolute_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from cuda_program_cas import ContentAddressedProgramCache

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_PROGRAM_CAS_SHARED", " ".join(["", "store-a", str(tmp_path / "b"), ""]))
    with caplog.at_level(logging.WARNING, logger="cuda_program_cas"):
        for _ in range(2):
            cache = ContentAddressedProgramCache(tmp_path / "cas")
            assert list(cache.store.inner.shared_paths()) == [str(tmp_path / "store-a"), str(tmp_path / "b")]
    relative = [w for w in warnings_of(caplog) if "is a relative path" in w]
    assert relative == [
        f"cuda-program-cas: CUDA_PROGRAM_CAS_SHARED='store-a' is a relative path; it is taken as "
        f"{tmp_path / 'store-a'} (the working directory of the process that read it first): give an absolute path"
    ]


# -- config shows every setting and where it came from -----------------------------------------


def test_config_shows_each_setting_and_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cas"
    assert cli(capsys, "config", str(root), "max-size", "40K")[0] == 0
    code, out, _ = cli(capsys, "config", str(root), "--json")
    report = json.loads(out)
    assert code == 0 and report["problem_count"] == 0
    settings = report["settings"]
    assert settings["directory"] == {"value": str(root), "source": "argument", "origin": "", "note": ""}
    assert settings["max_size_bytes"]["value"] == CAP and settings["max_size_bytes"]["source"] == "cache"
    assert settings["max_size_bytes"]["origin"] == str(root / "settings.json")
    assert settings["shared"]["source"] == settings["log_file"]["source"] == "default"

    monkeypatch.setenv("CUDA_PROGRAM_CAS_DIR", str(root))
    monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_SIZE", "1M")
    monkeypatch.setenv("CUDA_PROGRAM_CAS_SHARED", str(tmp_path / "store"))
    monkeypatch.setenv("CUDA_PROGRAM_CAS_LOG", str(tmp_path / "cas.log"))
    code, out, _ = cli(capsys, "config")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"directory  {root} (environment: CUDA_PROGRAM_CAS_DIR)"
    assert lines[1] == (
        "max-size   1.0 MiB (1,048,576 bytes) (environment: CUDA_PROGRAM_CAS_MAX_SIZE; overrides the cache's "
        "40,960 bytes)"
    )
    assert lines[2] == f"shared     {tmp_path / 'store'} (environment: CUDA_PROGRAM_CAS_SHARED)"
    assert lines[3] == f"log file   {tmp_path / 'cas.log'} (environment: CUDA_PROGRAM_CAS_LOG)"

    monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_SIZE", "abc")
    code, out, _ = cli(capsys, "config", "max-size")
    assert code == 1  # a problem found, and not fixed: the variable is ignored, the cache's cap applies
    assert out.splitlines() == [
        f"max-size   40.0 KiB (40,960 bytes) (cache: {root / 'settings.json'})",
        "problem: CUDA_PROGRAM_CAS_MAX_SIZE='abc' is ignored: not a size: 'abc' (expected e.g. 500M, 10G or a "
        "number of bytes)",
    ]


def test_config_on_a_path_with_no_cache_yet_says_so_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = cli(capsys, "config", str(tmp_path / "new"))
    assert code == 0 and out.splitlines()[0] == f"directory  {tmp_path / 'new'} (argument; no cache there yet)"
    assert "max-size   none (default; no cap)" in out
    assert not (tmp_path / "new").exists()
    from cuda_program_cas._disk.settings import effective_settings

    assert [s.name for s in effective_settings(str(tmp_path / "new"))] == [
        "directory",
        "max_size_bytes",
        "shared",
        "log_file",
    ]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["max-size", "0"], "max-size: a size must be more than zero, got '0' (or none to remove the cap)"),
        (["max-size", "lots"], "max-size: not a size: 'lots'"),
        (["colour", "blue"], "unknown setting 'blue' (after the path 'colour'): a cache stores max-size"),
        (["max-size", "1G", "extra"], "too many arguments: 'extra'"),
    ],
)
def test_config_bad_usage_exits_2_and_stores_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    monkeypatch.setenv("CUDA_PROGRAM_CAS_DIR", str(tmp_path / "cas"))
    code, out, err = cli(capsys, "config", *argv)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1] == f"cuda-program-cas config: error: {needle}" or needle in err
    assert not (tmp_path / "cas").exists()


def test_config_refuses_a_file_and_a_foreign_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    for name in ("file", "foreign"):
        for argv in ([], ["max-size", "1G"]):
            code, _, err = cli(capsys, "config", str(tmp_path / name), *argv)
            assert code == 2 and "Traceback" not in err
    assert sorted(os.listdir(tmp_path / "foreign")) == ["notes.txt"]


def test_stats_compares_with_the_stored_cap_and_says_where_it_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = CacheStore(tmp_path / "cas")
    store.put("k", b"x" * 4000)
    assert cli(capsys, "config", store.root, "max-size", "40K")[0] == 0
    code, out, _ = cli(capsys, "stats", store.root)
    assert code == 0 and "% used (stored in the cache: cuda-program-cas config)" in out
    code, out, _ = cli(capsys, "stats", store.root, "--json")
    report = json.loads(out)
    assert report["max_size_bytes"] == CAP and report["max_size_source"] == "cache"
    monkeypatch.setenv("CUDA_PROGRAM_CAS_MAX_SIZE", "0")  # before: stats exited 2 on a bad value
    code, out, _ = cli(capsys, "stats", store.root, "--json")
    assert code == 0 and json.loads(out)["max_size_bytes"] == CAP


def test_a_fork_while_the_say_once_lock_is_held_leaves_the_child_able_to_warn(tmp_path: Path) -> None:
    """Another thread of the parent may hold it at the fork: the child gets a lock of its own."""
    import select

    import cuda_program_cas._base.config

    read_end, write_end = os.pipe()
    with cuda_program_cas._base.config._seen_lock:
        pid = os.fork()
        if pid == 0:  # the child: a bad value to warn about, then say so
            try:
                os.environ["CUDA_PROGRAM_CAS_MAX_SIZE"] = "forked-bad"
                cuda_program_cas._base.config.env_max_size()
                os.write(write_end, b"1")
            finally:
                os._exit(0)
    os.close(write_end)
    ready, _, _ = select.select([read_end], [], [], 60)
    if not ready:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    said = os.read(read_end, 1) if ready else b""
    os.close(read_end)
    assert said == b"1", "the child hung on the lock its parent held at the fork"
