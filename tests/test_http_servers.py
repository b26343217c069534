"""The HTTP test servers of tools/testkit/ do what the HTTP store's tests rely on, seen by stdlib clients.

A real nginx (skipped where none is installed or it cannot start): static reads with Range and
keep-alive, WebDAV PUT that lands whole or not at all, the bearer token, TLS. The fault server:
each misbehaviour, and its counts, which the HTTP store's tests use to prove retries and reuse.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.faults import Fault, FaultServer, refused_url
from testkit.nginx import Nginx, nginx_or_skip

DATA = bytes(range(256)) * 40  # 10,240 bytes, every offset's byte known

#: Tests of the test servers themselves, the same on every Python: the full run (CI's 3.11) has them.
pytestmark = pytest.mark.slow


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[Nginx]:
    server = nginx_or_skip(tmp_path / "nginx")
    (server.root / "packs").mkdir()
    (server.root / "packs" / "pack-1.cpk").write_bytes(DATA)
    with server:
        yield server


def _conn(server: Nginx, timeout: float = 5) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)


def _get(conn: http.client.HTTPConnection, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    return _call(conn, "GET", path, headers=headers)


def _call(
    conn: http.client.HTTPConnection,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """One request and its whole response, so the connection can carry the next."""
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    return resp.status, resp.read()


# -- nginx ----------------------------------------------------------------------------------


def test_nginx_serves_a_file_and_404s_a_missing_one(nginx: Nginx) -> None:
    with urllib.request.urlopen(nginx.read_url("packs/pack-1.cpk"), timeout=5) as resp:
        assert resp.status == 200
        assert resp.read() == DATA
        assert resp.headers["ETag"]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(nginx.read_url("packs/nope"), timeout=5)
    assert e.value.code == 404
    e.value.close()


def test_nginx_range_gets_206_and_the_slice(nginx: Nginx) -> None:
    conn = _conn(nginx)
    try:
        conn.request("GET", "/store/packs/pack-1.cpk", headers={"Range": "bytes=1000-1999"})
        resp = conn.getresponse()
        assert resp.status == 206
        assert resp.headers["Content-Range"] == f"bytes 1000-1999/{len(DATA)}"
        assert resp.read() == DATA[1000:2000]
        assert _get(conn, "/store/packs/pack-1.cpk", {"Range": "bytes=-10"}) == (206, DATA[-10:])
    finally:
        conn.close()
    entries = nginx.requests(wait_for=2)
    assert [(e.status, e.range, e.body_bytes) for e in entries] == [
        (206, "bytes=1000-1999", 1000),
        (206, "bytes=-10", 10),
    ]


def test_nginx_log_proves_keep_alive_reuse(nginx: Nginx) -> None:
    nginx.reset_log()
    conn = _conn(nginx)
    try:
        for _ in range(3):
            assert _get(conn, "/store/packs/pack-1.cpk", {"Range": "bytes=0-0"}) == (206, DATA[:1])
    finally:
        conn.close()
    other = _conn(nginx)
    try:
        assert _get(other, "/store/packs/pack-1.cpk")[0] == 200
    finally:
        other.close()
    entries = nginx.requests(wait_for=4)
    assert len({e.connection for e in entries[:3]}) == 1
    assert [e.connection_requests for e in entries] == [1, 2, 3, 1]
    assert entries[3].connection != entries[0].connection


def test_nginx_dav_put_creates_nested_paths_and_mkcol(nginx: Nginx) -> None:
    conn = _conn(nginx)
    try:
        assert _call(conn, "PUT", "/dav/blobs/ab/cdef", b"blob bytes")[0] == 201
        assert _call(conn, "MKCOL", "/dav/index/00/")[0] == 409  # MKCOL makes one level: the parent must exist
        assert _call(conn, "MKCOL", "/dav/index/")[0] == 201
        assert _call(conn, "MKCOL", "/dav/index/00/")[0] == 201
        assert _call(conn, "PUT", "/dav/blobs/ab/cdef", b"again")[0] == 204  # an overwrite
        assert _get(conn, "/store/blobs/ab/cdef") == (200, b"again")
        assert _call(conn, "MOVE", "/dav/blobs/ab/cdef", headers={"Destination": "/dav/blobs/ab/moved"})[0] in (
            201,
            204,
        )
        assert _get(conn, "/store/blobs/ab/moved") == (200, b"again")
        assert _call(conn, "DELETE", "/dav/blobs/ab/moved")[0] == 204
    finally:
        conn.close()
    assert (nginx.root / "index" / "00").is_dir()
    assert list((nginx.root / "blobs" / "ab").iterdir()) == []


def test_nginx_dav_put_cut_off_mid_body_leaves_no_file(nginx: Nginx) -> None:
    """The body goes to client_body_temp_path and is renamed onto the target only when complete."""
    sock = socket.create_connection(("127.0.0.1", nginx.port), timeout=5)
    try:
        head = b"PUT /dav/packs/pack-2.cpk HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000\r\n\r\n"
        sock.sendall(head + b"x" * 300_000)
        # Synchronise: nginx has the partial body in its temp folder (so it read some of it).
        deadline = time.monotonic() + 5
        while not any(p.is_file() for p in nginx.prefix.joinpath("body-temp").rglob("*")):
            assert time.monotonic() < deadline, "nginx never buffered the body"
            time.sleep(0.01)
        assert not (nginx.root / "packs" / "pack-2.cpk").exists()
    finally:
        sock.close()
    entries = nginx.requests(wait_for=1)  # nginx logs the aborted request once it sees the close
    assert entries and entries[-1].method == "PUT" and entries[-1].status != 201
    assert not (nginx.root / "packs" / "pack-2.cpk").exists()
    assert sorted(p.name for p in (nginx.root / "packs").iterdir()) == ["pack-1.cpk"]


def test_nginx_token_401_without_it(tmp_path: Path) -> None:
    with nginx_or_skip(tmp_path / "nginx", token="s3cret-Token") as server:
        (server.root / "f").write_bytes(b"hi")
        conn = _conn(server)
        try:
            assert _get(conn, "/store/f")[0] == 401
            assert _get(conn, "/store/f", {"Authorization": "Bearer wrong"})[0] == 401
            assert _get(conn, "/store/f", server.auth_headers()) == (200, b"hi")
            assert _call(conn, "PUT", "/dav/g", b"x")[0] == 401
            assert _call(conn, "PUT", "/dav/g", b"x", server.auth_headers())[0] == 201
        finally:
            conn.close()
        assert (server.root / "g").read_bytes() == b"x"


def test_nginx_tls_with_the_cert_as_ca_and_not_without(tmp_path: Path) -> None:
    with nginx_or_skip(tmp_path / "nginx", tls=True) as server:
        (server.root / "f").write_bytes(b"secure")
        assert server.base_url.startswith("https://127.0.0.1:")
        assert server.cert is not None
        trusted = ssl.create_default_context(cafile=str(server.cert))
        for host in ("127.0.0.1", "localhost"):
            url = server.read_url("f").replace("127.0.0.1", host)
            with urllib.request.urlopen(url, context=trusted, timeout=5) as resp:
                assert resp.read() == b"secure"
        with pytest.raises(urllib.error.URLError) as e:
            urllib.request.urlopen(server.read_url("f"), context=ssl.create_default_context(), timeout=5)
        assert isinstance(e.value.reason, ssl.SSLCertVerificationError)


@pytest.mark.parametrize(("certificate", "error"), [("expired", "certificate has expired"), ("wrong-host", "mismatch")])
def test_nginx_tls_expired_and_wrong_host_certificates_fail_with_the_ca_trusted(
    tmp_path: Path, certificate: str, error: str
) -> None:
    with nginx_or_skip(tmp_path / "nginx", tls=True, certificate=certificate) as server:
        (server.root / "f").write_bytes(b"secure")
        assert server.cert is not None
        trusted = ssl.create_default_context(cafile=str(server.cert))
        with pytest.raises(urllib.error.URLError) as e:
            urllib.request.urlopen(server.read_url("f"), context=trusted, timeout=5)
        assert isinstance(e.value.reason, ssl.SSLCertVerificationError)
        assert error in str(e.value.reason)


def test_nginx_stop_leaves_no_process(tmp_path: Path) -> None:
    server = nginx_or_skip(tmp_path / "nginx")
    pid = server._proc.pid if server._proc else 0
    port = server.port
    server.stop()
    server.stop()  # idempotent
    assert not server.running
    with pytest.raises(ProcessLookupError):
        import os

        os.killpg(pid, 0)  # neither the master nor a worker is left in its group
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# -- The fault server -----------------------------------------------------------------------


@pytest.fixture
def faults(tmp_path: Path) -> Iterator[FaultServer]:
    root = tmp_path / "served"
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / "b").write_bytes(DATA)
    (root / "other").write_bytes(b"other bytes")
    with FaultServer(root) as server:
        yield server


def _fconn(server: FaultServer, timeout: float = 5) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)


def test_faults_ok_range_and_keep_alive(faults: FaultServer) -> None:
    conn = _fconn(faults)
    try:
        assert _get(conn, "/blobs/b") == (200, DATA)
        conn.request("GET", "/blobs/b", headers={"Range": "bytes=10-19"})
        resp = conn.getresponse()
        assert (resp.status, resp.headers["Content-Range"], resp.read()) == (
            206,
            f"bytes 10-19/{len(DATA)}",
            DATA[10:20],
        )
        assert _get(conn, "/blobs/b", {"Range": "bytes=-5"}) == (206, DATA[-5:])
        assert _get(conn, "/blobs/b", {"Range": f"bytes={len(DATA)}-"})[0] == 416
        assert _get(conn, "/nope")[0] == 404
        conn.request("HEAD", "/other")
        resp = conn.getresponse()
        assert (resp.status, resp.headers["Content-Length"], resp.read()) == (200, "11", b"")
    finally:
        conn.close()
    assert faults.connections == 1
    assert faults.requests_per_connection() == {1: 6}
    assert faults.hits("/blobs/b") == 4
    assert [r.seq for r in faults.log] == [1, 2, 3, 4, 5, 6]


def test_faults_refuse(faults: FaultServer) -> None:
    with pytest.raises(urllib.error.URLError) as e:
        urllib.request.urlopen(refused_url("/blobs/b"), timeout=5)
    assert isinstance(e.value.reason, ConnectionRefusedError)
    faults.set("/blobs/", Fault.refuse())
    conn = _fconn(faults)
    try:
        with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
            _get(conn, "/blobs/b")
    finally:
        conn.close()
    assert faults.hits("/blobs/b") == 1
    assert urllib.request.urlopen(faults.url("other"), timeout=5).read() == b"other bytes"


def test_faults_stall_times_out_and_stop_releases_it(tmp_path: Path) -> None:
    root = tmp_path / "served"
    root.mkdir()
    (root / "f").write_bytes(b"data")
    server = FaultServer(root).start()
    try:
        server.set_default(Fault.stall())
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=0.3)
        try:
            with pytest.raises(TimeoutError):
                _get(conn, "/f")
        finally:
            conn.close()
        # A client that never gives up: stop() still returns, and the client sees the end.
        result: list[object] = []
        blocked = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)

        def client() -> None:
            try:
                result.append(_get(blocked, "/f"))
            except Exception as e:
                result.append(e)

        thread = threading.Thread(target=client)
        thread.start()
        assert server.wait_for(2, path="/f")
    finally:
        t0 = time.monotonic()
        server.stop()
    assert time.monotonic() - t0 < 5
    thread.join(5)
    blocked.close()
    assert not thread.is_alive()
    assert isinstance(result[0], (http.client.RemoteDisconnected, ConnectionError))


def test_faults_stall_body_sends_headers_only(faults: FaultServer) -> None:
    faults.set("/blobs/", Fault.stall_body())
    conn = _fconn(faults, timeout=0.3)
    try:
        conn.request("GET", "/blobs/b")
        resp = conn.getresponse()
        assert (resp.status, resp.headers["Content-Length"]) == (200, str(len(DATA)))
        with pytest.raises(TimeoutError):
            resp.read()
    finally:
        conn.close()


def test_faults_trickle_one_byte_at_a_time(faults: FaultServer) -> None:
    faults.set("/other", Fault.trickle(ms=20))
    t0 = time.monotonic()
    conn = _fconn(faults)
    try:
        conn.request("GET", "/other")
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.read(1) == b"o"
        assert resp.read() == b"ther bytes"
    finally:
        conn.close()
    assert time.monotonic() - t0 >= 10 * 0.02 * 0.9  # 10 gaps between 11 bytes


@pytest.mark.parametrize("code", [403, 404, 500, 503])
def test_faults_status(faults: FaultServer, code: int) -> None:
    faults.set("/blobs/", Fault.status(code))
    conn = _fconn(faults)
    try:
        assert _get(conn, "/blobs/b")[0] == code
        assert _get(conn, "/other") == (200, b"other bytes")  # same connection: still kept alive
    finally:
        conn.close()
    assert faults.connections == 1


def test_faults_times_then_ok(faults: FaultServer) -> None:
    faults.set("/blobs/b", Fault.status(503, times=2))
    conn = _fconn(faults)
    try:
        assert [_get(conn, "/blobs/b")[0] for _ in range(3)] == [503, 503, 200]
    finally:
        conn.close()
    assert [r.fault for r in faults.log] == ["status", "status", "ok"]


def test_faults_truncate(faults: FaultServer) -> None:
    faults.set("/blobs/", Fault.truncate())
    conn = _fconn(faults)
    try:
        conn.request("GET", "/blobs/b")
        resp = conn.getresponse()
        assert resp.headers["Content-Length"] == str(len(DATA))
        with pytest.raises(http.client.IncompleteRead) as e:
            resp.read()
        assert e.value.partial == DATA[: len(DATA) // 2]
    finally:
        conn.close()


def test_faults_wrong_bytes(faults: FaultServer) -> None:
    faults.set("/blobs/", Fault.wrong_bytes())
    conn = _fconn(faults)
    try:
        status, body = _get(conn, "/blobs/b", {"Range": "bytes=100-199"})
    finally:
        conn.close()
    assert status == 206 and len(body) == 100
    assert body != DATA[100:200] and body[1:] == DATA[101:200]


def test_faults_redirects(faults: FaultServer) -> None:
    faults.set("/loop", Fault.redirect_loop())
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(faults.url("loop"), timeout=5)
    assert e.value.code == 302 and "redirect" in str(e.value.reason)
    e.value.close()
    assert faults.hits("/loop") >= 2
    faults.set("/moved", Fault.redirect_to(faults.url("other")))
    with urllib.request.urlopen(faults.url("moved"), timeout=5) as resp:
        assert resp.read() == b"other bytes"
    assert faults.hits("/other") == 1


def test_faults_arrived_event_syncs_without_sleep(faults: FaultServer) -> None:
    faults.set_default(Fault.stall())
    assert not faults.arrived.is_set()
    conn = _fconn(faults, timeout=10)
    thread = threading.Thread(target=lambda: pytest.raises(Exception, _get, conn, "/other"))
    thread.start()
    try:
        assert faults.arrived.wait(5)
        assert faults.log[0].path == "/other" and faults.log[0].fault == "stall"
    finally:
        faults.stop()
        thread.join(5)
        conn.close()
    assert not thread.is_alive()


def _raw(server: FaultServer, path: str, headers: str = "") -> socket.socket:
    """A socket that sent ``GET path`` and nothing more."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
    return sock


