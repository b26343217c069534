"""Change notification for the front door's headers: one inotify queue instead of a stat per header.

:func:`arm` watches every inode a variant's stat check depends on (467 for the
CUB block-reduce kernel): each directory a lookup of each header, guard and
candidate passes through, in the kernel's order, before a name in it is looked
up, and each header. Once a check passes with the watches armed, the variant is
clean until an event touches one: a lookup costs one ``epoll_wait``. Everything
is dirty on a queue overflow, a change of the mount table, and in a forked
child. A watch that cannot be added, or a file system not known to raise every
event, keeps the stat check. Not seen (docs/guarantees.md): writes through a
shared ``mmap`` until unmapped. Linux only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import stat
import struct
import sys
import threading
from collections.abc import Iterable
from typing import Any

from cuda_program_cas._base.fork import after_fork_call
from cuda_program_cas._base.log import LOGGER as _log
from cuda_program_cas._disk.fskind import WATCHABLE, fs_type

__all__ = ["Token", "arm"]


IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
#: Events that add, remove or rename an entry of a directory.
_ENTRY_EVENTS = IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
#: What a watch asks for (IN_UNMOUNT, IN_Q_OVERFLOW and IN_IGNORED come unasked).
_EVENTS = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | _ENTRY_EVENTS | IN_DELETE_SELF | IN_MOVE_SELF
_EVENT = struct.Struct("iIII")
#: As the kernel: at most 40 symlinks followed in one lookup.
_MAX_LINKS = 40
#: A sixteenth of the user's watches (8,192 on older kernels): 8 ranks of a job leave
#: half to editors and build tools. A CUB kernel takes about 470.
_SHARE = 16


class _Unwatchable(Exception):
    pass


class Token:
    """What :func:`arm` returns: clean while no event touched what it watched since."""

    __slots__ = ("_seq", "_verified", "_watcher", "_wds")

    def __init__(self, watcher: _Watcher, seq: int, wds: frozenset[int]) -> None:
        self._watcher, self._seq, self._wds, self._verified = watcher, seq, wds, seq

    def clean(self) -> bool:
        """True while nothing this token watches changed since it was armed (reads the queue first)."""
        w = self._watcher
        if not w.alive:  # a forked child's copy: its lock may be held by a thread that is not there
            return False
        with w.lock:
            w.drain()
            last = w.last_change
            if last == self._verified:
                return True
            seq = self._seq
            if w.all_changed > seq:
                return False
            changed = w.changed
            for wd in self._wds:
                if changed.get(wd, 0) > seq:
                    return False
            self._verified = last
            return True


class _Watcher:
    def __init__(self, fd: int, mounts: int, poller: select.epoll, budget: int, add_watch: Any) -> None:
        self.fd, self.mounts, self.poller, self.budget, self.add_watch = fd, mounts, poller, budget, add_watch
        self.lock = threading.Lock()
        self.alive = True
        #: One counter orders arms and changes: a token armed at n is dirty once a change > n touched it.
        self.seq = self.last_change = self.all_changed = 0
        self.changed: dict[int, int] = {}
        #: Per watch: the entry names whose events count, and whether every entry's creation or removal does.
        self.names: dict[int, set[str]] = {}
        self.every_entry: set[int] = set()
        #: st_dev -> whether its file system raises an event for every change; cleared when mounts change.
        self.local: dict[int, bool] = {}

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def drain(self) -> None:
        ready = self.poller.poll(0)
        if not ready:
            return
        for fd, _mask in ready:
            if fd == self.mounts:  # a mount or unmount may hide or show any directory
                self._everything_changed()
            else:
                self._read_events()

    def _everything_changed(self) -> None:
        self.all_changed = self.last_change = self.next_seq()
        self.local.clear()

    def _read_events(self) -> None:
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                self._everything_changed()
                return
            if not buf:
                return
            at, end = 0, len(buf)
            while at + 16 <= end:
                wd, mask, _cookie, size = _EVENT.unpack_from(buf, at)
                name = buf[at + 16 : at + 16 + size].rstrip(b"\0")
                at += 16 + size
                self._event(wd, mask, name)

    def _event(self, wd: int, mask: int, raw_name: bytes) -> None:
        if mask & IN_Q_OVERFLOW:
            self._everything_changed()  # events were lost: any of them may have mattered
            return
        if mask & IN_IGNORED:  # the watch is gone (inode removed, file system unmounted)
            self.names.pop(wd, None)
            self.every_entry.discard(wd)
        elif raw_name:
            name = os.fsdecode(raw_name)
            if name not in self.names.get(wd, ()) and not (mask & _ENTRY_EVENTS and wd in self.every_entry):
                return  # another entry of a directory on the way
        self.changed[wd] = self.last_change = self.next_seq()

    def close(self) -> None:
        self.alive = False
        self.lock = threading.Lock()  # in a forked child, a thread of the parent may have held it
        for close in (self.poller.close, lambda: os.close(self.fd), lambda: os.close(self.mounts)):
            try:
                close()
            except OSError:
                pass


class _Arming:
    def __init__(self, watcher: _Watcher) -> None:
        self._w = watcher
        self.wds: set[int] = set()
        self._dirs: dict[str, int] = {}
        self._steps: dict[tuple[str, str], str | None] = {}

    def walk(self, path: str, *, guard: bool) -> None:
        """Watch what resolving ``path`` depends on; a ``guard`` directory's every entry counts."""
        if not path.startswith("/"):
            raise _Unwatchable(f"{path!r} is not absolute")
        if not self._dirs:
            self._watch("/", os.lstat("/"), directory=True)
        reached = self._resolve("/", path.split("/"), 0)
        if guard and reached is not None and reached in self._dirs:
            self._w.every_entry.add(self._dirs[reached])

    def _resolve(self, cur: str, parts: list[str], depth: int) -> str | None:
        """The physical path ``parts`` lead to from ``cur``; None where the kernel's walk fails."""
        for name in parts:
            if name in ("", "."):
                continue
            if cur not in self._dirs:
                return None  # a name after a file: ENOTDIR
            if name == "..":
                cur = os.path.dirname(cur)  # a directory walked through already
                continue
            found = self._step(cur, name, depth)
            if found is None:
                return None
            cur = found
        return cur

    def _step(self, cur: str, name: str, depth: int) -> str | None:
        key = (cur, name)
        if key in self._steps:
            return self._steps[key]
        self._w.names.setdefault(self._dirs[cur], set()).add(name)  # before the lookup: later changes count
        child = f"{cur}/{name}" if cur != "/" else f"/{name}"
        found: str | None
        try:
            st = os.lstat(child)
        except OSError:
            found = None  # missing: its creation is an event of cur
        else:
            if stat.S_ISLNK(st.st_mode):
                found = None
                if depth < _MAX_LINKS:
                    try:
                        target = os.readlink(child)
                    except OSError:
                        target = None
                    if target is not None:
                        start = "/" if target.startswith("/") else cur
                        found = self._resolve(start, target.split("/"), depth + 1)
            else:
                self._watch(child, st, directory=stat.S_ISDIR(st.st_mode))
                found = child
        self._steps[key] = found
        return found

    def _watch(self, path: str, st: os.stat_result, *, directory: bool) -> None:
        w = self._w
        local = w.local.get(st.st_dev)
        if local is None:
            local = w.local[st.st_dev] = fs_type(path) in WATCHABLE
        if not local:
            raise _Unwatchable(f"{path} is on a file system that may change without an event here")
        flags = _EVENTS | IN_DONT_FOLLOW | (IN_ONLYDIR if directory else 0)
        wd = w.add_watch(w.fd, os.fsencode(path), flags)
        if wd < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOENT, errno.ENOTDIR):
                return  # replaced since its lookup: an event of its directory says so
            raise _Unwatchable(f"inotify_add_watch({path}) failed: {os.strerror(err)}")
        w.names.setdefault(wd, set())
        self.wds.add(wd)
        if len(w.names) > w.budget:
            raise _Unwatchable(f"this process holds its share of inotify watches ({w.budget})")
        if directory:
            self._dirs[path] = wd


