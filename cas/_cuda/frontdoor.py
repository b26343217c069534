"""The front door: ``cache.compile(...)``, for the compiles ``Program.compile(cache=)`` refuses.

``Program.compile(cache=...)`` refuses compiles that read headers through
``include_path``/``pre_include`` (or a source name with a directory) unless the
caller fingerprints them by hand, and refuses ``name_expressions`` outright. This
module caches both, in the manner of ccache's direct mode.

The *record* of a compile is keyed by its inputs without header contents
(``make_program_cache_key`` over the code, options, target and name expressions,
with this module's tag as ``extra_digest``). When a relative name can decide
which file NVRTC opens, or the binary's debug information names the directory,
the working directory is part of that key too: two projects with the same
relative paths never share a record. A record lists, for each of the last few
compiles of those inputs (a *variant*):

- every file NVRTC read: the name its time trace gives, resolved against the
  compile's working directory exactly as the kernel resolved it (symlinks and
  ``..`` included), with its blake3 and a tag of its stat data;
- *guard directories*: for each header, the directories an earlier search
  location would have had to hold it in, so that a new header that would now be
  found first is seen (a directory's mtime changes when an entry is added,
  removed or renamed; its identity changes when a symlink to it moves).

A name that cannot be resolved to one regular file makes the compile
uncacheable: it returns its program, stores nothing, counts a dropped write and
logs one WARNING per process naming the header. NVRTC's own builtin header is
the one name it reads from memory.

A lookup checks the variants, newest first: the guards must be unchanged, and
each header is re-hashed only when its stat changed (a per-process stat cache
spares even that). From a variant's second look in a process, inotify watches are
armed before that check, and while they report nothing a look costs one read of
their queue instead of a stat per header (:mod:`cuda_program_cas._cuda.watch`).
The variant names its *result*: the raw binary (the same blob
``Program.compile(cache=)`` stores for equal bytes), with the ``ObjectCode``
name and the symbol mapping of the name expressions kept in the variant. A
record and its results share a group of key ids (:mod:`cuda_program_cas.index`), so
eviction and ``gc`` keep or remove them together. One ``compile`` counts one hit
or one miss, whatever it looked up.

A miss first takes the claim on the record key (:meth:`CacheStore.claim`): of the
processes of a node that miss the same inputs at once, one compiles and the others
wait, then look the record up again and hit.

A miss compiles uncached. With NVRTC 13 or later the compile runs with
``fdevice_time_trace``, whose JSON lists every header NVRTC read (the binary is
the same with and without it). Before 13, every file under the search
directories is fingerprinted instead. A header whose ctime is not older than the
compile's start may have changed while NVRTC read it: the result is returned but
not stored.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import stat
import struct
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from blake3 import blake3

from cuda_program_cas._base.fork import after_fork
from cuda_program_cas._base.log import LOGGER as _log
from cuda_program_cas._disk.files import FileId, file_id
from cuda_program_cas._store.store import CacheStore
from cuda_program_cas.index import grouped_id

from .tracedirs import new_trace_dir  # a SIGKILLed miss leaves its folder: the next process's sweeps it

if TYPE_CHECKING:
    from .watch import Token

__all__ = ["FrontDoor", "may_include_quoted", "refuse_unkeyable"]

_perf_ns = time.perf_counter_ns
_monotonic = time.monotonic

#: Mixed into the record key: a new format of records gets new keys.
_TAG = b"cuda-program-cas front door 4"
_RECORD = b"cpcas-frontdoor/record\0"
_RESULT = b"cpcas-frontdoor/result\0"
_KEY = b"cpcas-frontdoor/key\0"
#: Record keys remembered per front door (inputs met before in this process).
_MAX_MEMO = 1024
#: Variants kept per record (compiles of the same inputs against other headers).
_MAX_VARIANTS = 4
#: Records kept decoded per front door, with what this process proved of their variants.
_MAX_DECODED = 256
#: A variant that could not be watched (a full watch table, NFS...) is armed again after this long.
_REARM_S = 10.0
#: Before NVRTC 13, the include trees are fingerprinted: at most this many files.
_MAX_TREE_FILES = 50_000
#: Hex digits kept of a header's blake3 (128 bits) and of a stat tag (64 bits).
_DIGEST_HEX = 32
_TAG_HEX = 16
#: Headers NVRTC reads from memory: their name in the trace is no file.
_BUILTIN_HEADERS = frozenset({"__nv_nvrtc_builtin_header.h"})
#: Flags whose output names the working directory (debug information, line tables).
_DEBUG_FLAG = re.compile(rb"debug|line-?info|^-G$")
#: Options whose effect the front door cannot key soundly, and why.
_REFUSED = {
    "pch": "precompiled headers are written and read outside what a key can see",
    "use_pch": "the precompiled header file is read outside what a key can see",
    "pch_dir": "precompiled headers are read and written outside what a key can see",
    "create_pch": "it writes a file, which a cache hit would not",
    "time": "it writes a timing file, which a cache hit would not",
    "fdevice_time_trace": "it writes a trace file, which a cache hit would not (the front door traces on its own)",
}
#: Header names already warned about as uncacheable in this process.
_warned: set[str] = set()


def _digest(data: bytes) -> str:
    return blake3(data).hexdigest()[:_DIGEST_HEX]


def _stat_tag(values: tuple[int, ...]) -> str:
    """A short, stable tag of stat fields: equal tags mean (almost surely) the same fields.

    blake2b of 64 bits, not blake3: 0.6 us a tag against 2.3 (Python's object set-up
    dominates at 40 bytes), and a fresh process's first hit of the CUB kernel makes 467.
    A copy of a prepared hasher and a prepared packing: 0.35 us against 0.84.
    """
    h = _TAG_HASH.copy()
    h.update(_PACK5(*values) if len(values) == 5 else struct.pack(f"<{len(values)}q", *values))
    return h.hexdigest()


_TAG_HASH = hashlib.blake2b(digest_size=_TAG_HEX // 2)
_PACK5 = struct.Struct("<5q").pack


class _HeaderCache:
    """Headers' identities and digests, per process: a hit re-hashes nothing it already hashed."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[FileId, str]] = {}
        self._lock = threading.Lock()
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # another thread of the parent may have held it

    @property
    def known(self) -> dict[str, tuple[FileId, str]]:
        """What this process learnt, by path: the file's identity and its digest (read without the lock)."""
        return self._known

    def learn(self, learnt: dict[str, tuple[FileId, str]]) -> None:
        """Enter identities and digests proved elsewhere (a record's stat tags that still hold)."""
        if learnt:
            with self._lock:
                self._known.update(learnt)

    def digest(self, path: str, st: os.stat_result, recorded: tuple[str, str] | None = None) -> str | None:
        """blake3 of the file at ``path`` whose stat is ``st``; None when it changed while read.

        ``recorded``: the stat tag and digest a record keeps for it; a file whose
        stat still has that tag is not read again.
        """
        key = file_id(st)
        known = self._known.get(path)
        if known is not None and known[0] == key:
            return known[1]
        if recorded is not None and _stat_tag(key) == recorded[0]:
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
    return _digest(data)


