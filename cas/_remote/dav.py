"""The store's remote side: WebDAV writes (PUT, MKCOL, DELETE) and HEAD (ranged reads are the engine's).

Each call returns what the server said or raises :class:`.client.HttpFailure`, with the
URL as :func:`.urls.shown` gives it. Atomicity is the server's job (nginx's dav module
renames a complete body onto the target). A server that answers ``409 Conflict`` to a PUT
gets the missing collections made with MKCOL, top down, and the PUT again. A 2xx is a
claim, not a proof: the uploader reads back what it sent (:mod:`cuda_program_cas._shared.upload`).
"""

from __future__ import annotations

from typing import IO

from cuda_program_cas._base.urls import shown

from .client import HttpFailure, Reply, request

__all__ = ["delete", "put", "size_of"]

_PUT_OK = frozenset((200, 201, 204))
_ABSENT = frozenset((404, 410))
#: Why nginx answers 500 to a PUT, each seen with nginx 1.22 (tests/test_http_publish.py).
_STORE_FAILED_HINT = (
    "the server could not store it; with nginx, likely causes: the folder is not writable by nginx's worker "
    "user, create_full_put_path is off and a folder is missing, or the disk (or client_body_temp_path's) is "
    "full; nginx's error log says which"
)
_AUTH_HINT = "the server wants a token: set CUDA_PROGRAM_CAS_HTTP_TOKEN or a ~/.netrc entry for the host"


def _refused(url: str, reply: Reply, method: str) -> HttpFailure:
    detail = f"{method} answered {reply.status}"
    if reply.status in (401, 403):
        detail += f" ({_AUTH_HINT}, with write access for a publish)"
    elif reply.status == 405 and method in ("PUT", "MKCOL"):
        detail += " (the server does not accept WebDAV writes there: nginx needs dav_methods PUT MKCOL)"
    elif reply.status == 413:
        detail += " (the body is too large for the server: nginx needs client_max_body_size 0)"
    elif reply.status == 500 and method in ("PUT", "MKCOL"):
        detail += f" ({_STORE_FAILED_HINT})"
    return HttpFailure(shown(url), f"HTTP {reply.status}", detail, outage=reply.status >= 500)


def size_of(url: str) -> int | None:
    """The size of the file at ``url`` (its ``Content-Length``; unsaid: -1), or None when there is none."""
    reply = request("HEAD", url)
    if reply.status in _ABSENT:
        return None
    if reply.status != 200:
        raise _refused(url, reply, "HEAD")
    length = reply.headers.get("content-length", "")
    return int(length) if length.isdigit() else -1


def put(url: str, data: bytes | IO[bytes], *, root: str) -> int:
    """Store ``data`` at ``url`` (below the store URL ``root``); the status: 200, 201, 204, or 412."""
    reply = request("PUT", url, body=data)
    if reply.status == 409:
        _make_parents(root, url)
        reply = request("PUT", url, body=data)
    if reply.status in _PUT_OK or reply.status == 412:
        return reply.status
    raise _refused(url, reply, "PUT")


def delete(url: str) -> None:
    """Remove the file at ``url``; nothing when there is none (404, 410)."""
    reply = request("DELETE", url)
    if reply.status not in _PUT_OK and reply.status not in _ABSENT:
        raise _refused(url, reply, "DELETE")


def _make_parents(root: str, url: str) -> None:
    """MKCOL ``root`` and every collection below it on the way to ``url``, top down (405: it exists)."""
    below = url[len(root) :].strip("/").split("/")[:-1] if url.startswith(root + "/") else []
    level = root
    for part in ["", *below]:
        level = f"{level}/{part}" if part else level
        reply = request("MKCOL", level + "/")
        if reply.status not in (200, 201, 204, 405):
            raise _refused(level + "/", reply, "MKCOL")
