"""What the tests' real servers share: one child process in a session of its own, on a loopback port.

:class:`ServerProcess` is the life cycle of :class:`_nginx.Nginx` and :class:`_redis.RedisServer`:
wait until the child says it is ready and its port accepts, stop it (a signal, then SIGKILL to
its whole process group after 5 s), ``running``, and ``with`` (start, then stop). Each server
writes its own config, starts its binary (``start()``) and says how it tells it is ready
(``_started()``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from types import TracebackType
from typing import TypeVar

__all__ = ["ServerProcess"]

_S = TypeVar("_S", bound="ServerProcess")


class ServerProcess:
    """A server run as a child on 127.0.0.1:``port`` (see the module docstring)."""

    port: int = 0
    start_timeout: float = 10.0
    _proc: subprocess.Popen[bytes] | None = None

    def start(self: _S) -> _S:
        raise NotImplementedError

    def _started(self) -> bool:
        """True once the child says it is ready (its pid file, its log)."""
        raise NotImplementedError

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
            time.sleep(0.01)
        return False

    def _terminate(self, sig: int = signal.SIGTERM) -> None:
        """``sig`` to the child, then SIGKILL to its process group after 5 s (workers too); reaped."""
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

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self: _S) -> _S:
        return self.start() if self._proc is None else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
