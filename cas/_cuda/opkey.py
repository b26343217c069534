"""A canonical encoding of what a cuda.compute build depends on: its arguments and each Python op.

A store key must hold across processes and nodes, so values are bytes that
depend only on what the compiled code depends on: a function by its qualified
name, code object (never line numbers), defaults, closure and the globals it
names (followed modules by name and version); plain values, enums, NumPy
values; arguments (:func:`arg_part`) by dtype, iterator kind or op. Anything
else raises :class:`Uncacheable` naming it: the build runs uncached.
"""

from __future__ import annotations

import builtins
import enum
import struct
import sys
import types
from typing import Any

from .frontkey import Uncacheable

__all__ = ["Uncacheable", "arg_part", "encode_op", "encode_value"]

#: Bumped with any change of the encoding: a new format gets new keys.
FORMAT = b"cpcas-compute-op 1\0"
#: Top-level packages whose modules an op may name (by name and version): their attributes are theirs.
_FOLLOWED = frozenset({"numpy", "numba", "numba_cuda_mlir"}) | frozenset(sys.stdlib_module_names)
_CODE_FIELDS = ("co_argcount", "co_posonlyargcount", "co_kwonlyargcount", "co_nlocals", "co_flags")
#: How deep values and calls nest before the op is called uncacheable (a bound, not a limit met in practice).
_MAX_DEPTH = 64


def _module_version(name: str) -> str:
    top = name.partition(".")[0]
    if top in sys.stdlib_module_names:
        return "stdlib"
    module = sys.modules.get(top)
    version = getattr(module, "__version__", None)
    if not isinstance(version, str):
        raise Uncacheable(f"module {top!r} has no version to key it by")
    return version


