"""Warm sets: the entries a job used, kept in its shared stores, so that a cold node fetches them in a few
requests rather than a round trip per kernel (docs/cluster.md, "Cold nodes").

The job is ``$CUDA_PROGRAM_CAS_JOB``, else the main script's name and a hash of its path (an
interactive session and ``off``: none). Its set, ``sets/<sha256 of the job>`` in each store, lists
each entry used, in order of first use, with its pack place where known (:data:`MAX_ENTRIES` at
most); write-back sends it once the job is quiet (:data:`QUIET_S`) and at exit, when it lacks an
entry used. The merge puts the writer's entries first; two writers at once lose one's additions
until the next run. A line is a hint: a key gets only what its own entry names (:mod:`.fetchbatch`).
At the first local miss a thread fetches the entries not local, while they fit the cap; a lookup
meanwhile waits for its own entry's fetch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cuda_program_cas._base.config import VAR_JOB
from cuda_program_cas._base.fork import ForkSafeLock, after_fork
from cuda_program_cas._disk.packset import is_pack_name
from cuda_program_cas.index import is_hex, is_local_id

from .tier import Tier

__all__ = [
    "MAX_SET_BYTES",
    "QUIET_S",
    "SetEntry",
    "Used",
    "WarmFetch",
    "Where",
    "encode",
    "job_name",
    "merge",
    "parse",
    "parse_job",
    "set_name",
    "stored_sets",
    "updated",
]

_log = logging.getLogger("cuda_program_cas")

#: Entries a set holds at most (a large job uses a few hundred kernels).
MAX_ENTRIES = 4096
#: A set's bytes at most: a line is at most about 190 bytes.
MAX_SET_BYTES = 1 << 20
#: Seconds without a new entry before write-back sends the set (and when the process exits).
QUIET_S = 2.0
#: How long a lookup waits for the set to be read and its entry fetched, at most (each request has its deadline).
WAIT_S = 60.0
#: The folder of a store that holds its sets.
SETS = "sets"
_HEADER = b"cuda-program-cas set 1\n"


def parse_job(text: str) -> str:
    """A job's name: printable, at most 200 characters; ``off`` turns warm sets off."""
    name = text.strip()
    if len(name) > 200 or not name.isprintable():
        raise ValueError("a job is a printable name of at most 200 characters (or off)")
    return name


def job_name() -> str | None:
    """This process's job: ``$CUDA_PROGRAM_CAS_JOB``, else the main script's name and a hash of its path; or None."""
    given = VAR_JOB.value()
    if given is not None:
        return None if given.lower() == "off" else given
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if not isinstance(script, str) or not script:
        return None  # a REPL, ``-c``, a notebook's kernel
    path = os.path.realpath(script)
    return f"{os.path.basename(path)}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


def set_name(job: str) -> str:
    return f"{SETS}/" + hashlib.sha256(job.encode()).hexdigest()


def stored_sets(root: str) -> list[str]:
    """The sets a store directory holds, as object names."""
    try:
        names = os.listdir(os.path.join(root, SETS))
    except OSError:
        return []
    return sorted(f"{SETS}/{n}" for n in names if is_hex(n, 64))


@dataclass(frozen=True, slots=True)
class SetEntry:
    """One entry of a set; where known its blob's pack, offset and stored length, and (``at``) its index entry."""

    kid: str
    digest: str
    size: int
    pack: str | None = None
    offset: int | None = None
    length: int | None = None
    at: int | None = None

    def line(self) -> bytes:
        where = ""
        if self.pack is not None and self.offset is not None and self.length is not None and self.at is not None:
            where = f" {self.pack} {self.offset} {self.length} {self.at}"
        return f"{self.kid} {self.digest} {self.size}{where}\n".encode()


def encode(entries: Sequence[SetEntry]) -> bytes:
    """A set's bytes: the header, one line per entry, and ``end N`` (a set cut short is a bad one)."""
    return _HEADER + b"".join(e.line() for e in entries) + b"end %d\n" % len(entries)


