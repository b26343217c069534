"""The front door: ``cache.compile(...)``, for the compiles ``Program.compile(cache=)`` refuses.

``Program.compile(cache=...)`` refuses compiles that read headers through
``include_path``/``pre_include`` (or a source name with a directory) unless the
caller fingerprints them by hand, and refuses ``name_expressions`` outright. This
module caches both, in the manner of ccache's direct mode:

- The *record* of a compile is keyed by its inputs without header contents
  (``make_program_cache_key`` over the code, options, target and name
  expressions, with this module's tag as ``extra_digest``). It lists, for each
  of the last few compiles of those inputs (a *variant*), every file the compile
  read (path, size, mtime, ctime, inode, blake3) and *guard directories*: for
  each header, the directories an earlier include directory would have had to
  hold it in, so that a new header that would now be found first is seen (a
  directory's mtime changes when an entry is added, removed or renamed).
- A lookup checks each variant: the guards must be unchanged, and each header is
  re-hashed only when its stat changed (a per-process stat cache spares even
  that). The *result key* is derived from the record key and the header contents;
  under it is the raw binary (the same blob ``Program.compile(cache=)`` stores
  for equal bytes). The variant also keeps the ``ObjectCode`` name and the symbol
  mapping of the name expressions.
- A miss compiles uncached. With NVRTC 13 or later the compile runs with
  ``fdevice_time_trace``, whose JSON lists every header NVRTC read (the binary is
  the same with and without it); before 13, every file under the include
  directories is fingerprinted instead. A header whose ctime is not older than
  the compile's start may have changed while NVRTC read it: the result is
  returned but not stored.

Records and results are ordinary entries of the cache (under keys of
their own), so eviction, ``gc``, ``verify``, ``stats`` and ``publish`` treat
them like any other, and a node of a cluster finds them in a shared store. A
node whose headers have the same bytes at the same paths hits; where the paths
differ, the record lists paths that do not exist there, and it misses (and
records its own variant).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from blake3 import blake3

from ._files import FileId, file_id
from ._store import CacheStore

__all__ = ["FrontDoor"]

_log = logging.getLogger("cas")

#: Mixed into the record key: a new format of records gets new keys.
_TAG = b"cuda-program-cas front door 2"
_RECORD = b"cpcas-frontdoor/record\0"
_RESULT = b"cpcas-frontdoor/result\0"
#: Record keys remembered per front door (inputs met before in this process).
_MAX_MEMO = 1024
#: Variants kept per record (compiles of the same inputs against other headers).
_MAX_VARIANTS = 4
#: Before NVRTC 13, the include trees are fingerprinted: at most this many files.
_MAX_TREE_FILES = 50_000
#: Options whose effect the front door cannot key soundly, and why.
_REFUSED = {
    "pch": "precompiled headers are written and read outside what a key can see",
    "use_pch": "the precompiled header file is read outside what a key can see",
    "pch_dir": "precompiled headers are read and written outside what a key can see",
    "create_pch": "it writes a file, which a cache hit would not",
    "time": "it writes a timing file, which a cache hit would not",
    "fdevice_time_trace": "it writes a trace file, which a cache hit would not (the front door traces on its own)",
}


class _HeaderCache:
    """Headers' identities and digests, per process: a hit re-hashes nothing it already hashed."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[FileId, str]] = {}
        self._lock = threading.Lock()

    def digest(self, path: str, st: os.stat_result, recorded: tuple[FileId, str] | None = None) -> str | None:
        """blake3 of the file at ``path`` whose stat is ``st``; None when it changed while read."""
        key = file_id(st)
        known = self._known.get(path)
        if known is not None and known[0] == key:
            return known[1]
        if recorded is not None and recorded[0] == key:
            digest = recorded[1]
        else:
            hashed = _hash_file(path, key)
            if hashed is None:
                return None
            digest = hashed
        with self._lock:
            self._known[path] = (key, digest)
        return digest