class _Encoder:
    """Tagged, length-prefixed bytes; functions met again are back references."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.functions: dict[int, int] = {}
        self.keep: list[object] = []  # the functions met: their ids stay theirs while encoding
        self.depth = 0

    def put(self, tag: bytes, payload: bytes = b"") -> None:
        self.out.append(tag + struct.pack("<Q", len(payload)) + payload)

    def text(self, tag: bytes, value: str) -> None:
        self.put(tag, value.encode("utf-8", "surrogatepass"))

    def value(self, value: Any, where: str) -> None:
        self.depth += 1
        try:
            if self.depth > _MAX_DEPTH:
                raise Uncacheable(f"{where}: nested deeper than {_MAX_DEPTH}")
            self._value(value, where)
        finally:
            self.depth -= 1

    def _value(self, value: Any, where: str) -> None:  # one branch per kind
        kind = type(value)
        if value is None or value is Ellipsis:
            self.text(b"K", repr(value))
        elif kind is bool:
            self.put(b"B", b"\1" if value else b"\0")
        elif kind is int:
            self.text(b"I", str(value))
        elif kind is float:
            self.put(b"F", struct.pack("<d", value))
        elif kind is complex:
            self.put(b"C", struct.pack("<dd", value.real, value.imag))
        elif kind is str:
            self.text(b"S", value)
        elif kind is bytes:
            self.put(b"Y", value)
        elif kind in (tuple, list, frozenset, set):
            items = list(value)
            if kind in (frozenset, set):
                items = sorted(items, key=lambda v: self._sub(v, where))
            self.put(b"T", kind.__name__.encode() + b":" + str(len(items)).encode())
            for item in items:
                self.value(item, where)
        elif kind is dict:
            pairs = sorted(((self._sub(k, where), k, v) for k, v in value.items()), key=lambda p: p[0])
            self.put(b"D", str(len(pairs)).encode())
            for _enc, k, v in pairs:
                self.value(k, where)
                self.value(v, where)
        elif isinstance(value, enum.Enum):
            self.text(b"E", f"{kind.__module__}.{kind.__qualname__}")
            self.value(value.value, where)
        elif kind is types.CodeType:
            self.code(value, where)
        elif kind is types.FunctionType:
            self.function(value)
        elif kind is types.ModuleType:
            name = value.__name__
            if name.partition(".")[0] not in _FOLLOWED:
                raise Uncacheable(f"{where}: module {name!r}, whose attributes this cache does not follow")
            self.text(b"M", f"{name}={_module_version(name)}")
        elif kind is types.BuiltinFunctionType and getattr(builtins, getattr(value, "__name__", ""), None) is value:
            self.text(b"b", getattr(value, "__name__", ""))
        elif (kind is types.BuiltinFunctionType or _is_ufunc(value)) and _followed_builtin(value):
            self.text(b"b", f"{value.__module__}.{value.__name__}={_module_version(value.__module__)}")
        elif (py_func := _py_func(value)) is not None:
            self.function(py_func)  # a numba dispatcher: its Python function is what compiles
        else:
            self.other(value, where)

    def other(self, value: Any, where: str) -> None:
        np = sys.modules.get("numpy")
        if np is not None:
            if isinstance(value, np.dtype):
                self.dtype(value)
                return
            if isinstance(value, (np.generic,)) and not isinstance(value, np.object_):
                self.dtype(value.dtype)
                self.put(b"v", value.tobytes())
                return
            if type(value) is np.ndarray and value.dtype != object:
                self.dtype(value.dtype)
                self.text(b"h", repr(value.shape))
                self.put(b"v", np.ascontiguousarray(value).tobytes())
                return
            if type(value) is type and issubclass(value, np.generic):
                self.text(b"t", f"numpy.{value.__name__}")
                return
        device = device_dtype(value)
        if device is not None:
            self.dtype(device[0])
            self.text(b"d", repr(device[1]))
            return
        kind = type(value)
        raise Uncacheable(f"{where}: a {kind.__module__}.{kind.__qualname__}, which this cache cannot encode")

    def dtype(self, dtype: Any) -> None:
        # descr names every field and its offset type; str the byte order and size; isalignedstruct the padding.
        self.text(b"t", f"{dtype.str}|{dtype.descr!r}|{dtype.itemsize}|{dtype.isalignedstruct}")

    def _sub(self, value: Any, where: str) -> bytes:
        sub = _Encoder()
        sub.depth = self.depth
        sub.value(value, where)
        return b"".join(sub.out)

    def code(self, code: types.CodeType, where: str) -> None:
        self.put(b"c", code.co_code)
        self.text(b"n", "|".join(str(getattr(code, f)) for f in _CODE_FIELDS))
        for names in (code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars):
            self.value(names, where)
        self.value(code.co_consts, where)

    def function(self, func: types.FunctionType) -> None:
        seen = self.functions.get(id(func))
        if seen is not None:
            self.text(b"R", str(seen))
            return
        self.functions[id(func)] = len(self.functions)
        self.keep.append(func)
        where = f"op {func.__module__}.{func.__qualname__}"
        self.text(b"f", func.__qualname__)
        self.code(func.__code__, where)
        self.value(func.__defaults__, where)
        self.value(func.__kwdefaults__, where)
        for name, cell in zip(func.__code__.co_freevars, func.__closure__ or (), strict=True):
            try:
                contents = cell.cell_contents
            except ValueError:
                raise Uncacheable(f"{where}: closure variable {name!r} is not bound yet") from None
            self.value(contents, f"{where}, closure variable {name!r}")
        for name in sorted(_names(func.__code__)):
            self.global_(func, name, where)

    def global_(self, func: types.FunctionType, name: str, where: str) -> None:
        namespace = func.__globals__
        if name in namespace:
            self.text(b"g", name)
            self.value(namespace[name], f"{where}, global {name!r}")
        elif hasattr(builtins, name):
            self.text(b"G", name)  # a builtin, or an attribute named like one: both are the name
        else:
            self.text(b"a", name)  # an attribute: its owner (a followed module, an argument) is keyed


def _names(code: types.CodeType) -> set[str]:
    """The names a code object and those nested in it load."""
    names = set(code.co_names)
    for const in code.co_consts:
        if type(const) is types.CodeType:
            names |= _names(const)
    return names


def _is_ufunc(value: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and type(value) is np.ufunc


def _followed_builtin(value: Any) -> bool:
    """A function of a followed module (``math.sqrt``, ``numpy.sqrt``) that it names as its own."""
    module = getattr(value, "__module__", None) or ("numpy" if _is_ufunc(value) else None)
    if not isinstance(module, str) or module.partition(".")[0] not in _FOLLOWED:
        return False
    owner = sys.modules.get(module)
    return owner is not None and getattr(owner, getattr(value, "__name__", ""), None) is value


def _py_func(value: Any) -> types.FunctionType | None:
    """The Python function of a numba dispatcher, else None."""
    if (type(value).__module__ or "").partition(".")[0] not in ("numba", "numba_cuda_mlir", "numba_cuda"):
        return None
    py_func = getattr(value, "py_func", None)
    return py_func if type(py_func) is types.FunctionType else None


def device_dtype(value: Any) -> tuple[Any, tuple[int, ...]] | None:
    """``(dtype, shape)`` of a device array (``__cuda_array_interface__``), else None."""
    try:  # asked of the type first: no property of a class without it runs
        iface = hasattr(type(value), "__cuda_array_interface__") and value.__cuda_array_interface__
    except Exception:
        return None
    if not isinstance(iface, dict):
        return None
    np = sys.modules.get("numpy")
    if np is None:
        return None
    descr = iface.get("descr")
    dtype = np.dtype(descr if isinstance(descr, list) and len(descr) > 1 else iface["typestr"])
    return dtype, tuple(iface.get("shape", ()))


def encode_value(value: Any, where: str = "value") -> bytes:
    """The canonical bytes of ``value``; raises :class:`Uncacheable` naming what it cannot encode."""
    enc = _Encoder()
    enc.value(value, where)
    return b"".join(enc.out)


def encode_op(func: types.FunctionType) -> bytes:
    """The canonical bytes of a Python op: everything its compiled code depends on."""
    if type(func) is not types.FunctionType:
        raise TypeError(f"encode_op takes a Python function, got {type(func).__name__}")
    enc = _Encoder()
    enc.put(b"V", f"{sys.implementation.cache_tag}".encode())
    enc.function(func)
    return FORMAT + b"".join(enc.out)


def arg_part(name: str, value: Any) -> bytes:
    """The canonical bytes of one argument of a ``make_*`` call, as the build depends on it."""
    enc = _Encoder()
    enc.text(b"A", name)
    _arg(enc, value, f"argument {name}")
    return b"".join(enc.out)


def _arg(enc: _Encoder, value: Any, where: str) -> None:
    kind = type(value)
    mod = getattr(kind, "__module__", "") or ""
    np = sys.modules.get("numpy")
    if kind is types.FunctionType or _py_func(value) is not None:
        enc.put(b"o", encode_op(value if kind is types.FunctionType else _py_func(value)))  # type: ignore[arg-type]
    elif isinstance(value, enum.Enum) or value is None or kind in (bool, int, str):
        enc.value(value, where)
    elif (device := device_dtype(value)) is not None:
        enc.text(b"p", "device array")  # a pointer iterator over its dtype; shape and address are state
        enc.dtype(device[0])
    elif mod.startswith("cuda.compute"):
        _compute_object(enc, value, where)
    elif np is not None and (kind is np.ndarray or isinstance(value, np.generic)):
        enc.text(b"p", "host value")  # an initial value: its dtype is compiled, its contents are state
        enc.dtype(value.dtype)
    elif kind in (tuple, list) and all(type(v) is int for v in value):
        enc.value(value, where)
    else:
        raise Uncacheable(f"{where}: a {mod}.{kind.__qualname__}, which this cache cannot encode")


def _compute_object(enc: _Encoder, value: Any, where: str) -> None:
    """cuda.compute's own objects: proxies, structs, iterators, well-known and stateless ops."""
    name = type(value).__name__
    if name == "ProxyArray":
        enc.text(b"p", "device array")
        enc.dtype(value.dtype)
    elif name == "ProxyValue" or any(c.__name__ == "_Struct" for c in type(value).__mro__):
        enc.text(b"p", "host value")  # a gpu_struct value, or a proxy of one
        enc.dtype(value.dtype)
    elif name == "_StatelessOp" and type(getattr(value, "_func", None)) is types.FunctionType:
        enc.put(b"o", encode_op(value._func))
    elif name == "_WellKnownOp":
        enc.value(value._kind, where)
    elif hasattr(value, "kind") and any(c.__name__ == "IteratorBase" for c in type(value).__mro__):
        enc.text(b"i", "iterator")
        _kind(enc, value.kind, where)
    else:
        raise Uncacheable(f"{where}: a cuda.compute {name}, which this cache cannot encode")


def _kind(enc: _Encoder, kind: Any, where: str) -> None:
    """An iterator's ``kind``: names, flags, type descriptors, nested kinds and stateless ops."""
    if type(kind) is tuple:
        enc.put(b"T", str(len(kind)).encode())
        for item in kind:
            _kind(enc, item, where)
    elif type(kind).__name__ == "TypeDescriptor":
        enc.dtype(kind.dtype)
        enc.text(b"n", f"{kind.size}|{kind.alignment}")
    elif type(kind).__module__.startswith("cuda.compute") and not isinstance(kind, enum.Enum):
        _compute_object(enc, kind, f"{where}'s kind")
    elif type(kind) in (str, bool, int) or kind is None or isinstance(kind, enum.Enum):
        enc.value(kind, where)
    else:
        raise Uncacheable(f"{where}: an iterator kind holding a {type(kind).__qualname__}")
