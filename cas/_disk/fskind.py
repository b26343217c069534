"""Which file systems are local enough to trust: ``statfs`` ``f_type`` against an allowlist.

Three questions rest on it. The header watch (:mod:`cuda_program_cas._cuda.watch`)
needs a file system whose every change raises an inotify event; the NVRTC
version record (:mod:`cuda_program_cas._cuda.nvrtcver`) needs one whose stat data
(inode, size, mtime, ctime) prove a file unchanged; the record of blobs verified
in this boot (:mod:`cuda_program_cas._disk.bootrecord`) needs one that sets a
file's ctime from this kernel's clock on every change.

- Local disk and memory file systems (ext2/3/4, xfs, btrfs, f2fs, tmpfs, ramfs)
  answer both: every change goes through this kernel's VFS, which raises the
  event and sets the times.
- overlayfs raises events for changes made through it, but not for changes made
  to its lower layers beneath it (the case of an image layer shared by
  containers): no watch. Its stat data still change on every change made through
  it (a write copies the file up: a new inode), and changing a lower layer while
  it is mounted is undefined in overlayfs itself: the stat question is answered.
- Everything else is not trusted: NFS, CIFS/SMB, FUSE, 9p, Lustre, GPFS, CephFS
  and the like change on another machine (no event here; attributes come from a
  cache that may be seconds old), and a kind not named here is unknown.

Linux only (``statfs`` through libc); elsewhere nothing is trusted.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["CTIME_RELIABLE", "MOUNTINFO", "STAT_RELIABLE", "WATCHABLE", "ctime_reliable_device", "fs_type"]

#: ``f_type`` of the local file systems whose every change raises an inotify event here.
WATCHABLE = frozenset(
    {
        0xEF53,  # ext2, ext3, ext4
        0x58465342,  # xfs
        0x9123683E,  # btrfs
        0xF2F52010,  # f2fs
        0x01021994,  # tmpfs
        0x858458F6,  # ramfs
    }
)
_OVERLAYFS = 0x794C7630
#: ``f_type`` of the file systems whose stat data prove a file unchanged.
STAT_RELIABLE = WATCHABLE | {_OVERLAYFS}
#: ``f_type`` of the file systems where this kernel sets a file's ctime on every change to it,
#: changes beneath included: the local ones. Not overlayfs (a lower layer can change beneath it).
CTIME_RELIABLE = WATCHABLE

# struct statfs starts with f_type (a long on every 64-bit Linux ABI); 120 bytes on
# x86-64 and aarch64: the buffer leaves room.
_STATFS_SIZE = 256
#: libc's statfs, bound on first use (ctypes costs about 2 ms to import): [] not yet, [None] none here.
_statfs: list[Any] = []


def fs_type(path: str) -> int | None:
    """The ``f_type`` of the file system holding ``path`` (followed); None when it cannot be had."""
    if not _statfs:
        _statfs.append(_bind_statfs())
    statfs = _statfs[0]
    if statfs is None:
        return None
    import ctypes

    buf = ctypes.create_string_buffer(_STATFS_SIZE)
    if statfs(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def _bind_statfs() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        statfs = ctypes.CDLL(None, use_errno=True).statfs
        statfs.argtypes = (ctypes.c_char_p, ctypes.c_void_p)
        statfs.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return statfs


#: How ``/proc/self/mountinfo`` names the file systems of :data:`CTIME_RELIABLE`.
_CTIME_RELIABLE_NAMES = frozenset((b"ext2", b"ext3", b"ext4", b"xfs", b"btrfs", b"f2fs", b"tmpfs", b"ramfs"))
#: Where the mounts of this process are listed (a module attribute: tests read a copy they wrote).
MOUNTINFO = "/proc/self/mountinfo"


def ctime_reliable_device(device: int) -> bool:
    """Whether ``device`` (an ``st_dev``) is mounted here as a file system of :data:`CTIME_RELIABLE`.

    Read from :data:`MOUNTINFO`, without ``statfs`` (and ctypes): about 20 us. A
    device listed by no mount (a btrfs subvolume's own device number), or by mounts
    of differing kinds, is not.
    """
    try:
        with open(MOUNTINFO, "rb") as f:
            table = f.read()
    except OSError:
        return False
    needle = b" %d:%d " % (os.major(device), os.minor(device))
    kinds = set()
    at = table.find(needle)
    while at >= 0:
        start = table.rfind(b"\n", 0, at) + 1
        end = table.find(b"\n", at)
        line = table[start : len(table) if end < 0 else end].split(b" ")
        # ID, parent ID, major:minor, root, mount point, options, optional fields, "-", type, source, options.
        if len(line) > 3 and line[2] == needle[1:-1] and b"-" in line[6:]:
            kinds.add(line[line.index(b"-", 6) + 1])
        at = table.find(needle, at + 1)
    return bool(kinds) and kinds <= _CTIME_RELIABLE_NAMES
