"""A real redis-server on loopback, for the Redis engine's tests and benchmarks: one server, its own counters.

``RedisServer(prefix)`` runs redis-server in the foreground on 127.0.0.1 and a free port, its
``redis.conf``, working directory and log under ``prefix``, no persistence. Options:
``password`` (``requirepass``); ``tls=True`` (TLS only, a certificate made as
:mod:`testkit.nginx` makes one; ``cert`` is the CA, for a client's bundle); ``maxmemory`` and
``policy``. ``enable-debug-command`` is on, so a test can ``DEBUG SLEEP``.

``url`` has no password, ``url_with_password()`` has it. ``client()`` is a redis-py client of
its own for setting up and for the server's figures: ``commandstats()``, ``stats()`` and
``reset_stats()``. ``kill()`` is an outage; ``start(port=server.port)`` brings it back.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from testkit.nginx import _make_cert
from testkit.server import ServerProcess, start_or_skip

__all__ = ["RedisServer", "RedisServerError", "find_redis_server"]

_WORD_RE = re.compile(r"[A-Za-z0-9._~+/=-]+")


class RedisServerError(RuntimeError):
    """redis-server could not be started; the message ends with the tail of its log."""


def find_redis_server() -> str | None:
    """The redis-server binary: on PATH, else /usr/bin/redis-server; None if neither."""
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    )


class RedisServer(ServerProcess):
    """redis-server on 127.0.0.1, configured for a test (see the module docstring)."""

    def __init__(
        self,
        prefix: str | os.PathLike[str],
        *,
        password: str | None = None,
        tls: bool = False,
        maxmemory: str | None = None,
        policy: str = "noeviction",
    ) -> None:
        for what, word in (("password", password), ("maxmemory", maxmemory), ("policy", policy)):
            if word is not None and not _WORD_RE.fullmatch(word):
                raise ValueError(f"{what}: only [A-Za-z0-9._~+/=-] (it is written into redis.conf)")
        self.prefix = Path(prefix).resolve()
        self.password = password
        self.tls = tls
        self.maxmemory = maxmemory
        self.policy = policy
        self.conf = self.prefix / "redis.conf"
        self.log = self.prefix / "redis.log"
        #: The CA that signed the server's certificate: what a client trusts (``CUDA_PROGRAM_CAS_CA_BUNDLE``).
        self.cert: Path | None = None
        self._server_cert: Path | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://`` with tls=True), without the password."""
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def url_with_password(self, password: str | None = None) -> str:
        """The URL with ``password`` (default: the server's) as the default user's: ``redis://:PW@...``."""
        word = self.password if password is None else password
        return self.url.replace("://", f"://:{word}@", 1)

    def _config(self) -> str:
        lines = [
            "bind 127.0.0.1",
            f"port {0 if self.tls else self.port}",
            "daemonize no",
            'save ""',
            "appendonly no",
            f"dir {self.prefix}",
            f"logfile {self.log}",
            "databases 16",
            f"maxmemory-policy {self.policy}",
            "enable-debug-command yes",
        ]
        if self.maxmemory:
            lines.append(f"maxmemory {self.maxmemory}")
        if self.password:
            lines.append(f"requirepass {self.password}")
        if self.tls:
            assert self.cert is not None
            lines += [
                f"tls-port {self.port}",
                f"tls-cert-file {self._server_cert}",
                f"tls-key-file {self.prefix / 'key.pem'}",
                "tls-auth-clients no",
            ]
        return "\n".join(lines) + "\n"

    def start(self, port: int | None = None) -> RedisServer:
        """Write the config and start redis-server on ``port`` (default: a free one); return once it answers."""
        binary = find_redis_server()
        if binary is None:
            raise RedisServerError("redis-server is not installed (not on PATH, no /usr/bin/redis-server)")
        self.prefix.mkdir(parents=True, exist_ok=True)
        if self.tls and self.cert is None:
            self.cert, self._server_cert, _key = _make_cert(self.prefix)

        def spawn() -> subprocess.Popen[bytes]:
            self.conf.write_text(self._config())
            self.log.write_text("")
            return subprocess.Popen(
                [binary, str(self.conf)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

        self._launch(spawn, lambda tail: RedisServerError(f"redis-server did not start; log tail:\n{tail}"), port)
        return self

    def _started(self) -> bool:
        return "Ready to accept connections" in self.log_tail(20000)

    # -- the server's own figures -------------------------------------------------------------
    def client(self) -> Any:
        """A redis-py client of this server (its password, its certificate), made once per start."""
        if self._client is None:
            import redis

            tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": str(self.cert)} if self.tls else {}
            self._client = redis.Redis(
                host="127.0.0.1", port=self.port, password=self.password, socket_timeout=10, **tls
            )
        return self._client

    def commandstats(self) -> dict[str, int]:
        """Calls per command since the start or ``reset_stats()``: ``{"get": 3}``. A script's or a transaction's
        commands count as themselves, ``exec`` once per transaction; a subcommand is ``client|setinfo``."""
        info = self.client().info("commandstats")
        return {name.removeprefix("cmdstat_"): int(fields["calls"]) for name, fields in info.items()}

    def stats(self) -> dict[str, Any]:
        """``INFO stats``: ``total_commands_processed``, ``total_connections_received``, ``keyspace_hits``..."""
        return dict(self.client().info("stats"))

    def reset_stats(self) -> None:
        """``CONFIG RESETSTAT``: the counters start again from 0."""
        self.client().config_resetstat()


def redis_or_skip(prefix: str | os.PathLike[str], **options: Any) -> RedisServer:
    """A started :class:`RedisServer` (stopped by the caller), or ``pytest.skip`` naming why there is none."""
    missing = "redis-server is not installed (not on PATH, no /usr/bin/redis-server): apt-get install redis-server"
    return start_or_skip(RedisServer(prefix, **options), None if find_redis_server() else missing)