def _dir_tag(path: str) -> str | None:
    """A directory's identity and entry times as a tag; None when it is missing or not a directory."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    return _stat_tag((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns))


# Plain slotted classes, not dataclasses: the decorator costs about 1 ms a class at import,
# a fifth of a fresh process's first hit.


class _Header:
    __slots__ = ("digest", "path", "tag")

    def __init__(self, path: str, tag: str, digest: str) -> None:
        self.path, self.tag, self.digest = path, tag, digest


class _Variant:
    """One compile of a record's inputs, decoded for checking."""

    __slots__ = ("guards", "headers", "mapping", "name", "result")

    def __init__(
        self,
        result: str,
        name: str,
        mapping: dict[Any, bytes],
        headers: tuple[tuple[str, str, str], ...],
        guards: tuple[tuple[str, str | None], ...],
    ) -> None:
        self.result, self.name, self.mapping, self.headers, self.guards = result, name, mapping, headers, guards


class _Proof:
    """What this process proved of one variant: a stat check passed, then a watch armed before one."""

    __slots__ = ("retry_at", "seen", "token")

    def __init__(self) -> None:
        self.seen = False
        self.token: Token | None = None
        self.retry_at = 0.0


class _Uncacheable(Exception):
    """A compile whose inputs cannot be recorded soundly: its result is returned, not stored."""

    def __init__(self, reason: str, name: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.name = name


@functools.cache
def _cuda_core() -> tuple[Any, Any, Any, Any]:
    """``ObjectCode``, ``Program``, ``ProgramOptions``, ``make_program_cache_key``, imported once."""
    from cuda.core import ObjectCode, Program, ProgramOptions
    from cuda.core.utils import make_program_cache_key

    return ObjectCode, Program, ProgramOptions, make_program_cache_key


class FrontDoor:
    """``compile(...)`` over one :class:`cuda_program_cas.CacheStore`."""

    def __init__(self, store: CacheStore) -> None:
        self._store = store
        self._headers = _HeaderCache()
        #: What make_program_cache_key returned for inputs met before (see _memo_key).
        self._record_keys: dict[tuple[object, ...], bytes] = {}
        #: Per record key id met: its bytes, its decoded variants and what this process proved of each.
        self._decoded: dict[str, tuple[bytes, list[_Variant], list[_Proof]]] = {}
        #: Lookups the watch answered without a stat (see cuda_program_cas._cuda.watch).
        self.watched_hits = 0

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
        t0 = _perf_ns()
        try:
            flags = _nvrtc_flags(options, target_type)
            search = _Search.of(code, code_type, options, flags)
        except _Uncacheable as exc:
            # No working directory to resolve names against (it was removed): compile as Program would.
            self._uncacheable(exc, None)
            return Program(code, code_type, options=options).compile(target_type, name_expressions, logs)
        extra = _TAG + _libdevice_fingerprint(options, code_type) + search.key_part() + _name_part(options)
        memo = _memo_key(code, code_type, options, target_type, flags, names=name_expressions, extra=extra)
        # A C++ compile is keyed here, with NVRTC's version from its record (see
        # nvrtcver): a hit need not load NVRTC. Others go to make_program_cache_key.
        # make_program_cache_key validates the inputs as Program would (code and target
        # types, name expressions: bytearray is refused), loading NVRTC to key them.
        cuda_core_key = functools.partial(
            make_program_cache_key,
            code=code,
            code_type=code_type,
            options=options,
            target_type=target_type,
            name_expressions=name_expressions,
            extra_digest=extra,
        )
        nvrtc = _nvrtc_version(self._store) if memo is not None else None
        record_key = self._record_keys.get((memo, nvrtc)) if memo is not None else None
        if record_key is None:
            if memo is not None:
                record_key = _own_key(memo, nvrtc)
                if len(self._record_keys) >= _MAX_MEMO:
                    self._record_keys.clear()
                self._record_keys[(memo, nvrtc)] = record_key
            else:
                record_key = cuda_core_key()
        record_kid = grouped_id(record_key, None)
        found = self._lookup(record_kid, record_key)
        if isinstance(found, tuple):
            data, variant, shared = found
            self._store.note_hit(record_kid, shared, t0_ns=t0)
            return _object_code(ObjectCode, data, target_type, variant.name, variant.mapping)
        if memo is not None:
            # Keyed here: a miss has make_program_cache_key check the inputs (it loads NVRTC,
            # which the compile does anyway), so a bad input gets the error it always got.
            cuda_core_key()
        if self._store.read_only:
            # A read-only cache is never written: compile, return, count the write it drops.
            self._store.note_miss(record_kid, found, t0_ns=t0)
            result = Program(code, code_type, options=options).compile(target_type, name_expressions, logs)
            self._store.note_dropped(record_kid, "read-only cache")
            return result
        # One process of the node compiles these inputs; the others wait for its record.
        with self._store.claim(record_kid) as claim:
            if claim.held or claim.waited:
                # Stored meanwhile, by the claimant waited for or one that let go just before.
                found = self._lookup(record_kid, record_key)
                if isinstance(found, tuple):
                    data, variant, shared = found
                    self._store.note_hit(record_kid, shared, t0_ns=t0, waited=claim.waited)
                    return _object_code(ObjectCode, data, target_type, variant.name, variant.mapping)
            self._store.note_miss(record_kid, found, t0_ns=t0)
            return self._compile(
                code,
                code_type,
                options,
                target_type,
                expressions=name_expressions,
                logs=logs,
                search=search,
                key=record_key,
                nvrtc=nvrtc,
            )

    def _compile(
        self,
        code: str | bytes,
        code_type: str,
        options: Any,
        target_type: str,
        *,
        expressions: tuple[Any, ...],
        logs: Any,
        search: _Search,
        key: bytes,
        nvrtc: str | None,
    ) -> Any:
        """A miss: compile uncached, record the headers it read, store the result and the record.

        ``nvrtc``: the version the key holds, when keyed here; a compile by another
        NVRTC (its file replaced since the key was made) is returned, not stored.
        """
        _ObjectCode, Program, ProgramOptions, _key = _cuda_core()
        name_expressions, record_key = expressions, key
        record_kid = grouped_id(record_key, None)
        started_ns = _fs_clock(self._store.layout.tmp)
        traced = code_type == "c++" and _nvrtc_major() >= 13
        trace_dir = new_trace_dir() if traced else None
        trace = os.path.join(trace_dir, "trace") if trace_dir is not None else ""
        # Traced here unless an earlier traced compile of this process failed (see _TRACES).
        here = traced and _TRACES.sound
        compile_options = _with_trace(options, trace) if here else options
        try:
            try:
                compile_t0 = time.perf_counter()
                result = Program(code, code_type, options=compile_options).compile(target_type, name_expressions, logs)
                compile_s = time.perf_counter() - compile_t0
            except BaseException:
                if here:
                    _TRACES.sound = False
                    _end_nvrtc_tracing(Program, ProgramOptions)
                raise
            try:
                if code_type != "c++":
                    paths: list[str] = []
                elif traced:
                    names = _traced_names(trace + ".json") if here else None
                    if names is None:
                        if here:
                            _TRACES.sound = False  # another library's traced compile may have failed
                        names = _trace_in_child(code, code_type, options, target_type, name_expressions, trace=trace)
                    paths = search.resolve(names)
                else:
                    paths = _tree_files(search.dirs)
                paths = sorted({*paths, *search.pre_includes})
                headers = self._read_headers(paths, started_ns)
                if nvrtc is not None and _loaded_nvrtc_version() != nvrtc:
                    raise _Uncacheable(f"NVRTC {_loaded_nvrtc_version()} compiled it, not NVRTC {nvrtc} of its key")
            except _Uncacheable as exc:
                self._uncacheable(exc, record_kid)
                return result
        finally:
            if trace_dir is not None:
                shutil.rmtree(trace_dir, ignore_errors=True)
        guards = _guards([h.path for h in headers], search.dirs)
        result_key = _result_key(record_key, [(h.path, h.digest) for h in headers])
        mapping = dict(result.symbol_mapping) if name_expressions else {}
        stored = self._store.put_id(grouped_id(record_key, result_key), bytes(result.code))
        if stored:
            self._remember(record_key, headers, guards, result_key, name=result.name, mapping=mapping)
            if nvrtc is not None:
                _remember_nvrtc(self._store)  # a hit of the next process need not load NVRTC
            from .inputs import describe

            try:  # the journal never costs a compile its result
                inputs = describe(
                    code,
                    code_type,
                    options,
                    target_type,
                    name_expressions,
                    nvrtc=nvrtc or _loaded_nvrtc_version(),
                    cwd=search.cwd,
                    headers={h.path: h.digest[:12] for h in headers},
                )
            except Exception as exc:
                _log.debug("cuda-program-cas: front door: inputs not journaled: %r", exc)
            else:
                self._store.note_compiled(record_kid, compile_s, "front", inputs)
        return result

    def _uncacheable(self, exc: _Uncacheable, record_kid: str | None) -> None:
        """Count and report a compile whose result cannot be stored soundly (one WARNING per header)."""
        self._store.note_dropped(record_kid, exc.reason)
        if exc.name is not None and exc.name not in _warned:
            _warned.add(exc.name)
            _log.warning("cuda-program-cas: front door: %s; such compiles are not cached", exc.reason)

    # -- lookups ---------------------------------------------------------------------

    def _lookup(self, record_kid: str, record_key: bytes) -> tuple[bytes, _Variant, str | None] | str:
        """``(bytes, variant, shared store or None)`` of a hit, else why it missed."""
        found = self._store.find(record_kid)
        if found is None:
            return "new inputs: no record of them"
        raw, shared = found
        # Decode a record once, and keep what this process proved of its variants (see _Proof)
        # while its bytes stay the same: compared, not only by identity, since the record read
        # back from disk after this process stored it is another object (2 us for 42 KB).
        decoded = self._decoded.get(record_kid)
        if decoded is None or (decoded[0] is not raw and decoded[0] != raw):
            if len(self._decoded) >= _MAX_DECODED:
                self._decoded.clear()
            variants = _decode_record(raw)
            decoded = self._decoded[record_kid] = (raw, variants, [_Proof() for _ in variants])
        why = None  # the newest variant's reason
        for variant, proof in zip(decoded[1], decoded[2], strict=True):
            changed = self._proven(variant, proof)
            if changed is None:
                data = self._store.find(grouped_id(record_key, bytes.fromhex(variant.result)))
                if data is not None:
                    return data[0], variant, data[1] if data[1] is not None else shared
                changed = "the result of a matching variant is gone"
            why = why or changed
        return why or "the record is damaged or of another format"

    def _proven(self, variant: _Variant, proof: _Proof) -> str | None:
        """:meth:`_check`, or nothing at all while the watch proves the variant unchanged since it last held."""
        token = proof.token
        if token is not None:
            if token.clean():
                self.watched_hits += 1
                return None
            proof.token = None
        if not proof.seen:
            # The first look in this process: the stat check alone. A job looks each kernel up
            # once, so arming (about as costly again) waits for the second look.
            changed = self._check(variant)
            proof.seen = changed is None
            return changed
        now = _monotonic()
        if now < proof.retry_at:
            return self._check(variant)
        from .watch import arm

        # Armed before the check: a change after it raises an event, one before it fails the check.
        token = arm([h[0] for h in variant.headers], [g[0] for g in variant.guards])
        changed = self._check(variant)
        if token is None:
            proof.retry_at = now + _REARM_S  # it could not be watched: stat, and try again later
        elif changed is None:
            proof.token = token
        return changed

    def _check(self, variant: _Variant) -> str | None:
        """None when the variant's headers and guards still hold, else what changed."""
        headers = self._headers
        known = headers.known
        learnt: dict[str, tuple[FileId, str]] = {}  # entered at the end, in one go (a lock a header cost 0.3 ms)
        try:
            for path, tag, digest in variant.headers:
                try:
                    st = os.stat(path)
                except OSError:
                    return f"header {path} is gone"
                key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                seen = known.get(path)
                if seen is not None and seen[0] == key:
                    if seen[1] != digest:
                        return f"header {path} changed"
                elif _stat_tag(key) == tag:
                    learnt[path] = (key, digest)
                elif headers.digest(path, st) != digest:
                    return f"header {path} changed"
        finally:
            headers.learn(learnt)
        for directory, dir_tag in variant.guards:
            if _dir_tag(directory) != dir_tag:
                return f"directory {directory} changed (a header may now be found elsewhere)"
        return None

    # -- misses ----------------------------------------------------------------------

    def _read_headers(self, paths: list[str], started_ns: int) -> list[_Header]:
        headers = []
        for path in paths:
            try:
                st = os.stat(path)
            except OSError as exc:
                raise _Uncacheable(f"header {path!r} NVRTC read cannot be found again ({exc.strerror})", path) from None
            if not stat.S_ISREG(st.st_mode):
                raise _Uncacheable(f"header {path!r} NVRTC read is not a regular file", path)
            if st.st_ctime_ns >= started_ns:
                raise _Uncacheable(f"header {path} changed while it was compiled")
            digest = self._headers.digest(path, st)
            if digest is None:
                raise _Uncacheable(f"header {path} changed while it was read")
            headers.append(_Header(path, _stat_tag(file_id(st)), digest))
        return headers

    def _remember(
        self,
        record_key: bytes,
        headers: list[_Header],
        guards: list[tuple[str, str | None]],
        result_key: bytes,
        *,
        name: str,
        mapping: dict[Any, bytes],
    ) -> None:
        record_kid = grouped_id(record_key, None)
        found = self._store.find(record_kid)
        old = [] if found is None else _decode_raw(found[0])
        new = _encode_variant(result_key.hex(), headers, guards, name, mapping)
        kept = [new, *(v for v in old if v.get("result") != new["result"])]
        self._store.put_id(record_kid, _encode_record(kept[:_MAX_VARIANTS]))
        # A variant pushed out leaves a result no record reaches: it goes now.
        for variant in kept[_MAX_VARIANTS:]:
            try:
                self._store.delete_id(grouped_id(record_key, bytes.fromhex(str(variant.get("result")))))
            except (ValueError, TypeError):
                pass


# -- inputs -------------------------------------------------------------------------------


def _nvrtc_flags(options: Any, target_type: object) -> tuple[bytes, ...] | None:
    """The options as NVRTC gets them (``ProgramOptions.as_bytes``, 3 us); None when they are refused."""
    if not isinstance(target_type, str):
        return None
    try:
        return tuple(options.as_bytes("nvrtc", target_type.lower()))
    except Exception:
        return None  # make_program_cache_key (or Program) reports what is wrong


def _memo_key(
    code: object,
    code_type: str,
    options: Any,
    target_type: str,
    flags: tuple[bytes, ...] | None,
    *,
    names: tuple[object, ...],
    extra: bytes,
) -> tuple[object, ...] | None:
    """What a C++ compile's record key is made of, here (see :func:`_own_key`); None where cuda-core keys it.

    The code, the target, the options' flags as NVRTC gets them
    (``ProgramOptions.as_bytes("nvrtc", target)``, 3 us against make_program_cache_key's
    25), the name expressions with their types and ``extra``: what
    make_program_cache_key hashes for NVRTC, less its version probe, which
    loads NVRTC. Code that is not ``str``, ``extra_sources``, inputs whose flags
    cannot be had and name expressions of other types go to make_program_cache_key,
    which refuses them as Program would.
    """
    if not isinstance(code_type, str) or code_type.lower() != "c++" or not isinstance(target_type, str):
        return None
    if type(code) is not str or getattr(options, "extra_sources", None) is not None:
        return None
    if flags is None or not all(type(n) is str or type(n) is bytes for n in names):
        return None
    return (code, target_type.lower(), flags, tuple(sorted((type(n) is bytes, n) for n in names)), extra)


def _own_key(memo: tuple[Any, ...], nvrtc: str | None) -> bytes:
    """The record key of a C++ compile: sha256 of NVRTC's version and :func:`_memo_key`'s parts, each length-prefixed.

    A key of its own (not make_program_cache_key's), so that NVRTC's version can
    come from a record instead of from the library; its tag keeps it apart from
    every key cuda-core makes.
    """
    code, target, flags, names, extra = memo
    h = hashlib.sha256(_KEY)

    def part(label: bytes, data: bytes) -> None:
        h.update(label + len(data).to_bytes(8, "big") + data)

    part(b"nvrtc", str(nvrtc).encode())
    part(b"target", target.encode())
    part(b"code", code.encode("utf-8", "surrogateescape"))
    part(b"flags", len(flags).to_bytes(8, "big"))
    for flag in flags:
        part(b"flag", bytes(flag))
    part(b"names", len(names).to_bytes(8, "big"))
    for is_bytes, name in names:
        part(b"b" if is_bytes else b"s", name if is_bytes else name.encode("utf-8", "surrogateescape"))
    part(b"extra", extra)
    return h.digest()


def _nvrtc_version(store: CacheStore) -> str:
    from .nvrtcver import version

    return version(store)


def _remember_nvrtc(store: CacheStore) -> None:
    from .nvrtcver import remember

    remember(store)


def _loaded_nvrtc_version() -> str:
    from .nvrtcver import loaded_version

    return loaded_version()


#: ``#include`` (or ``__has_include``, ``#include_next``) not followed by ``<``: a quoted or computed name.
_QUOTED_INCLUDE = re.compile(rb"include(?:_next)?[ \t]*\(?[ \t]*(?![<\s])")


@functools.lru_cache(maxsize=256)
def _may_include_quoted(code: str | bytes) -> bool:
    """Whether the main source may name a header in quotes (or by a macro): then its directory is searched."""
    data = code.encode("utf-8", "surrogateescape") if isinstance(code, str) else code
    return _QUOTED_INCLUDE.search(data) is not None


class _Search:
    """Where NVRTC looks for this compile's files, in its order, and the working directory they depend on.

    ``cwd`` is set when a relative name decides which file is opened (a relative
    include directory, ``pre_include`` or source directory, or the working
    directory itself as the source's directory), or when the binary names the
    directory (debug information, line tables). It is then part of the record key.
    """

    __slots__ = ("cwd", "dirs", "pre_includes")

    def __init__(self, cwd: str | None, dirs: tuple[str, ...], pre_includes: tuple[str, ...]) -> None:
        self.cwd, self.dirs, self.pre_includes = cwd, dirs, pre_includes

    @staticmethod
    def of(code: object, code_type: str, options: Any, flags: tuple[bytes, ...] | None) -> _Search:
        if code_type != "c++":
            return _NO_SEARCH
        includes = tuple(_as_list(getattr(options, "include_path", None)))
        pre = tuple(_as_list(getattr(options, "pre_include", None)))
        name = getattr(options, "name", None)
        quoted = not getattr(options, "no_source_include", None) and (
            not isinstance(code, (str, bytes)) or _may_include_quoted(code)
        )
        searched, wants_cwd = _search_plan(includes, pre, name if isinstance(name, str) else None, bool(quoted), flags)
        cwd = None
        if wants_cwd:
            try:
                cwd = os.getcwd()
            except OSError as exc:
                raise _Uncacheable(
                    f"the working directory cannot be read ({exc.strerror})", "the working directory"
                ) from None
        return _placed_search(searched, pre, cwd)

    def key_part(self) -> bytes:
        return b"" if self.cwd is None else b"\0cwd:" + self.cwd.encode("utf-8", "surrogateescape")

    def resolve(self, names: list[str] | None) -> list[str]:
        """The files NVRTC opened, from the names its trace gives; raises _Uncacheable for one it cannot be."""
        if names is None:
            raise _Uncacheable("NVRTC's trace of the headers it read is missing, damaged or incomplete", "the trace")
        paths = []
        for name in names:
            if name in _BUILTIN_HEADERS:
                continue
            if os.path.isabs(name):
                paths.append(name)
            elif self.cwd is not None:
                # As the kernel resolved it: no normpath, which would undo a symlink followed by "..".
                paths.append(os.path.join(self.cwd, name))
            else:
                raise _Uncacheable(f"header {name!r} was found through a relative name the key does not cover", name)
        return paths


def _name_part(options: Any) -> bytes:
    """The source's name: cuda-core's key leaves it out (the binary does not depend on it), but a hit's
    ``ObjectCode.name`` must be the one this compile would give."""
    return b"\0name:" + repr(getattr(options, "name", None)).encode("utf-8", "surrogateescape")


def _strip_sep(path: str) -> str:
    """``path`` without trailing separators (NVRTC names ``hdr/`` as ``hdr``), the root kept."""
    stripped = path.rstrip(os.sep)
    return stripped or path


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


#: What the switch asks before it routes a compile here.
refuse_unkeyable = _refuse_unkeyable
may_include_quoted = _may_include_quoted


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


#: The search of a compile that is not C++ (nothing is searched); _Search objects are never changed.
_NO_SEARCH = _Search(None, (), ())


@functools.lru_cache(maxsize=256)
def _search_plan(
    includes: tuple[str, ...], pre: tuple[str, ...], name: str | None, quoted: bool, flags: tuple[bytes, ...] | None
) -> tuple[tuple[str, ...], bool]:
    """The directories searched, in order, as the options name them; and whether the working directory matters.

    Kept per options (a hit of the same options asks again: 4.7 us of regular
    expressions and generators otherwise, a fifth of a small kernel's hit).
    """
    source_dir = os.path.dirname(name) if name is not None else ""
    flags = flags or ()
    flag = b"--use-bundled-headers="
    bundled = [f[len(flag) :].decode("utf-8", "surrogateescape") for f in flags if f.startswith(flag)]
    # Quoted names from the source are looked for next to it; a relative pre_include
    # is looked for in the working directory, then along the search path.
    searched: list[str] = []
    if quoted:
        searched.append(source_dir)
    if any(not os.path.isabs(p) for p in pre):
        searched.extend(d for d in ("", source_dir) if d not in searched)
    for top in bundled:
        searched.extend((top, os.path.join(top, "cccl")))
    searched.extend(includes)
    relative = any(not os.path.isabs(d) for d in searched) or any(not os.path.isabs(p) for p in pre)
    names_dir = any(_DEBUG_FLAG.search(f) for f in flags)
    return tuple(searched), relative or names_dir


@functools.lru_cache(maxsize=256)
def _placed_search(searched: tuple[str, ...], pre: tuple[str, ...], cwd: str | None) -> _Search:
    """The search of :func:`_search_plan`, its directories made absolute against ``cwd`` where it matters."""
    base = cwd or ""
    dirs = tuple(_strip_sep(os.path.join(base, d)) for d in searched)
    # An absolute pre_include is read as named; a relative one is found along the
    # search path, and the trace names where.
    return _Search(cwd, tuple(dict.fromkeys(dirs)), tuple(p for p in pre if os.path.isabs(p)))


def _as_list(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)]
    return [os.fspath(v) for v in value]  # type: ignore[attr-defined]


