"""The switch: every ``cuda.core`` ``Program.compile`` and ``Linker.link`` of a process through the cache.

:func:`install` rebinds ``cuda.core.Program`` (an immutable extension type) and
``Linker``, and every module attribute bound to them, to subclasses. A compile
with ``cache=`` goes as given; PTX and refused options go uncached; headers,
``name_expressions`` or libdevice go to the front door; every other goes to
``Program.compile(cache=)``, its miss holding the node's claim on the key. One
cache per process; a failing cache is one WARNING and the uncached compile.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

from cuda_program_cas._base.config import ENV_SWITCH, env_switched_off, parse_switch, say_once
from cuda_program_cas._base.fork import ForkSafeLock

__all__ = [
    "activate",
    "activate_compute",
    "hook_failed",
    "hook_inner",
    "install",
    "installed",
    "routed",
    "swap",
    "uninstall",
    "unswap",
]

_log = logging.getLogger("cuda_program_cas")

_lock = ForkSafeLock()


class _State:
    mode: str | None = None
    #: The original classes, and this module's subclasses of them (made once per process).
    original: dict[str, Any] = {}  # noqa: RUF012  # one instance, a namespace
    switched: dict[str, Any] = {}  # noqa: RUF012
    cache: Any = None
    cache_failed = False
    routed = 0  # compiles and links sent through the cache, counted under _lock


_S = _State()
_inside = threading.local()


def installed() -> str | None:
    """``"on"`` or ``"read-only"`` while the switch is installed, else None."""
    return _S.mode


def routed() -> int:
    """How many compiles and links of this process the switch sent through the cache."""
    return _S.routed


def _count_routed(inner: Any) -> Any:
    with _lock:
        _S.routed += 1
    inner.note_switched()
    return inner


def install(*, read_only: bool = False) -> None:
    """Send every ``cuda.core`` compile and link of this process through the cache (``CUDA_PROGRAM_CAS=1``).

    The cache, ``$CUDA_PROGRAM_CAS_DIR`` or the default, opens on the first compile.
    """
    from .boot import defer

    defer("read-only" if read_only else "1")


def uninstall() -> None:
    """Undo :func:`install`: the original classes everywhere, compiles uncached (the cache stays open)."""
    from .boot import remove

    remove()
    with _lock:
        _S.mode = None
        unswap(_S.original, _S.switched)  # cuda.core's classes and cuda.compute's factories
    nvvm = sys.modules.get("cuda_program_cas._cuda.nvvm")  # numba-cuda's hook, loaded only where numba was
    if nvvm is not None:
        nvvm.unhook()


def activate(value: str) -> None:
    """Install the switch in the mode ``value`` names (a ``CUDA_PROGRAM_CAS`` value); ``cuda.core`` is imported."""
    try:
        mode = parse_switch(value) if value.strip() else "off"
    except ValueError as exc:  # as config's reader words it, and said once for both
        say_once(("env", ENV_SWITCH, value), "cuda-program-cas: %s=%r is ignored: %s", ENV_SWITCH, value, exc)
        return
    if mode == "off":
        uninstall()
        return
    # From sys.modules: inside the import hook, cuda.core has run but is not yet an attribute of cuda.
    core: Any = sys.modules.get("cuda.core")
    if core is None:
        import importlib

        core = importlib.import_module("cuda.core")
    with _lock:
        if _S.mode is not None and _S.mode != mode and _S.cache is not None:
            _S.cache = None  # another mode: another instance (read-only or not)
        _S.mode = mode
        for name in ("Program", "Linker"):
            swap(_S.original, _S.switched, name, getattr(core, name), functools.partial(_subclass, name))


def activate_compute(mode: str) -> None:
    """:func:`activate`, and cuda.compute's factories routed (run once ``cuda.compute.algorithms`` is imported)."""
    activate(mode)
    if _S.mode is None:
        return
    from .compute import FACTORIES, HOOKED, switched

    algorithms = sys.modules[HOOKED]
    make = functools.partial(switched, inner_for=hook_inner)
    with _lock:
        for name in FACTORIES:
            current = getattr(algorithms, name, None)
            if current is not None:
                swap(_S.original, _S.switched, name, current, make)