def _hash_file(path: str, key: FileId) -> str | None:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
            if file_id(os.fstat(fh.fileno())) != key:
                return None
    except OSError:
        return None
    return blake3(data).hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class _Header:
    path: str
    stat: FileId
    digest: str

    def as_json(self) -> list[object]:
        return [self.path, *self.stat, self.digest]


@dataclasses.dataclass(frozen=True, slots=True)
class _Guard:
    """A directory whose entries decide which file an include finds; ``stat`` None: it was missing."""

    path: str
    stat: tuple[int, int] | None

    def as_json(self) -> list[object]:
        return [self.path, *(self.stat or ())]


def _dir_stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_ctime_ns) if stat.S_ISDIR(st.st_mode) else None


@functools.cache
def _cuda_core() -> tuple[Any, Any, Any, Any]:
    """``ObjectCode``, ``Program``, ``ProgramOptions``, ``make_program_cache_key``, imported once."""
    from cuda.core import ObjectCode, Program, ProgramOptions
    from cuda.core.utils import make_program_cache_key

    return ObjectCode, Program, ProgramOptions, make_program_cache_key


class FrontDoor:
    """``compile(...)`` over one :class:`cas.CacheStore`."""

    def __init__(self, store: CacheStore) -> None:
        self._store = store
        self._headers = _HeaderCache()
        #: What make_program_cache_key returned for inputs met before (see _memo_key).
        self._record_keys: dict[tuple[object, ...], bytes] = {}
        #: The last record's bytes and its decoded variants.
        self._decoded: tuple[bytes, list[dict[str, Any]]] | None = None

    def compile(
        self,
        code: str | bytes,
        code_type: str,
        options: Any,
        target_type: str,
        *,
        name_expressions: Sequence[str | bytes] = (),
        logs: Any = None,
    ) -> Any:
        ObjectCode, Program, ProgramOptions, make_program_cache_key = _cuda_core()
        if options is None:
            options = ProgramOptions()
        if not isinstance(options, ProgramOptions):
            raise TypeError(f"options must be a cuda.core.ProgramOptions or None, got {type(options).__name__}")
        name_expressions = tuple(name_expressions)
        _refuse_unkeyable(options, code_type)
        extra = _TAG + _libdevice_fingerprint(options, code_type)
        memo = _memo_key(code, code_type, options, target_type, names=name_expressions, extra=extra)
        record_key = self._record_keys.get(memo) if memo is not None else None
        if record_key is None:
            # make_program_cache_key validates the rest as Program would (code and
            # target types, name expressions: bytearray is refused).
            record_key = make_program_cache_key(
                code=code,
                code_type=code_type,
                options=options,
                target_type=target_type,
                name_expressions=name_expressions,
                extra_digest=extra,
            )
            if memo is not None:
                if len(self._record_keys) >= _MAX_MEMO:
                    self._record_keys.clear()
                self._record_keys[memo] = record_key
        found = self._lookup(record_key, target_type)
        if found is not None:
            data, name, mapping = found
            return _object_code(ObjectCode, data, target_type, name, mapping)

        if self._store.read_only:
            # A read-only cache is never written: compile, return, store nothing.
            return Program(code, code_type, options=options).compile(target_type, name_expressions, logs)
        dirs = _search_dirs(options)
        started_ns = _fs_clock(self._store.layout.tmp)
        traced = None
        if code_type == "c++" and _nvrtc_major() >= 13:
            trace_dir = tempfile.mkdtemp(prefix="cpcas-trace-")
            traced = os.path.join(trace_dir, "trace")
            compile_options = dataclasses.replace(options, fdevice_time_trace=traced)
        else:
            trace_dir = None
            compile_options = options
        try:
            result = Program(code, code_type, options=compile_options).compile(target_type, name_expressions, logs)
            if code_type != "c++":
                paths: list[str] | None = []
            elif traced is not None:
                paths = _traced_headers(traced + ".json")
            else:
                paths = None
            if paths is None:
                paths = _tree_files(dirs)
        finally:
            if trace_dir is not None:
                shutil.rmtree(trace_dir, ignore_errors=True)
        if paths is None:
            _log.debug("cuda-program-cas: front door: the headers of a compile could not be listed; not stored")
            return result
        paths = sorted({*paths, *_pre_includes(options)})
        headers = self._read_headers(paths, started_ns)
        if headers is None:
            _log.debug("cuda-program-cas: front door: a header changed while it was compiled; not stored")
            return result
        guards = _guards(headers, dirs)
        result_key = _result_key(record_key, [(h.path, h.digest) for h in headers])
        mapping = dict(result.symbol_mapping) if name_expressions else {}
        stored = self._store.put(_RESULT + result_key, bytes(result.code))
        if stored:
            self._remember(record_key, headers, guards, result_key, name=result.name, mapping=mapping)
        return result

    # -- lookups ---------------------------------------------------------------------

    def _lookup(self, record_key: bytes, target_type: str) -> tuple[bytes, str, dict[Any, bytes]] | None:
        raw = self._store.get(_RECORD + record_key)
        if raw is None:
            return None
        # A record served from memory is the same bytes object as before: decode it once.
        decoded = self._decoded
        if decoded is not None and decoded[0] is raw:
            variants = decoded[1]
        else:
            variants = _decode_record(raw)
            self._decoded = (raw, variants)
        for variant in variants:
            result_key = self._check(record_key, variant)
            if result_key is None:
                continue
            meta = _variant_meta(variant)
            if meta is None:
                continue
            data = self._store.get(_RESULT + result_key)
            if data is None:
                continue
            return data, meta[0], meta[1]
        _log.debug("cuda-program-cas: front door miss: a header changed (%d variants checked)", len(variants))
        return None

    def _check(self, record_key: bytes, variant: dict[str, Any]) -> bytes | None:
        """The result key of ``variant`` when its guards and headers still hold, else None."""
        try:
            for path, *rest in variant["guards"]:
                if _dir_stat(path) != (tuple(rest) or None):
                    return None
            found = []
            header_digest = self._headers.digest
            for path, dev, ino, size, mtime, ctime, digest in variant["headers"]:
                try:
                    st = os.stat(path)
                except OSError:
                    return None  # deleted, or its directory is gone
                now = header_digest(path, st, ((dev, ino, size, mtime, ctime), digest))
                if now is None:
                    return None
                found.append((path, now))
        except (KeyError, TypeError, ValueError):
            return None  # a record of another shape: a miss
        return _result_key(record_key, found)

    # -- misses ----------------------------------------------------------------------

    def _read_headers(self, paths: list[str], started_ns: int) -> list[_Header] | None:
        headers = []
        for path in paths:
            try:
                st = os.stat(path)
            except OSError:
                return None
            if not stat.S_ISREG(st.st_mode) or st.st_ctime_ns >= started_ns:
                return None  # changed since the compile began: NVRTC may have read other bytes
            digest = self._headers.digest(path, st)
            if digest is None:
                return None
            headers.append(_Header(path, file_id(st), digest))
        return headers

    def _remember(
        self,
        record_key: bytes,
        headers: list[_Header],
        guards: list[_Guard],
        result_key: bytes,
        *,
        name: str,
        mapping: dict[Any, bytes],
    ) -> None:
        raw = self._store.get(_RECORD + record_key)
        variants = [] if raw is None else _decode_record(raw)
        new = {
            "result": result_key.hex(),
            "headers": [h.as_json() for h in headers],
            "guards": [g.as_json() for g in guards],
            **_encode_meta(name, mapping),
        }
        kept = [new, *(v for v in variants if v.get("result") != new["result"])][:_MAX_VARIANTS]
        body = json.dumps({"v": 2, "variants": kept}, separators=(",", ":")).encode()
        self._store.put(_RECORD + record_key, body)