def _nvrtc_major() -> int:
    try:
        from cuda.bindings import nvrtc

        _err, major, _minor = nvrtc.nvrtcVersion()
        return int(major)
    except Exception:
        return 0


def _fs_clock(directory: str) -> int:
    """The file system's clock now (:func:`cuda_program_cas._disk.files.fs_now`), or the process clock less a tick."""
    from cuda_program_cas._disk.files import fs_now

    now = fs_now(directory)
    return now if now is not None else time.time_ns() - 50_000_000


class _TraceHealth:
    """Whether NVRTC's time traces of this process can be trusted.

    NVRTC 13.5 breaks them for good once a traced compile fails with an error
    inside an included file: every later trace of the process lacks its first
    events (its builtin header, then the source's first includes). So after a
    traced compile fails, or a trace comes back without the builtin header, the
    front door traces in a child process instead, where NVRTC starts clean. That
    costs the child's start (about 0.7 s here) per miss, not per hit. A forked
    child inherits NVRTC's state, so it inherits this flag too.
    """

    sound = True


_TRACES = _TraceHealth()
#: The child that traces a compile: the inputs come pickled on stdin, the trace goes to a file.
_TRACE_CHILD = (
    "import pickle, sys\n"
    "from cuda.core import Program\n"
    "code, code_type, options, target_type, names = pickle.loads(sys.stdin.buffer.read())\n"
    "Program(code, code_type, options=options).compile(target_type, names)\n"
)