def parse(data: bytes | None) -> list[SetEntry] | None:
    """The entries of a set's bytes, in order; None when they are not a whole set (a bad line spoils it)."""
    if data is None or not data.startswith(_HEADER) or not data.endswith(b"\n"):
        return None
    lines = data[len(_HEADER) : -1].decode("ascii", "replace").split("\n")
    if lines.pop() != f"end {len(lines)}" or len(lines) > MAX_ENTRIES:
        return None
    out: list[SetEntry] = []
    seen: set[str] = set()
    for line in lines:
        fields = line.split(" ")
        if len(fields) not in (3, 7) or not is_hex(fields[0], 64) or not is_hex(fields[1], 64):
            return None
        if not all(f.isascii() and f.isdigit() for f in fields[2:3] + fields[4:]):
            return None
        if (len(fields) > 3 and not is_pack_name(fields[3])) or fields[0] in seen:
            return None
        seen.add(fields[0])
        if len(fields) == 7:
            kid, digest, size, pack, offset, length, at = fields
            out.append(SetEntry(kid, digest, int(size), pack, int(offset), int(length), int(at)))
        else:
            out.append(SetEntry(fields[0], fields[1], int(fields[2])))
    return out


def merge(ours: Sequence[SetEntry], theirs: Sequence[SetEntry], gone: set[str]) -> list[SetEntry] | None:
    """The set to write: ours first, then theirs not ours and not gone; None: nothing new."""
    known = {e.kid: e for e in theirs}
    if all((k := known.get(e.kid)) is not None and k.digest == e.digest and (e.pack is None or k == e) for e in ours):
        return None
    mine = {e.kid for e in ours}
    merged = list(ours) + [e for e in theirs if e.kid not in mine and e.kid not in gone]
    return merged[:MAX_ENTRIES]


#: ``(pack, offset, length, at)``: the pack (its file name), offset and stored length that hold an entry's blob, and
#: where its index entry lies in that pack (-1: not known).
Place = tuple[str, int, int, int]
#: ``where(kid, digest)``: the place of this entry in a store now; None: loose there.
Where = Callable[[str, str], "Place | None"]


def _at(e: SetEntry, place: Place | None) -> SetEntry:
    if place is None or place[3] < 0:
        return SetEntry(e.kid, e.digest, e.size)
    return SetEntry(e.kid, e.digest, e.size, *place)


def updated(
    held: bytes | None, ours: Sequence[SetEntry], gone: set[str] | None = None, where: Where | None = None
) -> bytes | None:
    """The bytes to store for a set held as ``held`` (None: none there); None when ``held`` is right.

    The one read-modify-write of a set (write-back's, publish's, repack's): ``ours`` merged in, then
    with ``where`` every line placed anew. A damaged ``held`` is replaced by ours, if any.
    """
    theirs = parse(held)
    base = theirs or []
    merged = merge(ours, base, gone or set())
    out = base if merged is None else merged
    if where is not None:
        out = [_at(e, where(e.kid, e.digest)) for e in out]  # each placed anew
    if not out or out == theirs:
        return None
    return encode(out)


class Used:
    """The entries one process used, in order of first use (thread-safe).

    ``changed()`` runs (outside the lock) when an entry the set read at start lacks is first used.
    """

    def __init__(self) -> None:
        self._order: dict[str, tuple[str, int]] = {}
        self._lock = ForkSafeLock()
        self.known: dict[str, SetEntry] = {}  # the set as read at start (the fetch fills it)
        self.changed: Callable[[], None] | None = None

    def add(self, kid: str, digest: str, size: int) -> None:
        """Record one use (a dict lookup when ``kid`` was used before: this is on the hot path)."""
        if kid in self._order or is_local_id(kid):
            return
        with self._lock:
            if kid in self._order or len(self._order) >= MAX_ENTRIES:
                return
            self._order[kid] = (digest, size)
        known = self.known.get(kid)
        if (known is None or known.digest != digest) and self.changed is not None:
            self.changed()

    def entries(self, where: Callable[[str], Place | None] | None = None) -> list[SetEntry]:
        """What was used, in order; with the place ``where(kid)`` says, else the one the set read said."""
        with self._lock:
            used = list(self._order.items())
        out = []
        for kid, (digest, size) in used:
            e = SetEntry(kid, digest, size)
            place = where(kid) if where is not None else None
            known = self.known.get(kid)
            if place is None and known is not None and known.digest == digest and known.pack is not None:
                out.append(known)  # as the set said: the store's packs not listed in this process
            else:
                out.append(_at(e, place))
        return out


