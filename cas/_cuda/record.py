"""A front-door record (see :mod:`.frontdoor`): headers' fingerprints, guards, its result's key, its stored form."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import threading
from collections.abc import Sequence
from typing import Any

from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._disk.files import FileId, blake3_hasher, file_id

__all__ = [
    "NO_DIR",
    "DirKey",
    "Header",
    "HeaderCache",
    "Variant",
    "content_digest",
    "decode_raw",
    "decode_record",
    "dir_guards",
    "directory_key",
    "encode_record",
    "encode_variant",
    "guard_dirs",
    "proof_of",
    "renewed_record",
    "result_key_of",
    "stat_tag",
]

_RESULT = b"cpcas-frontdoor/result\0"
#: Hex digits kept of a header's blake3 (128 bits) and of a stat tag (64 bits).
_DIGEST_HEX = 32
_TAG_HEX = 16


def content_digest(data: bytes) -> str:
    """A header's digest as a record keeps it: blake3, 128 bits in hex."""
    return blake3_hasher()(data).hexdigest()[:_DIGEST_HEX]


def stat_tag(values: tuple[int, ...]) -> str:
    """A 64-bit tag of stat fields: blake2b from a prepared hasher, 0.35 us a tag against blake3's 2.3."""
    h = _TAG_HASH.copy()
    h.update(_PACK5(*values) if len(values) == 5 else struct.pack(f"<{len(values)}q", *values))
    return h.hexdigest()


