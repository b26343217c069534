"""Store URLs: which entries of a store list are URLs, and how a URL is checked and shown.

``CUDA_PROGRAM_CAS_SHARED`` separates stores with ``os.pathsep``, which is ``:`` on
POSIX, and a URL holds ``:`` after its scheme and before a port. The split is
made first, then mended: a part ``http`` or ``https`` followed by a part that
starts with ``//`` opens a URL; an IPv6 literal (``[::1]``) is joined up to its
``]``; and a next part that starts with a port number (digits, then ``/`` or
nothing) is that URL's port when the URL has no path yet. After ``//user``, a
part with ``@`` before any ``/`` is the password and the host: a URL with
credentials stays whole, so it is refused whole, and its password is never taken
for a directory (and logged). So
``/nfs/store:https://cache.example:8443/store:/scratch/store`` is three stores.
A directory whose relative name starts with digits and a slash would be read as
a port: write it ``./8080/store`` (relative names get a WARNING anyway).
"""

from __future__ import annotations

import re

__all__ = ["is_store_url", "join", "mend_split", "normalize_store_url", "shown"]

_SCHEMES = ("http://", "https://")
_PORT_PART = re.compile(r"\d+(/.*)?")


def is_store_url(text: object) -> bool:
    """True when ``text`` names a store over HTTP(S) (a ``str`` starting with ``http://`` or ``https://``)."""
    return isinstance(text, str) and text[:8].lower().startswith(_SCHEMES)


def mend_split(parts: list[str]) -> list[str]:
    """The parts of a ``os.pathsep`` split, with the URLs the split cut put back together."""
    from urllib.parse import urlsplit  # only where a store list is read: not on a plain cache's path

    out: list[str] = []
    i = 0
    while i < len(parts):
        part = parts[i]
        if part.lower() in ("http", "https") and i + 1 < len(parts) and parts[i + 1].startswith("//"):
            url = f"{part}:{parts[i + 1]}"
            i += 2
            # An IPv6 literal ([::1]) was cut at each of its colons: join up to its "]".
            while i < len(parts) and "[" in _authority(url) and "]" not in _authority(url):
                url, i = f"{url}:{parts[i]}", i + 1
            # "//user" then "password@host...": credentials (refused later, but named whole).
            if i < len(parts) and "/" not in url.split("//", 1)[1] and "@" in parts[i].split("/", 1)[0]:
                url, i = f"{url}:{parts[i]}", i + 1
            # "//host" then "8443/path": the port, when the URL has neither a path nor a port yet.
            host = _authority(url).rpartition("@")[2]
            if (
                i < len(parts)
                and _PORT_PART.fullmatch(parts[i])
                and not urlsplit(url).path
                and ":" not in host.rpartition("]")[2]
            ):
                url, i = f"{url}:{parts[i]}", i + 1
            out.append(url)
            continue
        out.append(part)
        i += 1
    return out


def _authority(url: str) -> str:
    """The part of ``url`` between ``//`` and the next ``/``."""
    return url.split("//", 1)[1].split("/", 1)[0]


def normalize_store_url(url: str) -> str:
    """``url`` checked and without a trailing slash; ``ValueError`` naming what is wrong.

    A store URL is ``http(s)://host[:port]/path``: no user name or password in it
    (a token comes from the environment or ``.netrc``, never from a URL that ends
    up in logs), no query and no fragment (entries are paths below it).
    """
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"not an http(s) URL: {shown(url)!r}")
    if not parts.hostname:
        raise ValueError(f"store URL has no host: {shown(url)!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"store URL carries credentials: {shown(url)!r}; put a token in CUDA_PROGRAM_CAS_HTTP_TOKEN or ~/.netrc"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"store URL has a query or fragment: {shown(url)!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"store URL has a bad port: {shown(url)!r}") from exc
    return f"{parts.scheme.lower()}://{parts.netloc}{parts.path.rstrip('/')}"


def join(base: str, relative: str) -> str:
    """The URL of ``relative`` (a store-relative path with ``/``) below the store URL ``base``."""
    return f"{base}/{relative}"


def shown(url: str) -> str:
    """``url`` as it may be logged: any user name and password replaced by ``***``."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"***@{host}").geturl()
