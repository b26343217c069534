"""What the front door keys a compile by, and what it refuses to key.

A C++ compile's record key is made here, with NVRTC's version from its record
(:mod:`.nvrtcver`); other compiles go to ``make_program_cache_key``.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

__all__ = [
    "TAG",
    "Uncacheable",
    "libdevice_fingerprint",
    "memo_key",
    "name_part",
    "nvrtc_flags",
    "object_code",
    "own_key",
    "refuse_unkeyable",
]

#: Mixed into the record key: a new format of records gets new keys.
TAG = b"cuda-program-cas front door 4"
_KEY = b"cpcas-frontdoor/key\0"
#: Options whose effect the front door cannot key soundly, and why.
_REFUSED = {
    "pch": "precompiled headers are written and read outside what a key can see",
    "use_pch": "the precompiled header file is read outside what a key can see",
    "pch_dir": "precompiled headers are read and written outside what a key can see",
    "create_pch": "it writes a file, which a cache hit would not",
    "time": "it writes a timing file, which a cache hit would not",
    "fdevice_time_trace": "it writes a trace file, which a cache hit would not (the front door traces on its own)",
}


class Uncacheable(Exception):
    """A compile whose inputs cannot be recorded soundly: its result is returned, not stored."""

    def __init__(self, reason: str, name: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.name = name


def nvrtc_flags(options: Any, target_type: object) -> tuple[bytes, ...] | None:
    """The options as NVRTC gets them (``ProgramOptions.as_bytes``, 3 us); None when they are refused."""
    if not isinstance(target_type, str):
        return None
    try:
        return tuple(options.as_bytes("nvrtc", target_type.lower()))
    except Exception:
        return None  # make_program_cache_key (or Program) reports what is wrong


def memo_key(
    code: object,
    code_type: str,
    options: Any,
    target_type: str,
    flags: tuple[bytes, ...] | None,
    *,
    names: tuple[object, ...],
    extra: bytes,
) -> tuple[object, ...] | None:
    """What a C++ compile's record key is made of here: what make_program_cache_key hashes, less its
    NVRTC version probe (which loads NVRTC); None where cuda-core keys it."""
    if not isinstance(code_type, str) or code_type.lower() != "c++" or not isinstance(target_type, str):
        return None
    if type(code) is not str or getattr(options, "extra_sources", None) is not None:
        return None
    if flags is None or not all(type(n) is str or type(n) is bytes for n in names):
        return None
    return (code, target_type.lower(), flags, tuple(sorted((type(n) is bytes, n) for n in names)), extra)


def own_key(memo: tuple[Any, ...], nvrtc: str | None) -> bytes:
    """The record key of a C++ compile: sha256 of NVRTC's version and :func:`memo_key`'s parts, length-prefixed."""
    code, target, flags, names, extra = memo
    h = hashlib.sha256(_KEY)

    def part(label: bytes, data: bytes) -> None:
        h.update(label + len(data).to_bytes(8, "big") + data)

    part(b"nvrtc", str(nvrtc).encode())
    part(b"target", target.encode())
    part(b"code", code.encode("utf-8", "surrogateescape"))
    part(b"flags", len(flags).to_bytes(8, "big"))
    for flag in flags:
        part(b"flag", bytes(flag))
    part(b"names", len(names).to_bytes(8, "big"))
    for is_bytes, name in names:
        part(b"b" if is_bytes else b"s", name if is_bytes else name.encode("utf-8", "surrogateescape"))
    part(b"extra", extra)
    return h.digest()


def name_part(options: Any) -> bytes:
    """The source's name, which cuda-core's key leaves out, but a hit's ``ObjectCode.name`` gives."""
    return b"\0name:" + repr(getattr(options, "name", None)).encode("utf-8", "surrogateescape")


def refuse_unkeyable(options: Any, code_type: str) -> None:
    for name, why in _REFUSED.items():
        value = getattr(options, name, None)
        if bool(value) if name == "pch" else value is not None:
            raise ValueError(f"cache.compile() does not support ProgramOptions.{name}: {why}")
    if code_type == "nvvm" and getattr(options, "use_libdevice", None) and _libdevice_path() is None:
        raise ValueError(
            "cache.compile() does not support ProgramOptions.use_libdevice here: the libdevice file that "
            "would be linked cannot be found, so it cannot be fingerprinted"
        )


def _libdevice_path() -> str | None:
    try:
        from cuda.core._program import _find_libdevice_path

        path = _find_libdevice_path()
    except Exception:  # ImportError too: a cuda.core without it
        return None
    return os.fspath(path) if path else None


def libdevice_fingerprint(options: Any, code_type: str) -> bytes:
    """The libdevice file's blake3, for NVVM compiles that link it (its bytes change the output)."""
    if code_type != "nvvm" or not getattr(options, "use_libdevice", None):
        return b""
    path = _libdevice_path()
    assert path is not None  # refused above otherwise
    from cuda_program_cas._disk.files import blake3_hasher

    with open(path, "rb") as fh:
        return b"\0libdevice:" + blake3_hasher()(fh.read()).hexdigest().encode()


def object_code(object_code_type: Any, data: bytes, target_type: str, name: str, mapping: Any = None) -> Any:
    """A hit as the uncached compile or link returns it (``object_code_type``: ``cuda.core.ObjectCode``)."""
    make = {
        "cubin": object_code_type.from_cubin,
        "ptx": object_code_type.from_ptx,
        "ltoir": object_code_type.from_ltoir,
    }
    return make[target_type](data, name=name, symbol_mapping=mapping or None)