def swap(
    originals: dict[str, Any], switched: dict[str, Any], name: str, current: Any, make: Callable[[Any], Any]
) -> None:
    """Bind ``name``'s routed form, made once by ``make(original)``, wherever its original is bound."""
    original = getattr(current, "cpcas_original", current)
    if name not in switched:
        originals[name] = original
        switched[name] = make(original)
    rebind(original, switched[name])


def unswap(originals: dict[str, Any], switched: dict[str, Any]) -> None:
    """Undo :func:`swap`: every name's original bound again wherever its routed form is."""
    for name, routed_form in switched.items():
        rebind(routed_form, originals[name])


def _internal(modname: str) -> bool:
    """cuda.core's private modules (its classes' homes, and what uses them inside) and this package's."""
    if modname.startswith("cuda_program_cas"):
        return True  # the cache's own compiles stay uncached
    if modname.startswith("cuda.core."):  # public ones (cuda.core.experimental in older versions) are rebound
        return any(part.startswith("_") or part in ("cu12", "cu13") for part in modname.split(".")[2:])
    return False


def rebind(old: object, new: object) -> None:
    """Every module attribute bound to ``old`` now bound to ``new``, except in cuda.core's internals and ours."""
    for modname, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or _internal(modname):
            continue
        try:
            namespace = object.__getattribute__(module, "__dict__")  # a lazy module is not loaded by this
        except AttributeError:
            continue
        for attr, value in list(namespace.items()):
            if value is old:
                namespace[attr] = new


def _made_first(base: Any, prop: str) -> property:
    def read(self: Any) -> Any:
        _materialize(self)
        return getattr(base, prop).__get__(self, base)

    return property(read)


def _subclass(name: str, original: type) -> type:
    if name == "Program":
        base: Any = original  # cuda.core's, its properties read as descriptors

        class Program(original):  # type: ignore[misc]
            """``cuda.core.Program``, its compiles routed through the cache (``cuda_program_cas.install()``)."""

            cpcas_original = original

            def __init__(self, code: Any, code_type: Any, options: Any = None) -> None:
                self._cpcas_inputs: Any = (code, code_type, options)
                # A C++ hit needs no NVRTC program: making it (and loading NVRTC, 8 ms) waits.
                self._cpcas_deferred = (
                    _S.mode is not None
                    and not _depth()
                    and isinstance(code, str)
                    and code_type == "c++"
                    and type(options).__name__ == "ProgramOptions"
                    and type(options).__module__.startswith("cuda.core")
                )
                if not self._cpcas_deferred:
                    super().__init__(code, code_type, options)

            def compile(
                self, target_type: Any, name_expressions: Sequence[Any] = (), logs: Any = None, *, cache: Any = None
            ) -> Any:
                return _compile(self, target_type, name_expressions, logs, cache)

            def close(self) -> None:
                self._cpcas_deferred = False  # closed before NVRTC's program was made: never made
                self._cpcas_inputs = None  # a compile after close goes to the original, which refuses it
                base.close(self)

        # Only those this cuda-core has (1.1 has no is_closed or pch_status).
        for prop in ("backend", "handle", "pch_status"):
            if hasattr(base, prop):
                setattr(Program, prop, _made_first(base, prop))
        if hasattr(base, "is_closed"):
            closed = property(lambda self: False if self._cpcas_deferred else bool(base.is_closed.__get__(self, base)))
            Program.is_closed = closed
        Program.__module__ = "cuda_program_cas"
        Program.__qualname__ = "Program"
        return Program

    class Linker(original):  # type: ignore[misc]
        """``cuda.core.Linker``, its links routed through the cache (``cuda_program_cas.install()``)."""

        cpcas_original = original

        def __init__(self, *object_codes: Any, options: Any = None) -> None:
            super().__init__(*object_codes, options=options)
            self._cpcas_inputs = (object_codes, options)

        def link(self, target_type: Any) -> Any:
            return _link(self, target_type)

    Linker.__module__ = "cuda_program_cas"
    Linker.__qualname__ = "Linker"
    return Linker


