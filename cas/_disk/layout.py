"""The cache root: ``layout.json``, ``CACHEDIR.TAG``, the top-level directories and their paths.

Opening a directory that is empty (or absent) lays it out. A directory holding anything but
our own names is refused, never adopted; so is a newer layout version, and an older one
(only pre-release versions wrote one), with a message naming the command that empties it.
A damaged ``layout.json`` among only our own names is rewritten by a writable open (and
``verify --repair``); a read-only open and the maintenance verbs refuse it.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import os
import stat
import time
from collections.abc import Iterator

from cuda_program_cas._base.errors import LayoutError
from cuda_program_cas._base.log import LOGGER as _log

from .atomic import atomic_write, make_tmp_dir
from .files import NotRegularFile, read_small, shard_path, trusted_mtime_ns

__all__ = [
    "BLOBS",
    "BOOT_RECORD_FILE",
    "CACHEDIR_TAG",
    "CLAIM_SUFFIX",
    "FILES",
    "INDEX",
    "LAYOUT_FILE",
    "LAYOUT_VERSION",
    "SETTINGS_FILE",
    "STALE_TMP_S",
    "Layout",
    "LayoutState",
    "check_layout",
    "check_layout_data",
    "create_layout",
    "damaged_layout_error",
    "is_shared_store",
    "layout_bytes",
    "layout_version",
    "mark_shared_store",
    "parse_layout",
    "stale_temp_files",
    "temp_files",
    "unwritable_reason",
    "url_path",
    "write_layout",
]

LAYOUT_NAME = "cuda-program-cas"
LAYOUT_VERSION = 2
LAYOUT_FILE = "layout.json"
BLOBS = "blobs"
INDEX = "index"
TMP = "tmp"
#: Claims (:mod:`cuda_program_cas._local.claims`) are temp files like any other, swept once stale.
CLAIM_SUFFIX = ".claim"
QUARANTINE = "quarantine"
LOCK_FILE = "evict.lock"
COUNTERS_FILE = "counters"
COUNTERS_LOCK = "counters.lock"
BOOT_RECORD_FILE = "verified"
MISSES_FILE = "misses"
MISSES_OLD = "misses.1"
USAGE_FILE = "usage"
SETTINGS_FILE = "settings.json"
#: Temp files this old belong to a crashed writer: no write takes anywhere near that long.
STALE_TMP_S = 3600.0

#: Every path the package makes under a cache root or shared store, with what it is. A
#: directory ends in ``/``; ``<N hex>`` is N lowercase hex digits, ``<digits>`` a decimal
#: number, ``*`` any characters within one name. docs/design.md's layout specification
#: names exactly these, and tests/test_layout_spec.py checks that real runs leave no other.
FILES: tuple[tuple[str, str], ...] = (
    ("CACHEDIR.TAG", "tells backup tools to skip the cache (bford.info/cachedir)"),
    (LAYOUT_FILE, "the layout's name, version and hashes; `shared` in a store publish made"),
    (SETTINGS_FILE, "settings stored in the cache (`cuda-program-cas config PATH max-size 10G`)"),
    ("keys", "a shared store's key list: the keys it holds and their compile times (publish, write-back)"),
    (f"{BLOBS}/", "the binaries, in 256 shards"),
    (f"{BLOBS}/<2 hex>/", "a shard"),
    (f"{BLOBS}/<2 hex>/<62 hex>", "a compiled binary, verbatim, named by its blake3 digest"),
    (f"{INDEX}/", "the manifests, in 256 shards"),
    (f"{INDEX}/<2 hex>/", "a shard"),
    (f"{INDEX}/<2 hex>/<62 hex>", "a key's one-line manifest, named by sha256 of the key"),
    (f"{TMP}/", "staging for atomic writes, claims, large downloads (owner-only)"),
    (f"{TMP}/<digits>-<16 hex>.tmp", "a file being written, or a staged download (pid, then a unique draw)"),
    (f"{TMP}/<64 hex>{CLAIM_SUFFIX}", "empty; locked by the one process of the node compiling that key id"),
    (f"{QUARANTINE}/", "what failed verification, kept for inspection"),
    (f"{QUARANTINE}/<64 hex>.<digits>.<digits>", "a blob that failed its digest (digest, ns, pid)"),
    (f"{QUARANTINE}/pack-<16 hex>-<8 hex>.cpk.<digits>", "a pack that failed verification (name, ns)"),
    (LOCK_FILE, "taken without waiting by the one evictor, collector or repack at a time"),
    (COUNTERS_FILE, "the lifetime counters: one self-checking line per flush"),
    (COUNTERS_LOCK, "taken briefly by whoever appends to or rewrites the counters or the usage ledger"),
    (BOOT_RECORD_FILE, "blobs verified in this boot, by file identity: a fresh process need not hash them again"),
    (USAGE_FILE, "the usage ledger: each entry's compile time and the time its hits saved"),
    (MISSES_FILE, "the miss journal: recent misses' inputs, for `explain` (bounded)"),
    (MISSES_OLD, "the miss journal's previous part, kept when it rotates"),
    ("packs/", "a shared store's pack files (`publish --pack`, `repack`)"),
    ("packs/pack-<16 hex>-<8 hex>.cpk", "an immutable pack: entries, then their index (time-ordered name)"),
    ("packs/list", "the pack names, for readers that cannot list a directory (HTTP)"),
    ("packs/summary", "every pack's index in one file, so that publish need not read every pack"),
    ("packs/retired/", "packs a repack replaced, kept a grace period for readers that opened them"),
    ("packs/retired/pack-<16 hex>-<8 hex>.cpk", "a replaced pack"),
    ("sets/", "a shared store's warm sets, one per job (write-back, publish, repack)"),
    ("sets/<64 hex>", "the entries one job used, in order of first use; named by sha256 of the job's name"),
)
_OWN_NAMES = frozenset(pattern.split("/", 1)[0] for pattern, _ in FILES)


CACHEDIR_TAG = (
    b"Signature: 8a477f597d28d172789f06886806bc55\n"
    b"# This file is a cache directory tag created by cuda-program-cas.\n"
    b"# For information about cache directory tags, see https://bford.info/cachedir/\n"
)


class LayoutState(enum.Enum):
    """What :func:`check_layout` found at a cache root."""

    OK = "ok"
    MISSING = "missing"
    DAMAGED = "damaged"


class Layout:
    """Paths of one cache root (as ``str`` for the hot path)."""

    __slots__ = (
        "blobs",
        "counters",
        "counters_lock",
        "index",
        "lock",
        "misses",
        "misses_old",
        "quarantine",
        "root",
        "tmp",
        "usage",
    )

    def __init__(self, root: str) -> None:
        self.root = root
        self.blobs = os.path.join(root, BLOBS)
        self.index = os.path.join(root, INDEX)
        self.tmp = os.path.join(root, TMP)
        self.quarantine = os.path.join(root, QUARANTINE)
        self.lock = os.path.join(root, LOCK_FILE)
        self.counters = os.path.join(root, COUNTERS_FILE)
        self.counters_lock = os.path.join(root, COUNTERS_LOCK)
        self.misses = os.path.join(root, MISSES_FILE)
        self.misses_old = os.path.join(root, MISSES_OLD)
        self.usage = os.path.join(root, USAGE_FILE)

    def blob_path(self, digest: str) -> str:
        """Where the blob ``digest`` (validated) lives."""
        return shard_path(self.blobs, digest)

    def manifest_path(self, kid: str) -> str:
        """Where the manifest of key id ``kid`` (validated) lives."""
        return shard_path(self.index, kid)

    @contextlib.contextmanager
    def collector_lock(self, wait_s: float = 0.0) -> Iterator[bool]:
        """Hold ``evict.lock``, the one lock of gc, the cap's eviction and repack.

        Yields True while held, False when another holds it past ``wait_s`` seconds.
        """
        import filelock

        lock = filelock.FileLock(self.lock, timeout=wait_s)
        try:
            lock.acquire(timeout=wait_s, blocking=wait_s > 0)
        except filelock.Timeout:
            yield False
            return
        try:
            yield True
        finally:
            lock.release()


def url_path(kind: str, name: str) -> str:
    """Where a validated blob (``kind`` ``blobs``) or manifest (``index``) lies below a store's URL."""
    assert kind in (BLOBS, INDEX)
    return f"{kind}/{name[:2]}/{name[2:]}"