def _end_nvrtc_tracing(program: Any, program_options: Any) -> None:
    """Make NVRTC stop tracing after a traced compile failed.

    NVRTC 13.5 then keeps tracing: its next compile in the process, traced or not,
    writes ``.json`` into the working directory. One small traced compile that
    succeeds (to a temp file, removed) ends that, so the user's directory stays clean.
    """
    trace_dir = new_trace_dir()
    try:
        options = program_options(arch="sm_80", fdevice_time_trace=os.path.join(trace_dir, "trace"))
        program('extern "C" __global__ void cpcas_end_trace() {}', "c++", options=options).compile("cubin")
    except Exception as exc:
        _log.debug("cuda-program-cas: front door: NVRTC's tracing could not be ended: %r", exc)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def _trace_in_child(
    code: object, code_type: str, options: Any, target_type: str, names: tuple[Any, ...], *, trace: str
) -> list[str] | None:
    """The names of the files a compile reads, from a trace made in a child process (None if it failed)."""
    import pickle
    import subprocess
    import sys

    spec = pickle.dumps((code, code_type, _with_trace(options, trace), target_type, names))
    try:
        done = subprocess.run(
            [sys.executable, "-c", _TRACE_CHILD],
            input=spec,
            capture_output=True,
            timeout=3600,
            check=False,
            env={**os.environ, "CUDA_PROGRAM_CAS": "0"},  # the child's compile is this miss's: never the cache's
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return _traced_names(trace + ".json") if done.returncode == 0 else None


def _with_trace(options: Any, trace: str) -> Any:
    """``options`` with NVRTC's time trace written to ``trace`` (a ProgramOptions is a dataclass)."""
    import dataclasses

    return dataclasses.replace(options, fdevice_time_trace=trace)


def _traced_names(trace_path: str) -> list[str] | None:
    """The names of the files NVRTC's time trace says it processed, as it spelled them; None if unreadable."""
    try:
        with open(trace_path, "rb") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        return None
    names = set()
    for event in events:
        if isinstance(event, dict) and event.get("name") == "Processing Header File":
            detail = (event.get("args") or {}).get("detail")
            if not isinstance(detail, str) or not detail:
                return None  # a header it read, named in a way we cannot follow
            names.add(detail)
    # NVRTC reads its builtin header before anything else. A trace without it lost its
    # beginning, and with it the first headers of the source (see _TraceHealth).
    if not names & _BUILTIN_HEADERS:
        return None
    return sorted(names)


def _tree_files(dirs: Sequence[str]) -> list[str]:
    """Every regular file under ``dirs`` (NVRTC before 13 cannot say what it read)."""
    found: list[str] = []
    for top in dirs:
        for dirpath, _subdirs, files in os.walk(top):
            found.extend(os.path.join(dirpath, f) for f in files)
            if len(found) > _MAX_TREE_FILES:
                raise _Uncacheable(f"over {_MAX_TREE_FILES} files under the include directories to fingerprint")
    return found


def _guards(paths: list[str], dirs: Sequence[str]) -> list[tuple[str, str | None]]:
    """The directories whose entries decide where each header is found (see the module docstring).

    For a header under search directory ``i`` (as spelled) at ``sub/name``, the
    directories ``sub`` of every search directory up to ``i``; a header under
    several (nested search directories) gets the guards of each. A header under
    none is guarded by its own directory.
    """
    wanted: set[str] = set()
    for path in paths:
        wanted.add(os.path.dirname(path))
        for i, top in enumerate(dirs):
            if path.startswith(top + os.sep):
                sub = os.path.dirname(path[len(top) + 1 :])
                wanted.update(os.path.join(earlier, sub) if sub else earlier for earlier in dirs[: i + 1])
    guards: dict[str, str | None] = {}
    for path in wanted:
        # A directory that does not exist is guarded by its deepest existing ancestor:
        # creating it changes that ancestor's entries.
        probe = path
        while True:
            tag = _dir_tag(probe)
            if tag is not None or os.path.dirname(probe) == probe:
                guards[probe] = tag
                break
            probe = os.path.dirname(probe)
        if probe != path:
            guards[path] = None
    return sorted(guards.items())


def _result_key(record_key: bytes, headers: list[tuple[str, str]]) -> bytes:
    """The key of a compile's result: its record key and each header's ``(path, digest)``."""
    h = hashlib.sha256(_RESULT + record_key)
    for path, digest in sorted(headers):
        h.update(b"\0" + path.encode("utf-8", "surrogateescape") + b"\0" + digest.encode())
    return h.digest()


# -- stored forms -------------------------------------------------------------------------
#
# A record is compact JSON: {"v": 3, "variants": [...]}, newest variant first. A
# variant's headers are grouped by directory, {dir: [[name, stat tag, digest], ...]},
# so a CUB kernel's ~410 headers take about 60 bytes each.


def _encode_variant(
    result: str, headers: list[_Header], guards: list[tuple[str, str | None]], name: str, mapping: dict[Any, bytes]
) -> dict[str, Any]:
    by_dir: dict[str, list[list[str]]] = {}
    for h in headers:
        directory, base = os.path.split(h.path)
        by_dir.setdefault(directory, []).append([base, h.tag, h.digest])
    symbols = []
    for key, lowered in mapping.items():
        kind, text = ("b", key.hex()) if isinstance(key, bytes) else ("s", key)
        value = lowered if isinstance(lowered, bytes) else str(lowered).encode()
        symbols.append([kind, text, value.hex()])
    return {"result": result, "name": name, "symbols": symbols, "headers": by_dir, "guards": guards}


def _encode_record(variants: list[dict[str, Any]]) -> bytes:
    return json.dumps({"v": 3, "variants": variants}, separators=(",", ":")).encode()


def _decode_raw(raw: bytes) -> list[dict[str, Any]]:
    try:
        data = json.loads(raw)
    except ValueError:
        return []
    if not isinstance(data, dict) or data.get("v") != 3 or not isinstance(data.get("variants"), list):
        return []
    return [v for v in data["variants"] if isinstance(v, dict)]


def _decode_record(raw: bytes) -> list[_Variant]:
    """The variants of a record, checked for shape; a damaged variant is left out (a miss)."""
    variants = []
    for v in _decode_raw(raw):
        try:
            mapping: dict[Any, bytes] = {}
            for kind, text, value in v["symbols"]:
                mapping[bytes.fromhex(text) if kind == "b" else str(text)] = bytes.fromhex(value)
            headers = tuple(
                (_join(directory, base), str(tag), str(digest))
                for directory, entries in v["headers"].items()
                for base, tag, digest in entries
            )
            guards = tuple((str(path), None if tag is None else str(tag)) for path, tag in v["guards"])
            bytes.fromhex(v["result"])
            variants.append(_Variant(str(v["result"]), str(v["name"]), mapping, headers, guards))
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return variants


def _join(directory: str, base: str) -> str:
    """``os.path.join`` of what ``os.path.split`` gave at encoding (a third of its cost: 410 a CUB record)."""
    if not isinstance(directory, str) or not isinstance(base, str):
        raise TypeError(directory)
    return f"{directory}{base}" if directory.endswith(os.sep) or not directory else f"{directory}{os.sep}{base}"


def _object_code(object_code: Any, data: bytes, target_type: str, name: str, mapping: dict[Any, bytes]) -> Any:
    make = {"cubin": object_code.from_cubin, "ptx": object_code.from_ptx, "ltoir": object_code.from_ltoir}[target_type]
    return make(data, name=name, symbol_mapping=mapping or None)