def _process_cache() -> Any:
    """This process's cache, opened on first use; None when it cannot be (one WARNING)."""
    cache = _S.cache
    if cache is not None or _S.cache_failed or env_switched_off():  # CUDA_PROGRAM_CAS=0 wins over install()
        return cache
    with _lock:
        if _S.cache is None and not _S.cache_failed:
            read_only = _S.mode == "read-only"
            try:
                from cuda_program_cas._base.config import default_cache_dir

                from .cache import ContentAddressedProgramCache

                if read_only and not default_cache_dir().is_dir():
                    return None  # nothing to hit yet, and a read-only cache is never created: not a failure
                _S.cache = ContentAddressedProgramCache(read_only=read_only)
            except Exception as exc:
                _S.cache_failed = True
                hook_failed(exc)
                return None
            _log.info(
                "cuda-program-cas: switch on%s: cuda.core Program.compile and Linker.link of this process "
                "go through the cache at %s",
                " (read-only)" if _S.mode == "read-only" else "",
                _S.cache.path,
            )
        return _S.cache


def hook_inner() -> Any:
    """The process cache's ``Inner`` for NVVM and cuda.compute, counted as routed; else None. Never raises."""
    if _S.mode is None:
        return None
    try:
        cache = _process_cache()
        inner = None if cache is None else _inner_of()(cache)
    except Exception as exc:
        hook_failed(exc)
        return None
    return None if inner is None else _count_routed(inner)


def hook_failed(exc: BaseException) -> None:
    say_once(
        ("switch-failed",),
        "cuda-program-cas: the cache failed (%r); compiles run uncached instead (said once per process)",
        exc,
    )


def _front_door_needed(code: Any, code_type: str, options: Any, name_expressions: Sequence[Any]) -> bool:
    if name_expressions:
        return True
    if code_type == "nvvm":
        return bool(getattr(options, "use_libdevice", None))
    if getattr(options, "include_path", None) or getattr(options, "pre_include", None):
        return True
    name = getattr(options, "name", None)
    if isinstance(name, str) and ("/" in name or "\\" in name):
        return True
    return not isinstance(code, (str, bytes)) or _front_door_checks()[1](code)


@functools.cache
def _inner_of() -> Any:
    from .cache import inner_of

    return inner_of


@functools.cache
def _front_door_checks() -> tuple[Any, Any]:
    """``refuse_unkeyable`` and ``may_include_quoted``, imported once (an import a hit costs tens of us)."""
    from .frontkey import refuse_unkeyable
    from .search import may_include_quoted

    return refuse_unkeyable, may_include_quoted


def _keyable(options: Any, kind: str) -> bool:
    try:
        _front_door_checks()[0](options, kind)
    except ValueError:
        return False
    return True


def _depth() -> int:
    depth: int = getattr(_inside, "depth", 0)
    return depth


class _Inside:
    """Marks the thread while the cache runs a compile: that compile is the original, uncached one."""

    def __enter__(self) -> None:
        _inside.depth = _depth() + 1
        _inside.error = None

    def __exit__(self, *exc: object) -> None:
        _inside.depth -= 1
        _inside.error = None  # kept, its frames would be freed after sys ("Error in sys.excepthook")


_materialize_lock = ForkSafeLock()


def _materialize(program: Any) -> None:
    if getattr(program, "_cpcas_deferred", False):
        with _materialize_lock:
            if program._cpcas_deferred:
                code, code_type, options = program._cpcas_inputs
                _S.original["Program"].__init__(program, code, code_type, options)
                program._cpcas_deferred = False


