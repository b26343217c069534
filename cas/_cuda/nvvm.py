"""The switch's hook on numba-cuda's NVVM compiles: a Python kernel's IR to PTX or LTO-IR through the cache.

:func:`activate` binds a subclass to ``CompilationUnit`` wherever the name is
bound; it records ``add_module``, ``lazy_add_module`` and ``verify``, and
``compile`` looks the result up under a key of every module (kind, length,
blake3), the options as NVVM gets them, NVVM's and its IR's version and the
wrapper's module. A hit has an empty ``log``; a miss with a non-empty log is not
stored. numba names symbols with a per-process counter: a process that compiles
another function first gets new keys.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from cuda_program_cas._base.fork import ForkSafeLock
from cuda_program_cas._disk.files import blake3_hasher
from cuda_program_cas.index import key_id

from .frontkey import Uncacheable
from .switch import activate as switch_on
from .switch import hook_failed, hook_inner, installed, swap, unswap

__all__ = ["LLVM70", "MODULES", "activate", "hook", "hooked", "unhook"]

MODULES = ("numba.cuda.cudadrv.nvvm", "numba_cuda_mlir.numba_cuda.cudadrv.nvvm")
#: numba-cuda-mlir's module whose ``_call_llvm70_capi`` (its NVVM compiles below sm_100) is wrapped.
LLVM70 = "numba_cuda_mlir.mlir_optimization"
#: Mixed into every key: a new key format gets new keys.
_TAG = b"cuda-program-cas nvvm 1\0"
_PREFIX = b"cpcas-nvvm/1\0"
#: Mixed into the keys of numba-cuda-mlir's LLVM 7 path.
_TAG_LLVM70 = b"cuda-program-cas llvm70 1\0"

_lock = ForkSafeLock()


#: Per module hooked: the name rebound (numba-cuda-mlir's LLVM 7 path serves chips below sm_100).
_HOOKS = {**dict.fromkeys(MODULES, "CompilationUnit"), LLVM70: "_call_llvm70_capi"}


class _State:
    original: dict[str, Any] = {}  # noqa: RUF012  # one instance, a namespace
    switched: dict[str, Any] = {}  # noqa: RUF012
    versions: dict[type, list[Any]] = {}  # noqa: RUF012  # per original class
    files: dict[tuple[str, int, int], list[Any]] = {}  # noqa: RUF012  # (path, size, mtime_ns): [path, size, blake3]


_S = _State()


def activate(mode: str) -> None:
    """The switch in ``mode`` (a ``CUDA_PROGRAM_CAS`` value), and :func:`hook`."""
    switch_on(mode)
    if installed() is not None:
        hook()


def hook() -> None:
    """Bind the caching forms wherever the names of :data:`_HOOKS` of loaded modules are bound."""
    with _lock:
        for name, attr in _HOOKS.items():
            current = getattr(sys.modules.get(name), attr, None)
            if isinstance(current, type) if name in MODULES else callable(current):
                swap(_S.original, _S.switched, name, current, _subclass if name in MODULES else _llvm70)


def unhook() -> None:
    """The original ``CompilationUnit`` and ``_call_llvm70_capi`` everywhere again."""
    with _lock:
        unswap(_S.original, _S.switched)


def hooked() -> list[str]:
    """The modules of :data:`MODULES` (and :data:`LLVM70`) whose compiles go through the cache now."""
    return [
        name
        for name, attr in _HOOKS.items()
        if name in _S.switched and getattr(sys.modules.get(name), attr, None) is _S.switched[name]
    ]


def _subclass(original: type) -> type:
    class CompilationUnit(original):  # type: ignore[misc]
        """numba-cuda's ``CompilationUnit``, its compiles through the cache (the switch)."""

        cpcas_original = original

        def __init__(self, options: Any) -> None:
            super().__init__(options)
            self._cpcas_calls: list[tuple[str, Any]] = []  # ("add" | "lazy" | "verify", buffer)

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
    return _through(
        lambda: _key(unit, original, calls),
        lambda: _uncached(unit, original, calls),
        lambda: setattr(unit, "log", ""),  # as a compile that stored had it
        lambda: "nvvm: NVVM logged warnings, which a hit would not repeat" if getattr(unit, "log", "") else None,
    )


