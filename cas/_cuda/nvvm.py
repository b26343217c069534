"""The switch's hook on numba-cuda's NVVM compiles: a Python kernel's IR to PTX or LTO-IR through the cache.

numba-cuda compiles a kernel's LLVM IR with NVVM through ``cuda.bindings.nvvm``,
not ``cuda.core``, in ``numba.cuda.cudadrv.nvvm.CompilationUnit``; numba-cuda-mlir
has the same class (over its own ctypes binding) in
``numba_cuda_mlir.numba_cuda.cudadrv.nvvm``. Every NVVM compile of either goes
``CompilationUnit(options)``, ``add_module`` (each IR module), ``verify``,
``lazy_add_module`` (libdevice), ``compile``. When such a module is imported with
the switch on (the start-up hook, :mod:`cuda_program_cas._cuda.boot`, or
``install()``), :func:`activate` binds a subclass to ``CompilationUnit`` there and in
every module that imported the name (as the switch rebinds ``Program``).

The subclass records the calls instead of making them, and ``compile`` looks the
result up under a key of everything NVVM is given, in order:

- each module: added or added lazily, its length and its blake3 (the lazy one is
  libdevice: its content digest, read as numba read it);
- that ``verify`` ran, and where;
- the options as NVVM gets them (``-arch=compute_80``, ``-opt=3``, ``-gen-lto``...);
- NVVM's version and IR version, as the wrapper reports them, and the wrapper's module;
- this module's format tag.

A hit returns the stored bytes, which are the bytes the uncached compile returns
(tests/test_nvvm.py compares them) with no NVVM call; the unit's ``log`` is empty,
as a compile that stored was. A miss takes the node's claim on the key (one compile
per key per node at once), makes the recorded calls in order and stores the result
as an ordinary entry of the store, with its compile time (what hits save) and its
inputs in the miss journal (``via``: ``nvvm``; for ``explain``). A compile whose
NVVM log is not empty is not stored (a hit would not repeat its warnings): a dropped
write. An error of NVVM's is raised as the uncached compile raises it; anything
failing inside the cache is the switch's one WARNING and the uncached compile.

numba names a kernel's symbols with a counter of the functions it compiled in the
process (``_ZN8__main__1kB2v1...``): the same job compiles the same IR in every fresh
process and hits, but a process that compiles another function first gets new keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from typing import Any

from cuda_program_cas._base.fork import ForkSafeLock
from cuda_program_cas._disk.files import blake3_hasher
from cuda_program_cas.index import key_id

from .switch import activate as switch_on
from .switch import hook_failed, hook_inner, installed, rebind

__all__ = ["MODULES", "activate", "hook", "hooked", "unhook"]

#: The modules whose ``CompilationUnit`` is rebound.
MODULES = ("numba.cuda.cudadrv.nvvm", "numba_cuda_mlir.numba_cuda.cudadrv.nvvm")
#: Mixed into every key: a new key format gets new keys.
_TAG = b"cuda-program-cas nvvm 1\0"
#: The key's prefix in the store (the rest is a sha256): no other key of the store starts so.
_PREFIX = b"cpcas-nvvm/1\0"

_lock = ForkSafeLock()


class _State:
    #: Per module of :data:`MODULES`: its original class and this module's subclass of it.
    original: dict[str, type] = {}  # noqa: RUF012  # one instance, a namespace
    switched: dict[str, type] = {}  # noqa: RUF012
    #: Per original class: NVVM's version as the key holds it.
    versions: dict[type, list[Any]] = {}  # noqa: RUF012


_S = _State()


class _Unkeyable(Exception):
    """A compile whose inputs cannot be keyed: it runs uncached."""


def activate(mode: str) -> None:
    """The switch in ``mode`` (a ``CUDA_PROGRAM_CAS`` value), and the hook in every loaded module of :data:`MODULES`."""
    switch_on(mode)
    if installed() is not None:
        hook()


def hook() -> None:
    """Bind the caching subclass to ``CompilationUnit`` in each loaded module of :data:`MODULES`, and where imported."""
    with _lock:
        for name in MODULES:
            module = sys.modules.get(name)
            current = getattr(module, "CompilationUnit", None)
            if not isinstance(current, type):
                continue
            original: type = getattr(current, "cpcas_original", current)
            if name not in _S.switched:
                _S.original[name] = original
                _S.switched[name] = _subclass(original)
            rebind(original, _S.switched[name])


def unhook() -> None:
    """The original ``CompilationUnit`` everywhere again (what ``uninstall()`` does here)."""
    with _lock:
        for name, switched in _S.switched.items():
            rebind(switched, _S.original[name])


def hooked() -> list[str]:
    """The modules of :data:`MODULES` whose ``CompilationUnit`` is the caching subclass now."""
    return [
        name
        for name in MODULES
        if name in _S.switched and getattr(sys.modules.get(name), "CompilationUnit", None) is _S.switched[name]
    ]


def _subclass(original: type) -> type:
    class CompilationUnit(original):  # type: ignore[misc]
        """numba-cuda's ``CompilationUnit``, its compiles through the cache (the switch)."""

        cpcas_original = original

        def __init__(self, options: Any) -> None:
            super().__init__(options)
            #: The calls recorded, in order: ``("add" | "lazy" | "verify", buffer)``.
            self._cpcas_calls: list[tuple[str, Any]] = []

        def add_module(self, buffer: Any) -> None:
            self._cpcas_calls.append(("add", buffer))

        def lazy_add_module(self, buffer: Any) -> None:
            self._cpcas_calls.append(("lazy", buffer))

        def verify(self) -> None:
            self._cpcas_calls.append(("verify", b""))

        def compile(self) -> Any:
            return _compile(self, original)

    CompilationUnit.__module__ = "cuda_program_cas"
    CompilationUnit.__qualname__ = "CompilationUnit"
    return CompilationUnit