def _recv_until(sock: socket.socket, n: int) -> bytes:
    """At least ``n`` bytes (or what came before the end)."""
    data = b""
    while len(data) < n:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    return data


def test_faults_trickle_status_sends_the_status_line_a_byte_at_a_time(faults: FaultServer) -> None:
    faults.set("/other", Fault.trickle_status(ms=20))
    t0 = time.monotonic()
    with _raw(faults, "/other") as sock:
        got = _recv_until(sock, 17)
    assert got.startswith(b"HTTP/1.1 200 xxxx") and not got.strip(b"HTTP/1.1 200 x")  # never a line end
    assert time.monotonic() - t0 >= 7 * 0.02 * 0.9  # 7 gaps between the pieces


def test_faults_trickle_headers_sends_a_header_line_at_a_time_without_end(faults: FaultServer) -> None:
    faults.set("/other", Fault.trickle_headers(ms=20))
    t0 = time.monotonic()
    with _raw(faults, "/other") as sock:
        got = _recv_until(sock, 17 + 3 * 16)
    assert got.startswith(b"HTTP/1.1 200 OK\r\nX-Trickle-0: 0\r\nX-Trickle-1: 1\r\nX-Trickle-2: 2\r\n")
    assert b"\r\n\r\n" not in got
    assert time.monotonic() - t0 >= 3 * 0.02 * 0.9


