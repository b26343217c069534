"""A real nginx on loopback, for the HTTP store's tests and benchmarks: static reads and WebDAV writes of one directory.

``Nginx(prefix, root)`` runs nginx in the foreground (``daemon off``) on 127.0.0.1 and a free
port, its config, logs and temp folders under ``prefix``. ``/store/`` reads ``root`` as static
files (Range answered by nginx, ``etag on``, keep-alive); ``/dav/`` writes it by WebDAV
(``create_full_put_path on``). A PUT's body lands in ``client_body_temp_path``, on ``root``'s
filesystem, and is renamed onto the target once complete: a reader never sees a partial file,
and a client that disconnects mid-body leaves nothing. MKCOL makes one level (409 where the
parent is missing).

``token`` answers 401 to a request without ``Authorization: Bearer <token>``. ``tls=True``
serves HTTPS with a certificate of a CA of its own (``cert``, for a client's bundle);
``certificate`` picks one of :data:`CERTIFICATES`. ``requests()`` parses the access log, one
JSON object a line.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import ssl
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from testkit.server import ServerProcess, start_or_skip

__all__ = ["CERTIFICATES", "LogEntry", "Nginx", "NginxError", "find_nginx", "nginx_or_skip"]

READ_PREFIX = "/store/"
DAV_PREFIX = "/dav/"
_TOKEN_RE = re.compile(r"[A-Za-z0-9._~+/=-]+")
# The access log: one JSON object a line. $connection is the connection's serial number and
# $connection_requests the request's number on it: two requests on one connection prove keep-alive.
_LOG_FORMAT = (
    '{"method":"$request_method","uri":"$request_uri","status":$status,"range":"$http_range",'
    '"body_bytes":$body_bytes_sent,"bytes":$bytes_sent,"request_length":$request_length,'
    '"connection":$connection,"connection_requests":$connection_requests}'
)


class NginxError(RuntimeError):
    """nginx could not be started; the message ends with the tail of its error log."""


@dataclass(frozen=True)
class LogEntry:
    """One line of the access log."""

    method: str
    uri: str
    status: int
    range: str  # the Range request header, "" where none
    body_bytes: int  # $body_bytes_sent
    bytes: int  # $bytes_sent, headers included
    request_length: int
    connection: int  # nginx's serial number of the connection
    connection_requests: int  # 1 for the first request on a connection, 2 for the next, ...


def find_nginx() -> str | None:
    """The nginx binary: on PATH, else /usr/sbin/nginx (Debian's, off a non-root PATH); None if neither."""
    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)