def _compile(unit: Any, original: Any) -> Any:
    calls, unit._cpcas_calls = unit._cpcas_calls, []
    inner = hook_inner()
    if inner is None:  # the switch is off, or no cache could be opened (said once)
        return _uncached(unit, original, calls)
    try:
        key, inputs = _key(unit, original, calls)
    except Exception as exc:
        result = _uncached(unit, original, calls)
        if not isinstance(exc, _Unkeyable):
            hook_failed(exc)
        inner.note_dropped(None, f"nvvm: {exc}")
        return result
    kid = key_id(key)
    with contextlib.ExitStack() as claims:
        # On a miss the node's claim on the key is held until the result is stored (or NVVM failed).
        try:
            found = inner.find_or_claim(kid, claims, reason="new inputs")
        except Exception as exc:
            hook_failed(exc)
            found = None
        if found is not None:
            unit.log = ""
            return found[0]
        t0 = time.perf_counter()
        result = _uncached(unit, original, calls)
        seconds = time.perf_counter() - t0
        if getattr(unit, "log", ""):
            inner.note_dropped(kid, "nvvm: NVVM logged warnings, which a hit would not repeat")
            return result
        try:
            if inner.put_id(kid, bytes(result)):
                inner.note_compiled(kid, seconds, "nvvm", inputs)
        except Exception as exc:  # the caller has its result; the cache only loses an entry
            hook_failed(exc)
        return result


def _uncached(unit: Any, original: Any, calls: list[tuple[str, Any]]) -> Any:
    """The recorded calls made on NVVM, in order, then its compile: what numba's own class does."""
    for what, buffer in calls:
        if what == "add":
            original.add_module(unit, buffer)
        elif what == "lazy":
            original.lazy_add_module(unit, buffer)
        else:
            original.verify(unit)
    return original.compile(unit)


def _key(unit: Any, original: type, calls: list[tuple[str, Any]]) -> tuple[bytes, dict[str, Any]]:
    """The store key of one NVVM compile, and its inputs as the miss journal holds them."""
    options = [o.decode("utf-8", "surrogateescape") if isinstance(o, bytes) else str(o) for o in unit.options]
    version = _version(unit, original)
    blake3 = blake3_hasher()
    key = hashlib.sha256(_TAG)  # a sha256, as cuda.core's keys and the links'; blake3 for the contents
    key.update(json.dumps([original.__module__, version, options]).encode())
    code, libdevice = blake3(), blake3()
    for what, buffer in calls:
        if not isinstance(buffer, (bytes, bytearray, memoryview)):
            raise _Unkeyable(f"a module given as {type(buffer).__name__}, not bytes")
        digest = blake3(buffer).hexdigest()
        key.update(b"\0" + json.dumps([what, len(buffer), digest]).encode())
        (libdevice if what == "lazy" else code).update(digest.encode())
    inputs = {
        "code": code.hexdigest()[:32],
        "code_type": "nvvm",
        "target": "ltoir" if "-gen-lto" in options else "ptx",
        "options": options,
        "names": [],
        "nvvm": "{}.{} (IR {}.{})".format(*version[0][:2], *version[1][:2]),
        "libdevice": libdevice.hexdigest()[:16],
    }
    return _PREFIX + key.digest(), inputs


def _version(unit: Any, original: type) -> list[Any]:
    """``[NVVM's version, its IR version]`` as the wrapper reports them, asked once per class."""
    found = _S.versions.get(original)
    if found is None:
        try:
            found = [list(unit.driver.get_version()), list(unit.driver.get_ir_version())]
        except Exception as exc:
            raise _Unkeyable(f"NVVM's version cannot be told ({type(exc).__name__}: {exc})") from None
        _S.versions[original] = found
    return found
