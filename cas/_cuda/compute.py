"""cuda.compute's algorithm builds as entries of the store: ``cache.build(make_reduce_into, d_in=...)``.

A built algorithm serializes and loads back without compiling. Its key
(:func:`key_of`): the tools' versions, the factory, every argument
(:func:`.opkey.arg_part`) and the target compute capabilities, so
``cache.prebuild`` on any node fills a store for another node's GPUs. A hit that
does not load is built again; what cannot be keyed or serialized is built
uncached (a dropped write). A loaded algorithm is kept per thread and key
(cuda.compute gives each thread its objects).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cuda_program_cas._base.config import say_once

if TYPE_CHECKING:
    from cuda_program_cas._store.store import Inner

__all__ = ["FACTORIES", "HOOKED", "build", "key_of", "switched", "uncacheable_count"]

#: Mixed into every key: a new key format gets new keys.
_TAG = b"cuda-program-cas compute 1\0"
#: Before every stored value: what the entry is, and of which factory (checked before it is loaded).
_MAGIC = b"cpcas-compute/1\0"
#: The factories cuda.compute 1.2 has.
FACTORIES = (
    "make_binary_transform",
    "make_exclusive_scan",
    "make_histogram_even",
    "make_inclusive_scan",
    "make_lower_bound",
    "make_merge_sort",
    "make_radix_sort",
    "make_reduce_into",
    "make_segmented_reduce",
    "make_segmented_sort",
    "make_select",
    "make_three_way_partition",
    "make_unary_transform",
    "make_unique_by_key",
    "make_upper_bound",
)
HOOKED = "cuda.compute.algorithms"

_local = threading.local()
_uncacheable = [0]


def uncacheable_count() -> int:
    """How many cuda.compute builds of this process ran uncached because they cannot be keyed or stored."""
    return _uncacheable[0]


@functools.cache
def _versions() -> bytes:
    """What every key holds of the build's tools (raises Uncacheable when one cannot be told)."""
    from .nvrtcver import loaded_version
    from .opkey import Uncacheable

    try:
        from importlib.metadata import PackageNotFoundError, version

        from cuda.bindings import nvjitlink

        try:
            from cuda.compute._build_info import USING_V2
        except ImportError:
            USING_V2 = False
        nvrtc = loaded_version()
        if not nvrtc[:1].isdigit():
            raise RuntimeError(f"nvrtcVersion: {nvrtc}")
        try:
            mlir = version("numba-cuda-mlir")
        except PackageNotFoundError:
            mlir = "-"
        parts = {
            "python": sys.version,
            "cache_tag": sys.implementation.cache_tag,
            "cuda-cccl": version("cuda-cccl"),
            "backend": "v2" if USING_V2 else "v1",
            "cuda-bindings": version("cuda-bindings"),
            "nvrtc": nvrtc,
            "nvjitlink": ".".join(map(str, nvjitlink.version())),
            "numba-cuda-mlir": mlir,
            "numpy": version("numpy"),
        }
    except Exception as exc:
        raise Uncacheable(f"the versions of cuda.compute's tools cannot be told ({exc!r})") from None
    return repr(sorted(parts.items())).encode()


def _targets(kwargs: dict[str, Any]) -> list[tuple[int, int]]:
    """The compute capabilities the build is for, as cuda.compute normalizes them (or the device's)."""
    from cuda.compute._cccl_interop import normalize_compute_capabilities

    ccs = normalize_compute_capabilities(kwargs.get("compute_capability"))
    if ccs is None:
        from cuda.compute._caching import _get_current_device_info

        try:
            ccs = [tuple(_get_current_device_info()[1])]
        except Exception as exc:
            raise _NoDevice(exc) from None
    return [(int(a), int(b)) for a, b in ccs]


class _NoDevice(Exception):
    """No device to build for and no ``compute_capability=``: the uncached factory says so."""