def _read_layout(path: str) -> dict[str, object] | None:
    """The parsed layout file, or None when it is damaged (a symlink or a FIFO is damage too).

    Raises ``FileNotFoundError`` when there is none, :class:`LayoutError` when it is a
    directory (a writable open could not replace it), ``OSError`` when it cannot be read.
    """
    try:
        return parse_layout(read_small(path, 4096))
    except NotRegularFile:
        if not os.path.isdir(path):
            return None
        root = os.path.dirname(path)
        raise LayoutError(
            f"cache at {root!r} has a directory where its {LAYOUT_FILE} belongs; remove it "
            "(`rmdir` it if empty) and open the cache again"
        ) from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # a symlink, refused by O_NOFOLLOW
            return None
        raise


def parse_layout(raw: bytes) -> dict[str, object] | None:
    """``layout.json``'s bytes parsed, or None when they are not a layout file of ours."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: thousands of "["
        return None
    if not isinstance(data, dict) or data.get("layout") != LAYOUT_NAME:
        return None
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        return None
    return data


def check_layout_data(root: str, data: dict[str, object]) -> int:
    """The version of a parsed layout; :class:`LayoutError` when this code cannot read it (older, newer, hashes)."""
    version = data["version"]
    assert isinstance(version, int)
    if version < LAYOUT_VERSION:
        raise LayoutError(
            f"cache at {root!r} has layout version {version}, written by a pre-release cuda-program-cas, which this "
            f"version does not read; empty it with `cuda-program-cas clear {root}` (or use another directory)"
        )
    if version > LAYOUT_VERSION:
        raise LayoutError(
            f"cache at {root!r} has layout version {version}, newer than this cuda-program-cas "
            f"understands ({LAYOUT_VERSION}); upgrade cuda-program-cas or use another directory"
        )
    if data.get("blob_hash") != "blake3" or data.get("key_hash") != "sha256":
        raise LayoutError(
            f"cache at {root!r} uses hashes {data.get('blob_hash')!r}/{data.get('key_hash')!r}, not blake3/sha256"
        )
    return version


def _stored_layout(root: str) -> dict[str, object] | None:
    try:
        return _read_layout(os.path.join(root, LAYOUT_FILE))
    except (OSError, LayoutError):
        return None


def layout_version(root: str) -> int | None:
    """The version ``layout.json`` records, or None when it is missing or damaged."""
    data = _stored_layout(root)
    if data is None:
        return None
    version = data["version"]
    assert isinstance(version, int)
    return version


def check_layout(root: str) -> LayoutState:
    """Validate an existing cache root without writing (:class:`LayoutError`: not one this code can use)."""
    # One stat decides: "a directory?" then "anything there?" would take a directory
    # another process made in between for a file.
    try:
        st = os.stat(root)
    except (FileNotFoundError, NotADirectoryError):
        try:
            target = os.readlink(root)
        except OSError:
            return LayoutState.MISSING  # nothing there (or a parent is not a directory: create fails)
        raise LayoutError(f"cache path {root!r} is a symlink to {target!r}, which does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise LayoutError(f"cache path {root!r} exists and is not a directory")
    try:
        data = _read_layout(os.path.join(root, LAYOUT_FILE))
    except FileNotFoundError:
        data, present = None, False
    else:
        present = True
    if data is not None:
        check_layout_data(root, data)
        return LayoutState.OK
    with os.scandir(root) as it:
        foreign = sorted(e.name for e in it if e.name not in _OWN_NAMES)
    if foreign:
        hint = ""
        if "entries" in foreign:
            hint = " (it looks like a FileStreamProgramCache: import it with `cuda-program-cas import-filestream`)"
        raise LayoutError(
            f"directory {root!r} is not a cuda-program-cas cache: it holds {', '.join(map(repr, foreign[:5]))}"
            f"{', ...' if len(foreign) > 5 else ''}{hint}"
        )
    return LayoutState.DAMAGED if present else LayoutState.MISSING


def damaged_layout_error(root: str) -> LayoutError:
    """The one message for a cache whose ``layout.json`` is damaged."""
    return LayoutError(
        f"cache at {root!r} has a damaged layout.json; repair it with `cuda-program-cas verify --repair` "
        "from an account that can write there"
    )


def is_shared_store(root: str) -> bool:
    """True when ``layout.json`` marks ``root`` as a shared store (``publish`` does)."""
    data = _stored_layout(root)
    return data is not None and data.get("shared") is True


def write_layout(root: str, tmp_dir: str, **changes: object) -> None:
    """Rewrite ``layout.json`` atomically with ``changes``, keeping what else it says (damaged: afresh)."""
    path = os.path.join(root, LAYOUT_FILE)
    try:
        data = _read_layout(path)
    except FileNotFoundError:
        data = None
    raw = layout_bytes(data, **changes)
    if raw is not None:
        atomic_write(path, raw, tmp_dir, mode=0o644)


def layout_bytes(current: dict[str, object] | None, **changes: object) -> bytes | None:
    """``layout.json``'s bytes saying ``current`` (None: a new layout) with ``changes``; None: no change."""
    base = {"layout": LAYOUT_NAME, "version": LAYOUT_VERSION, "blob_hash": "blake3", "key_hash": "sha256"}
    new = dict(current if current is not None else base)
    new.update(changes)
    if new == current:
        return None
    return (json.dumps(new, indent=2, sort_keys=True) + "\n").encode()