#: The certificates ``Nginx(certificate=...)`` can serve: their names and validity (None: from a
#: day ago for two days).
CERTIFICATES: dict[str, tuple[str, tuple[str, str] | None]] = {
    "good": ("IP:127.0.0.1,DNS:localhost", None),
    "expired": ("IP:127.0.0.1,DNS:localhost", ("20200101000000Z", "20200102000000Z")),
    "wrong-host": ("DNS:wrong.example", None),
}
_CA_CONF = """[ ca ]
default_ca = test_ca
[ test_ca ]
database = {dir}/index.txt
new_certs_dir = {dir}
serial = {dir}/serial
default_md = sha256
policy = any
unique_subject = no
[ any ]
commonName = supplied
[ leaf ]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = {names}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


def _openssl(*args: str) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise NginxError("tls=True needs the openssl command, which is not on PATH")
    done = subprocess.run([openssl, *args], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise NginxError(f"openssl {args[0]} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def _make_cert(directory: Path, certificate: str = "good") -> tuple[Path, Path, Path]:
    """A CA of its own and a server certificate it signed (see :data:`CERTIFICATES`): CA, certificate, key.

    ``openssl ca`` signs, because it alone sets any validity period (an expired one too).
    """
    names, dates = CERTIFICATES[certificate]
    if dates is None:
        now = datetime.now(timezone.utc)
        dates = tuple(t.strftime("%Y%m%d%H%M%SZ") for t in (now - timedelta(days=1), now + timedelta(days=2)))
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, csr = directory / "cert.pem", directory / "key.pem", directory / "cert.csr"
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-days", "2", "-subj", "/CN=cuda-program-cas test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
    _openssl("req", "-new", *ec, "-subj", "/CN=cuda-program-cas test server", "-keyout", str(key), "-out", str(csr))
    conf = directory / "ca.cnf"
    conf.write_text(_CA_CONF.format(dir=directory, names=names))
    (directory / "index.txt").write_text("")
    (directory / "serial").write_text("01\n")
    _openssl("ca", "-batch", "-config", str(conf), "-cert", str(ca), "-keyfile", str(ca_key), "-in", str(csr),
             "-out", str(cert), "-extensions", "leaf", "-startdate", dates[0], "-enddate", dates[1],
             "-notext")  # fmt: skip
    return ca, cert, key


class Nginx(ServerProcess):
    """nginx serving ``root`` (default ``prefix/root``) under ``/store/`` and ``/dav/``."""

    def __init__(
        self,
        prefix: str | os.PathLike[str],
        root: str | os.PathLike[str] | None = None,
        *,
        token: str | None = None,
        tls: bool = False,
        certificate: str = "good",
        server_block: str | None = None,
    ) -> None:
        if certificate not in CERTIFICATES:
            raise ValueError(f"certificate: one of {sorted(CERTIFICATES)}, not {certificate!r}")
        if token is not None and not _TOKEN_RE.fullmatch(token):
            raise ValueError("token: only [A-Za-z0-9._~+/=-] (it is written into nginx.conf)")
        self.prefix = Path(prefix).resolve()
        self.root = Path(root).resolve() if root is not None else self.prefix / "root"
        self.token = token
        self.tls = tls
        self.certificate = certificate
        #: A whole ``server { ... }`` block to use instead of the built-in one (docs/http.md's, in a test):
        #: ``LISTEN``, ``CERT`` and ``KEY`` in it become this server's address, certificate and key.
        self.server_block = server_block
        self.conf = self.prefix / "nginx.conf"
        self.error_log = self.prefix / "error.log"
        self.access_log = self.prefix / "access.log"
        self.pid_file = self.prefix / "nginx.pid"
        self.cert: Path | None = None  # the CA's certificate (a client's CA bundle) where tls=True
        self.server_cert: Path | None = None  # the certificate nginx serves, signed by that CA
        self._log_offset = 0

    # -- URLs -------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` (``https://`` with tls=True), no trailing slash."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def read_url(self, sub: str = "") -> str:
        """The URL that reads ``root/sub`` (``sub`` relative, "" for the folder itself)."""
        return self.base_url + READ_PREFIX + sub.lstrip("/")

    def dav_url(self, sub: str = "") -> str:
        """The WebDAV URL of ``root/sub``; MKCOL wants a trailing slash on folders."""
        return self.base_url + DAV_PREFIX + sub.lstrip("/")

    def auth_headers(self) -> dict[str, str]:
        """``{"Authorization": "Bearer <token>"}``, or {} where there is no token."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    # -- Config -----------------------------------------------------------------------------
    def _body_temp(self) -> Path:
        """A temp folder for PUT bodies on root's filesystem, so each PUT lands by rename."""
        body = self.prefix / "body-temp"
        body.mkdir(parents=True, exist_ok=True)
        if os.stat(body).st_dev != os.stat(self.root).st_dev:
            body = self.root.parent / f".nginx-body-{os.getpid()}-{id(self)}"
            body.mkdir(parents=True, exist_ok=True)
        return body

    def _config(self) -> str:
        p = self.prefix
        user = "user root root;\n" if os.geteuid() == 0 else ""  # workers must read pytest's 0700 dirs
        listen = f"127.0.0.1:{self.port}" + (" ssl" if self.tls else "")
        tls = ""
        if self.tls:
            assert self.server_cert is not None
            tls = (
                f"        ssl_certificate {self.server_cert};\n"
                f"        ssl_certificate_key {self.prefix / 'key.pem'};\n"
                "        ssl_protocols TLSv1.2 TLSv1.3;\n"
            )
        auth = ""
        if self.token:
            auth = (
                f'        if ($http_authorization != "Bearer {self.token}") {{ return 401; }}\n'
                '        add_header WWW-Authenticate "Bearer" always;\n'
            )
        root = str(self.root).rstrip("/") + "/"
        server = self._server(listen, tls, auth, root)
        return f"""{user}worker_processes 1;
error_log {self.error_log} info;
events {{ worker_connections 256; }}
http {{
    default_type application/octet-stream;
    log_format jsonl escape=json '{_LOG_FORMAT}';
    access_log {self.access_log} jsonl;
    client_body_temp_path {self._body_temp()};
    proxy_temp_path {p / "proxy-temp"};
    fastcgi_temp_path {p / "fastcgi-temp"};
    uwsgi_temp_path {p / "uwsgi-temp"};
    scgi_temp_path {p / "scgi-temp"};
    sendfile on;
    keepalive_timeout 60s;
    keepalive_requests 1000;
{server}
}}
"""

    def _server(self, listen: str, tls: str, auth: str, root: str) -> str:
        if self.server_block is not None:
            block = self.server_block.replace("LISTEN", listen).replace("CERT", str(self.server_cert))
            return block.replace("KEY", str(self.prefix / "key.pem"))
        return f"""    server {{
        listen {listen};
        server_name localhost;
{tls}{auth}        location {READ_PREFIX} {{
            alias {root};
            etag on;
            autoindex off;
        }}
        location {DAV_PREFIX} {{
            alias {root};
            dav_methods PUT DELETE MKCOL COPY MOVE;
            create_full_put_path on;
            client_max_body_size 0;
            dav_access user:rw group:r all:r;
        }}
        location / {{ return 404; }}
    }}"""

    # -- Life cycle -------------------------------------------------------------------------
    def start(self) -> Nginx:
        """Write the config and start nginx; return once it accepts connections. Raises NginxError."""
        binary = find_nginx()
        if binary is None:
            raise NginxError("nginx is not installed (not on PATH, no /usr/sbin/nginx)")
        self.prefix.mkdir(parents=True, exist_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        if self.tls and self.cert is None:
            self.cert, self.server_cert, _ = _make_cert(self.prefix, self.certificate)

        def spawn() -> subprocess.Popen[bytes]:
            self.conf.write_text(self._config())
            self.access_log.touch()
            self.error_log.write_text("")
            self.pid_file.unlink(missing_ok=True)
            with open(self.prefix / "stderr.log", "wb") as stderr:  # a file, not a pipe nobody drains
                return subprocess.Popen(
                    [binary, "-p", f"{self.prefix}/", "-c", str(self.conf), "-e", str(self.error_log),
                     "-g", f"daemon off; pid {self.pid_file};"],
                    stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                    start_new_session=True,  # its own process group: stop() can kill master and workers together
                )  # fmt: skip

        self._launch(spawn, lambda tail: NginxError(f"nginx did not start; error log tail:\n{tail}"))
        return self

    def _started(self) -> bool:
        # nginx writes the pid file after it has bound its listening sockets.
        assert self._proc is not None
        try:
            pid = int(self.pid_file.read_text().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        return pid == self._proc.pid

    def log_tail(self, n: int = 3000) -> str:
        """The tail of nginx's error log (info level), then of its stderr."""
        logs = (self.error_log, self.prefix / "stderr.log")
        return "".join(p.read_text(errors="replace") for p in logs if p.exists())[-n:]

    # -- Logs -------------------------------------------------------------------------------
    def requests(self, wait_for: int = 0, timeout: float = 5.0) -> list[LogEntry]:
        """The access log's entries since the last ``reset_log()``.

        nginx logs a request after it sent the response, so a client may be ahead of the log:
        ``wait_for=n`` polls until at least n entries are there (or ``timeout`` passed).
        """
        deadline = time.monotonic() + timeout
        while True:
            with open(self.access_log, "rb") as f:
                f.seek(self._log_offset)
                data = f.read()
            lines = data.decode().splitlines(keepends=True)
            entries = [LogEntry(**json.loads(line)) for line in lines if line.endswith("\n")]
            if len(entries) >= wait_for or time.monotonic() >= deadline:
                return entries
            time.sleep(0.01)

    def reset_log(self) -> None:
        """Forget the entries so far: ``requests()`` returns only later ones.

        nginx logs a request just after its answer, so a client's last request may not be in
        the log yet. So a marker request goes first and the log starts after its line: the one
        worker logs each request before it serves the next. With nginx stopped, the log starts
        at its end now.
        """
        offset = self.access_log.stat().st_size
        marker = f"/cpcas-log-marker-{time.monotonic_ns()}"
        conn = (
            http.client.HTTPSConnection("127.0.0.1", self.port, timeout=5, context=ssl._create_unverified_context())
            if self.tls
            else http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        )
        try:
            conn.request("GET", marker)
            conn.getresponse().read()
        except (OSError, http.client.HTTPException):
            self._log_offset = offset
            return
        finally:
            conn.close()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            with open(self.access_log, "rb") as f:
                f.seek(offset)
                data = f.read()
            at = data.find(marker.encode())
            end = data.find(b"\n", at) if at >= 0 else -1
            if end >= 0:
                self._log_offset = offset + end + 1
                return
            time.sleep(0.005)
        self._log_offset = self.access_log.stat().st_size


def nginx_or_skip(
    prefix: str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    *,
    token: str | None = None,
    tls: bool = False,
    certificate: str = "good",
) -> Nginx:
    """A started :class:`Nginx` (stopped by the caller), or ``pytest.skip`` with the reason."""
    missing = "nginx is not installed (not on PATH, no /usr/sbin/nginx): apt-get install nginx-light"
    return start_or_skip(
        Nginx(prefix, root, token=token, tls=tls, certificate=certificate), None if find_nginx() else missing
    )
