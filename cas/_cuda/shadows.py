"""The paths that could shadow a front-door compile's headers: each name NVRTC would have tried first.

Every ``#include`` and ``__has_include`` of the source and each header read names
a header; each path its search tries before the file found is a *candidate*
that must stay absent. The scan over-approximates (skipped branches count).
Where a candidate cannot be checked precisely (not a regular file, a search
stopped at a file NVRTC did not read, a file system whose negative lookups may
be stale, a name made by a macro), its directory is guarded by its entries'
times instead. Only a miss imports this.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable
from typing import Any

from cuda_program_cas._base.log import LOGGER as _log
from cuda_program_cas._disk.fskind import STAT_RELIABLE, fs_type

from .frontkey import Uncacheable
from .record import DirKey, Header, content_digest, dir_guards, guard_dirs
from .search import Search, as_list

__all__ = ["ABSENT_ERRNOS", "Computed", "directives", "shadows_and_guards"]

#: What a lookup of an absent candidate may fail with: nothing there, or a file where a directory would be.
ABSENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR})

# A directive's kinds: quoted, angled, next (#include_next, any spelling), and a name made by a macro.
QUOTED, ANGLED, NEXT = "q", "a", "n"

_INCLUDE = re.compile(rb"^[ \t]*#[ \t]*(include|include_next|import)\b[ \t]*(.?)", re.M)
_DEFINE = re.compile(rb"^[ \t]*#[ \t]*define[ \t]+(\w+)\([^)\n]*\)(.*)$", re.M)
_LITERAL = re.compile(rb'[ \t]*(?:<([^>\n]*)>|"([^"\n]*)")')


class Computed(Exception):
    """A file names a header through a macro."""


def _wrappers(data: bytes) -> set[bytes]:
    """Function-like macros of ``data`` whose body hands a parameter to ``__has_include`` (``_CCCL_HAS_INCLUDE``)."""
    found = set()
    for m in _DEFINE.finditer(data):
        if re.search(rb"\b__has_include(_next)?\b[ \t]*\([ \t]*[A-Za-z_]", m.group(2)):
            found.add(m.group(1))
    return found


def directives(data: bytes, wrappers: Iterable[bytes] = ()) -> list[tuple[str, str]]:
    """Every header ``data`` names: ``(kind, spelling)``; raises :class:`Computed` for a name made by a macro.

    ``wrappers``: macros whose uses count as ``__has_include`` of the name they are given.
    """
    data = data.replace(b"\\\r\n", b"").replace(b"\\\n", b"")  # continued lines, as the preprocessor joins them
    found: list[tuple[str, str]] = []
    for m in _INCLUDE.finditer(data):
        opener = m.group(2)
        if opener in (b"", b"\n", b"\r"):
            continue  # "#include" alone: an error NVRTC reports, no name
        literal = _LITERAL.match(data, m.start(2))
        if literal is None:
            raise Computed(data[m.start() : data.find(b"\n", m.start())].decode("utf-8", "replace").strip())
        _add(found, m.group(1) == b"include_next", literal)
    macro_lines = {m.start(): m.end() for m in _DEFINE.finditer(data)}
    names = [rb"__has_include(?:_next)?", *(re.escape(w) for w in wrappers)]
    for m in re.finditer(rb"\b(" + b"|".join(names) + rb")\b[ \t]*(\(?)", data):
        if not m.group(2):
            continue  # "defined(__has_include)", "#ifdef __has_include": no call
        literal = _LITERAL.match(data, m.end())
        if literal is None:
            if any(start <= m.start() < end for start, end in macro_lines.items()):
                continue  # a wrapper's own body: its uses are read as calls (see _wrappers)
            raise Computed(data[m.start() : data.find(b"\n", m.start())].decode("utf-8", "replace").strip())
        _add(found, m.group(1).endswith(b"_next"), literal)
    return found


def _add(found: list[tuple[str, str]], nxt: bool, literal: re.Match[bytes]) -> None:
    angled, quoted = literal.group(1), literal.group(2)
    raw = angled if angled is not None else quoted
    if raw is None or b"\0" in raw or not raw.strip():
        return
    kind = NEXT if nxt else (ANGLED if angled is not None else QUOTED)
    found.append((kind, os.fsdecode(raw.strip())))


def shadows_and_guards(
    code: str | bytes, code_type: str, options: Any, headers: list[Header], search: Search
) -> tuple[list[str], list[tuple[str, DirKey | None]]]:
    """The candidates that must stay absent, and the directories guarded where one cannot be checked.

    Each header is read again: one whose bytes changed since it was hashed raises :class:`Uncacheable`.
    """
    if code_type != "c++":
        return [], []
    absent: set[str] = set()
    dirs: set[str] = set()
    computed: str | None = None  # the first name made by a macro
    read: set[tuple[int, int]] = set()
    read_paths = {h.path for h in headers}
    source = code.encode("utf-8", "surrogateescape") if isinstance(code, str) else bytes(code)
    texts: list[tuple[str | None, bytes]] = [(None, source)]
    for h in headers:
        try:
            with open(h.path, "rb") as fh:
                data = fh.read()
                st = os.fstat(fh.fileno())
        except OSError:
            raise Uncacheable(f"header {h.path} NVRTC read cannot be read again", h.path) from None
        if content_digest(data) != h.digest:
            raise Uncacheable(f"header {h.path} changed while it was read")
        read.add((st.st_dev, st.st_ino))
        texts.append((os.path.dirname(h.path), data))
    wrappers: set[bytes] = set()
    for _d, data in texts:
        if b"__has_include" in data:
            wrappers |= _wrappers(data.replace(b"\\\r\n", b"").replace(b"\\\n", b""))
    pre = as_list(getattr(options, "pre_include", None))
    lookups: set[tuple[str | None, str, str]] = {(None, QUOTED, p) for p in pre if not os.path.isabs(p)}
    for includer, data in texts:
        try:
            lookups.update((includer, kind, name) for kind, name in directives(data, wrappers))
        except Computed as exc:
            computed = computed or str(exc)
    local: dict[str, bool] = {}
    for includer, kind, name in lookups:
        if os.path.isabs(name):
            continue
        order = [includer] if includer is not None and kind == QUOTED else []
        order.extend(search.dirs)
        for d in order:
            path = os.path.join(d, name)
            state, identity = _state(path)
            if state == "absent":
                if _trusted(path, local):
                    absent.add(path)
                else:
                    dirs.add(os.path.dirname(path))
                continue
            # A header read, by the path NVRTC named (another name of the same file, such as a
            # hard link made during the compile, is not proof that NVRTC found it there).
            if state == "file" and identity in read and path in read_paths:
                if kind == NEXT:
                    continue  # #include_next: later directories may have been searched too
                break
            # No regular file, or one NVRTC did not read there: its directory's entries decide.
            dirs.add(os.path.dirname(path))
            if state == "file" and kind != NEXT:
                break
    if computed is not None:
        _log.debug("cuda-program-cas: front door: %s: directories guarded instead of names", computed)
        dirs.update(g for g, _key in guard_dirs([h.path for h in headers], search.dirs))
    return sorted(absent), dir_guards(dirs)


def _state(path: str) -> tuple[str, tuple[int, int] | None]:
    """``absent``, ``file`` (a regular one, with its device and inode), ``other`` or ``unknown``."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return ("absent" if exc.errno in ABSENT_ERRNOS else "unknown"), None
    except ValueError:
        return "unknown", None
    return ("file", (st.st_dev, st.st_ino)) if stat.S_ISREG(st.st_mode) else ("other", None)


def _trusted(path: str, local: dict[str, bool]) -> bool:
    """Whether an absence at ``path`` is seen at once: its deepest existing directory's file system is local."""
    probe = os.path.dirname(path)
    while True:
        known = local.get(probe)
        if known is not None:
            return known
        try:
            os.stat(probe)
        except OSError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return False
            probe = parent
            continue
        trusted = local[probe] = fs_type(probe) in STAT_RELIABLE
        return trusted
