"""The cache root: ``layout.json``, ``CACHEDIR.TAG`` and the top-level directories.

Opening a directory that is empty (or absent) lays it out. A directory holding
anything but our own names is refused, never adopted. A layout version newer than
this code is refused. A damaged ``layout.json`` in a directory that holds only our
own names is rewritten: every manifest carries its own format tag and every blob
its digest, so nothing is read on a guess.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time

from index._files import atomic_write

from ._errors import LayoutError

__all__ = [
    "LAYOUT_VERSION",
    "STALE_TMP_S",
    "Layout",
    "check_layout",
    "create_layout",
    "is_shared_store",
    "mark_shared_store",
    "stale_temp_files",
    "sweep_stale_temp_files",
]

_log = logging.getLogger("cas")

LAYOUT_NAME = "cuda-program-cas"
LAYOUT_VERSION = 1
LAYOUT_FILE = "layout.json"
BLOBS = "blobs"
INDEX = "index"
TMP = "tmp"
QUARANTINE = "quarantine"
LOCK_FILE = "evict.lock"
#: Temp files this old in ``tmp/`` belong to a crashed writer (or an interrupted
#: publish): no write takes anywhere near that long.
STALE_TMP_S = 3600.0
_OWN_NAMES = frozenset({LAYOUT_FILE, "CACHEDIR.TAG", BLOBS, INDEX, TMP, QUARANTINE, LOCK_FILE, "gc.lock"})

_LAYOUT = {"layout": LAYOUT_NAME, "version": LAYOUT_VERSION, "blob_hash": "blake3", "key_hash": "sha256"}
_CACHEDIR_TAG = (
    b"Signature: 8a477f597d28d172789f06886806bc55\n"
    b"# This file is a cache directory tag created by cuda-program-cas.\n"
    b"# For information about cache directory tags, see https://bford.info/cachedir/\n"
)


class Layout:
    """Paths of one cache root (as ``str`` for the hot path)."""

    __slots__ = ("blobs", "index", "lock", "quarantine", "root", "tmp")

    def __init__(self, root: str) -> None:
        self.root = root
        self.blobs = os.path.join(root, BLOBS)
        self.index = os.path.join(root, INDEX)
        self.tmp = os.path.join(root, TMP)
        self.quarantine = os.path.join(root, QUARANTINE)
        self.lock = os.path.join(root, LOCK_FILE)


def _read_layout(path: str) -> dict[str, object] | None:
    """The parsed layout file, or None when it is damaged (empty, not JSON, not ours)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(4096)
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("layout") != LAYOUT_NAME:
        return None
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        return None
    return data


def check_layout(root: str) -> str:
    """Validate an existing cache root without writing: ``"ok"``, ``"missing"`` or ``"damaged"``.

    Raises :class:`LayoutError` for a file, a foreign directory or a newer layout.
    """
    if not os.path.isdir(root):
        if os.path.lexists(root):
            raise LayoutError(f"cache path {root!r} exists and is not a directory")
        return "missing"
    layout_path = os.path.join(root, LAYOUT_FILE)
    try:
        data = _read_layout(layout_path)
    except FileNotFoundError:
        data = None
        present = False
    else:
        present = True
    if data is not None:
        version = data["version"]
        assert isinstance(version, int)
        if version > LAYOUT_VERSION:
            raise LayoutError(
                f"cache at {root!r} has layout version {version}, newer than this cuda-program-cas "
                f"understands ({LAYOUT_VERSION}); upgrade cuda-program-cas or use another directory"
            )
        if data.get("blob_hash") != "blake3" or data.get("key_hash") != "sha256":
            raise LayoutError(
                f"cache at {root!r} uses hashes {data.get('blob_hash')!r}/{data.get('key_hash')!r}, not blake3/sha256"
            )
        return "ok"
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
    return "damaged" if present else "missing"


def is_shared_store(root: str) -> bool:
    """True when ``layout.json`` marks ``root`` as a shared store (``publish`` does)."""
    try:
        data = _read_layout(os.path.join(root, LAYOUT_FILE))
    except OSError:
        return False
    return data is not None and data.get("shared") is True


def mark_shared_store(root: str, tmp_dir: str, *, mode: int = 0o644) -> None:
    """Record in ``layout.json`` that ``root`` is a shared store, so its collector is careful.

    Rewrites the file atomically, keeping what else it says; a no-op when marked.
    """
    path = os.path.join(root, LAYOUT_FILE)
    data = _read_layout(path)
    if data is None:
        raise LayoutError(f"cannot mark {root!r} as a shared store: its {LAYOUT_FILE} is missing or damaged")
    if data.get("shared") is True:
        return
    data["shared"] = True
    atomic_write(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode(), tmp_dir, mode=mode)


def create_layout(root: str) -> None:
    """Lay out (or repair) ``root``; ``layout.json`` is written last, atomically."""
    state = check_layout(root)
    if state == "ok":
        return
    if state == "damaged":
        _log.warning("cuda-program-cas: rewriting damaged %s in %s", LAYOUT_FILE, root)
    lay = Layout(root)
    os.makedirs(root, exist_ok=True)
    for sub in (lay.blobs, lay.index):
        os.makedirs(sub, exist_ok=True)
    os.makedirs(lay.tmp, mode=0o700, exist_ok=True)
    tag = os.path.join(root, "CACHEDIR.TAG")
    if not os.path.exists(tag):
        atomic_write(tag, _CACHEDIR_TAG, lay.tmp, mode=0o644)
    body = (json.dumps(_LAYOUT, indent=2, sort_keys=True) + "\n").encode()
    atomic_write(os.path.join(root, LAYOUT_FILE), body, lay.tmp, mode=0o644)


def stale_temp_files(tmp_dir: str, now: float | None = None) -> list[tuple[str, os.stat_result]]:
    """Files in ``tmp_dir`` older than :data:`STALE_TMP_S`, with their stat."""
    cutoff = (time.time() if now is None else now) - STALE_TMP_S
    found = []
    try:
        with os.scandir(tmp_dir) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode) and st.st_mtime < cutoff:
                    found.append((entry.path, st))
    except OSError:
        pass
    return found


def sweep_stale_temp_files(tmp_dir: str) -> int:
    """Remove the stale temp files of ``tmp_dir``, best effort; returns how many went.

    Young ones are left alone: they may be another process's write in flight.
    """
    removed = 0
    for path, _st in stale_temp_files(tmp_dir):
        try:
            os.unlink(path)
        except OSError:
            continue
        removed += 1
    return removed
