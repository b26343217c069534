"""A WebDAV server of the tests' own that answers every PUT ``201 Created`` and keeps less than it was sent.

A real HTTP/1.1 server on 127.0.0.1 (``http.server``, a thread a connection,
keep-alive). It serves the files of a folder for GET and HEAD (one Range,
``bytes=a-b`` or ``bytes=-n``, answered 206 with ``Content-Range``), makes
folders for MKCOL, and takes PUTs as nginx with ``create_full_put_path on``
does: the parents made, the body written to a temp file and renamed into place.
Then it lies, for the paths that start with a prefix of ``lies``:

- ``"nothing"``: it reads the whole body, answers 201, and stores nothing;
- ``"half"``: it stores the first half of the body, and answers 201.

``LyingDav(root, lies={"/": "nothing"})`` lies about every file;
``{"/packs/list": "half"}`` only about the listing (the longest prefix wins).
Every request is recorded as ``(method, path, status)`` in ``log``.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import unquote

__all__ = ["LyingDav"]

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's pool expects
    timeout = 10  # a client that goes quiet mid-request frees its thread
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.sockets.add(self.connection)

    def finish(self) -> None:
        with self.server.lock:
            self.server.sockets.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: object) -> None:
        return  # no stderr noise; the server keeps its own log

    def _path(self) -> Path | None:
        rel = unquote(self.path.split("?", 1)[0]).strip("/")
        parts = rel.split("/") if rel else []
        if any(p in ("", ".", "..") for p in parts):
            return None
        return self.server.root.joinpath(*parts)

    def _answer(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        with self.server.lock:
            self.server.log.append((self.command, self.path, status))
        headers = {"Content-Length": str(len(body)), **(headers or {})}
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        path = self._path()
        if path is None or not path.is_file():
            self._answer(404, b"not found\n")
            return
        data = path.read_bytes()
        span = _RANGE.fullmatch(self.headers.get("Range", ""))
        if span is None or span.groups() == ("", ""):
            self._answer(200, data)
            return
        first, last = span.groups()
        start = max(len(data) - int(last), 0) if first == "" else int(first)
        end = min(int(last), len(data) - 1) if first != "" and last else len(data) - 1
        if not data or start > end:
            self._answer(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            return
        self._answer(206, data[start : end + 1], {"Content-Range": f"bytes {start}-{end}/{len(data)}"})

    def do_HEAD(self) -> None:
        path = self._path()
        if path is None or not path.is_file():
            self._answer(404)
            return
        # The size of what it holds, as any static server says it.
        self._answer(200, b"", {"Content-Length": str(path.stat().st_size)})

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
        path = self._path()
        if path is None:
            self._answer(403)
            return
        lie = self.server.lie_for(self.path)
        if lie != "nothing":
            kept = body[: len(body) // 2] if lie == "half" else body
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.server.root, prefix=".put-")
            with os.fdopen(fd, "wb") as f:
                f.write(kept)
            os.replace(tmp, path)
        self._answer(201, b"created\n")

    def do_MKCOL(self) -> None:
        path = self._path()
        if path is None:
            self._answer(403)
            return
        try:
            path.mkdir()
        except FileExistsError:
            self._answer(405)
            return
        self._answer(201)


class _Server(ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True  # server_close() joins every handler: nothing is left running

    def __init__(self, root: Path, lies: dict[str, str]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.lies = lies
        self.lock = threading.Lock()
        self.log: list[tuple[str, str, int]] = []
        self.sockets: set[socket.socket] = set()

    def lie_for(self, path: str) -> str | None:
        best = max((p for p in self.lies if path.startswith(p)), key=len, default=None)
        return None if best is None else self.lies[best]


class LyingDav:
    """``with LyingDav(root, lies={"/blobs/": "half"}) as s:``; ``s.url("store")``."""

    def __init__(self, root: str | os.PathLike[str], lies: dict[str, str]) -> None:
        if any(kind not in ("nothing", "half") for kind in lies.values()):
            raise ValueError(f"lies are 'nothing' or 'half', got {lies!r}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._server = _Server(self.root, {p if p.startswith("/") else "/" + p: k for p, k in lies.items()})
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05})

    def __enter__(self) -> LyingDav:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.shutdown()
        with self._server.lock:
            for sock in list(self._server.sockets):
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a handler waiting for the next request
                except OSError:
                    pass
        self._server.server_close()
        self._thread.join()

    def url(self, sub: str = "") -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/{sub.lstrip('/')}"

    @property
    def log(self) -> list[tuple[str, str, int]]:
        with self._server.lock:
            return list(self._server.log)
