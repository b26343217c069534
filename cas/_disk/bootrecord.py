"""Blobs verified in this boot: a fresh process need not hash a blob whose file is provably the one verified.

A blob's file identity (:data:`cuda_program_cas._disk.files.FileId`) proves it unchanged
since it was hashed, as ccache's inode cache does, provided that the record is of this boot
(it carries the boot id), that the file's ctime was at least :data:`MIN_AGE_NS` old when
hashed (any later change sets a later ctime), and that the file system sets ctime on every
change (a local one: :data:`cuda_program_cas._disk.fskind.CTIME_RELIABLE`).

The record, ``<root>/verified``, is a header and a fixed table of open-addressed slots, each
a digest, its identity and a check (8 bytes of hashlib's blake2b: no blake3 to load), read
with one ``pread`` per lookup. A torn or damaged slot fails its check; a record of the
wrong size, magic or boot, or that another user owns or may write, is not consulted.
See ``docs/guarantees.md``.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import threading
from typing import Any

from cuda_program_cas._base.fork import after_fork

from .atomic import atomic_write
from .files import FileId
from .layout import BOOT_RECORD_FILE

__all__ = ["BOOT_ID_FILE", "MIN_AGE_NS", "BootRecord", "boot_id", "old_enough"]

#: Module attributes: tests point them elsewhere in their processes.
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
MIN_AGE_NS = 2 * 10**9

_MAGIC = b"CASBOOT2"  # 1: checks were blake3's (such a record is replaced, as a damaged one is)
_HEADER = struct.Struct("<8s36sII")  # magic, boot id, slot count, slot size
_HEADER_BYTES = 64
_BODY = struct.Struct("<32s3Q2q")  # digest, st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns
_CHECK_BYTES = 8
_SLOT_BYTES = _BODY.size + _CHECK_BYTES
_SLOTS = 16384
_PROBES = 8
_RECORD_BYTES = _HEADER_BYTES + _SLOTS * _SLOT_BYTES
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_boot: list[str | None] = []


def old_enough(identity: FileId, now_ns: int) -> bool:
    """Whether a file of ``identity`` hashed at ``now_ns`` may be remembered as verified (ctime MIN_AGE_NS old)."""
    return now_ns - identity[4] >= MIN_AGE_NS


def boot_id() -> str | None:
    """This boot's id (read once per process), or None where the system gives none."""
    if not _boot:
        try:
            with open(BOOT_ID_FILE, "rb") as f:
                raw = f.read(64).strip()
            _boot.append(raw.decode("ascii") if len(raw) == 36 else None)
        except (OSError, UnicodeDecodeError):
            _boot.append(None)
    return _boot[0]


class BootRecord:
    """The record of one cache root's verified blobs (``blobs`` its blob directory); opened on first use.

    ``writable``: entries may be added, and a record of another boot or damaged replaced.
    Safe to share between threads and across a fork.
    """

    def __init__(self, root: str, blobs: str, tmp_dir: str, *, writable: bool) -> None:
        self._path = os.path.join(root, BOOT_RECORD_FILE)
        self._blobs = blobs
        self._tmp = tmp_dir
        self._writable = writable
        self._lock = threading.Lock()
        #: None: not opened yet; False: not to be used in this process; else (descriptor, device of blobs/).
        self._state: Any = None
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def _slots(self, digest: str, identity: FileId) -> tuple[int, bytes, bytes] | None:
        """The record's descriptor, the slot body for ``digest`` and the slots it may use; None: no record."""
        state = self._state
        if state is None:
            state = self._open()
        if state is False or identity[0] != state[1]:
            return None
        body = _BODY.pack(bytes.fromhex(digest), *identity)
        # One read: the table is laid out so that a digest's probe slots are adjacent.
        window = os.pread(state[0], _PROBES * _SLOT_BYTES, _HEADER_BYTES + _first_slot(body) * _SLOT_BYTES)
        return state[0], body, window

    def vouches(self, digest: str, identity: FileId) -> bool:
        """True when this boot's record says blob ``digest`` was verified as the file ``identity`` describes."""
        try:
            found = self._slots(digest, identity)
        except (ValueError, struct.error, OSError):
            return False
        if found is None:
            return False
        _, body, window = found
        # A search in C; a digest's bytes found across two slots are at no slot's start.
        at = window.find(body[:32])
        while at > 0 and at % _SLOT_BYTES:
            at = window.find(body[:32], at + 1)
        if at < 0:
            return False
        slot = window[at : at + _SLOT_BYTES]
        return slot[: _BODY.size] == body and slot[_BODY.size :] == _check(body)

    def enter(self, digest: str, identity: FileId, now_ns: int) -> None:
        """Record that blob ``digest`` hashed right as the file ``identity``, at ``now_ns`` (when old enough)."""
        if not self._writable or not old_enough(identity, now_ns):
            return
        try:
            found = self._slots(digest, identity)
            if found is None:
                return
            fd, body, window = found
            first = _first_slot(body)
            where = first
            for i in range(_PROBES):
                head = window[i * _SLOT_BYTES : i * _SLOT_BYTES + 32]
                if head == body[:32] or head == bytes(32):
                    where = (first + i) % _SLOTS
                    break
            # A full probe window: its first slot gives way (a record, not the truth: a blob left out is hashed).
            os.pwrite(fd, body + _check(body), _HEADER_BYTES + where * _SLOT_BYTES)
        except (ValueError, struct.error, OSError):
            pass

    def _open(self) -> Any:
        with self._lock:
            if self._state is None:
                self._state = self._try_open()
            return self._state

    def _try_open(self) -> Any:
        from .fskind import ctime_reliable_device

        boot = boot_id()
        if boot is None:
            return False
        try:
            device = os.stat(self._blobs).st_dev
        except OSError:
            return False
        if not ctime_reliable_device(device):
            return False
        opened = self._opened(boot)
        if opened is None and self._writable:
            header = _HEADER.pack(_MAGIC, boot.encode("ascii"), _SLOTS, _SLOT_BYTES).ljust(_HEADER_BYTES, b"\0")
            try:
                atomic_write(self._path, [header, bytes(_SLOTS * _SLOT_BYTES)], self._tmp)
            except OSError:
                return False
            opened = self._opened(boot)
        return False if opened is None else (opened, device)

    def _opened(self, boot: str) -> int | None:
        """A descriptor of the record, if it is this boot's, well formed and this user's alone."""
        try:
            fd = os.open(self._path, (os.O_RDWR if self._writable else os.O_RDONLY) | _O_NOFOLLOW)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            want = _HEADER.pack(_MAGIC, boot.encode("ascii"), _SLOTS, _SLOT_BYTES)
            if (
                stat.S_ISREG(st.st_mode)
                and st.st_size == _RECORD_BYTES
                and st.st_uid == os.geteuid()
                and not st.st_mode & 0o022
                and os.pread(fd, _HEADER.size, 0) == want
            ):
                return fd
        except OSError:
            pass
        os.close(fd)
        return None


def _first_slot(body: bytes) -> int:
    """Where a digest's probe window starts: its first bytes, kept clear of the table's end."""
    return int.from_bytes(body[:4], "little") % (_SLOTS - _PROBES + 1)


def _check(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=_CHECK_BYTES).digest()
