"""The tests' nginx: :mod:`_nginx` (in tools/, shared with the benchmarks), and a skip where it cannot run."""

from __future__ import annotations

import os

import pytest
from _nginx import LogEntry, Nginx, NginxError, find_nginx, free_port

__all__ = ["LogEntry", "Nginx", "NginxError", "find_nginx", "free_port", "nginx_or_skip"]


def nginx_or_skip(
    prefix: str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    *,
    token: str | None = None,
    tls: bool = False,
    certificate: str = "good",
) -> Nginx:
    """A started :class:`Nginx`, or ``pytest.skip`` with the reason (not installed, or its error log tail).

    The caller stops it (``with nginx_or_skip(tmp_path / "ngx") as n:``, or a fixture's finaliser).
    """
    if find_nginx() is None:
        pytest.skip("nginx is not installed (not on PATH, no /usr/sbin/nginx): apt-get install nginx-light")
    server = Nginx(prefix, root, token=token, tls=tls, certificate=certificate)
    try:
        return server.start()
    except NginxError as e:
        server.stop()
        pytest.skip(f"nginx did not start: {e}")
