"""Which file systems are local enough to trust: ``statfs`` ``f_type`` against an allowlist.

The header watch needs a file system whose every change raises an inotify event
(:data:`WATCHABLE`); the NVRTC version record one whose stat data prove a file unchanged
(:data:`STAT_RELIABLE`); the boot record one that sets ctime from this kernel's clock on
every change (:data:`CTIME_RELIABLE`). Local disk and memory file systems answer all three.
overlayfs misses events for changes to its lower layers, but its stat data still change
(a write copies up; changing a lower layer while mounted is undefined). NFS, SMB, FUSE,
Lustre and anything unknown are not trusted; off Linux nothing is.

:class:`FsClock` says how old a file's stat data are on the clock that stamped them: they
prove a file unchanged only once that clock moved a step past its ctime (one second on
ext3, ext4 with 128-byte inodes, FAT or a coarse NFS export).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

__all__ = [
    "CLOCK_LAG_NS",
    "CTIME_RELIABLE",
    "STAT_RELIABLE",
    "WATCHABLE",
    "FsClock",
    "ctime_reliable_device",
    "fs_type",
    "time_step_ns",
]

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
STAT_RELIABLE = WATCHABLE | {_OVERLAYFS}
CTIME_RELIABLE = WATCHABLE

# struct statfs starts with f_type (a long); 120 bytes on x86-64 and aarch64.
_STATFS_SIZE = 256


def fs_type(path: str) -> int | None:
    """The ``f_type`` of the file system holding ``path`` (followed); None when it cannot be had."""
    statfs = _bind_statfs()
    if statfs is None:
        return None
    import ctypes

    buf = ctypes.create_string_buffer(_STATFS_SIZE)
    if statfs(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


@functools.cache
def _bind_statfs() -> Any:
    """libc's statfs, bound on first use (ctypes costs about 2 ms to import); None here."""
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


def ctime_reliable_device(device: int) -> bool:
    """Whether ``device`` (an ``st_dev``) is mounted here, by every mount of it, as one of :data:`CTIME_RELIABLE`.

    Read from the mount table without ctypes: about 20 us.
    """
    try:
        with open("/proc/self/mountinfo", "rb") as f:
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


#: The step assumed of a clock of whole seconds (FAT keeps 2 s), and the margin for a file
#: system whose clock is another machine's and cannot be read.
UNKNOWN_STEP_NS = 2 * 10**9
#: How far this kernel's file times may lag ``time.time_ns()`` (its coarse clock: a tick).
CLOCK_LAG_NS = 50_000_000


def time_step_ns(t_ns: int) -> int:
    """The coarsest step of a file system clock that could have stamped ``t_ns``: a power of ten of ns,
    or :data:`UNKNOWN_STEP_NS` for a whole second (a finer time taken as coarser only errs young).
    """
    if t_ns % 1_000_000_000 == 0:
        return UNKNOWN_STEP_NS
    step = 1
    while t_ns % (step * 10) == 0:
        step *= 10
    return step


class FsClock:
    """Lower bounds of the clocks of file systems at one moment: when this was made.

    ``own_dir`` (the cache's ``tmp``) is touched to read its file system's own clock. Other
    devices are measured against ``time.time_ns()`` less :data:`CLOCK_LAG_NS`, and less
    :data:`UNKNOWN_STEP_NS` more where another machine stamps them (docs/guarantees.md).
    """

    __slots__ = ("_local", "_own", "_wall")

    def __init__(self, own_dir: str | None) -> None:
        from .files import fs_now

        self._own: tuple[int, int] | None = None
        if own_dir is not None:
            try:
                device = os.stat(own_dir).st_dev
            except OSError:
                pass
            else:
                now = fs_now(own_dir)
                if now is not None:
                    self._own = (device, now)
        self._wall = time.time_ns()
        self._local: dict[int, bool] = {}

    def now(self, device: int) -> int:
        """A time no later than the clock that stamps files of ``device`` read when this was made."""
        own = self._own
        if own is not None and own[0] == device:
            return own[1]
        local = self._local.get(device)
        if local is None:
            local = self._local[device] = ctime_reliable_device(device)
        return self._wall - CLOCK_LAG_NS - (0 if local else UNKNOWN_STEP_NS)

    def old(self, st: os.stat_result) -> bool:
        """Whether any change to the file of ``st`` after this moment gives it another ctime."""
        return self.old_at(st.st_dev, st.st_ctime_ns)

    def old_at(self, device: int, ctime_ns: int) -> bool:
        """:meth:`old` of a file of ``device`` whose ctime is ``ctime_ns``."""
        return ctime_ns + time_step_ns(ctime_ns) <= self.now(device)