def key_of(name: str, kwargs: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """The store key of ``name(**kwargs)`` and its journaled inputs; :class:`.opkey.Uncacheable` if unsound."""
    from .opkey import Uncacheable, arg_part

    if name not in FACTORIES:
        raise Uncacheable(f"{name} is not a cuda.compute factory this cache knows")
    targets = _targets(kwargs)
    h = hashlib.sha256(_TAG + _versions() + name.encode() + b"\0" + repr(targets).encode())
    options = []
    code = hashlib.sha256()
    for arg in sorted(kwargs):
        if arg == "compute_capability":
            continue
        part = arg_part(arg, kwargs[arg])
        h.update(hashlib.sha256(part).digest())
        if b"cpcas-compute-op" in part:
            code.update(part)  # the ops are the code: a changed op is "code changed" to explain
        else:
            options.append(f"{arg}={hashlib.sha256(part).hexdigest()[:12]}")
    inputs = {
        "code": code.hexdigest()[:16],
        "code_type": f"cuda.compute {name}",
        "target": ",".join(f"sm_{a}{b}" for a, b in targets),
        "nvrtc": hashlib.sha256(_versions()).hexdigest()[:12],
        "options": options,
    }
    return h.digest(), inputs


def build(inner: Inner, make: Any, kwargs: dict[str, Any]) -> Any:
    """``make(**kwargs)``, a cuda.compute factory, loaded from the store when it holds the build."""
    from cuda_program_cas._local.why import NO_RECORD, Why
    from cuda_program_cas.index import key_id

    from .opkey import Uncacheable

    original = getattr(make, "cpcas_original", make)
    name = getattr(original, "__name__", None)
    if name not in FACTORIES or not str(getattr(original, "__module__", "")).startswith("cuda.compute."):
        raise TypeError(f"not one of cuda.compute's make_* factories: {make!r}")
    assert isinstance(name, str)
    if _depth():  # a factory called while this thread builds one: part of that build
        return original(**kwargs)
    try:
        if b"'backend', 'v1'" not in _versions():  # v2 (HostJIT) does not serialize yet
            raise Uncacheable("this cuda.compute's backend (v2) cannot serialize builds")
        key, inputs = key_of(name, kwargs)
    except Uncacheable as exc:
        result = _build_uncached(original, kwargs)
        _dropped(inner, name, exc.reason)
        return result
    except _NoDevice:
        return original(**kwargs)  # it raises cuda.compute's own error: no device, pass compute_capability=
    except Exception as exc:  # the cache never costs a build
        say_once(("compute key", type(exc).__name__), "cuda-program-cas: compute: key failed (%r); built uncached", exc)
        return original(**kwargs)
    kid = key_id(key)
    memo: dict[str, Any] = _local.__dict__.setdefault("memo", {})
    if kid in memo:
        return memo[kid]
    with contextlib.ExitStack() as claims:
        why = Why(NO_RECORD, "new inputs: no build of them")
        try:
            found = inner.find_or_claim(kid, claims, reason=why)
        except Exception as exc:
            say_once(("compute lookup", type(exc).__name__), "cuda-program-cas: compute: lookup failed (%r)", exc)
            found = None
        if found is not None:
            algorithm = _load(found[0], name)
            if algorithm is not None:
                memo[kid] = algorithm
                return algorithm
            why = Why(NO_RECORD, "the stored build did not load: built again")
        t0 = time.perf_counter()
        algorithm = _build_uncached(original, kwargs)
        seconds = time.perf_counter() - t0
        try:
            from cuda.compute import serialize

            blob = _MAGIC + name.encode() + b"\0" + serialize(algorithm)
        except Exception as exc:
            _dropped(inner, name, f"the algorithm did not serialize ({exc!r})")
            return algorithm
        memo[kid] = algorithm
        try:
            if inner.put_id(kid, blob):
                inner.note_compiled(kid, seconds, "compute", inputs, why)
        except Exception as exc:  # the caller has its algorithm; the cache only loses an entry
            say_once(("compute write", type(exc).__name__), "cuda-program-cas: compute: write failed (%r)", exc)
            inner.note_dropped(kid, f"write failed: {exc!r}")
        return algorithm


def _build_uncached(original: Any, kwargs: dict[str, Any]) -> Any:
    """The factory as cuda.compute runs it; the factories it calls inside are not looked up."""
    _local.depth = _depth() + 1
    try:
        return original(**kwargs)
    finally:
        _local.depth -= 1


def _depth() -> int:
    depth: int = getattr(_local, "depth", 0)
    return depth


def _load(data: bytes, name: str) -> Any:
    """The stored algorithm, or None when it is not one of ``name`` or does not load."""
    head = _MAGIC + name.encode() + b"\0"
    if not data.startswith(head):
        return None
    try:
        from cuda.compute import deserialize

        return deserialize(data[len(head) :])
    except Exception as exc:
        say_once(
            ("compute load", type(exc).__name__), "cuda-program-cas: compute: a stored build did not load (%r)", exc
        )
        return None


def _dropped(inner: Inner, name: str, reason: str) -> None:
    """An uncacheable build: a dropped write, said once per reason, journaled for ``explain``."""
    from cuda_program_cas._local.why import UNCACHEABLE, Why
    from cuda_program_cas.index import key_id

    _uncacheable[0] += 1
    say_once(("compute uncached", reason), "cuda-program-cas: compute: %s %s; such builds are not cached", name, reason)
    inner.note_dropped(None, reason)
    if inner.store.read_only:
        return
    from cuda_program_cas._local.journal import record_miss

    kid = key_id(f"cuda-program-cas compute uncacheable\0{name}\0{reason}")
    record_miss(inner.layout, kid, 0.0, "compute", {"code_type": f"cuda.compute {name}"}, why=Why(UNCACHEABLE, reason))


def switched(original: Any, inner_for: Callable[[], Inner | None]) -> Any:
    """``original``, a factory, built through ``inner_for()`` (None: uncached)."""

    @functools.wraps(original)
    def make(*args: Any, **kwargs: Any) -> Any:
        inner = inner_for() if not args and not _depth() else None
        if inner is None:
            return original(*args, **kwargs)
        return build(inner, original, kwargs)

    make.cpcas_original = original  # type: ignore[attr-defined]
    return make
