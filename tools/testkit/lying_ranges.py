"""A file server of the tests' own, run as its own process, that answers a request for several ranges falsely.

``python -m testkit.lying_ranges ROOT LIE`` serves the files under ROOT on
127.0.0.1 (a free port, printed as ``port N`` on its first line) with
``http.server``, keep-alive. A GET with no Range, or one range (``bytes=a-b`` or
``bytes=-n``), is answered truly (200, or 206 with ``Content-Range``), so a
client's ordinary reads work. A GET for several ranges gets the lie ``LIE``:

- ``boundary``: a ``multipart/byteranges`` answer whose parts are framed by
  another boundary than its ``Content-Type`` names;
- ``unasked``: a well framed answer whose second part is a range that was not
  asked for (the asked one moved by a byte), its ``Content-Range`` saying so;
- ``single``: a ``206`` of the first range alone, as if only it was asked;
- ``bytes``: a well framed answer of the ranges asked, one byte of each flipped.

Every request is appended to ``ROOT/../lying.log`` as ``METHOD PATH RANGE`` lines.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

_ONE = re.compile(r"bytes=(\d*)-(\d*)")
_LOCK = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 10
    root: Path
    lie: str
    log_path: Path

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        wanted = self.headers.get("Range", "")
        with _LOCK, open(self.log_path, "a") as log:
            log.write(f"GET {self.path} {wanted or '-'}\n")
        path = self.root / unquote(self.path.split("?", 1)[0]).lstrip("/")
        if not path.resolve().is_relative_to(self.root) or not path.is_file():
            self._send(404, b"", {})
            return
        data = path.read_bytes()
        if not wanted:
            self._send(200, data, {})
            return
        spans = []
        for part in wanted.removeprefix("bytes=").split(","):
            m = _ONE.fullmatch("bytes=" + part.strip())
            if m is None:
                self._send(416, b"", {})
                return
            first, last = m.groups()
            if not first:
                spans.append((len(data) - int(last), len(data) - 1))
            else:
                spans.append((int(first), min(int(last or len(data) - 1), len(data) - 1)))
        if len(spans) == 1 or self.lie == "single":
            a, b = spans[0]
            self._send(206, data[a : b + 1], {"Content-Range": f"bytes {a}-{b}/{len(data)}"})
            return
        boundary = "0000000000000042"
        framed = "0000000000000043" if self.lie == "boundary" else boundary
        body = b""
        for i, (first, last) in enumerate(spans):
            shift = 1 if self.lie == "unasked" and i == 1 else 0
            a, b = first + shift, last + shift
            chunk = data[a : b + 1]
            if self.lie == "bytes":
                chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
            body += (
                f"\r\n--{framed}\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Range: bytes {a}-{b}/{len(data)}\r\n\r\n"
            ).encode() + chunk
        body += f"\r\n--{framed}--\r\n".encode()
        self._send(206, body, {"Content-Type": f"multipart/byteranges; boundary={boundary}"})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def main() -> None:
    root, lie = Path(sys.argv[1]).resolve(), sys.argv[2]
    handler = type("Handler", (_Handler,), {"root": root, "lie": lie, "log_path": root.parent / "lying.log"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    print(f"port {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