def test_faults_many_headers_sends_them_all_then_the_file(faults: FaultServer) -> None:
    faults.set("/other", Fault.many_headers(150))
    with _raw(faults, "/other") as sock:
        data = _recv_until(sock, 150 * 12)
        while not data.endswith(b"other bytes"):
            data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.count(b"X-Many-") == 150 and body == b"other bytes"


@pytest.mark.parametrize("by", [5, -5])
def test_faults_lie_length_says_a_wrong_content_length_then_closes(faults: FaultServer, by: int) -> None:
    faults.set("/other", Fault.lie_length(by))
    with _raw(faults, "/other") as sock:
        data = _recv_until(sock, 1 << 20)  # to the close
    head, _, body = data.partition(b"\r\n\r\n")
    assert f"Content-Length: {11 + by}".encode() in head and body == b"other bytes"


@pytest.mark.parametrize("length", [None, 10 * 10**9])
def test_faults_endless_sends_zeros_for_as_long_as_it_is_read(faults: FaultServer, length: int | None) -> None:
    faults.set("/other", Fault.endless(length))
    with _raw(faults, "/other") as sock:
        data = _recv_until(sock, 3 << 20)
    head, _, body = data.partition(b"\r\n\r\n")
    assert (b"Content-Length: 10000000000" in head) == (length is not None)
    assert len(body) >= (3 << 20) - len(head) - 4 and not body.strip(b"\x00")


