"""The testing package (tools/testkit/): its servers start and stop cleanly, its worker harness tells failures."""

from __future__ import annotations

import socket
import subprocess
import textwrap
import urllib.request
from pathlib import Path

import pytest
from testkit.forks import ForkError, ForkServer
from testkit.nginx import nginx_or_skip
from testkit.proxy import Proxy
from testkit.redis_server import redis_or_skip
from testkit.workers import collect, run_worker, spawn_worker

#: A worker as every tool writes one: it finds its spec, works, and answers one JSON line.
#: It imports testkit itself, which only the child's PYTHONPATH (child_env) makes possible.
_WORKER = textwrap.dedent(
    """
    import signal, sys
    from testkit.workers import answer, worker_spec

    spec = worker_spec(sys.argv[1:])
    if spec["do"] == "fail":
        sys.exit("the worker failed on purpose")
    if spec["do"] == "hang":
        signal.pause()  # until the parent kills it
    answer({"twice": spec["n"] * 2})
    """
)


def _refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.fixture
def worker(tmp_path: Path) -> str:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    return str(script)


def test_a_worker_answers_in_a_fresh_interpreter_that_imports_the_kit(worker: str) -> None:
    assert run_worker(worker, {"do": "work", "n": 21}, timeout=60) == {"twice": 42}


def test_a_failed_worker_is_reported_with_its_stderr(worker: str) -> None:
    with pytest.raises(RuntimeError, match="exited 1 without an answer: the worker failed on purpose"):
        run_worker(worker, {"do": "fail"}, timeout=60)


def test_a_worker_past_its_timeout_is_killed_and_reported(worker: str) -> None:
    proc = spawn_worker(worker, {"do": "hang"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = collect(proc, timeout=0.5)
    assert done.timed_out and done.answer is None and done.returncode < 0
    assert done.failure.startswith("did not finish in time")


def test_redis_server_starts_answers_and_stops_cleanly(tmp_path: Path) -> None:
    server = redis_or_skip(tmp_path / "redis")
    with server:
        assert server.running
        assert server.client().ping() is True
    assert not server.running
    assert _refuses(server.port)
    server.stop()  # idempotent


def test_nginx_serves_the_root_through_the_proxy_and_stops_cleanly(tmp_path: Path) -> None:
    with nginx_or_skip(tmp_path / "nginx") as server:
        (server.root / "hello").write_bytes(b"hello")
        with urllib.request.urlopen(server.read_url("hello"), timeout=10) as resp:
            assert resp.read() == b"hello"
        with Proxy(("127.0.0.1", server.port)) as proxy:
            url = server.read_url("hello").replace(f":{server.port}/", f":{proxy.port}/")
            with urllib.request.urlopen(url, timeout=10) as resp:
                assert resp.read() == b"hello"
    assert not server.running
    assert _refuses(server.port)


def test_a_forked_call_has_the_callers_directory_and_environment_and_reports_a_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = "import os\n\ndef main(name):\n    if name == 'boom':\n        raise ValueError(name)\n"
    source += "    return os.getcwd(), os.environ.get(name), os.getpid()\n"
    with ForkServer("import json\n") as forks:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("TESTKIT_PROBE", "set after the server started")
        cwd, value, pid = forks.call(source, "TESTKIT_PROBE")
        assert (cwd, value) == (str(tmp_path), "set after the server started")
        assert forks.call(source, "TESTKIT_PROBE")[2] != pid  # a fresh child each call
        with pytest.raises(ForkError, match="ValueError: boom"):
            forks.call(source, "boom")
