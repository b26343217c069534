"""Where NVRTC looks for a front-door compile's headers, and the working directory they depend on."""

from __future__ import annotations

import functools
import os
from typing import Any

from .frontkey import Uncacheable

__all__ = ["BUILTIN_HEADERS", "Search", "as_list", "may_include_quoted"]

#: Headers NVRTC reads from memory: their name in the trace is no file.
BUILTIN_HEADERS = frozenset({"__nv_nvrtc_builtin_header.h"})
#: What may follow ``include`` (and blanks) in a ``#include <...>``: anything else may be a quoted or computed name.
_ANGLED_OR_BLANK = frozenset(b"< \t\n\r\f\v")


def _names_dir(flag: bytes) -> bool:
    """Whether a flag's output names the working directory (debug information, line tables)."""
    return b"debug" in flag or b"lineinfo" in flag or b"line-info" in flag or flag in (b"-G", b"-G\n")


@functools.lru_cache(maxsize=256)
def may_include_quoted(code: str | bytes) -> bool:
    """Whether some ``include``, past blanks, is followed by anything but ``<`` or a line's end.

    Byte scans: compiling a regular expression costs a first hit 0.2 ms.
    """
    data = code.encode("utf-8", "surrogateescape") if isinstance(code, str) else code
    end = len(data)
    at = data.find(b"include")
    while at >= 0:
        after = at + 7
        while after < end and data[after] in (32, 9):  # spaces and tabs
            after += 1
        if after == end or data[after] not in _ANGLED_OR_BLANK:
            return True
        at = data.find(b"include", at + 1)
    return False


class Search:
    """Where NVRTC looks, in its order; ``cwd`` (keyed) when a relative name or the binary depends on it."""

    __slots__ = ("cwd", "dirs", "pre_includes")

    def __init__(self, cwd: str | None, dirs: tuple[str, ...], pre_includes: tuple[str, ...]) -> None:
        self.cwd, self.dirs, self.pre_includes = cwd, dirs, pre_includes

    @staticmethod
    def of(code: object, code_type: str, options: Any, flags: tuple[bytes, ...] | None) -> Search:
        if code_type != "c++":
            return _NO_SEARCH
        includes = tuple(as_list(getattr(options, "include_path", None)))
        pre = tuple(as_list(getattr(options, "pre_include", None)))
        name = getattr(options, "name", None)
        quoted = not getattr(options, "no_source_include", None) and (
            not isinstance(code, (str, bytes)) or may_include_quoted(code)
        )
        searched, wants_cwd = _search_plan(includes, pre, name if isinstance(name, str) else None, bool(quoted), flags)
        cwd = None
        if wants_cwd:
            try:
                cwd = os.getcwd()
            except OSError as exc:
                raise Uncacheable(
                    f"the working directory cannot be read ({exc.strerror})", "the working directory"
                ) from None
        return _placed_search(searched, pre, cwd)

    def key_part(self) -> bytes:
        return b"" if self.cwd is None else b"\0cwd:" + self.cwd.encode("utf-8", "surrogateescape")

    def resolve(self, names: list[str] | None) -> list[str]:
        """The files NVRTC opened, from the names its trace gives; raises Uncacheable for one it cannot be."""
        if names is None:
            raise Uncacheable("NVRTC's trace of the headers it read is missing, damaged or incomplete", "the trace")
        paths = []
        for name in names:
            if name in BUILTIN_HEADERS:
                continue
            if os.path.isabs(name):
                paths.append(name)
            elif self.cwd is not None:
                # As the kernel resolved it: no normpath, which would undo a symlink followed by "..".
                paths.append(os.path.join(self.cwd, name))
            else:
                raise Uncacheable(f"header {name!r} was found through a relative name the key does not cover", name)
        return paths


#: The search of a compile that is not C++ (nothing is searched); Search objects are never changed.
_NO_SEARCH = Search(None, (), ())


@functools.lru_cache(maxsize=256)
def _search_plan(
    includes: tuple[str, ...], pre: tuple[str, ...], name: str | None, quoted: bool, flags: tuple[bytes, ...] | None
) -> tuple[tuple[str, ...], bool]:
    """The directories searched, in order, as the options name them; and whether the working directory matters."""
    source_dir = os.path.dirname(name) if name is not None else ""
    flags = flags or ()
    flag = b"--use-bundled-headers="
    bundled = [f[len(flag) :].decode("utf-8", "surrogateescape") for f in flags if f.startswith(flag)]
    # A relative pre_include is looked for in the working directory, then along the search path.
    searched: list[str] = []
    if quoted:
        searched.append(source_dir)
    if any(not os.path.isabs(p) for p in pre):
        searched.extend(d for d in ("", source_dir) if d not in searched)
    for top in bundled:
        searched.extend((top, os.path.join(top, "cccl")))
    searched.extend(includes)
    relative = any(not os.path.isabs(d) for d in searched) or any(not os.path.isabs(p) for p in pre)
    names_dir = any(_names_dir(f) for f in flags)
    return tuple(searched), relative or names_dir


@functools.lru_cache(maxsize=256)
def _placed_search(searched: tuple[str, ...], pre: tuple[str, ...], cwd: str | None) -> Search:
    base = cwd or ""
    joined = (os.path.join(base, d) for d in searched)
    dirs = tuple(p.rstrip(os.sep) or p for p in joined)  # as NVRTC names ``hdr/``: ``hdr``; the root kept
    return Search(cwd, tuple(dict.fromkeys(dirs)), tuple(p for p in pre if os.path.isabs(p)))


def as_list(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)]
    return [os.fspath(v) for v in value]  # type: ignore[attr-defined]