# -- inputs -------------------------------------------------------------------------------


def _memo_key(
    code: object, code_type: str, options: Any, target_type: str, *, names: tuple[object, ...], extra: bytes
) -> tuple[object, ...] | None:
    """What make_program_cache_key reads of a C++ compile, cheaply; None where no memo is kept.

    For NVRTC its key is a hash of the code, code and target types, the options'
    flags (``ProgramOptions.as_bytes("nvrtc", target)``, 3 us against its 25),
    the name expressions, ``extra_digest`` and the NVRTC version, which cannot
    change in a process; it refuses ``extra_sources``. Equal memo keys within a
    process therefore mean equal record keys. Other code types, and inputs it
    would refuse, always go to make_program_cache_key.
    """
    if not isinstance(code_type, str) or code_type.lower() != "c++" or not isinstance(target_type, str):
        return None
    if not isinstance(code, (str, bytes)) or getattr(options, "extra_sources", None) is not None:
        return None
    if not all(type(n) is str or type(n) is bytes for n in names):
        return None
    try:
        flags = tuple(options.as_bytes("nvrtc", target_type.lower()))
    except Exception:
        return None  # make_program_cache_key reports what is wrong
    return (code, target_type.lower(), flags, tuple((type(n) is bytes, n) for n in names), extra)