def _compile(program: Any, target_type: Any, name_expressions: Sequence[Any], logs: Any, cache: Any) -> Any:
    compile_ = _S.original["Program"].compile

    def original(program: Any, *args: Any, **kwargs: Any) -> Any:
        _materialize(program)
        return compile_(program, *args, **kwargs)

    if cache is not None:
        return original(program, target_type, name_expressions, logs, cache=cache)
    if _depth():
        try:
            return original(program, target_type, name_expressions, logs)
        except Exception as exc:
            _inside.error = exc  # the compiler's, not the cache's: raised as it is
            raise
    inputs = getattr(program, "_cpcas_inputs", None)
    if _S.mode is None or inputs is None:
        return original(program, target_type, name_expressions, logs)
    code, code_type, options = inputs
    cache = None
    try:  # the route; no compile runs in this try: its errors are never taken for the cache's
        kind = str(getattr(code_type, "value", code_type)).lower()  # a str, or cuda.core's SourceCodeType
        if kind != "ptx" and _keyable(options, kind):  # PTX to cubin runs the driver's linker: not keyed
            cache = _process_cache()
            front = _front_door_needed(code, kind, options, name_expressions)
    except Exception as exc:
        hook_failed(exc)
        cache = None
    if cache is None:
        return original(program, target_type, name_expressions, logs)
    _count_routed(_inner_of()(cache))
    uncached = functools.partial(original, program, target_type, name_expressions, logs)
    if front:
        return _cached(
            lambda: cache.compile(code, code_type, options, target_type, name_expressions=name_expressions, logs=logs),
            uncached,
        )
    guarded = _guarded_class()(cache)
    try:
        # A claim taken by the lookup's miss is held until this compile has stored, or failed.
        with contextlib.ExitStack() as guarded.claims:
            return original(program, target_type, name_expressions, logs, cache=guarded)
    except Exception as exc:
        if guarded.keyed:
            raise  # the key was made and looked up: what failed is the compile
        failure = exc  # cuda.core would not key it: compile as if uncached
    return _uncached(uncached, failure)


def _cached(run: Callable[[], Any], uncached: Callable[[], Any]) -> Any:
    """``run()``, the cache's compile or link; when the cache (not the compiler) fails, ``uncached()``."""
    with _Inside():
        try:
            return run()
        except Exception as exc:
            if exc is _inside.error:
                raise
            failure = exc
    return _uncached(uncached, failure)


def _uncached(run: Callable[[], Any], failure: Exception) -> Any:
    result = run()  # its error is the compiler's
    if not isinstance(failure, ValueError):
        hook_failed(failure)
    return result


@functools.cache
def _guarded_class() -> Any:
    from cuda.core.utils import ProgramCacheResource

    class Guarded(ProgramCacheResource):  # type: ignore[misc]  # cuda.core ships no stubs
        """A cache for one ``Program.compile(cache=)`` that never fails it: a failed read is a miss."""

        def __init__(self, cache: Any) -> None:
            self._cache = cache
            self.keyed = False  # cuda.core made the key and looked it up: what fails after is the compile
            self.claims: contextlib.ExitStack | None = None  # where a miss's claim is kept

        def get(self, key: bytes | str, default: Any = None) -> Any:
            self.keyed = True
            try:
                if self.claims is None:
                    found = self._cache.get(key)
                else:  # a miss holds the node's claim on the key until the compile around it ends
                    from cuda_program_cas.index import key_id

                    hit = _inner_of()(self._cache).find_or_claim(key_id(key), self.claims)
                    found = None if hit is None else hit[0]
            except Exception as exc:
                hook_failed(exc)
                return default
            return default if found is None else found

        def __getitem__(self, key: bytes | str) -> bytes:
            found = self.get(key)
            if found is None:
                raise KeyError(key)
            return found  # type: ignore[no-any-return]

        def __setitem__(self, key: bytes | str, value: Any) -> None:
            try:
                self._cache[key] = value
            except Exception as exc:
                hook_failed(exc)

        def __delitem__(self, key: bytes | str) -> None:
            del self._cache[key]

        def __contains__(self, key: object) -> bool:
            return key in self._cache

        def __len__(self) -> int:
            return len(self._cache)

        def clear(self) -> None:
            self._cache.clear()

    return Guarded


def _link(linker: Any, target_type: Any) -> Any:
    original = _S.original["Linker"].link
    inputs = getattr(linker, "_cpcas_inputs", None)
    if _S.mode is None or inputs is None or _depth():
        return original(linker, target_type)
    try:
        cache = _process_cache()
    except Exception as exc:
        hook_failed(exc)
        cache = None
    if cache is None:  # no cache could be opened (said once), or CUDA_PROGRAM_CAS=0
        return original(linker, target_type)
    objects, options = inputs
    _count_routed(_inner_of()(cache))
    return _cached(lambda: cache.link(objects, options, target_type), lambda: original(linker, target_type))