_TAG_HASH = hashlib.blake2b(digest_size=_TAG_HEX // 2)
_PACK5 = struct.Struct("<5q").pack


class HeaderCache:
    """Headers' identities and digests, per process: a hit re-hashes nothing it already hashed."""

    def __init__(self) -> None:
        #: By path: the file's identity and its digest (read without the lock).
        self.known: dict[str, tuple[FileId, str]] = {}
        self._lock = threading.Lock()
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # another thread of the parent may have held it

    def learn(self, learnt: dict[str, tuple[FileId, str]]) -> None:
        """Enter identities and digests proved elsewhere (a record's stat tags that still hold)."""
        if learnt:
            with self._lock:
                self.known.update(learnt)

    def digest(self, path: str, st: os.stat_result, *, old: bool) -> str | None:
        """blake3 of the file at ``path`` whose stat is ``st``; None when it changed while read.

        Remembered only when ``old``: a young file can change again within its clock step.
        """
        key = file_id(st)
        known = self.known.get(path)
        if known is not None and known[0] == key:
            return known[1]
        try:
            with open(path, "rb") as fh:
                data = fh.read()
                if file_id(os.fstat(fh.fileno())) != key:
                    return None
        except OSError:
            return None
        digest = content_digest(data)
        if old:
            with self._lock:
                self.known[path] = (key, digest)
        return digest


#: A directory's identity and entry times: device, inode, mtime and ctime in ns.
DirKey = tuple[int, int, int, int]


def directory_key(path: str) -> DirKey | None:
    """A directory's identity and entry times; None when it is missing or not a directory."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


#: A missing guard directory in a proof: no stat gives a negative device or inode.
NO_DIR = (-1, -1, -1, -1)


def proof_of(values: list[int]) -> str | None:
    """One blake2b-128 tag of a variant's whole stat data; None when a value does not fit 64 signed bits."""
    try:
        packed = struct.pack(f"<{len(values)}q", *values)
    except struct.error:
        return None
    return hashlib.blake2b(packed, digest_size=16, person=b"cpcas-proof").hexdigest()


# Plain slotted classes, not dataclasses: the decorator costs about 1 ms a class at import.


class Header:
    __slots__ = ("digest", "key", "path", "tag")

    def __init__(self, path: str, key: FileId, digest: str) -> None:
        self.path, self.key, self.tag, self.digest = path, key, stat_tag(key), digest


class Variant:
    """One compile of a record's inputs, decoded; ``absent``: the candidates (.shadows); ``proof``: proof_of."""

    __slots__ = ("absent", "guards", "headers", "mapping", "name", "proof", "result")

    def __init__(
        self,
        result: str,
        name: str,
        mapping: dict[Any, bytes],
        headers: tuple[tuple[str, str, str], ...],
        guards: tuple[tuple[str, str | None], ...],
        *,
        absent: tuple[str, ...] = (),
        proof: str | None = None,
    ) -> None:
        self.result, self.name, self.mapping, self.headers, self.guards = result, name, mapping, headers, guards
        self.absent, self.proof = absent, proof


def guard_dirs(paths: list[str], dirs: Sequence[str]) -> list[tuple[str, DirKey | None]]:
    """The directories whose entries decide where each header is found: for one under search directory ``i``
    at ``sub/name``, ``sub`` of every search directory up to ``i``, and always its own directory."""
    wanted: set[str] = set()
    for path in paths:
        wanted.add(os.path.dirname(path))
        for i, top in enumerate(dirs):
            if path.startswith(top + os.sep):
                sub = os.path.dirname(path[len(top) + 1 :])
                wanted.update(os.path.join(earlier, sub) if sub else earlier for earlier in dirs[: i + 1])
    return dir_guards(wanted)


def dir_guards(wanted: set[str]) -> list[tuple[str, DirKey | None]]:
    """Each of ``wanted`` with its :func:`directory_key`, sorted; a missing one also by its deepest existing one."""
    guards: dict[str, DirKey | None] = {}
    for path in wanted:
        probe = path  # a missing one: creating it changes its deepest existing ancestor
        while True:
            key = directory_key(probe)
            if key is not None or os.path.dirname(probe) == probe:
                guards[probe] = key
                break
            probe = os.path.dirname(probe)
        if probe != path:
            guards[path] = None
    return sorted(guards.items())


def result_key_of(record_key: bytes, headers: list[tuple[str, str]]) -> bytes:
    """The key of a compile's result: its record key and each header's ``(path, digest)``."""
    h = hashlib.sha256(_RESULT + record_key)
    for path, digest in sorted(headers):
        h.update(b"\0" + path.encode("utf-8", "surrogateescape") + b"\0" + digest.encode())
    return h.digest()


# A record is compact JSON: {"v": 4, "variants": [...]}, newest first; another "v" is a miss.
# Headers and candidates are grouped by directory, {dir: [[name, stat tag, digest], ...]}.
# "proof" is proof_of the headers' stat data (as decoded), the guards', then the candidates' count.

_VERSION = 4


def encode_variant(
    result: str,
    headers: list[Header],
    guards: list[tuple[str, DirKey | None]],
    name: str,
    mapping: dict[Any, bytes],
    *,
    absent: Sequence[str] = (),
) -> dict[str, Any]:
    grouped: dict[str, list[Header]] = {}
    for h in headers:
        grouped.setdefault(os.path.dirname(h.path), []).append(h)
    by_dir = {d: [[os.path.basename(h.path), h.tag, h.digest] for h in hs] for d, hs in grouped.items()}
    values = [v for hs in grouped.values() for h in hs for v in h.key]
    for _path, key in guards:
        values.extend(NO_DIR if key is None else key)
    grouped_absent: dict[str, list[str]] = {}
    for path in sorted(absent):
        directory, base = os.path.split(path)
        grouped_absent.setdefault(directory, []).append(base)
    values.append(len(absent))  # the proof holds only with every candidate absent (checked beside it)
    symbols = []
    for key, lowered in mapping.items():
        kind, text = ("b", key.hex()) if isinstance(key, bytes) else ("s", key)
        value = lowered if isinstance(lowered, bytes) else str(lowered).encode()
        symbols.append([kind, text, value.hex()])
    return {
        "result": result,
        "name": name,
        "symbols": symbols,
        "headers": by_dir,
        "guards": [[path, None if key is None else stat_tag(key)] for path, key in guards],
        "absent": grouped_absent,
        "proof": proof_of(values),
    }


def encode_record(variants: list[dict[str, Any]]) -> bytes:
    return json.dumps({"v": _VERSION, "variants": variants}, separators=(",", ":")).encode()


def decode_raw(raw: bytes) -> list[dict[str, Any]]:
    try:
        data = json.loads(raw)
    except ValueError:
        return []
    if not isinstance(data, dict) or data.get("v") != _VERSION or not isinstance(data.get("variants"), list):
        return []
    return [v for v in data["variants"] if isinstance(v, dict)]


def decode_record(raw: bytes) -> list[Variant]:
    """The variants of a record, checked for shape; a damaged variant is left out (a miss)."""
    variants = []
    for v in decode_raw(raw):
        try:
            mapping: dict[Any, bytes] = {}
            for kind, text, value in v["symbols"]:
                mapping[bytes.fromhex(text) if kind == "b" else str(text)] = bytes.fromhex(value)
            # No per-entry checks: ``prefix + base`` raises unless base is a str, and a tag or
            # digest of another type equals no computed one.
            headers = tuple(
                (_prefix(d) + base, tag, digest) for d, entries in v["headers"].items() for base, tag, digest in entries
            )
            guards = tuple((str(path), None if tag is None else str(tag)) for path, tag in v["guards"])
            absent = tuple(_prefix(d) + base for d, names in v["absent"].items() for base in names)
            bytes.fromhex(v["result"])
            proof = v.get("proof")
            proof = proof if isinstance(proof, str) else None
            variants.append(
                Variant(str(v["result"]), str(v["name"]), mapping, headers, guards, absent=absent, proof=proof)
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return variants


def _prefix(directory: object) -> str:
    if not isinstance(directory, str):
        raise TypeError(directory)
    return directory if not directory or directory.endswith(os.sep) else directory + os.sep


def renewed_record(raw: bytes, variant: Variant, renewed: dict[str, FileId], proof: str) -> bytes:
    """The record ``raw`` with ``variant``'s headers of ``renewed`` given their new stat data, and its new proof."""
    stored = decode_raw(raw)
    for v in stored:
        if v.get("result") != variant.result:
            continue
        at = 0
        for entries in v["headers"].values():
            for entry in entries:
                key = renewed.get(variant.headers[at][0])
                if key is not None:
                    entry[1] = stat_tag(key)
                at += 1
        v["proof"] = proof
    return encode_record(stored)