def _option_set(options: Any, name: str) -> bool:
    value = getattr(options, name, None)
    return bool(value) if name == "pch" else value is not None


def _refuse_unkeyable(options: Any, code_type: str) -> None:
    for name, why in _REFUSED.items():
        if _option_set(options, name):
            raise ValueError(f"cache.compile() does not support ProgramOptions.{name}: {why}")
    if code_type == "nvvm" and getattr(options, "use_libdevice", None) and _libdevice_path() is None:
        raise ValueError(
            "cache.compile() does not support ProgramOptions.use_libdevice here: the libdevice file that "
            "would be linked cannot be found, so it cannot be fingerprinted"
        )


def _libdevice_path() -> str | None:
    try:
        from cuda.core._program import _find_libdevice_path
    except ImportError:
        return None
    try:
        path = _find_libdevice_path()
    except Exception:
        return None
    return os.fspath(path) if path else None


def _libdevice_fingerprint(options: Any, code_type: str) -> bytes:
    """The libdevice file's blake3, for NVVM compiles that link it (its bytes change the output)."""
    if code_type != "nvvm" or not getattr(options, "use_libdevice", None):
        return b""
    path = _libdevice_path()
    assert path is not None  # refused above otherwise
    with open(path, "rb") as fh:
        return b"\0libdevice:" + blake3(fh.read()).hexdigest().encode()


def _as_list(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)]
    return [os.fspath(v) for v in value]  # type: ignore[attr-defined]


def _search_dirs(options: Any) -> list[str]:
    """Where quoted and angled includes are looked for, in order: the source's directory, then include_path."""
    dirs = []
    name = getattr(options, "name", None)
    if isinstance(name, str) and ("/" in name or os.sep in name):
        dirs.append(os.path.dirname(os.path.abspath(name)))
    dirs.extend(os.path.abspath(d) for d in _as_list(getattr(options, "include_path", None)))
    return dirs


def _pre_includes(options: Any) -> list[str]:
    return [os.path.abspath(p) for p in _as_list(getattr(options, "pre_include", None))]


def _nvrtc_major() -> int:
    try:
        from cuda.bindings import nvrtc

        _err, major, _minor = nvrtc.nvrtcVersion()
        return int(major)
    except Exception:
        return 0


def _fs_clock(directory: str) -> int:
    """The file system's clock now (see :func:`cas._files.fs_now`), or the process clock less a tick."""
    from ._files import fs_now

    now = fs_now(directory)
    return now if now is not None else time.time_ns() - 50_000_000


