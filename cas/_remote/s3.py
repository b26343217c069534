"""The S3 engine of a shared store: objects of a bucket under a prefix, signed by botocore, sent by the one HTTP client.

``s3://BUCKET/PREFIX`` names the store; its objects have a directory store's names
(``PREFIX/layout.json``, ``PREFIX/index/...``), so ``aws s3 sync`` copies a store in or out.
docs/s3.md says how a bucket is addressed, what each method asks and how leases work.

botocore (imported when an ``s3://`` store is opened) only resolves the user's AWS setup,
unchanged: the endpoint, read as its S3 client reads it (only for AWS's own is a client
made to say it: its model loads in 0.1 to 0.2 s); the region; and at the first request the
credentials by the standard chain, refreshed as they expire. It signs each request
(SigV4; no credentials: unsigned). :func:`.client.request` sends them, with its deadlines
and bounds, not botocore's (60 s timeouts and retries).

The engine is :class:`.http.HttpEngine` over those URLs (S3 has no multi-range GET: several
ranges are that many GETs at once). What differs: S3's error code is named with what to
check, and a missing bucket is an outage; ``create`` is a ``PUT`` with ``If-None-Match: *``;
``names`` lists (ListObjectsV2); a lease is an object ``leases/<key id>`` created only if
absent, holding its holder's token and expiry, taken over when expired by a replace
conditional on its ETag; ``layout.json`` is optional (a ``|write`` node fills an empty prefix).
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit
from xml.etree import ElementTree

from cuda_program_cas._base.engine import LEASE_MARK, Abilities

from .client import HttpFailure, Reply, sign_below
from .http import HttpEngine

__all__ = ["LEASES", "S3Engine", "s3_error"]

#: Where the leases are, below the prefix (one object per key id being compiled).
LEASES = "leases"
#: The largest lease object read (a token, a holder, an expiry).
_LEASE_BYTES = 4096
#: An S3 error body is read this far at most (a few hundred bytes of XML).
_ERROR_BYTES = 64 << 10
#: A listing page (1,000 keys of about 100 bytes, in XML) is far below this.
_PAGE_BYTES = 4 << 20
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_CODE = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")
_AUTH_HINT = (
    "are the AWS credentials right? AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the role; "
    "does it grant s3:GetObject (s3:PutObject, s3:DeleteObject to write) on the bucket?"
)
_THROTTLE_HINT = "the server throttles this prefix: fewer nodes at once, or ask for a higher request rate"


def s3_error(reply: Reply) -> str:
    """The S3 error code of ``reply``'s body (``NoSuchBucket``), or ""."""
    m = _CODE.search(reply.body[:_ERROR_BYTES])
    return m.group(1).decode() if m else ""


class _Aws:
    """What botocore resolved for this process: the endpoint, the region, the credentials."""

    def __init__(self) -> None:
        import botocore.session

        self._session = botocore.session.Session()
        configured = _configured_endpoint(self._session)
        if configured is not None:
            from botocore.utils import validate_region_name

            region = self._session.get_config_variable("region")
            validate_region_name(region)  # as a client does first: one it refuses (not a host label) breaks the store
            self.endpoint: str = configured.rstrip("/")
            self.region: str = region or "us-east-1"
        else:
            from botocore.config import Config

            # AWS's own endpoint is botocore's rules': a client is made only to read it, never sent through.
            client = self._session.create_client("s3", config=Config(s3={"addressing_style": "path"}))
            self.endpoint = client.meta.endpoint_url.rstrip("/")
            self.region = client.meta.region_name or "us-east-1"
        self._credentials: Any = None
        self._looked = False
        self._creds_lock = threading.Lock()

    def bucket_url(self, bucket: str) -> str:
        parts = urlsplit(self.endpoint)
        if not (parts.hostname or "").endswith(".amazonaws.com") or "." in bucket:  # not AWS's (an IP, localhost...)
            return f"{self.endpoint}/{bucket}"
        return f"{parts.scheme}://{bucket}.{parts.netloc}"

    def frozen(self, url: str) -> Any:
        """The credentials to sign with now (refreshed as they expire), or None for none at all (unsigned)."""
        try:
            with self._creds_lock:
                if not self._looked:
                    self._credentials = self._session.get_credentials()
                    self._looked = True
            return None if self._credentials is None else self._credentials.get_frozen_credentials()
        except Exception as exc:
            raise HttpFailure(url, "credentials", _without_secrets(exc)) from None

    def sign(self, method: str, url: str, headers: dict[str, str], body: bytes | IO[bytes] | None) -> dict[str, str]:
        """``headers`` with SigV4's (``Authorization``, ``X-Amz-Date``, ``X-Amz-Content-SHA256``...) added."""
        credentials = self.frozen(url)
        if credentials is None:
            return headers
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        signed = AWSRequest(method=method, url=url, data=b"" if body is None else body, headers=headers)
        S3SigV4Auth(credentials, "s3", self.region).add_auth(signed)
        if body is not None and not isinstance(body, bytes):
            body.seek(0)  # hashed for the signature: it is sent from its start
        return dict(signed.headers.items())


