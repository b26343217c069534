"""Store addresses: which entries of a store list are URLs, and how an address is checked and shown.

A store is a directory (a path, or a ``file://`` URL), an ``http(s)://`` URL, a
``redis(s)://`` URL, or an ``s3://BUCKET/PREFIX``. A list of stores separates them with
whitespace or ``;``; ``|write`` after a store names it writable. Spaces around ``|``, an
unknown scheme (``htp://``) and ``://`` inside a path are refused (``ValueError`` naming the
entry), never read as a read-only store or as relative directories.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from urllib.parse import SplitResult

__all__ = [
    "STORE_SCHEMES",
    "check_address",
    "is_store_url",
    "join",
    "normalize_store_url",
    "parse_store_entry",
    "scheme_of",
    "shown",
    "split_store_list",
]

#: Every scheme a store address may have (``file`` names a directory).
STORE_SCHEMES = ("file", "http", "https", "redis", "rediss", "s3")
_URL_SCHEMES = ("http", "https", "redis", "rediss", "s3")
#: An S3 bucket's name, as every S3-compatible server accepts it.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
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
    """True when ``text`` names a store reached over a network (``http(s)://``, ``redis(s)://``, ``s3://``)."""
    return scheme_of(text) in _URL_SCHEMES


class StoreEntry(NamedTuple):
    """One store of a list: its address (a path or a URL) and whether it was named writable."""

    address: str
    writable: bool = False


def check_address(address: str) -> None:
    """``ValueError`` naming ``address`` when it has ``://`` but no scheme of :data:`STORE_SCHEMES` (``htp://``)."""
    if "://" in address and scheme_of(address) is None:
        m = _SCHEME_RE.match(address)
        what = f"unknown store scheme {m.group(1)!r}" if m else "'://' in a path"
        raise ValueError(
            f"{what} in {shown(address)!r}: a store is a directory (a path or file://), http(s)://, redis(s):// or s3://"
        )


def parse_store_entry(text: str) -> StoreEntry:
    """``ADDRESS`` or ``ADDRESS|write`` (``file://`` gives the path); ``ValueError`` for anything else."""
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
    """The entries of a store list: whitespace or ``;`` between them, empty ones skipped."""
    return [part for part in _bars_joined(_LIST_SEP.split(text.strip())) if part]


def _bars_joined(parts: list[str]) -> list[str]:
    """``redis://h | write`` one part again, so that :func:`parse_store_entry` refuses it whole."""
    out: list[str] = []
    for part in parts:
        if out and (part.startswith("|") or out[-1].endswith("|")):
            out[-1] = f"{out[-1]} {part}"
        else:
            out.append(part)
    return out


def normalize_store_url(url: str) -> str:
    """``url`` checked and without a trailing slash; ``ValueError`` naming what is wrong.

    ``http(s)://host[:port]/path`` without credentials (they end up in logs), query or
    fragment; ``redis(s)://[[user]:password@]host[:port][/db]``; ``s3://BUCKET[/PREFIX]``
    without credentials, port, query or fragment.
    """
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _URL_SCHEMES:
        raise ValueError(f"not a store URL (http, https, redis or rediss): {shown(url)!r}")
    if not parts.hostname:
        raise ValueError(f"store URL has no host: {shown(url)!r}")
    if scheme == "s3":
        return _s3_url(url, parts)
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


def _s3_url(url: str, parts: SplitResult) -> str:
    bucket = parts.netloc
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ValueError(
            f"an S3 store is s3://BUCKET/PREFIX with a bucket's name (lowercase letters, digits, '.', '-'; "
            f"no credentials or port): {shown(url)!r}"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"store URL has a query or fragment: {shown(url)!r}")
    path = parts.path.strip("/")
    if any(part in ("", ".", "..") for part in path.split("/")) and path:
        raise ValueError(f"an S3 store's prefix has an empty, '.' or '..' part: {shown(url)!r}")
    return f"s3://{bucket}/{path}" if path else f"s3://{bucket}"


def join(base: str, relative: str) -> str:
    """The URL of ``relative`` (a store-relative path with ``/``) below the store URL ``base``."""
    return f"{base}/{relative}"


def shown(url: str) -> str:
    """``url`` as it may be logged: any user name and password, query (a signature) and fragment as ``***``."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.username is None and parts.password is None and not parts.query and not parts.fragment:
        return url
    if parts.username is not None or parts.password is not None:
        parts = parts._replace(netloc=f"***@{parts.netloc.rpartition('@')[2]}")
    return parts._replace(query="***" if parts.query else "", fragment="***" if parts.fragment else "").geturl()