def mark_shared_store(root: str, tmp_dir: str) -> None:
    """Record in ``layout.json`` that ``root`` is a shared store, so its collector is careful."""
    if layout_version(root) is None:
        raise LayoutError(f"cannot mark {root!r} as a shared store: its {LAYOUT_FILE} is missing or damaged")
    write_layout(root, tmp_dir, shared=True)


def create_layout(root: str) -> None:
    """Lay out ``root`` if it holds no cache yet; ``layout.json`` is written last, atomically.

    A damaged ``layout.json`` is rewritten (with a warning): every manifest and blob carries
    its own identity, so nothing is trusted on the layout's word.
    """
    state = check_layout(root)
    if state is LayoutState.OK:
        return
    if state is LayoutState.DAMAGED:
        _log.warning("cuda-program-cas: rewriting damaged %s in %s", LAYOUT_FILE, root)
    lay = Layout(root)
    os.makedirs(root, exist_ok=True)
    for sub in (lay.blobs, lay.index):
        os.makedirs(sub, exist_ok=True)
    make_tmp_dir(lay.tmp)
    tag = os.path.join(root, "CACHEDIR.TAG")
    if not os.path.exists(tag):
        atomic_write(tag, CACHEDIR_TAG, lay.tmp, mode=0o644)
    write_layout(root, lay.tmp, version=LAYOUT_VERSION)