@functools.cache
def _aws(environment: tuple[tuple[str, str], ...]) -> _Aws:
    """What the configuration resolves to: made once per process and per ``AWS_*`` environment (a test changes it)."""
    return _Aws()


def _configured_endpoint(session: Any) -> str | None:
    """The endpoint the configuration names for S3, read as a client reads it without making one; None for
    none (AWS's own), or where this botocore reads it otherwise (its reader is not public): a client then says."""
    try:
        from botocore.configprovider import ConfiguredEndpointProvider
        from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url

        if session.get_config_variable("ignore_configured_endpoint_urls"):
            return None
        chain = ConfiguredEndpointProvider(
            full_config=session.full_config, scoped_config=session.get_scoped_config(), client_name="s3"
        )
        found = chain.provide()
        valid = isinstance(found, str) and (is_valid_endpoint_url(found) or is_valid_ipv6_endpoint_url(found))
    except Exception:  # a broken profile too: the client made instead raises what it is
        return None
    return found if valid else None  # none, or one a client refuses (no scheme, a bad host): a client says why


def _without_secrets(exc: BaseException) -> str:
    """A credential failure as it may be logged: its type and botocore's message, which names no secret."""
    return f"{type(exc).__name__}: {str(exc)[:300]}"


class S3Engine(HttpEngine):
    """The objects of the store at ``s3://BUCKET/PREFIX`` (module docstring); ``ValueError`` for a bad address."""

    can = Abilities(
        ranges=True,
        conditional_get=True,
        conditional_create=True,
        listing=True,
        leases=True,
        remote=True,
        server=True,
        layout_optional=True,
    )
    lost_hint = "is it a real S3 server?"
    dav = False
    error_limit = _ERROR_BYTES  # an error's body names its code (NoSuchBucket, SlowDown...)

    def __init__(self, url: str, *, staging: str | None = None) -> None:
        super().__init__(url, staging=staging)
        address = self.root  # ``s3://BUCKET/PREFIX``, credentials never in it: what is shown
        if not address.startswith("s3://"):
            raise ValueError(f"not an S3 store address (s3://BUCKET/PREFIX): {address!r}")
        bucket, _, prefix = address[len("s3://") :].partition("/")
        if not re.fullmatch(r"[A-Za-z0-9._~/-]*", prefix):
            raise ValueError(f"an S3 store's prefix is letters, digits and . _ ~ - / only: {address!r}")
        self.bucket = bucket
        self.prefix = prefix
        try:
            self.aws: _Aws | None = _aws(tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
            self.bucket_url = self.aws.bucket_url(bucket)
        except Exception as exc:  # a broken configuration is this store's outage, said at its first use
            self.aws = None
            self.broken = HttpFailure(address, "aws configuration", _without_secrets(exc))
            self.bucket_url = f"https://{bucket}.s3.invalid"  # never asked: each call raises ``broken`` first
        self.root = f"{self.bucket_url}/{prefix}" if prefix else self.bucket_url
        if self.aws is not None:
            sign_below(self.bucket_url, self.aws.sign)

    # -- reads: the HTTP engine's (its fetch), with S3's answers named ------------------

    def _check(self, url: str, reply: Reply) -> None:
        """An outage for an answer that holds for every object: denied, throttled, down, no such bucket."""
        status = reply.status
        code = s3_error(reply)
        said = f"status {status}{' ' + code if code else ''}"
        if status >= 500:
            hint = f" ({_THROTTLE_HINT})" if code == "SlowDown" or status == 503 else ""
            raise HttpFailure(url, "server error", said + hint)
        if status in (401, 403):
            raise HttpFailure(url, "denied", f"{said} ({_AUTH_HINT})")
        if status == 404 and code == "NoSuchBucket":
            raise HttpFailure(
                url, "no such bucket", f"{said}: the bucket {self.bucket!r} does not exist at this endpoint"
            )
        if status == 301 or code == "PermanentRedirect":
            raise HttpFailure(url, "wrong region", f"{said}: set AWS_REGION (or the profile's region) to the bucket's")

    def _vetted(self, url: str, reply: Reply) -> None:
        if reply.status >= 500 or reply.status in (401, 403) or s3_error(reply) == "NoSuchBucket":
            self._check(url, reply)

    def _why(self, reply: Reply, method: str) -> str:
        code = s3_error(reply)
        return f" {code}" if code else ""

    # -- conditional creates and listings ------------------------------------------------

    def names(self, folder: str) -> list[str]:
        below = f"{folder.strip('/')}/"
        return sorted(name[len(below) :] for name, _, _ in self.listed(below, delimiter=True))

    def listed(self, below: str = "", *, delimiter: bool = False) -> Iterator[tuple[str, int, str]]:
        """``(name below the prefix, size, LastModified)`` of every object whose name starts with ``below``.

        ListObjectsV2, 1,000 a page; ``delimiter``: only those directly below ``below``.
        """
        prefix = f"{self.prefix}/" if self.prefix else ""
        token = ""
        while True:
            url = f"{self.bucket_url}?list-type=2&prefix={quote(prefix + below, safe='')}"
            if delimiter:
                url += "&delimiter=%2F"
            if token:
                url += f"&continuation-token={quote(token, safe='')}"
            reply = self._asked("GET", url, self._check, limit=_PAGE_BYTES, error_limit=_ERROR_BYTES)
            if reply.status != 200:
                raise HttpFailure(url, f"HTTP {reply.status}", "the bucket's listing was refused", outage=False)
            try:
                root = ElementTree.fromstring(reply.body)  # noqa: S314 - a bounded answer from the store's own server
            except ElementTree.ParseError as exc:
                raise HttpFailure(url, "damaged", f"a listing that is not XML: {exc}", outage=False) from None
            for item in root.iter(f"{_NS}Contents"):
                key = item.findtext(f"{_NS}Key") or ""
                size = item.findtext(f"{_NS}Size") or "0"
                if key.startswith(prefix + below) and size.isdigit():
                    yield key[len(prefix) :], int(size), item.findtext(f"{_NS}LastModified") or ""
            token = root.findtext(f"{_NS}NextContinuationToken") or ""
            if root.findtext(f"{_NS}IsTruncated") != "true" or not token:
                return

    # -- leases: conditional writes of leases/<name> ------------------------------------

    def lease(self, name: str, ttl_s: float, *, take: bool = True) -> str | None:
        where = f"{LEASES}/{name}"
        for _ in range(2):  # a lease released between the create refused and the read: once more
            if take:
                token = secrets.token_hex(16)
                if self.create(where, _lease_body(token, ttl_s)):
                    return token
            held = self._read_lease(where)
            if held is None:
                if not take:
                    return ""
                continue
            holder, expires, etag = held
            if time.time() < expires:
                return LEASE_MARK if holder == LEASE_MARK else None
            if not take:
                return ""  # expired: free (a mark past its time too)
            token = secrets.token_hex(16)
            return token if self._put_if(where, _lease_body(token, ttl_s), "If-Match", etag) else None
        return None

    def renew(self, name: str, token: str, ttl_s: float) -> bool:
        where = f"{LEASES}/{name}"
        held = self._read_lease(where)
        if held is None or held[0] != token:
            return False
        return self._put_if(where, _lease_body(token, ttl_s), "If-Match", held[2])

    def release(self, name: str, token: str, *, mark_s: float = 0.0) -> None:
        where = f"{LEASES}/{name}"
        held = self._read_lease(where)
        if held is None or held[0] != token:
            return  # lost meanwhile: another's now, or gone
        if mark_s > 0:
            self._put_if(where, _lease_body(LEASE_MARK, mark_s), "If-Match", held[2])
            return
        reply = self._send("DELETE", where, headers={"If-Match": held[2]})
        if reply.status not in (404, 412):
            self._refuse(where, reply, "DELETE")

    def create(self, where: str, body: bytes) -> bool:
        return self._put_if(where, body, "If-None-Match", "*")

    def _put_if(self, where: str, body: bytes, header: str, value: str) -> bool:
        """PUT ``where`` on the condition ``header: value``; False when it failed (412; 409 on AWS; 404: gone)."""
        reply = self._send("PUT", where, body, {header: value})
        if reply.status in (404, 409, 412):
            return False
        self._refuse(where, reply, f"PUT ({header})")
        return True

    def _read_lease(self, where: str) -> tuple[str, float, str] | None:
        """``(token or the mark, expiry, ETag)`` of the lease at ``where``; None: none. A garbled one is expired."""
        reply = self.fetch(where, limit=_LEASE_BYTES)
        if reply.status == 404:
            return None
        if reply.status != 200:
            self._refuse(where, reply, "GET")
        etag = reply.headers.get("etag", "")
        try:
            data = json.loads(reply.body)
            return str(data["token"]), float(data["expires"]), etag
        except (ValueError, KeyError, TypeError):
            return "", 0.0, etag


def _lease_body(token: str, ttl_s: float) -> bytes:
    """A lease's object: its token (or the mark), who holds it (for an operator), and when it expires."""
    holder = f"{os.uname().nodename} pid {os.getpid()}" if hasattr(os, "uname") else f"pid {os.getpid()}"
    return json.dumps({"token": token, "holder": holder, "expires": round(time.time() + ttl_s, 3)}).encode()


if TYPE_CHECKING:  # mypy checks that the class keeps the interfaces its record declares
    from cuda_program_cas._base.engine import ConditionalGet, Creates, Engine, Leases, Listing, Ranged

    def _is_engine(engine: S3Engine) -> tuple[Engine, Ranged, ConditionalGet, Creates, Listing, Leases]:
        return engine, engine, engine, engine, engine, engine
