"""What the tests' real servers share: one child process in a session of its own, on a loopback port.

:class:`ServerProcess` is the life cycle of :class:`~testkit.nginx.Nginx`,
:class:`~testkit.redis_server.RedisServer` and :class:`~testkit.weed.WeedServer`: start on a free
port (again on another where one was taken meanwhile), wait until the child says it is ready and
its port accepts, stop it (a signal, then SIGKILL to its whole process group after 5 s),
``kill()`` (an outage), ``running``, and ``with`` (start, then stop). Each server writes its own
config, starts its binary (``start()``) and says how it tells it is ready (``_started()``).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["ServerProcess", "free_port", "start_or_skip"]

_S = TypeVar("_S", bound="ServerProcess")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (nginx cannot listen on port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ServerProcess:
    """A server run as a child on 127.0.0.1:``port`` (see the module docstring)."""

    port: int = 0
    start_timeout: float = 10.0
    poll_s: float = 0.01
    #: The server's log, whose tail a failed start reports.
    log: Path
    _proc: subprocess.Popen[bytes] | None = None
    #: A client of the server's own (redis-py, botocore), closed when it stops.
    _client: Any = None

    def start(self: _S) -> _S:
        raise NotImplementedError

    def _started(self) -> bool:
        """True once the child says it is ready (its pid file, its log)."""
        raise NotImplementedError

    def _launch(
        self, spawn: Callable[[], subprocess.Popen[bytes]], failure: Callable[[str], Exception], port: int | None = None
    ) -> None:
        """``spawn()`` on ``port`` (default: a free one, up to 5 while another process takes it first).

        Returns once the child is ready; else raises ``failure(the tail of its log)`` (the child reaped).
        """
        last = ""
        for _ in range(5):
            self.port = port or free_port()
            self._proc = spawn()
            if self._wait_ready():
                return
            last = self.log_tail()
            self._terminate(signal.SIGKILL)
            # nginx and redis say "Address already in use", Go's weed "address already in use".
            if port or ("address already in use" not in last.lower() and f"({errno.EADDRINUSE}:" not in last):
                break
        raise failure(last)

    def _wait_ready(self) -> bool:
        """True once the child is ready and its port accepts; False if it exited or the start timeout passed."""
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            if self._started():
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    return True
                except OSError:
                    pass
            time.sleep(self.poll_s)
        return False

    def _terminate(self, sig: int = signal.SIGTERM) -> None:
        """``sig`` to the child, then SIGKILL to its process group after 5 s (workers too); reaped."""
        if self._client is not None:
            self._client.close()
            self._client = None
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the child left in its group
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        self._proc = None

    def stop(self) -> None:
        """Stop the server; idempotent."""
        self._terminate()

    def kill(self) -> None:
        """SIGKILL: the server dies at once, its connections reset (an outage)."""
        self._terminate(signal.SIGKILL)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self: _S) -> _S:
        return self.start() if self._proc is None else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_or_skip(server: _S, missing: str | None) -> _S:
    """``server`` started (stopped by the caller), or ``pytest.skip``: ``missing`` says what is not installed."""
    import pytest  # the tests' helper: the benchmarks import the servers without pytest

    if missing:
        pytest.skip(missing)
    try:
        return server.start()
    except RuntimeError as e:  # each server's error says it did not start, and its log's tail
        server.stop()
        pytest.skip(str(e))