def _through(
    keyed: Callable[[], tuple[bytes, dict[str, Any]]],
    call: Callable[[], Any],
    hit: Callable[[], None],
    unstorable: Callable[[], str | None],
) -> Any:
    """``call()``'s result under ``keyed()``'s key; ``hit()`` runs before a hit returns, ``unstorable()``
    says why a miss's result is not stored."""
    inner = hook_inner()
    if inner is None:  # the switch is off, or no cache could be opened (said once)
        return call()
    try:
        key, inputs = keyed()
    except Exception as exc:
        result = call()
        if not isinstance(exc, Uncacheable):
            hook_failed(exc)
        inner.note_dropped(None, f"nvvm: {exc}")
        return result
    kid = key_id(key)
    with contextlib.ExitStack() as claims:  # a miss holds the node's claim until it stored or failed
        try:
            found = inner.find_or_claim(kid, claims, reason="new inputs")
        except Exception as exc:
            hook_failed(exc)
            found = None
        if found is not None:
            hit()
            return found[0]
        t0 = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - t0
        why = unstorable()
        if why is not None:
            inner.note_dropped(kid, why)
            return result
        try:
            if inner.put_id(kid, bytes(result)):
                inner.note_compiled(kid, seconds, "nvvm", inputs)
        except Exception as exc:  # the caller has its result; the cache only loses an entry
            hook_failed(exc)
        return result


def _uncached(unit: Any, original: Any, calls: list[tuple[str, Any]]) -> Any:
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
            raise Uncacheable(f"a module given as {type(buffer).__name__}, not bytes")
        digest = blake3(buffer).hexdigest()
        key.update(b"\0" + json.dumps([what, len(buffer), digest]).encode())
        (libdevice if what == "lazy" else code).update(digest.encode())
    inputs = _inputs(code.hexdigest(), "-gen-lto" in options, options, version, libdevice.hexdigest())
    return _PREFIX + key.digest(), inputs


def _inputs(code: str, lto: bool, options: list[str], version: list[Any], libdevice: str) -> dict[str, Any]:
    return {
        "code": code[:32],
        "code_type": "nvvm",
        "target": "ltoir" if lto else "ptx",
        "options": options,
        "names": [],
        "nvvm": "{}.{} (IR {}.{})".format(*version[0][:2], *version[1][:2]),
        "libdevice": libdevice[:16],
    }


def _version(unit: Any, original: type) -> list[Any]:
    """``[NVVM's version, its IR version]`` as the wrapper reports them, asked once per class."""
    found = _S.versions.get(original)
    if found is None:
        try:
            found = [list(unit.driver.get_version()), list(unit.driver.get_ir_version())]
        except Exception as exc:
            raise Uncacheable(f"NVVM's version cannot be told ({type(exc).__name__}: {exc})") from None
        _S.versions[original] = found
    return found


def _llvm70(original: Any) -> Any:
    """``original`` (numba-cuda-mlir's ``_call_llvm70_capi``), its PTX and LTO-IR through the cache."""

    @functools.wraps(original)
    def _call_llvm70_capi(module: Any, target_options: Any, gen_lto: bool = False, gen_llvmir: bool = False) -> bytes:
        def call() -> bytes:
            return bytes(original(module, target_options, gen_lto=gen_lto, gen_llvmir=gen_llvmir))

        try:
            debugging = gen_llvmir or _dumps(target_options)
        except Exception as exc:  # whether it dumps cannot be told: uncached, said once
            hook_failed(exc)
            debugging = True
        if debugging:  # LLVM IR for reading, or dumps asked for: a debug path, uncached
            return call()
        return bytes(_through(lambda: _llvm70_key(module, target_options, gen_lto), call, lambda: None, lambda: None))

    _call_llvm70_capi.cpcas_original = original  # type: ignore[attr-defined]
    return _call_llvm70_capi


