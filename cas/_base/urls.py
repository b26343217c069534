"""Store addresses: which entries of a store list are URLs, and how an address is checked and shown.

A store is a directory (a path, or a ``file://`` URL), an ``http(s)://`` URL (a
web server; WebDAV for writes), or a ``redis(s)://`` URL. :data:`STORE_SCHEMES`
names every scheme; the table that picks an engine for each is
:mod:`cuda_program_cas._shared.tiers`.

A list of stores (``CUDA_PROGRAM_CAS_SHARED``) separates them with whitespace or
``;``: ``/nfs/store https://cache.example:8443/store redis://cache:6379/0|write``.
``|write`` after a store names it writable (new entries are written back to it);
without it a store is read only. Spaces around ``|``, a scheme not in
:data:`STORE_SCHEMES` (``htp://``) and ``://`` inside a path are refused
(``ValueError`` naming the entry), never read as a read-only store or as
relative directories.

The older form, ``os.pathsep`` between stores, is still read inside each part: the
split is made, then mended. A part that is a scheme followed by a part that
starts with ``//`` opens a URL; an IPv6 literal (``[::1]``) is joined up to its
``]``; and a next part that starts with a port number (digits, then ``/`` or
nothing) is that URL's port when the URL has no path yet. After ``//user``, a
part with ``@`` before any ``/`` is the password and the host: a URL with
credentials stays whole, so it is refused whole (HTTP) or kept whole (Redis), and
its password is never taken for a directory (and logged). So
``/nfs/store:https://cache.example:8443/store:/scratch/store`` is three stores.
A directory whose relative name starts with digits and a slash would be read as
a port: write it ``./8080/store`` (relative names get a WARNING anyway).
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = [
    "STORE_SCHEMES",
    "StoreEntry",
    "check_address",
    "is_store_url",
    "join",
    "mend_split",
    "normalize_store_url",
    "parse_store_entry",
    "scheme_of",
    "shown",
    "split_store_list",
]

#: Every scheme a store address may have (``file`` names a directory).
STORE_SCHEMES = ("file", "http", "https", "redis", "rediss")
#: The schemes of stores reached over a network.
_URL_SCHEMES = ("http", "https", "redis", "rediss")
_PORT_PART = re.compile(r"\d+([/|].*)?")
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_SCHEME_WORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
#: What follows ``|`` to name a store writable.
WRITABLE = "write"
_LIST_SEP = re.compile(r"[\s;]+")


def scheme_of(text: object) -> str | None:
    """The lowercase scheme of a store URL (one of :data:`STORE_SCHEMES`), or None for a path."""
    if not isinstance(text, str):
        return None
    m = _SCHEME_RE.match(text)
    if m is None:
        return None
    scheme = m.group(1).lower()
    return scheme if scheme in STORE_SCHEMES else None


def is_store_url(text: object) -> bool:
    """True when ``text`` names a store reached over a network (``http(s)://``, ``redis(s)://``)."""
    return scheme_of(text) in _URL_SCHEMES


class StoreEntry(NamedTuple):
    """One store of a list: its address (a path or a URL) and whether it was named writable."""

    address: str
    writable: bool = False


def check_address(address: str) -> None:
    """``ValueError`` naming ``address`` when it has ``://`` but no scheme of :data:`STORE_SCHEMES` (``htp://``).

    Such a typo would otherwise be a relative directory (a path of three names).
    """
    if "://" in address and scheme_of(address) is None:
        m = _SCHEME_RE.match(address)
        what = f"unknown store scheme {m.group(1)!r}" if m else "'://' in a path"
        raise ValueError(
            f"{what} in {shown(address)!r}: a store is a directory (a path or file://), http(s):// or redis(s)://"
        )


def parse_store_entry(text: str) -> StoreEntry:
    """``ADDRESS`` or ``ADDRESS|write``; ``ValueError`` for another attribute. ``file://`` gives the path.

    Also ``ValueError`` for spaces around ``|`` (``redis://h | write``: a store
    read-only and two relative directories, were it split there) and for an
    address :func:`check_address` refuses.
    """
    address, bar, attrs = text.partition("|")
    if bar and (address != address.rstrip() or attrs != attrs.strip()):
        tight = "|".join(part.strip() for part in text.split("|"))
        raise ValueError(f"spaces around '|' in {shown(text)!r}: write it {shown(tight)!r}")
    check_address(address)
    writable = False
    if bar:
        for attr in (a.strip() for a in attrs.split("|")):
            if attr.lower() != WRITABLE:
                raise ValueError(f"unknown store attribute {attr!r} after {shown(address)!r} (only |{WRITABLE})")
            writable = True
    if scheme_of(address) == "file":
        from urllib.parse import unquote, urlsplit

        parts = urlsplit(address)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"a file:// store must be on this host: {address!r}")
        address = unquote(parts.path)
    return StoreEntry(address, writable)


