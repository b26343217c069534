"""What a compile that missed was made of, in the miss journal's form (:mod:`cuda_program_cas._local.journal`).

:func:`install` wraps ``make_program_cache_key`` to keep, per thread, the last
key made with its inputs and the time; when the cache then stores under that key
(:func:`taken_for`), the compile in between was its miss.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from typing import Any

from cuda_program_cas._base.fork import ForkSafeLock
from cuda_program_cas._disk.files import blake3_hasher

__all__ = ["describe", "install", "taken_for"]

_perf = time.perf_counter
_last = threading.local()
_installed: list[Any] = []
_lock = ForkSafeLock()


def install() -> None:
    """Wrap ``make_program_cache_key`` once per process (idempotent; the key it returns is unchanged)."""
    if _installed:
        return
    with _lock:
        if _installed:
            return
        import cuda.core.utils._program_cache as program_cache
        from cuda.core import utils

        original = program_cache.make_program_cache_key
        original = getattr(original, "cpcas_original", original)

        @functools.wraps(original)
        def make_program_cache_key(*args: Any, **kwargs: Any) -> bytes:
            key: bytes = original(*args, **kwargs)
            _last.made = (key, kwargs, _perf())
            return key

        make_program_cache_key.cpcas_original = original  # type: ignore[attr-defined]
        for module in (program_cache, utils):
            if getattr(module, "make_program_cache_key", None) is original:
                module.make_program_cache_key = make_program_cache_key
        _installed.append(original)


def taken_for(key: object) -> tuple[float, dict[str, Any]] | None:
    """``(seconds since the key was made, its inputs described)`` when this thread last made ``key``, else None."""
    made = getattr(_last, "made", None)
    if made is None or made[0] != key:
        return None
    _last.made = None
    seconds = _perf() - made[2]
    kw = made[1]
    try:
        return seconds, describe(
            kw.get("code"),
            kw.get("code_type"),
            kw.get("options"),
            kw.get("target_type"),
            kw.get("name_expressions") or (),
            nvrtc=_plain_nvrtc(),
            extra=kw.get("extra_digest"),
        )
    except Exception:
        return None


def _plain_nvrtc() -> str:
    """The NVRTC version a plain key holds: cuda-core's probe, else the loaded library's."""
    try:
        from cuda.core.utils._program_cache._keys import _nvrtc_version

        major, minor = _nvrtc_version()
        return f"{major}.{minor}"
    except Exception:
        from .nvrtcver import loaded_version

        return loaded_version()


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    return str(getattr(value, "value", value))


def describe(
    code: object,
    code_type: object,
    options: Any,
    target_type: object,
    names: Sequence[object],
    *,
    nvrtc: str | None,
    extra: object = None,
    cwd: str | None = None,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    kind = _text(code_type).lower()
    target = _text(target_type).lower()
    blake3 = blake3_hasher()
    data = code.encode("utf-8", "surrogateescape") if isinstance(code, str) else bytes(code)  # type: ignore[call-overload]
    described: dict[str, Any] = {
        "code": blake3(data).hexdigest()[:32],
        "code_type": kind,
        "target": target,
        "options": _options(options, kind, target),
        "names": [_text(n) for n in names],
        "nvrtc": nvrtc or "",
    }
    if extra is not None:
        raw = extra if isinstance(extra, bytes) else str(extra).encode("utf-8", "surrogateescape")
        described["extra"] = blake3(raw).hexdigest()[:16]
    if cwd is not None:
        described["cwd"] = cwd
    if headers is not None:
        described["headers"] = headers
    return described


def _options(options: Any, kind: str, target: str) -> list[str]:
    """The options as NVRTC gets them; for other code types (or options NVRTC refuses), each field set."""
    if options is None:
        return []
    import dataclasses

    from .frontkey import nvrtc_flags

    flags = nvrtc_flags(options, target) if kind == "c++" else None
    if flags is not None:
        return [_text(f) for f in flags]
    if dataclasses.is_dataclass(options):
        return [
            f"{f.name}={getattr(options, f.name)!r}"
            for f in dataclasses.fields(options)
            if getattr(options, f.name) not in (None, False)
        ]
    return [repr(options)]