def test_faults_huge_trailer_serves_a_pack_as_large_as_its_trailer_claims(tmp_path: Path) -> None:
    from cuda_program_cas._disk.pack import TRAILER_SIZE, index_span, pack_chunks, parse_trailer

    pack = b"".join(pack_chunks([("11" * 32, "22" * 32, b"blob bytes", 7)]))
    (tmp_path / "p.cpk").write_bytes(pack)
    _checksum, index_offset, _count = parse_trailer(pack[-TRAILER_SIZE:], len(pack), "p")
    claimed = index_offset + 1024 + 96 * (2**32 - 1) + TRAILER_SIZE  # 412 GB
    with FaultServer(tmp_path) as server:
        server.set("/p.cpk", Fault.huge_trailer())
        conn = _fconn(server)
        try:
            conn.request("GET", "/p.cpk", headers={"Range": f"bytes=-{TRAILER_SIZE}"})
            resp = conn.getresponse()
            trailer = resp.read()
            assert (resp.status, resp.headers["Content-Range"]) == (
                206,
                f"bytes {claimed - TRAILER_SIZE}-{claimed - 1}/{claimed}",
            )
            assert index_span(claimed, trailer, "p") == (index_offset, 1024 + 96 * (2**32 - 1))
            assert _get(conn, "/p.cpk", {"Range": "bytes=0-17"}) == (206, pack[:18])  # the real bytes
            assert _get(conn, "/p.cpk", {"Range": f"bytes={len(pack)}-{len(pack) + 9}"}) == (206, bytes(10))
        finally:
            conn.close()
        server.set("/p.cpk", Fault.huge_trailer(2**32 - 1, consistent=False))
        conn = _fconn(server)
        try:
            conn.request("GET", "/p.cpk", headers={"Range": f"bytes=-{TRAILER_SIZE}"})
            resp = conn.getresponse()
            assert resp.headers["Content-Range"].endswith(f"/{len(pack)}")  # the real size: no longer fits
            with pytest.raises(ValueError, match="does not match the file's size"):
                parse_trailer(resp.read(), len(pack), "p")
        finally:
            conn.close()


def test_faults_trickle_handshake_sends_a_tls_record_a_byte_at_a_time(faults: FaultServer) -> None:
    faults.trickle_handshake(ms=20)
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", faults.port), timeout=5) as sock:
        got = _recv_until(sock, 8)
    assert got.startswith(b"\x16\x03\x03\x40\x00") and not got[5:].strip(b"\x00")  # 16 KiB record, slowly
    assert time.monotonic() - t0 >= 3 * 0.02 * 0.9
    assert faults.log == []  # no HTTP request was ever read


def test_nginx_or_skip_skips_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import testkit.nginx

    monkeypatch.setattr(testkit.nginx, "find_nginx", lambda: None)
    with pytest.raises(pytest.skip.Exception, match="nginx is not installed"):
        nginx_or_skip(tmp_path / "nginx")
