"""The front door: ``cache.compile(...)``, for compiles that read headers or name expressions.

A *record*, keyed by the inputs without header contents, lists the last few
*variants*: each file NVRTC read (blake3, stat tag), the candidates that must
stay absent (:mod:`.shadows`) and guard directories. A lookup checks variants
newest first by stat data, re-hashing only headers whose stat changed; from a
variant's second look, inotify answers (:mod:`.watch`). A header or guard not a
whole clock step older than the compile's start may have changed unseen: its
result is returned, not stored. Record and results share a key group.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import stat
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cuda_program_cas._base.config import say_once
from cuda_program_cas._base.log import LOGGER as _log
from cuda_program_cas._disk.files import FileId, file_id
from cuda_program_cas._disk.fskind import FsClock
from cuda_program_cas._local.why import DAMAGED, NO_RECORD, RESULT_GONE, Why
from cuda_program_cas._store.store import CacheStore
from cuda_program_cas.index import grouped_id

from .frontkey import (
    TAG,
    Uncacheable,
    libdevice_fingerprint,
    memo_key,
    name_part,
    nvrtc_flags,
    object_code,
    own_key,
    refuse_unkeyable,
)
from .nvrtcver import loaded_version as loaded_nvrtc_version
from .nvrtcver import remember as remember_nvrtc
from .nvrtcver import version as nvrtc_version
from .record import (
    NO_DIR,
    DirKey,
    Header,
    HeaderCache,
    Variant,
    decode_raw,
    decode_record,
    directory_key,
    encode_record,
    encode_variant,
    proof_of,
    renewed_record,
    result_key_of,
    stat_tag,
)
from .search import Search

if TYPE_CHECKING:
    from .watch import Token

__all__ = ["FrontDoor"]

_perf_ns = time.perf_counter_ns
_monotonic = time.monotonic

#: Record keys remembered per front door (inputs met before in this process).
_MAX_MEMO = 1024
#: Variants kept per record (compiles of the same inputs against other headers).
_MAX_VARIANTS = 4
#: Records kept decoded per front door, with what this process proved of their variants.
_MAX_DECODED = 256
#: A variant that could not be watched (a full watch table, NFS...) is armed again after this long.
_REARM_S = 10.0


class _Proof:
    """What this process proved of one variant: a stat check passed, then a watch armed before one."""

    __slots__ = ("retry_at", "seen", "token")

    def __init__(self) -> None:
        self.seen = False
        self.token: Token | None = None
        self.retry_at = 0.0


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
        self._inner = store.inner  # kept: a hit makes three calls through it
        self._headers = HeaderCache()
        self._record_keys: dict[tuple[object, ...], bytes] = {}  # by memo_key and NVRTC's version
        #: Per record key id: its bytes, its decoded variants and what this process proved of each.
        self._decoded: dict[str, tuple[bytes, list[Variant], list[_Proof]]] = {}
        self.watched_hits = 0  # lookups the watch answered without a stat

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
        _ObjectCode, Program, ProgramOptions, make_program_cache_key = _cuda_core()
        if options is None:
            options = ProgramOptions()
        if not isinstance(options, ProgramOptions):
            raise TypeError(f"options must be a cuda.core.ProgramOptions or None, got {type(options).__name__}")
        name_expressions = tuple(name_expressions)
        refuse_unkeyable(options, code_type)
        t0 = _perf_ns()
        try:
            flags = nvrtc_flags(options, target_type)
            search = Search.of(code, code_type, options, flags)
        except Uncacheable as exc:  # no working directory to resolve names against
            self._uncacheable(exc, None)
            return Program(code, code_type, options=options).compile(target_type, name_expressions, logs)
        extra = TAG + libdevice_fingerprint(options, code_type) + search.key_part() + name_part(options)
        memo = memo_key(code, code_type, options, target_type, flags, names=name_expressions, extra=extra)
        # A C++ compile is keyed here, NVRTC's version from its record: a hit need not load NVRTC.
        cuda_core_key = functools.partial(
            make_program_cache_key,
            code=code,
            code_type=code_type,
            options=options,
            target_type=target_type,
            name_expressions=name_expressions,
            extra_digest=extra,
        )
        nvrtc = nvrtc_version(self._inner) if memo is not None else None
        if memo is None:
            record_key = cuda_core_key()
        elif (record_key := self._record_keys.get((memo, nvrtc))) is None:
            if len(self._record_keys) >= _MAX_MEMO:
                self._record_keys.clear()
            record_key = self._record_keys[(memo, nvrtc)] = own_key(memo, nvrtc)
        record_kid = grouped_id(record_key, None)
        found = self._lookup(record_kid, record_key)
        if isinstance(found, tuple):
            return self._hit(found, record_kid, target_type, t0)
        if memo is not None:
            cuda_core_key()  # a miss loads NVRTC anyway: a bad input gets the error it always got
        if self._store.read_only:
            self._inner.note_miss(record_kid, found, t0_ns=t0)
            result = Program(code, code_type, options=options).compile(target_type, name_expressions, logs)
            self._inner.note_dropped(record_kid, "read-only cache")
            return result
        # One process of the node compiles these inputs; the others wait for its record.
        with self._inner.claim(record_kid) as claim:
            if claim.held or claim.waited:  # stored meanwhile, by the claimant waited for or one just before
                found = self._lookup(record_kid, record_key)
                if isinstance(found, tuple):
                    return self._hit(found, record_kid, target_type, t0, waited=claim.waited)
            self._inner.note_miss(record_kid, found, t0_ns=t0)
            inputs = (code, code_type, options, target_type, name_expressions, logs)
            return self._compile(inputs, search, record_key, nvrtc, found)

    def _hit(self, found: Any, kid: str, target: str, t0: int, waited: bool = False) -> Any:
        data, variant, shared = found
        self._inner.note_hit(kid, shared, t0_ns=t0, waited=waited)
        return object_code(_cuda_core()[0], data, target, variant.name, variant.mapping)

    def _compile(self, inputs: tuple[Any, ...], search: Search, record_key: bytes, nvrtc: str | None, why: str) -> Any:
        """A miss: compile uncached, record the headers it read, store the result and the record.

        ``nvrtc``: the version the key holds when keyed here (another NVRTC's result is not stored).
        """
        _ObjectCode, Program, ProgramOptions, _key = _cuda_core()
        from .shadows import shadows_and_guards
        from .trace import (
            TRACES,
            end_nvrtc_tracing,
            new_trace_dir,
            nvrtc_major,
            trace_in_child,
            traced_names,
            tree_files,
            with_trace,
        )

        code, code_type, options, target_type, name_expressions, logs = inputs
        record_kid = grouped_id(record_key, None)
        started = FsClock(self._inner.layout.tmp)
        traced = code_type == "c++" and nvrtc_major() >= 13
        trace_dir = new_trace_dir() if traced else None
        trace = os.path.join(trace_dir, "trace") if trace_dir is not None else ""
        here = traced and TRACES.sound  # else an earlier traced compile failed: trace in a child
        compile_options = with_trace(options, trace) if here else options
        try:
            try:
                compile_t0 = time.perf_counter()
                result = Program(code, code_type, options=compile_options).compile(target_type, name_expressions, logs)
                compile_s = time.perf_counter() - compile_t0
            except BaseException:
                if here:
                    TRACES.sound = False
                    end_nvrtc_tracing(Program, ProgramOptions)
                raise
            try:
                if code_type != "c++":
                    paths: list[str] = []
                elif traced:
                    names = traced_names(trace + ".json") if here else None
                    if names is None:
                        if here:
                            TRACES.sound = False  # another library's traced compile may have failed
                        names = trace_in_child(code, code_type, options, target_type, name_expressions, trace=trace)
                    paths = search.resolve(names)
                else:
                    paths = tree_files(search.dirs)
                paths = sorted({*paths, *search.pre_includes})
                headers = self._read_headers(paths, started)
                absent, guards = shadows_and_guards(code, code_type, options, headers, search)
                for path, key in guards:  # an entry changed too late for the directory's stat to prove it
                    if key is not None and not started.old_at(key[0], key[3]):
                        raise Uncacheable(f"directory {path} changed while it was compiled (or too shortly before)")
                if nvrtc is not None and loaded_nvrtc_version() != nvrtc:
                    raise Uncacheable(f"NVRTC {loaded_nvrtc_version()} compiled it, not NVRTC {nvrtc} of its key")
            except Uncacheable as exc:
                self._uncacheable(exc, record_kid)
                return result
        finally:
            if trace_dir is not None:
                shutil.rmtree(trace_dir, ignore_errors=True)
        result_key = result_key_of(record_key, [(h.path, h.digest) for h in headers])
        mapping = dict(result.symbol_mapping) if name_expressions else {}
        stored = self._inner.put_id(grouped_id(record_key, result_key), bytes(result.code))
        if stored:
            self._remember(record_key, headers, guards, absent, result_key, name=result.name, mapping=mapping)
            if nvrtc is not None:
                remember_nvrtc(self._inner)  # a hit of the next process need not load NVRTC
            from .inputs import describe

            try:  # the journal never costs a compile its result
                journaled = describe(
                    *inputs[:5],
                    nvrtc=nvrtc or loaded_nvrtc_version(),
                    cwd=search.cwd,
                    headers={h.path: h.digest[:12] for h in headers},
                )
            except Exception as exc:
                _log.debug("cuda-program-cas: front door: inputs not journaled: %r", exc)
            else:
                self._inner.note_compiled(record_kid, compile_s, "front", journaled, why)
        return result

    def _uncacheable(self, exc: Uncacheable, record_kid: str | None) -> None:
        self._inner.note_dropped(record_kid, exc.reason)
        if exc.name is not None:
            say_once(
                ("uncacheable", exc.name), "cuda-program-cas: front door: %s; such compiles are not cached", exc.reason
            )

    def _lookup(self, record_kid: str, record_key: bytes) -> tuple[bytes, Variant, str | None] | str:
        """``(bytes, variant, shared store or None)`` of a hit, else why it missed."""
        found = self._inner.find(record_kid)
        if found is None:
            return Why(NO_RECORD, "new inputs: no record of them")
        raw, shared = found
        # Decoded once, with what this process proved, while its bytes stay the same (compared:
        # a record read back after this process stored it is another object; 2 us for 42 KB).
        decoded = self._decoded.get(record_kid)
        if decoded is None or (decoded[0] is not raw and decoded[0] != raw):
            if len(self._decoded) >= _MAX_DECODED:
                self._decoded.clear()
            variants = decode_record(raw)
            decoded = self._decoded[record_kid] = (raw, variants, [_Proof() for _ in variants])
        why = None  # the newest variant's reason
        for variant, proof in zip(decoded[1], decoded[2], strict=True):
            fresh: list[Any] = []
            changed = self._proven(variant, proof, fresh)
            if changed is None:
                data = self._inner.find(grouped_id(record_key, bytes.fromhex(variant.result)))
                if data is not None:
                    if fresh:
                        self._refresh(record_kid, raw, variant, fresh[0])
                    return data[0], variant, data[1] if data[1] is not None else shared
                changed = Why(RESULT_GONE, "the result of a matching variant is gone")
            why = why or changed
        return why or Why(DAMAGED, "the record is damaged or of another format")

    def _proven(self, variant: Variant, proof: _Proof, fresh: list[Any]) -> str | None:
        """:meth:`_check`, or nothing while the watch proves the variant unchanged since it held."""
        token = proof.token
        if token is not None:
            if token.clean():
                self.watched_hits += 1
                return None
            proof.token = None
        if not proof.seen:
            # A job looks each kernel up once: arming (about as costly again) waits for a second look.
            changed = self._check(variant, fresh)
            proof.seen = changed is None
            return changed
        now = _monotonic()
        if now < proof.retry_at:
            return self._check(variant, fresh)
        from .watch import arm

        # Armed before the check: a change after it raises an event, one before it fails the check.
        token = arm([h[0] for h in variant.headers], [g[0] for g in variant.guards], variant.absent)
        changed = self._check(variant, fresh)
        if token is None:
            proof.retry_at = now + _REARM_S  # it could not be watched: stat, and try again later
        elif changed is None:
            proof.token = token
        return changed

    def _check(self, variant: Variant, fresh: list[Any] | None = None) -> str | None:
        """None when the variant still holds, else what changed.

        The whole stat data against its proof first; else each file, a header whose
        stat changed hashed again. Old new stat data go to ``fresh`` for :meth:`_refresh`.
        """
        if variant.proof is not None and self._same_stat(variant):
            return None
        headers = self._headers
        known = headers.known
        learnt: dict[str, tuple[FileId, str]] = {}  # entered in one go (a lock a header cost 0.3 ms)
        clock: FsClock | None = None
        keys: list[FileId] = []
        renewed: dict[str, FileId] = {}  # stat changed, bytes the same, stat data old
        young = False
        try:
            for path, tag, digest in variant.headers:
                try:
                    st = os.stat(path)
                except OSError:
                    return Why.header_gone(path)
                key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                keys.append(key)
                seen = known.get(path)
                if seen is not None and seen[0] == key:
                    if seen[1] != digest:
                        return Why.header_changed(path)
                    if stat_tag(key) != tag:
                        renewed[path] = key  # remembered in this process: old when hashed
                elif stat_tag(key) == tag:
                    learnt[path] = (key, digest)
                else:
                    if clock is None:
                        clock = FsClock(self._inner.layout.tmp)
                    old = clock.old(st)
                    if headers.digest(path, st, old=old) != digest:
                        return Why.header_changed(path)
                    if old:
                        renewed[path] = key
                    else:
                        young = True  # no new proof
        finally:
            headers.learn(learnt)
        for path in variant.absent:
            if _present(path):
                return Why.shadowed(path)
        guard_keys = []
        for directory, dir_tag in variant.guards:
            dir_key = directory_key(directory)
            if (None if dir_key is None else stat_tag(dir_key)) != dir_tag:
                return Why.directory_changed(directory)
            guard_keys.append(dir_key)
        if renewed and not young and fresh is not None:
            values = [v for key in keys for v in key]
            for dir_key in guard_keys:
                values.extend(NO_DIR if dir_key is None else dir_key)
            values.append(len(variant.absent))
            fresh.append((renewed, proof_of(values)))
        return None

    def _refresh(self, record_kid: str, raw: bytes, variant: Variant, fresh: Any) -> None:
        """Record a variant's new stat data, proven by content; never fails a hit."""
        renewed, proof = fresh
        if self._store.read_only or proof is None:
            return
        try:
            self._inner.put_id(record_kid, renewed_record(raw, variant, renewed, proof))
        except Exception as exc:
            _log.debug("cuda-program-cas: front door: new stat data not recorded: %r", exc)

    @staticmethod
    def _same_stat(variant: Variant) -> bool:
        """Whether every header and guard stats as its proof records, and every candidate is absent."""
        values: list[int] = []
        extend = values.extend
        stat_ = os.stat
        try:
            for path, _tag, _digest in variant.headers:
                st = stat_(path)
                extend((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        except OSError:
            return False
        for directory, _dir_tag in variant.guards:
            extend(directory_key(directory) or NO_DIR)
        for path in variant.absent:
            try:
                stat_(path)
            except OSError as exc:
                if exc.errno in _ABSENT:
                    continue
            return False
        values.append(len(variant.absent))
        return proof_of(values) == variant.proof

    def _read_headers(self, paths: list[str], started: FsClock) -> list[Header]:
        headers = []
        for path in paths:
            try:
                st = os.stat(path)
            except OSError as exc:
                raise Uncacheable(f"header {path!r} NVRTC read cannot be found again ({exc.strerror})", path) from None
            if not stat.S_ISREG(st.st_mode):
                raise Uncacheable(f"header {path!r} NVRTC read is not a regular file", path)
            if not started.old(st):  # changed after it was read, or may change again within its clock step
                raise Uncacheable(f"header {path} changed while it was compiled (or too shortly before)")
            digest = self._headers.digest(path, st, old=True)
            if digest is None:
                raise Uncacheable(f"header {path} changed while it was read")
            headers.append(Header(path, file_id(st), digest))
        return headers

    def _remember(
        self,
        record_key: bytes,
        headers: list[Header],
        guards: list[tuple[str, DirKey | None]],
        absent: list[str],
        result_key: bytes,
        *,
        name: str,
        mapping: dict[Any, bytes],
    ) -> None:
        record_kid = grouped_id(record_key, None)
        found = self._inner.find(record_kid)
        old = [] if found is None else decode_raw(found[0])
        new = encode_variant(result_key.hex(), headers, guards, name, mapping, absent=absent)
        kept = [new, *(v for v in old if v.get("result") != new["result"])]
        self._inner.put_id(record_kid, encode_record(kept[:_MAX_VARIANTS]))
        for variant in kept[_MAX_VARIANTS:]:  # a result no record reaches now
            try:
                self._inner.delete_id(grouped_id(record_key, bytes.fromhex(str(variant.get("result")))))
            except (ValueError, TypeError):
                pass


#: shadows.ABSENT_ERRNOS, which a hit does not import.
_ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR})


def _present(path: str) -> bool:
    """Whether a candidate is there, or cannot be shown absent."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno not in _ABSENT
    except ValueError:
        return True
    return True
