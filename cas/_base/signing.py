"""Signed entries: a site's ed25519 key says which bytes a key may map to in a shared store.

A node configured with the site's public keys (``$CUDA_PROGRAM_CAS_TRUSTED_KEYS``) uses an
entry of a shared store only if its manifest is signed by one of them; writers holding the
private key (``$CUDA_PROGRAM_CAS_SIGNING_KEY``) sign what they upload. What is signed is the
manifest line (format, key id, digest, size) after a domain prefix; the signature is the
manifest's second line::

    cpcas2 <key id> <digest> <size>\\n
    ed25519 <signer: 16 hex> <signature: 128 hex>\\n

``signer`` is the first 8 bytes of the blake3 of the raw public key. A manifest copied to
another key's path names the other key and is refused; a replayed signature can only give
a key what the site once signed for it. Keys are PEM files (``openssl genpkey -algorithm
ed25519``), or a public key inline as ``ed25519:<64 hex>``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from cuda_program_cas.index import split_signed

from .config import VAR_SIGNING_KEY, VAR_TRUSTED_KEYS, say_once

__all__ = ["Signer", "Trust", "env_signer", "env_trust", "key_problems", "untrusted_signer"]

_SIGNING = VAR_SIGNING_KEY.name
_TRUSTED = VAR_TRUSTED_KEYS.name

_DOMAIN = b"cuda-program-cas manifest v1\x00"
_MAX_KEY_FILE = 16 << 10


def _key_id(raw_public: bytes) -> str:
    return blake3(raw_public).hexdigest()[:16]


def _read_key_file(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read(_MAX_KEY_FILE + 1)
    if len(data) > _MAX_KEY_FILE:
        raise ValueError(f"{path}: larger than {_MAX_KEY_FILE} bytes: not a key file")
    return data


class Signer:
    """Signs manifest lines with one private key."""

    def __init__(self, private_key: Any) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        if not isinstance(private_key, Ed25519PrivateKey):
            raise ValueError("the signing key is not an ed25519 private key")
        self._key = private_key
        raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.key_id = _key_id(raw)
        #: The public key inline, as ``$CUDA_PROGRAM_CAS_TRUSTED_KEYS`` takes it.
        self.public = "ed25519:" + raw.hex()

    @classmethod
    def from_file(cls, path: str) -> Signer:
        """The key in PEM file ``path``; ``ValueError`` (naming the file) when it is not an ed25519 private key."""
        from cryptography.hazmat.primitives import serialization

        try:
            data = _read_key_file(path)
            if b"-----BEGIN PUBLIC KEY-----" in data:
                raise ValueError("a public key: the signing key is the private one (openssl genpkey's file)")
            return cls(serialization.load_pem_private_key(data, password=None))
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"signing key {path}: {exc}") from None

    def sign(self, line: bytes) -> bytes:
        """The signature line for manifest ``line``."""
        sig = self._key.sign(_DOMAIN + line)
        return b"ed25519 %s %s\n" % (self.key_id.encode(), sig.hex().encode())

    def signed(self, data: bytes) -> bool:
        """Whether manifest file ``data`` carries this key's valid signature (publish re-signs those that do not)."""
        return Trust({self.key_id: self._key.public_key()}).verify(data)


def _load_public_key(spec: str) -> tuple[str, Any]:
    """``(signer id, key)`` from ``ed25519:<64 hex>`` or a PEM public-key file; ``ValueError`` naming it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        if spec.startswith("ed25519:"):
            raw = bytes.fromhex(spec[len("ed25519:") :])
            key = Ed25519PublicKey.from_public_bytes(raw)
        else:
            loaded = serialization.load_pem_public_key(_read_key_file(spec))
            if not isinstance(loaded, Ed25519PublicKey):
                raise ValueError("not an ed25519 public key")
            key = loaded
            raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"trusted key {spec!r}: {exc}") from None
    return _key_id(raw), key


@dataclass(frozen=True)
class Trust:
    """The public keys a node accepts shared entries from (none: nothing is accepted)."""

    keys: dict[str, Any]

    def verify(self, data: bytes) -> bool:
        """Whether manifest file ``data`` (its line, then a signature line) is signed by a trusted key."""
        signed = split_signed(data)
        if signed is None:
            return False
        line, signer, signature = signed
        key = self.keys.get(signer)
        if key is None:
            return False
        from cryptography.exceptions import InvalidSignature

        try:
            key.verify(bytes.fromhex(signature), _DOMAIN + line)
        except InvalidSignature:
            return False
        return True


def env_trust() -> Trust | None:
    """The keys of ``$CUDA_PROGRAM_CAS_TRUSTED_KEYS``; None when unset (every verified entry is used).

    A key that cannot be read is left out (one WARNING); if none can, no shared entry is trusted.
    """
    found = _trusted_keys()
    if found is None:
        return None
    keys, problems = found
    for problem in problems:
        say_once(("trust", problem), "cuda-program-cas: %s", problem)
    return Trust(keys)


def _trusted_keys() -> tuple[dict[str, Any], list[str]] | None:
    """The keys that can be read, and a line for each problem; None when unset."""
    value = VAR_TRUSTED_KEYS.value()
    if value is None or not value.strip():
        return None
    keys: dict[str, Any] = {}
    problems = []
    for spec in value.replace(";", " ").split():
        try:
            kid, key = _load_public_key(os.path.expanduser(spec))
        except ValueError as exc:
            problems.append(f"{exc}; it is left out of ${_TRUSTED}")
            continue
        keys[kid] = key
    if not keys:
        problems.append(f"no usable key in ${_TRUSTED}: no shared entry is trusted")
    return keys, problems


def env_signer() -> Signer | None:
    """The key of ``$CUDA_PROGRAM_CAS_SIGNING_KEY``; None when unset. ``ValueError`` when it cannot be used."""
    value = VAR_SIGNING_KEY.value()
    if value is None or not value.strip():
        return None
    return Signer.from_file(os.path.expanduser(value.strip()))


def untrusted_signer(signer: Signer | None, trust: Trust) -> str | None:
    """Why a node trusting ``trust`` must not write back with ``signer`` (None: its public half is trusted)."""
    if signer is None:
        return (
            f"${_TRUSTED} is set and ${_SIGNING} is not: trusting nodes would refuse every "
            "unsigned entry sent (set the site's private key, or drop |write)"
        )
    if signer.key_id not in trust.keys:
        return (
            f"the public half of ${_SIGNING} ({signer.public}) is not among ${_TRUSTED}: trusting "
            "nodes would refuse every entry it signs"
        )
    return None


def key_problems(writable: bool) -> list[str]:
    """What ``config`` says about the keys of this environment: one line for each that cannot be used as meant."""
    problems: list[str] = []
    signer: Signer | None = None
    try:
        signer = env_signer()
    except ValueError as exc:
        problems.append(f"{exc} (${_SIGNING}): write-back drops every upload and publish refuses to run")
        writable = False
    found = _trusted_keys()
    if found is None:
        return problems
    keys, trust_problems = found
    problems += trust_problems
    if keys and (signer is not None or writable):
        why = untrusted_signer(signer, Trust(keys))
        if why is not None:
            problems.append(f"{why}; write-back is off")
    return problems
