"""Bad inputs and hostile paths: clear exceptions, and nothing read or written outside the root."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import time
from collections.abc import Callable

from blake3 import blake3

from cuda_program_cas import CacheStore, collect
from cuda_program_cas.index import key_id

from .checker import remove
from .common import Report, content, key_name, quiet, unexpected

# -- 5. bad inputs and paths --------------------------------------------------------------


def _listing(top: str) -> dict[str, tuple[int, int, str]]:
    """Every path under ``top`` with mode, size and a hash of its content (symlinks by target)."""
    out: dict[str, tuple[int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                digest = "->" + os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as fh:
                    digest = hashlib.sha256(fh.read()).hexdigest()
            else:
                digest = ""
            out[os.path.relpath(path, top)] = (st.st_mode, st.st_size if not stat.S_ISDIR(st.st_mode) else 0, digest)
    return out


def _expect_raise(
    rep: Report, what: str, exc_types: tuple[type[BaseException], ...], fn: Callable[[], object], named: str | None
) -> None:
    rep.operations += 1
    rep.faults += 1
    try:
        fn()
    except exc_types as exc:
        if named is not None and named not in str(exc):
            rep.fail(f"{what}: {type(exc).__name__} does not name the offending value {named!r}: {exc}")
        return
    except Exception as exc:
        rep.fail(f"{what}: raised {type(exc).__name__} ({exc}), expected {'/'.join(t.__name__ for t in exc_types)}")
        return
    rep.fail(f"{what}: accepted, expected {'/'.join(t.__name__ for t in exc_types)}")


def _key_in_shard(prefix: str, of: Callable[[int], str], start: int = 0) -> int:
    """A torture key index whose name (as ``of`` computes it) starts with ``prefix``."""
    i = start
    while not of(i).startswith(prefix):
        i += 1
    return i


def merge_reports(name: str, *parts: Report) -> Report:
    """One report of several single-process parts."""
    rep = Report(name, processes=1)
    for part in parts:
        for field_name in ("operations", "hits", "misses", "writes", "faults", "wrong_bytes", "exceptions", "seconds"):
            setattr(rep, field_name, getattr(rep, field_name) + getattr(part, field_name))
        rep.notes += part.notes
        if part.skipped:
            rep.notes.append(f"{part.scenario}: skipped: {part.skipped}")
        for message in part.failures:
            rep.fail(message)
    rep.seconds = round(rep.seconds, 1)
    return rep


def run_paths(workdir: str) -> Report:
    """The bad-input table of the design brief, and hostile paths; nothing outside the root is touched."""
    return merge_reports("paths", run_bad_inputs(workdir), run_hostile_paths(workdir))


def run_bad_inputs(workdir: str) -> Report:
    """Each row of "What a bad input gets": a clear exception naming the value, nothing on disk changed."""
    from cuda_program_cas import LayoutError, ReadOnlyCacheError

    quiet()
    started = time.monotonic()
    rep = Report("bad-inputs", processes=1)
    base = os.path.join(workdir, "inputs")
    root = os.path.join(base, "cache")
    store = CacheStore(root)
    store.put("good", b"good bytes")
    before = _listing(base)
    for key in (1, 1.5, None, ["k"], object()):
        for op, fn in (
            ("get", lambda k=key: store.get(k)),
            ("put", lambda k=key: store.put(k, b"x")),
            ("delete", lambda k=key: store.delete(k)),
        ):
            _expect_raise(rep, f"{op} with key {key!r}", (TypeError,), fn, type(key).__name__)
    for value in ("text", 1, None, [1, 2]):
        _expect_raise(
            rep, f"put value {value!r}", (TypeError,), lambda v=value: store.put("k", v), type(value).__name__
        )
    for cap in (True, 1.5, 0, -1, "10G"):
        target = os.path.join(base, "never-created")
        _expect_raise(
            rep,
            f"max_size_bytes={cap!r}",
            (TypeError, ValueError),
            lambda c=cap, t=target: CacheStore(t, max_size_bytes=c),
            repr(cap),
        )
        if os.path.lexists(target):
            rep.fail(f"max_size_bytes={cap!r} was rejected but {target} was created")
    a_file = os.path.join(base, "a-file")
    with open(a_file, "wb") as fh:
        fh.write(b"not a cache\n")
    foreign = os.path.join(base, "foreign")
    os.makedirs(foreign)
    with open(os.path.join(foreign, "notes.txt"), "wb") as fh:
        fh.write(b"mine\n")
    before = _listing(base)
    _expect_raise(rep, "path is a file", (LayoutError, OSError), lambda: CacheStore(a_file), "a-file")
    _expect_raise(rep, "path is ''", (ValueError,), lambda: CacheStore(""), "''")
    _expect_raise(rep, "path is a foreign directory", (LayoutError,), lambda: CacheStore(foreign), "foreign")
    ro = CacheStore(root, read_only=True)
    rep.operations += 1
    if ro.put("new", b"bytes") or ro.counters()["dropped_writes"] != 1:
        rep.fail("put on a read-only cache: not dropped and counted")  # not bad input: never raised
    _expect_raise(rep, "delete on a read-only cache", (ReadOnlyCacheError,), lambda: ro.delete("good"), "read-only")
    _expect_raise(rep, "clear on a read-only cache", (ReadOnlyCacheError,), ro.clear, "read-only")
    if ro.get("good") != b"good bytes":
        rep.fail("a read-only cache did not return its entry")
    after = _listing(base)
    if after != before:
        changed = sorted(set(after.items()) ^ set(before.items()))[:5]
        rep.fail(f"bad inputs changed the disk: {changed}")
    try:
        from cuda_program_cas import ContentAddressedProgramCache
    except ImportError:  # pragma: no cover
        rep.notes.append("adapter checks skipped: cuda.core not importable")
        return rep
    cache = ContentAddressedProgramCache(root)
    _expect_raise(rep, "`key in cache`", (TypeError,), lambda: "good" in cache, "cache.get(key)")
    for value in ("text", 1, None, [1, 2]):
        _expect_raise(
            rep, f"cache[k] = {value!r}", (TypeError,), lambda v=value: cache.__setitem__("k", v), type(value).__name__
        )
    for key in (1, None):
        _expect_raise(
            rep, f"cache[{key!r}] = b''", (TypeError,), lambda k=key: cache.__setitem__(k, b"x"), type(key).__name__
        )
    if _listing(base) != after:
        rep.fail("bad inputs through the adapter changed the disk")
    rep.seconds = time.monotonic() - started
    return rep


def run_hostile_paths(workdir: str) -> Report:
    """Symlinked shard directories and files, hostile manifests: misses, and a sentinel left untouched."""
    quiet()
    started = time.monotonic()
    rep = Report("hostile-paths", processes=1)
    base = os.path.join(workdir, "hostile")
    sentinel = os.path.join(base, "sentinel")
    os.makedirs(os.path.join(sentinel, "ab"))
    with open(os.path.join(sentinel, "secret"), "wb") as fh:
        fh.write(b"do not read or write me\n")
    root = os.path.join(base, "cache")
    store = CacheStore(root)
    for i in range(40):
        store.put(key_name(i), content(i))
    # A key whose manifest shard is replaced by a symlink into the sentinel, holding a
    # valid-looking manifest: a hit would mean the cache read outside its root.
    ki = _key_in_shard("ab", lambda n: key_id(key_name(n)), 1000)
    kid = key_id(key_name(ki))
    good = blake3(content(0)).hexdigest()
    store.put(key_name(0), content(0))
    with open(os.path.join(sentinel, "ab", kid[2:]), "wb") as fh:
        fh.write(b"cpcas2 %s %s %d\n" % (kid.encode(), good.encode(), len(content(0))))
    index_shard = os.path.join(root, "index", "ab")
    remove(index_shard)
    os.symlink(os.path.join(sentinel, "ab"), index_shard)
    # A blob shard symlinked into the sentinel; the blob sitting there is valid.
    bi = _key_in_shard("cd", lambda n: blake3(content(n)).hexdigest(), 0)
    bdigest = blake3(content(bi)).hexdigest()
    os.makedirs(os.path.join(sentinel, "cd"), exist_ok=True)
    with open(os.path.join(sentinel, "cd", bdigest[2:]), "wb") as fh:
        fh.write(content(bi))
    store.put(key_name(bi), content(bi))
    blob_shard = os.path.join(root, "blobs", "cd")
    remove(blob_shard)
    os.symlink(os.path.join(sentinel, "cd"), blob_shard)
    # Hostile manifests: path traversal, non-hex, upper-case digests; symlinked files.
    hostile = {
        "traversal": b"cpcas1 ../../etc/passwd 100\n",
        "nonhex": b"cpcas1 " + b"z" * 64 + b" 10\n",
        "upper": b"cpcas1 " + good.upper().encode() + b" %d\n" % len(content(0)),
        "abs": b"cpcas1 /etc/passwd 10\n",
    }
    hostile_keys = {}
    for n, (name, body) in enumerate(hostile.items()):
        hk = key_name(2000 + n)
        hostile_keys[name] = hk
        path = store.inner.layout.manifest_path(key_id(hk))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(body)
    link_key = key_name(3000)
    lpath = store.inner.layout.manifest_path(key_id(link_key))
    os.makedirs(os.path.dirname(lpath), exist_ok=True)
    os.symlink(os.path.join(sentinel, "secret"), lpath)
    blob_link_i = 5
    os.unlink(store.inner.blobs.path_for(blake3(content(blob_link_i)).hexdigest()))
    os.symlink(os.path.join(sentinel, "secret"), store.inner.blobs.path_for(blake3(content(blob_link_i)).hexdigest()))
    before = _listing(sentinel)
    # Now use the cache every way there is.
    rep.faults += 4 + len(hostile)
    checks: list[tuple[str, Callable[[], object]]] = [
        ("get through a symlinked index shard", lambda: store.get(key_name(ki))),
        ("get through a symlinked blob shard", lambda: store.get(key_name(bi))),
        ("get of a symlinked manifest", lambda: store.get(link_key)),
        ("get of a symlinked blob", lambda: store.get(key_name(blob_link_i))),
    ] + [(f"get of a {name} manifest", lambda k=k: store.get(k)) for name, k in hostile_keys.items()]
    for what, fn in checks:
        rep.operations += 1
        try:
            data = fn()
        except Exception as exc:
            unexpected(rep, what, exc)
            continue
        if data is not None:
            rep.fail(f"{what}: a hit ({len(data)} bytes) read from outside the cache root")
    for what, fn2 in (
        ("put into a symlinked index shard", lambda: store.put(key_name(ki), content(ki))),
        ("put into a symlinked blob shard", lambda: store.put(key_name(bi), content(bi))),
        ("put over a symlinked manifest", lambda: store.put(link_key, b"new bytes")),
        ("put over a symlinked blob", lambda: store.put(key_name(blob_link_i), content(blob_link_i))),
        ("stats", store.stats),
        ("enforce_cap", lambda: CacheStore(root, max_size_bytes=4096).inner.enforce_cap()),  # noqa: PLW0108 (opened then)
        ("delete through a symlinked index shard", lambda: store.delete(key_name(ki))),
        ("clear", store.clear),
    ):
        rep.operations += 1
        try:
            fn2()
        except KeyError:
            pass
        except Exception as exc:
            unexpected(rep, what, exc)
    rep.operations += 1
    try:
        collect(root, grace_s=0.0, max_size=4096, verify=True)
    except Exception as exc:
        unexpected(rep, "collect", exc)
    after = _listing(sentinel)
    if after != before:
        changed = sorted({k for k in set(after) | set(before) if after.get(k) != before.get(k)})
        rep.fail(f"the sentinel directory next to the cache changed: {changed[:8]}")
    with open(os.path.join(sentinel, "secret"), "rb") as fh:
        if fh.read() != b"do not read or write me\n":
            rep.fail("the sentinel file was overwritten")
    _not_regular(os.path.join(base, "odd"), rep)
    rep.seconds = time.monotonic() - started
    return rep


def _not_regular(root: str, rep: Report) -> None:
    """Directories where a blob or manifest belongs, a file where a shard directory belongs.

    ``get`` must miss without raising. What ``put`` does there is recorded as a
    note (a policy question: today it raises the ``OSError``).
    """
    store = CacheStore(root)
    for i in range(8):
        store.put(key_name(i), content(i))
    blob_dir = store.inner.blobs.path_for(blake3(content(1)).hexdigest())
    os.unlink(blob_dir)
    os.mkdir(blob_dir)
    man_dir = store.inner.layout.manifest_path(key_id(key_name(2)))
    os.unlink(man_dir)
    os.mkdir(man_dir)
    kid = key_id(key_name(3))
    shard_file = os.path.join(root, "index", kid[:2])
    shutil.rmtree(shard_file)
    with open(shard_file, "wb") as fh:
        fh.write(b"not a directory\n")
    rep.faults += 3
    fresh = CacheStore(root)
    raised = []
    for i in (1, 2, 3):
        rep.operations += 1
        try:
            data = fresh.get(key_name(i))
        except Exception as exc:
            unexpected(rep, f"get of key {i} with a non-regular file in the way", exc)
            continue
        if data is not None:
            rep.fail(f"key {i}: a hit through a non-regular file")
        try:
            fresh.put(key_name(i), content(i))
        except OSError as exc:
            raised.append(type(exc).__name__)
    for what, fn in (("stats", fresh.stats), ("clear", fresh.clear)):
        rep.operations += 1
        try:
            fn()
        except Exception as exc:
            unexpected(rep, f"{what} with non-regular files in the way", exc)
    if raised:
        rep.notes.append(f"put where a directory or a file is in the way raises {', '.join(raised)} (not dropped)")
