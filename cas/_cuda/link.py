"""``cache.link(...)``: ``Linker(*object_codes, options=...).link(target_type)`` through the cache.

A link is keyed by each input in order (code type, name, bytes, the path of a
path-backed one), every ``LinkerOptions`` field tagged with its type (``arch``
None resolved to the device's), the backend and its version, and the target.
What cannot be keyed soundly links uncached: a dropped write, one WARNING per
reason. The uncached link is ``cuda.core._linker``'s class, so the switch's
rebinding never calls itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
from collections.abc import Iterable
from typing import Any

from cuda_program_cas._base.config import say_once
from cuda_program_cas._disk.files import digest_of
from cuda_program_cas._store.store import Inner
from cuda_program_cas.index import key_id

from .frontkey import Uncacheable, object_code

__all__ = ["link", "link_uncached"]

#: Mixed into every key: a new key format gets new keys.
_TAG = b"cuda-program-cas link 1\0"
_PREFIX = b"cpcas-link/1\0"
_TARGETS = ("cubin", "ptx")


@functools.cache
def _cuda_core() -> tuple[Any, Any, Any]:
    """``ObjectCode``, ``LinkerOptions`` and the module holding cuda.core's own ``Linker``, imported once."""
    from cuda.core import LinkerOptions, ObjectCode

    try:
        import cuda.core._linker as linker_module
    except ImportError:  # a cuda.core laid out otherwise: its public name, as imported now
        import cuda.core as linker_module
    return ObjectCode, LinkerOptions, linker_module


def link(inner: Inner, object_codes: Iterable[Any], options: Any, target_type: str) -> Any:
    """``Linker(*object_codes, options=options).link(target_type)``, from ``inner``'s store when it holds it."""
    ObjectCode, LinkerOptions, _ = _cuda_core()
    objects = tuple(object_codes)
    if options is None:
        options = LinkerOptions()
    if not (objects and all(isinstance(o, ObjectCode) for o in objects) and target_type in _TARGETS):
        return link_uncached(objects, options, target_type)[0]  # it raises for them
    try:
        key, files = _key(objects, options, target_type, LinkerOptions)
    except Uncacheable as exc:
        result = link_uncached(objects, options, target_type)[0]
        _dropped(inner, str(exc))
        return result
    kid = key_id(key)
    with contextlib.ExitStack() as claims:  # a miss holds the node's claim until it stored or failed
        try:
            found = inner.find_or_claim(kid, claims, reason="new inputs")
        except Exception as exc:  # the cache must never cost the caller its link
            say_once(("link lookup", type(exc).__name__), "cuda-program-cas: link: lookup failed (%r); linking", exc)
            found = None
        if found is not None:
            return object_code(ObjectCode, found[0], target_type, options.name)
        result, backend = link_uncached(objects, options, target_type)
        why = _why_not_stored(files, backend)
        if why is not None:
            _dropped(inner, why)
            return result
        try:
            inner.put_id(kid, bytes(result.code))
        except Exception as exc:  # as above: the caller has its result, the cache only loses an entry
            say_once(("link write", type(exc).__name__), "cuda-program-cas: link: write failed (%r); not cached", exc)
            inner.note_dropped(kid, f"write failed: {exc!r}")
        return result


def link_uncached(objects: tuple[Any, ...], options: Any, target_type: str) -> tuple[Any, str | None]:
    """The link as cuda.core runs it, and the backend the linker says it used (None if it cannot say)."""
    linker = _cuda_core()[2].Linker(*objects, options=options)
    try:
        result = linker.link(target_type)
        backend = getattr(linker, "backend", None)  # newer cuda.core names it per linker (1.2 does not)
    finally:
        close = getattr(linker, "close", None)
        if close is not None:
            close()
    return result, backend if isinstance(backend, str) else None


def _dropped(inner: Inner, reason: str) -> None:
    say_once(("link uncached", reason), "cuda-program-cas: link: %s; such links are not cached", reason)
    inner.note_dropped(None, reason)


def _why_not_stored(files: dict[str, str], backend: str | None) -> str | None:
    for path, digest in files.items():
        try:
            if digest_of(_read(path)) != digest:
                return f"input file {path} changed while it was linked"
        except OSError:
            return f"input file {path} cannot be read again"
    if backend is not None and backend.lower() != _backend()[0].lower():
        return f"the linker used {backend}, not {_backend()[0]}"
    return None


def _key(objects: tuple[Any, ...], options: Any, target_type: str, linker_options: Any) -> tuple[bytes, dict[str, str]]:
    """The store key of a link, and the digest of each path-backed input (re-checked before storing)."""
    if type(options) is not linker_options:
        raise Uncacheable(f"options of type {type(options).__name__}, not LinkerOptions")
    backend, version = _backend()
    h = hashlib.sha256(_TAG)
    h.update(json.dumps([backend, version, target_type, _options_part(options)]).encode())
    files: dict[str, str] = {}
    for obj in objects:
        code, code_type, name = obj.code, obj.code_type, obj.name
        if isinstance(code, bytes):
            source, data = "", code
        elif isinstance(code, str):
            try:
                data = _read(code)
            except OSError as exc:
                raise Uncacheable(f"input file {code} cannot be read ({exc.strerror or exc})") from None
            source = code
        else:
            raise Uncacheable(f"an input whose code is a {type(code).__name__}")
        digest = digest_of(data)
        if source:
            files[source] = digest
        h.update(b"\0" + json.dumps([str(code_type), f"{name}", source, len(data), digest]).encode())
    return _PREFIX + h.digest(), files


def _options_part(options: Any) -> list[list[Any]]:
    """Every field of the options as ``[name, type tag, value]``, sorted by name; arch None resolved."""
    part = []
    for field in sorted(dataclasses.fields(options), key=lambda f: f.name):
        value = getattr(options, field.name)
        if field.name == "arch" and value is None:
            try:
                from cuda.core import Device

                major, minor = Device().compute_capability
            except Exception as exc:
                raise Uncacheable(f"arch=None and the current device cannot be asked ({type(exc).__name__})") from None
            value = f"sm_{major}{minor}"
        kind = type(value)
        if (kind is list or kind is tuple) and all(type(v) is str for v in value):
            value = list(value)
        elif not (value is None or kind is bool or kind is int or kind is str):
            raise Uncacheable(
                f"LinkerOptions.{field.name} of type {kind.__name__} (only None, bool, int, str and lists of str)"
            )
        part.append([field.name, kind.__name__, value])
    return part


@functools.cache
def _backend() -> tuple[str, str]:
    """The backend cuda.core links with (once per process) and its version: ``("nvJitLink", "(13, 5)")``."""
    try:
        which = _cuda_core()[2].Linker.which_backend()
        name = str(getattr(which, "value", which))
        if name.lower() == "nvjitlink":
            from cuda.bindings import nvjitlink

            return "nvJitLink", str(tuple(nvjitlink.version()))
        if name.lower() == "driver":
            from cuda.bindings import driver

            err, version = driver.cuDriverGetVersion()
            if int(err) != 0:
                raise RuntimeError(f"cuDriverGetVersion: {err}")
            return "driver", str(int(version))
    except Exception as exc:
        raise Uncacheable(f"the linker's backend cannot be told ({type(exc).__name__}: {exc})") from None
    raise Uncacheable(f"the linker's backend {name!r} is not known")


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()