def split_store_list(text: str) -> list[str]:
    """The entries of a store list: whitespace or ``;`` between them, and ``os.pathsep`` inside each part.

    Each part is split on ``os.pathsep`` and mended (:func:`mend_split`), so the
    older form (``/a:https://host:8443/b``) reads as it always did.
    """
    import os

    out: list[str] = []
    for part in _bars_joined(_LIST_SEP.split(text.strip())):
        mended = [p for p in mend_split(part.split(os.pathsep)) if p]
        # '://' that no URL took (/nfs/a://b): kept whole, to be refused (check_address), not split into paths.
        out.extend(mended if "://" not in part or any("://" in p for p in mended) else [part])
    return out


def _bars_joined(parts: list[str]) -> list[str]:
    """The parts of a whitespace split with ``|`` attributes that spaces cut off joined back, spaces kept.

    ``redis://h | write`` is one entry again, which :func:`parse_store_entry`
    refuses, naming it whole: neither a read-only store nor directories ``|`` and ``write``.
    """
    out: list[str] = []
    for part in parts:
        if out and (part.startswith("|") or out[-1].endswith("|")):
            out[-1] = f"{out[-1]} {part}"
        else:
            out.append(part)
    return out


def mend_split(parts: list[str]) -> list[str]:
    """The parts of a ``os.pathsep`` split, with the URLs the split cut put back together."""
    from urllib.parse import urlsplit  # only where a store list is read: not on a plain cache's path

    out: list[str] = []
    i = 0
    while i < len(parts):
        part = parts[i]
        # A scheme this package does not know is mended too: the URL is then refused whole (check_address).
        if _SCHEME_WORD.fullmatch(part) and i + 1 < len(parts) and parts[i + 1].startswith("//"):
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

    An HTTP store URL is ``http(s)://host[:port]/path``: no user name or password
    in it (a token comes from the environment or ``.netrc``, never from a URL that
    ends up in logs), no query and no fragment (entries are paths below it).
    A Redis store URL is ``redis(s)://[[user]:password@]host[:port][/db]``, as
    Redis clients spell it: the password may be in it (it is never shown), and
    the path is a database number or nothing.
    """
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _URL_SCHEMES:
        raise ValueError(f"not a store URL (http, https, redis or rediss): {shown(url)!r}")
    if not parts.hostname:
        raise ValueError(f"store URL has no host: {shown(url)!r}")
    redis = scheme in ("redis", "rediss")
    if not redis and (parts.username is not None or parts.password is not None):
        raise ValueError(
            f"store URL carries credentials: {shown(url)!r}; put a token in CUDA_PROGRAM_CAS_HTTP_TOKEN or ~/.netrc"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"store URL has a query or fragment: {shown(url)!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"store URL has a bad port: {shown(url)!r}") from exc
    path = parts.path.rstrip("/")
    if redis and path and not (path[1:].isdigit() and path.count("/") == 1):
        raise ValueError(f"a Redis store URL's path is a database number (/0 to /15 ...): {shown(url)!r}")
    return f"{scheme}://{parts.netloc}{path}"


def join(base: str, relative: str) -> str:
    """The URL of ``relative`` (a store-relative path with ``/``) below the store URL ``base``."""
    return f"{base}/{relative}"


def shown(url: str) -> str:
    """``url`` as it may be logged: any user name and password, query and fragment replaced by ``***``.

    A query may be a credential too (a pre-signed URL's signature).
    """
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.username is None and parts.password is None and not parts.query and not parts.fragment:
        return url
    if parts.username is not None or parts.password is not None:
        parts = parts._replace(netloc=f"***@{parts.netloc.rpartition('@')[2]}")
    return parts._replace(query="***" if parts.query else "", fragment="***" if parts.fragment else "").geturl()