def _dumps(target_options: Any) -> bool:
    """Whether the compile prints what it works on (which a hit would not)."""
    from importlib import import_module

    config: Any = import_module("numba_cuda_mlir.numba_cuda").config
    return bool(target_options.get("dump_mlir") or target_options.get("dump") or config.CUDA_DUMP_NVVM)


def _llvm70_key(module: Any, target_options: Any, gen_lto: bool) -> tuple[bytes, dict[str, Any]]:
    """The store key of one ``_call_llvm70_capi`` compile: what the C library is handed, as the original
    reads it, and the identities of what it loads; and its journaled inputs."""
    from importlib import import_module
    from importlib.metadata import version

    tools: Any = import_module("numba_cuda_mlir.tools")
    libs: Any = import_module("numba_cuda_mlir.numba_cuda.cudadrv.libs")
    driver: Any = import_module("numba_cuda_mlir.numba_cuda.cudadrv.nvvm")
    mo: Any = sys.modules[LLVM70]
    gpu_mod = mo._get_single_gpu_module(module)
    pointees = mo.struct_pointees_attr(gpu_mod.operation)
    if pointees is not None:  # as the original sets it, before it hands the op over
        gpu_mod.operation.attributes["llvm70.struct_pointees"] = pointees
    text = gpu_mod.operation.get_asm(binary=True, enable_debug_info=True, print_generic_op_form=True)
    chip = target_options["chip"] if "chip" in target_options else tools.get_gpu_compute_capability()
    opt_level = int(target_options.get("opt_level", 2))
    debug_level = 2 if target_options.get("debug", False) else 1 if target_options.get("lineinfo", False) else 0
    if not isinstance(chip, str) or not isinstance(text, bytes):
        raise Uncacheable(f"the LLVM 7 path's chip {chip!r} or module is not as expected")
    libdevice = _file_id(libs.get_libdevice())
    nvvm: list[Any] = [mo._get_libnvvm_path().decode(), list(driver.NVVM().get_version())]
    nvvm.append(list(mo._get_nvvm_ir_version()))
    options = [f"chip={chip}", f"opt_level={opt_level}", f"debug_level={debug_level}", f"gen_lto={int(gen_lto)}"]
    identity = [
        version("numba-cuda-mlir"),
        _file_id(_libllvm(mo)),
        _file_id(tools.get_llvm70_capi_path()),
        nvvm,
        libdevice,
        options,
    ]
    code = blake3_hasher()(text).hexdigest()
    key = hashlib.sha256(_TAG_LLVM70)
    key.update(json.dumps(identity).encode() + b"\0" + json.dumps([len(text), code]).encode())
    inputs = _inputs(code, gen_lto, ["llvm70", *options], nvvm[1:], libdevice[2])
    return _PREFIX + key.digest(), inputs


def _libllvm(mo: Any) -> str:
    """The libLLVM 7 the original loads: ``LIBLLVM7``, else the one numba-cuda-mlir bundles."""
    found = os.environ.get("LIBLLVM7", "")
    if not found and os.name != "nt":
        bundled = os.path.join(os.path.dirname(mo.__file__), "lib", "libLLVM-7.so")
        found = os.path.realpath(bundled) if os.path.isfile(bundled) else ""
    if not found:  # a library found by its soname (conda's), or Windows': not told apart here
        raise Uncacheable("the LLVM 7 library cannot be told")
    return found


def _file_id(path: str) -> list[Any]:
    """``[path, size, blake3]`` of a file the compile reads, digested once per size and mtime."""
    st = os.stat(path)
    stamp = (path, st.st_size, st.st_mtime_ns)
    found = _S.files.get(stamp)
    if found is None:
        with open(path, "rb") as f:
            found = [path, st.st_size, blake3_hasher()(f.read()).hexdigest()]
        _S.files[stamp] = found
    return found