class WarmFetch:
    """One process's fetch of its job's set from ``tiers``, in a thread of its own.

    ``keep(kid, bytes, digest)`` copies a verified entry in; ``room``: bytes the entries may take, or None.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        name: str,
        *,
        is_local: Callable[[str, str], bool],
        keep: Callable[[str, bytes | memoryview, str], None],
        room: int | None,
        used: Used | None,
        per_entry: int = 0,
    ) -> None:
        self.tiers = tuple(tiers)
        self.name = name
        self._is_local = is_local
        self._keep = keep
        self._room = room
        self._per_entry = per_entry
        self._used = used
        self._read = threading.Event()  # the set was read (or could not be)
        self._lock = threading.Lock()
        self._pending: dict[str, threading.Event] = {}
        self._had: set[str] = set()  # fetched and kept: a lookup that missed just before is told to look again
        #: The store the set came from, what it listed, and what was fetched.
        self.source: Tier | None = None
        self.listed = 0
        self.fetched = 0
        self.gone: set[str] = set()
        self._thread: threading.Thread | None = None
        after_fork(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # the thread did not come along: nothing is on the way
        self._pending = {}
        self._read.set()

    def start(self) -> None:
        """Begin the fetch in its thread, once (at the first local miss: a warm node never reads the set)."""
        with self._lock:
            if self._thread is not None or self._read.is_set():
                return
            self._thread = threading.Thread(target=self._run, name="cuda-program-cas-warm-set", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the fetch to end (starting it now if no miss has yet); True when it has."""
        self.start()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def wait(self, kid: str) -> str | None:
        """After a local miss of ``kid``: wait for the set, then for ``kid``'s fetch; the store's root if it came."""
        self.start()
        if not self._read.wait(WAIT_S):
            return None
        with self._lock:
            event = self._pending.get(kid)
            came = kid in self._had
        if event is None:  # never listed, or kept already (after this lookup's local miss)
            return self.source.root if came and self.source is not None else None
        event.wait(WAIT_S)
        return self.source.root if self.source is not None else None

    def _run(self) -> None:
        try:
            self._fetch()
        except Exception:  # never into the caller: a lookup that waited goes on as usual
            _log.debug("cuda-program-cas: the warm set %s could not be fetched", self.name, exc_info=True)
        finally:
            self._read.set()
            with self._lock:
                pending, self._pending = self._pending, {}
            for event in pending.values():
                event.set()

    def _fetch(self) -> None:
        entries = None
        for tier in self.tiers:
            entries = parse(tier.get_object(self.name, MAX_SET_BYTES))
            if entries is not None:
                self.source = tier
                break
        if entries is None or self.source is None:
            return
        if self._used is not None:
            self._used.known = {e.kid: e for e in entries}
        self.listed = len(entries)
        wanted: list[SetEntry] = []
        total = 0
        for e in entries:  # in order of use, while they fit the cap
            if self._is_local(e.kid, e.digest):
                continue
            cost = e.size + self._per_entry
            if self._room is not None and total + cost > self._room:
                break
            total += cost
            wanted.append(e)
        with self._lock:
            for e in wanted:
                self._pending[e.kid] = threading.Event()
        self._read.set()
        had = set()

        def kept(kid: str, data: bytes | memoryview, digest: str) -> None:
            self._keep(kid, data, digest)
            had.add(kid)
            self.fetched += 1
            with self._lock:
                self._had.add(kid)
                event = self._pending.pop(kid, None)
            if event is not None:
                event.set()

        self.source.fetch_entries(wanted, kept)
        self.gone = {e.kid for e in wanted} - had
        _log.debug(
            "cuda-program-cas: warm set %s from %s: %d entries listed, %d fetched, %d not had",
            self.name,
            self.source.root,
            len(entries),
            len(had),
            len(self.gone),
        )