def _traced_headers(trace_path: str) -> list[str] | None:
    """The absolute paths of the headers NVRTC's time trace says it processed."""
    try:
        with open(trace_path, "rb") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        return None
    paths = set()
    for event in events:
        if isinstance(event, dict) and event.get("name") == "Processing Header File":
            detail = (event.get("args") or {}).get("detail")
            if isinstance(detail, str) and os.path.isabs(detail):  # NVRTC's builtin headers have no path
                paths.add(os.path.normpath(detail))
    return sorted(paths)


def _tree_files(dirs: list[str]) -> list[str] | None:
    """Every regular file under ``dirs`` (NVRTC before 13 cannot say what it read); None past the limit."""
    found: list[str] = []
    for top in dirs:
        for dirpath, _subdirs, files in os.walk(top):
            found.extend(os.path.join(dirpath, f) for f in files)
            if len(found) > _MAX_TREE_FILES:
                return None
    return found


def _guards(headers: list[_Header], dirs: list[str]) -> list[_Guard]:
    """The directories whose entries decide where each header is found (see the module docstring)."""
    wanted: set[str] = set()
    for header in headers:
        for i, top in enumerate(dirs):
            if header.path.startswith(top + os.sep):
                sub = os.path.dirname(header.path[len(top) + 1 :])
                wanted.update(os.path.join(earlier, sub) if sub else earlier for earlier in dirs[: i + 1])
                break
        else:
            wanted.add(os.path.dirname(header.path))
    guards = {}
    for path in wanted:
        # A directory that does not exist is guarded by its deepest existing ancestor:
        # creating it changes that ancestor's entries.
        probe = path
        while True:
            st = _dir_stat(probe)
            if st is not None or os.path.dirname(probe) == probe:
                guards[probe] = _Guard(probe, st)
                break
            probe = os.path.dirname(probe)
        if probe != path:
            guards[path] = _Guard(path, None)
    return [guards[p] for p in sorted(guards)]


def _result_key(record_key: bytes, headers: list[tuple[str, str]]) -> bytes:
    """The key of a compile's result: its record key and each header's ``(path, digest)``."""
    h = hashlib.sha256(record_key)
    for path, digest in sorted(headers):
        h.update(b"\0" + path.encode("utf-8", "surrogateescape") + b"\0" + digest.encode())
    return h.digest()


# -- stored forms -------------------------------------------------------------------------


def _decode_record(raw: bytes) -> list[dict[str, Any]]:
    try:
        data = json.loads(raw)
    except ValueError:
        return []
    if not isinstance(data, dict) or data.get("v") != 2 or not isinstance(data.get("variants"), list):
        return []
    return [v for v in data["variants"] if isinstance(v, dict)]


def _encode_meta(name: str, mapping: dict[Any, bytes]) -> dict[str, Any]:
    """A variant's ``name`` and ``symbols`` (the ObjectCode name, the symbol mapping) as JSON values."""
    symbols = []
    for key, lowered in mapping.items():
        kind, text = ("b", key.hex()) if isinstance(key, bytes) else ("s", key)
        value = lowered if isinstance(lowered, bytes) else str(lowered).encode()
        symbols.append([kind, text, value.hex()])
    return {"name": name, "symbols": symbols}


def _variant_meta(variant: dict[str, Any]) -> tuple[str, dict[Any, bytes]] | None:
    """The ObjectCode name and symbol mapping a variant keeps; None when they are damaged."""
    try:
        mapping: dict[Any, bytes] = {}
        for kind, text, value in variant["symbols"]:
            key = bytes.fromhex(text) if kind == "b" else text
            mapping[key] = bytes.fromhex(value)
        return str(variant["name"]), mapping
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _object_code(object_code: Any, data: bytes, target_type: str, name: str, mapping: dict[Any, bytes]) -> Any:
    make = {"cubin": object_code.from_cubin, "ptx": object_code.from_ptx, "ltoir": object_code.from_ltoir}[target_type]
    return make(data, name=name, symbol_mapping=mapping or None)
