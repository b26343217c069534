"""Fresh processes without the start-up: a server that imports once and forks a child for each call.

A test that compiles "in another process" over and over pays the interpreter's start and
the imports of cuda.core and the package each time (about a second on a loaded 2-core
machine). :class:`ForkServer` starts one interpreter that runs ``preload`` (its imports), then, for
each :meth:`ForkServer.call`, forks a child: the child has the modules but nothing else in
its memory (no cache opened, no compile made), takes the caller's working directory and
environment, runs ``main(*args)`` of the given source, and sends back its pickled return
value. A child that raises, or dies, is reported as :class:`ForkError`.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from types import TracebackType
from typing import Any

from testkit.workers import child_env

__all__ = ["ForkError", "ForkServer"]

_SERVER = r"""
import atexit, os, pickle, struct, sys, traceback
exec(compile(sys.argv[1], "<preload>", "exec"), {"__name__": "__preload__"})
inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = inp.read(4)
    if len(head) < 4:
        break
    request = inp.read(struct.unpack(">I", head)[0])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            source, cwd, env, args = pickle.loads(request)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            scope = {"__name__": "__forked__"}
            exec(compile(source, "<forked>", "exec"), scope)
            reply = ("ok", scope["main"](*args))
            atexit._run_exitfuncs()  # what the process leaves behind at its exit, before the parent goes on
        except BaseException:
            reply = ("raised", traceback.format_exc())
        with os.fdopen(w, "wb") as fh:
            fh.write(pickle.dumps(reply))
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        data = pickle.dumps(("died", f"the child ended with wait status {status} and no reply"))
    out.write(struct.pack(">I", len(data)) + data)
    out.flush()
"""


class ForkError(RuntimeError):
    """A forked child raised (the message is its traceback) or died without a reply."""


class ForkServer:
    """An interpreter that ran ``preload`` (imports); :meth:`call` runs a source's ``main`` in a fork of it."""

    def __init__(self, preload: str) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(keep_settings=True),
        )

    def call(self, source: str, *args: Any) -> Any:
        """``main(*args)`` of ``source``, run in a fresh fork in this process's working directory and environment."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        request = pickle.dumps((source, os.getcwd(), dict(os.environ), args))
        self._proc.stdin.write(struct.pack(">I", len(request)) + request)
        self._proc.stdin.flush()
        head = self._proc.stdout.read(4)
        if len(head) < 4:
            raise ForkError(f"the fork server exited ({self._proc.wait()})")
        kind, value = pickle.loads(self._proc.stdout.read(struct.unpack(">I", head)[0]))
        if kind != "ok":
            raise ForkError(value)
        return value

    def close(self) -> None:
        """End the server (end of its input) and reap it; idempotent."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