class _Process:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.lock = threading.Lock()
        self.watcher: _Watcher | None = None
        self.tried = False


_P = _Process()
_libc: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.inotify_init1.argtypes = (ctypes.c_int,)
        _libc.inotify_add_watch.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
    except (OSError, AttributeError):
        _libc = None


def _start() -> _Watcher | None:
    with _P.lock:
        if _P.tried or _libc is None:
            return _P.watcher
        _P.tried = True
        _P.watcher = _make(_libc)
        return _P.watcher


def _make(libc: ctypes.CDLL) -> _Watcher | None:
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        # EMFILE: the user's 128 inotify instances (fs.inotify.max_user_instances) are taken.
        _log.debug(
            "cuda-program-cas: front door: no inotify (%s), headers are stat'ed", os.strerror(ctypes.get_errno())
        )
        return None
    try:
        mounts = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        os.close(fd)
        _log.debug("cuda-program-cas: front door: no mount table to poll, headers are stat'ed: %r", exc)
        return None
    poller = select.epoll()
    poller.register(fd, select.EPOLLIN)
    # mountinfo is always readable: only POLLPRI/POLLERR say that the mount table changed.
    poller.register(mounts, select.EPOLLPRI | select.EPOLLERR)
    return _Watcher(fd, mounts, poller, _budget(), libc.inotify_add_watch)


def _budget() -> int:
    try:
        with open("/proc/sys/fs/inotify/max_user_watches", "rb") as fh:
            return max(0, int(fh.read()) // _SHARE)
    except (OSError, ValueError):
        return 8192 // _SHARE


def arm(headers: Iterable[str], guards: Iterable[str], absent: Iterable[str] = ()) -> Token | None:
    """Watch what a variant's check depends on, before that check runs; None when it cannot be.

    ``guards``: directories whose every entry counts. Keep the token only once the check has passed.
    """
    w = _start()
    if w is None or not w.alive:
        return None
    with w.lock:
        w.drain()
        seq = w.next_seq()
        arming = _Arming(w)
        try:
            for path in headers:
                arming.walk(path, guard=False)
            for path in guards:
                arming.walk(path, guard=True)
            for path in absent:
                arming.walk(path, guard=False)
        except (_Unwatchable, OSError) as exc:
            _log.debug("cuda-program-cas: front door: headers are stat'ed: %s", exc)
            return None
        return Token(w, seq, frozenset(arming.wds))


def _forget_in_child() -> None:
    """A forked child must never read its parent's queue: it arms its own."""
    if _P.watcher is not None:
        _P.watcher.close()  # the child's copies of the descriptors
    _P.reset()


after_fork_call(_forget_in_child)