def unwritable_reason(lay: Layout) -> str | None:
    """Why this process cannot write the cache at ``lay`` (naming the directory), or None when it can."""
    for directory in (lay.root, lay.index, lay.blobs, lay.tmp):
        if os.path.isdir(directory) and not os.access(directory, os.W_OK):
            why = "permission denied"
            try:
                if os.statvfs(directory).f_flag & os.ST_RDONLY:
                    why = "read-only filesystem"
            except (OSError, AttributeError):
                pass
            return f"{why}: {directory}"
    return None


def temp_files(tmp_dir: str) -> list[tuple[str, os.stat_result]]:
    """Every file in ``tmp_dir`` (writes in flight and crashed writers' leftovers), with its stat."""
    found = []
    try:
        with os.scandir(tmp_dir) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    found.append((entry.path, st))
    except OSError:
        pass
    return found


def stale_temp_files(tmp_dir: str) -> list[tuple[str, os.stat_result]]:
    """Files in ``tmp_dir`` older than :data:`STALE_TMP_S`, with their stat."""
    now_ns = time.time_ns()
    cutoff = now_ns - int(STALE_TMP_S * 1e9)
    return [(path, st) for path, st in temp_files(tmp_dir) if trusted_mtime_ns(st.st_mtime_ns, now_ns) < cutoff]
