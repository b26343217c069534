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

A fourth question is how old a file's stat data are on the clock that stamped them
(:class:`FsClock`): stat data prove a file unchanged only once the clock of its file
system has moved past its ctime by a step of that clock, since a change within the same
step leaves every field as it was (one second on ext4 made with 128-byte inodes, ext3,
and what FAT or a coarse NFS export gives).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

__all__ = [
    "CLOCK_LAG_NS",
    "CTIME_RELIABLE",
    "MOUNTINFO",
    "STAT_RELIABLE",
    "UNKNOWN_STEP_NS",
    "WATCHABLE",
    "FsClock",
    "ctime_reliable_device",
    "fs_type",
    "time_step_ns",
]

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


# -- how old stat data are, on their file system's clock ----------------------------------

#: The step assumed of a clock whose times are whole seconds (one or two: FAT keeps mtimes
#: in 2 s), and the margin taken for a file system whose clock is not this kernel's and
#: cannot be read (NFS, FUSE... when the cache is elsewhere): as the blobs' record
#: (:data:`cuda_program_cas._disk.bootrecord.MIN_AGE_NS`).
UNKNOWN_STEP_NS = 2 * 10**9
#: How far this kernel's file times may lag ``time.time_ns()`` (its coarse clock: a tick).
CLOCK_LAG_NS = 50_000_000


def time_step_ns(t_ns: int) -> int:
    """The coarsest step of a file system clock that could have stamped ``t_ns``: a power of ten of ns,
    or :data:`UNKNOWN_STEP_NS` for a whole second.

    Measured on the time itself: a clock of 1 s steps only gives whole seconds, one of
    10 ms multiples of 10 ms. A clock of ns steps gives a multiple of 1000 one time in a
    thousand; such a time is then taken as coarser than it is, and its file is thought
    young for a microsecond longer: never the other way.
    """
    if t_ns % 1_000_000_000 == 0:
        return UNKNOWN_STEP_NS
    step = 1
    while t_ns % (step * 10) == 0:
        step *= 10
    return step


class FsClock:
    """Lower bounds of the clocks of file systems at one moment: when this was made.

    ``own_dir``: a directory the cache may touch (its ``tmp``): the mtime it gets is its
    file system's own clock (:func:`cuda_program_cas._disk.files.fs_now`), NFS server's
    included. Files of any other device are measured against ``time.time_ns()``: less a
    tick (:data:`CLOCK_LAG_NS`) where this kernel stamps them (:data:`CTIME_RELIABLE`),
    less :data:`UNKNOWN_STEP_NS` more where another machine's clock does (an NFS server
    that lags this host by more than that is not covered; docs/guarantees.md says so).
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
        #: Per device met: whether this kernel stamps its files (read from the mount table once).
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
        """Whether any change to the file of ``st`` after this moment gives it another ctime.

        True once the clock of its file system has moved a whole step (:func:`time_step_ns`)
        past its ctime: a change within the step of its last change would leave its stat
        data as they are.
        """
        return self.old_at(st.st_dev, st.st_ctime_ns)

    def old_at(self, device: int, ctime_ns: int) -> bool:
        """:meth:`old` of a file of ``device`` whose ctime is ``ctime_ns``."""
        return ctime_ns + time_step_ns(ctime_ns) <= self.now(device)
