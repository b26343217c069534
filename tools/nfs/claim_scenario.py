#!/usr/bin/env python3
"""Claims on a cache that sits on NFS: processes of one mount, and of several mounts of one export.

Claims (an ``flock`` on ``tmp/<key id>.claim``) on NFS go through the client's lock emulation:
locks the server arbitrates (NLM for NFSv3, the protocol's own for NFSv4), or node-local ones
with ``nolock`` or ``local_lock=``. ``tools/nfs/scenarios.py`` runs the cases (docs/nfs-harness.md
lists them), each on fresh mounts of the export (``nosharecache``). Every process must end with
the key's right bytes whatever its claim did; :func:`check_claims` checks what the docs promise.
On plain directories (no ``--nfs-export``) the cases that need mounts are reported as skipped.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import nfs_common  # first: it makes this checkout's cuda_program_cas the one imported
from testkit.workers import answer, read_answer, spawn_worker, worker_spec

#: What :class:`Proc` notes as said once the worker's answer has come.
ANSWERED = "(answered)"

Result = dict[str, Any]

#: Where the cases mount the export (in the guest).
MOUNT_BASE = "/mnt/claims"
#: The other NFS client of the dead-node case: a network namespace, a veth pair between it and
#: the guest, the addresses on each side.
NETNS, VETH_HOST, VETH_NODE = "nfsh-node-d", "nfsh-vh", "nfsh-vg"
HOST_ADDR, NODE_ADDR = "10.99.0.1", "10.99.0.2"

#: The mounts the cases share, by name: two nodes of each kind.
MOUNTS = {
    "v4a": "rw,vers=4.2",
    "v4b": "rw,vers=4.2",
    "v4pos": "rw,vers=4.2,lookupcache=positive",
    "v3a": "rw,vers=3",
    "v3b": "rw,vers=3",
    "nolock-x": "rw,vers=3,nolock",
    "nolock-y": "rw,vers=3,nolock",
}

#: What the docs say of claims on NFS, checked by every run (see :func:`check_claims`).
CLAIMS: dict[str, float] = {
    # A holder SIGKILLed while its node lives: a waiter on its mount or another takes over within this.
    "takeover_after_kill_max_s": 5.0,
    # A claim returns within its bound (at least the first try's 1 s) and this, whatever holds the
    # lock or keeps a try from returning (a dead node, no lock daemon).
    "wait_past_bound_max_s": 2.0,
    # A waiter takes a dead node's claim over within this many of the server's leases.
    "dead_node_leases_max": 2.0,
    # A put, or a close, whatever the counters' lock does (each flushes the lifetime counters under
    # it: the flush waits at most 2 s, and a try that does not return is given up).
    "put_or_close_max_s": 5.0,
}
#: A process of the no-lock-daemon cases that has not finished after this prints its stacks and exits
#: (a compile and its write take under a second; a lock call may not return at all).
HANG_S = 120.0
#: The first try at a lock may take this long whatever the bound (claims._FIRST_TRY_S).
FIRST_TRY_S = 1.0


def value_for(key: str) -> bytes:
    """The bytes a compile of ``key`` gives: every process derives them itself (8 KiB)."""
    return hashlib.sha256(key.encode()).digest() * 256


# -- the worker: one claiming process ----------------------------------------------------------


def worker(cfg: Result) -> Result:
    """Look ``cfg["key"]`` up in the cache at ``cfg["root"]``; on a miss claim it and "compile".

    What the front door does: a miss takes the key's claim; held or waited for, the key
    is looked up again; still missing, it compiles (here: says ``compiling`` and waits
    for ``go on`` on stdin) and stores. Says ``ready``, then waits for ``start``; says
    ``waiting`` when it first waits for another's claim.
    """
    from cuda_program_cas import CacheStore
    from cuda_program_cas._local import claims
    from cuda_program_cas.index import key_id

    out: Result = {"wrong": [], "exceptions": [], "wait_s": cfg["wait_s"], "lock_calls": 0, "lock_max_s": 0.0,
                   "lock_errors": {}}  # fmt: skip
    real_lock, real_wait = claims.try_lock, claims._wait

    def timed_lock(fd: int, until: float, close: Callable[[int], None]) -> bool:
        t0 = time.monotonic()
        try:
            return real_lock(fd, until, close)
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            out["lock_errors"][name] = out["lock_errors"].get(name, 0) + 1
            raise
        except Exception as exc:  # a try that outlasted its bound (claims._Slow)
            out["lock_errors"][type(exc).__name__] = out["lock_errors"].get(type(exc).__name__, 0) + 1
            raise
        finally:
            out["lock_calls"] += 1
            out["lock_max_s"] = round(max(out["lock_max_s"], time.monotonic() - t0), 3)

    def said_wait(fd: int, deadline: float) -> bool:
        print("waiting", flush=True)
        return real_wait(fd, deadline)

    claims.try_lock = timed_lock
    claims._wait = said_wait  # type: ignore[assignment]
    # What the claim said (at DEBUG: why no claim was taken), and where a process that hangs hangs.
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage()[:300])  # type: ignore[method-assign]
    logger = logging.getLogger("cuda_program_cas")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    out["log"] = records
    faulthandler.dump_traceback_later(cfg.get("hang_s", 600), exit=True)
    key = cfg["key"]
    want = value_for(key)
    store = CacheStore(cfg["root"])
    print("ready", flush=True)
    if sys.stdin.readline() != "start\n":
        raise SystemExit("no start")
    before = nfs_common.mountstats(cfg["mount"])
    t0 = time.monotonic()
    data = store.get(key)
    out.update(hit_first=data is not None, compiled=False)
    if data is None:
        with store.inner.claim(key_id(key), wait_s=cfg["wait_s"]) as claim:
            out.update(held=claim.held, waited=claim.waited, timed_out=claim.timed_out)
            out["claim_s"] = round(time.monotonic() - t0, 3)
            if claim.held or claim.waited:
                data = store.get(key)
                out["hit_after_wait"] = data is not None
            if data is None:
                print("compiling", flush=True)
                if sys.stdin.readline() != "go on\n":
                    raise SystemExit("no go on")
                data = want
                out["compiled"] = True
                t_put = time.monotonic()
                store.put(key, data)
                out["put_s"] = round(time.monotonic() - t_put, 3)
                print("stored", flush=True)
    out["total_s"] = round(time.monotonic() - t0, 3)
    print("looked up", flush=True)
    ops = nfs_common.ops_between(before, nfs_common.mountstats(cfg["mount"]))
    out["lock_ops"] = {k: v for k, v in ops.items() if k.startswith("LOCK")}
    if data != want:
        out["wrong"].append(f"{key}: {len(data or b'')} bytes returned")
    stored = CacheStore(cfg["root"]).get(key)  # what a later process of this mount reads
    if stored is not None and stored != want:
        out["wrong"].append(f"{key}: {len(stored)} bytes stored")
    out["stored"] = stored is not None
    t_close = time.monotonic()
    store.close()  # flushes the lifetime counters, under their lock
    out["close_s"] = round(time.monotonic() - t_close, 3)
    print("closed", flush=True)
    return out


def worker_main(cfg: Result) -> int:
    try:
        out = worker(cfg)
    except Exception:
        out = {"wrong": [], "exceptions": [traceback.format_exc()]}
    answer(out)
    return 1 if out["exceptions"] or out["wrong"] else 0


# -- the orchestrator's side of a worker ---------------------------------------------------------


class Proc:
    """A worker process, and when it first said each line."""

    def __init__(self, who: str, root: str, mount: str, key: str, wait_s: float, *, hang_s: float = 600.0) -> None:
        self.who = who
        cfg = {"root": root, "mount": mount, "key": key, "wait_s": wait_s, "hang_s": hang_s}
        self.proc = spawn_worker(
            __file__, cfg, keep_settings=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.said: dict[str, float] = {}
        self.result: Result | None = None
        self.stderr = ""
        self._cond = threading.Condition()
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                if line.startswith("{"):  # the answer, the last line
                    self.result = read_answer(line)
                    self.said.setdefault(ANSWERED, time.monotonic())
                else:
                    self.said.setdefault(line.strip(), time.monotonic())
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _read_stderr(self) -> None:
        # Line by line: a worker stuck in the kernel (a lock call to a lock manager that is gone)
        # never exits, so its stderr never ends; the stacks faulthandler printed are wanted all the same.
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr += line

    def wait_for(self, *words: str, timeout: float = 180.0) -> str | None:
        """The first of ``words`` it said (waiting until it does), or None: it exited, or the time ran out."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for word in words:
                    if word in self.said:
                        return word
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    return None
                self._cond.wait(left)

    def done(self) -> bool:
        with self._cond:
            return self._eof

    def say(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it exited: its result says why

    def finish(self, timeout: float = 180.0) -> Result:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.wait_for(ANSWERED, timeout=10)  # the reader has seen the end
        return self.result or {}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


@contextlib.contextmanager
def started(specs: list[tuple[str, str, str, float]], key: str, hang_s: float = 600.0) -> Iterator[list[Proc]]:
    """A worker for each ``(who, root, mount, wait_s)``, each ready; all killed at the end.

    A worker still running after ``hang_s`` prints every thread's stack on stderr and exits.
    """
    procs = [Proc(who, root, mount, key, wait_s, hang_s=hang_s) for who, root, mount, wait_s in specs]
    try:
        for p in procs:
            p.wait_for("ready")
        yield procs
    finally:
        for p in procs:
            p.kill()


def let_compile(procs: list[Proc], timeout: float = 300.0) -> None:
    """Answer ``go on`` to every worker that says ``compiling``, until all have finished."""
    answered: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for k, p in enumerate(procs):
            if k not in answered and "compiling" in p.said:
                answered.add(k)
                p.say("go on")
        if all(p.done() for p in procs):
            return
        time.sleep(0.02)


def outcome(procs: list[Proc], failures: list[str], case: str) -> Result:
    """Collect every worker's result: a wrong byte, an exception or a missing result fails the run."""
    rows = []
    deadline = time.monotonic() + 180.0  # one wait for all: a worker stuck in the kernel cannot be killed
    for p in procs:
        out = p.finish(timeout=max(1.0, deadline - time.monotonic()))
        who = f"claims {case}: {p.who}"
        if not out:
            said = sorted(p.said, key=p.said.__getitem__)
            stderr = p.stderr.strip()
            failures.append(f"{who}: no result (it said {said}, exit status {p.proc.returncode}): {stderr[-2500:]}")
            rows.append({"who": p.who, "no_result": True, "said": said, "stderr": stderr[-4000:]})
            continue
        failures.extend(f"{who}: WRONG BYTES {text}" for text in out.get("wrong", [])[:3])
        failures.extend(f"{who}: exception: {text.strip()}" for text in out.get("exceptions", [])[:2])
        if not out.get("exceptions") and not out.get("stored"):
            failures.append(f"{who}: the key is not stored after its compile")
        rows.append({"who": p.who, **{k: v for k, v in out.items() if k not in ("wrong", "exceptions")}})
    return {"processes": rows, "compiles": sum(bool(r.get("compiled")) for r in rows if not r.get("no_result"))}


# -- mounts -------------------------------------------------------------------------------------


class Mounts:
    """Mounts of the export made for the claim cases (``nosharecache``), all undone at the end.

    Off NFS (no export), every "mount" is the one plain directory the scenarios were given.
    """

    def __init__(self, env: Any) -> None:
        self.export: str | None = env.export
        self.plain = os.path.dirname(env.publisher)
        self.made: list[str] = []
        self.options: dict[str, str] = {}

    def mount(self, name: str, opts: str, *, netns: str | None = None, server: str | None = None) -> str:
        """The path of a new mount named ``name`` with ``opts``; raises OSError with mount's message."""
        if not self.export:
            return self.plain
        path = os.path.join(MOUNT_BASE, name)
        os.makedirs(path, exist_ok=True)
        source = self.export if server is None else f"{server}:{self.export.partition(':')[2]}"
        cmd = ["mount", "-t", "nfs", "-o", f"nosharecache,{opts}", source, path]
        if netns:
            # Another NFS client: mounted from the namespace (its transport), under another host name
            # (NFSv4.1+ clients name themselves by it); the mount itself is visible to every process.
            cmd = ["nsenter", f"--net=/run/netns/{netns}", "unshare", "--uts", "sh", "-c",
                   f'hostname {netns} && exec "$@"', "sh", *cmd]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            raise OSError(f"mount -o {opts} failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
        self.made.append(path)
        self.options[name] = nfs_common.mount_options([path])[path]
        return path

    def made_or(self, name: str) -> str:
        """The mount named ``name`` made earlier (off NFS: the plain directory)."""
        return os.path.join(MOUNT_BASE, name) if self.export else self.plain

    def root(self, mount: str, case: str) -> str:
        return os.path.join(mount, "claims", case)

    def undo(self) -> None:
        for path in reversed(self.made):
            # Lazily: a mount whose client lost its server must not hold up the run.
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=60, check=False)
        self.made.clear()


def _sh(*cmd: str) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise OSError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    return proc.stdout


def statd(running: bool) -> str:
    """Start or stop ``rpc.statd`` (NFSv3 locks need it on the client); what rpcbind then lists for it."""
    if running and not _statd_pids():
        for sub in ("sm", "sm.bak"):
            os.makedirs(os.path.join("/var/lib/nfs", sub), exist_ok=True)
        # Not through pipes: the daemon it leaves behind would hold them open.
        subprocess.run(["rpc.statd", "--no-notify"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=60, check=True)  # fmt: skip
    elif not running:
        pids = _statd_pids()
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
    listed = subprocess.run(["rpcinfo", "-p", "127.0.0.1"], capture_output=True, text=True, timeout=30, check=False)
    return " ".join(ln.split()[-1] + "/" + ln.split()[1] for ln in listed.stdout.splitlines() if " status" in ln)


def _statd_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _comm(p) == "rpc.statd"]


def _comm(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def make_other_client() -> None:
    """A network namespace joined to the guest by a veth pair: another NFS client of the same server."""
    _sh("ip", "netns", "add", NETNS)
    _sh("ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NODE)
    _sh("ip", "link", "set", VETH_NODE, "netns", NETNS)
    _sh("ip", "addr", "add", f"{HOST_ADDR}/24", "dev", VETH_HOST)
    _sh("ip", "link", "set", VETH_HOST, "up")
    _sh("ip", "-n", NETNS, "addr", "add", f"{NODE_ADDR}/24", "dev", VETH_NODE)
    _sh("ip", "-n", NETNS, "link", "set", VETH_NODE, "up")
    _sh("ip", "-n", NETNS, "link", "set", "lo", "up")


def lease_s() -> float | None:
    try:
        with open("/proc/fs/nfsd/nfsv4leasetime") as fh:
            return float(fh.read())
    except OSError:
        return None


# -- the cases ------------------------------------------------------------------------------------


def case_one_mount(mounts: Mounts, name: str, opts: str, failures: list[str]) -> Result:
    """4 processes of one mount miss one key at the same moment (a job's ranks): one compiles."""
    mount = mounts.mount(name, opts)
    root = mounts.root(mount, f"one-{name}")
    _new_cache(mounts, f"one-{name}")
    with started([(f"p{i}", root, mount, 120.0) for i in range(4)], "one") as procs:
        for p in procs:
            p.say("start")
        for p in procs:  # each holds the claim or waits for it (or, with no claim, compiles)
            p.wait_for("waiting", "compiling")
        let_compile(procs)
        row = outcome(procs, failures, f"one mount {name}")
    return {"case": "one mount, 4 processes at once", "mount": name, "options": mounts.options.get(name), **row}


def case_two_mounts(mounts: Mounts, a: str, b: str, failures: list[str], label: str) -> Result:
    """A holder on mount ``a``; while it compiles, a waiter more on ``a`` and two on ``b``."""
    ma, mb = mounts.made_or(a), mounts.made_or(b)
    root_a, root_b = mounts.root(ma, f"two-{a}-{b}"), mounts.root(mb, f"two-{a}-{b}")
    _new_cache(mounts, f"two-{a}-{b}")
    specs = [("holder", root_a, ma, 120.0), (f"{a} waiter", root_a, ma, 120.0),
             (f"{b} waiter 1", root_b, mb, 120.0), (f"{b} waiter 2", root_b, mb, 120.0)]  # fmt: skip
    with started(specs, "two") as procs:
        procs[0].say("start")
        procs[0].wait_for("compiling")
        for p in procs[1:]:
            p.say("start")
            p.wait_for("waiting", "compiling")
        waited = [p.who for p in procs[1:] if "waiting" in p.said]
        let_compile(procs)
        row = outcome(procs, failures, label)
    return {"case": label, "mounts": [a, b], "waited_for_the_holder": waited, **row}


def case_killed(mounts: Mounts, a: str, b: str, failures: list[str]) -> Result:
    """SIGKILL a holder mid-compile on ``a``: how soon a waiter on ``a`` and one on ``b`` take over."""
    takeovers: Result = {}
    rows = []
    for where, side in (("same mount", a), ("other mount", b)):
        ma, mw = mounts.made_or(a), mounts.made_or(side)
        case = f"killed-{a}-{side}-{len(rows)}"
        root_h, root_w = mounts.root(ma, case), mounts.root(mw, case)
        _new_cache(mounts, case)
        with started([("holder", root_h, ma, 0.0), ("waiter", root_w, mw, 120.0)], "killed") as (holder, waiter):
            holder.say("start")
            holder.wait_for("compiling")
            waiter.say("start")
            waiter.wait_for("waiting", "compiling")
            t_kill = time.monotonic()
            holder.proc.send_signal(signal.SIGKILL)
            if waiter.wait_for("compiling", timeout=150) == "compiling":
                takeovers[f"waiter on the {where} ({side})"] = round(waiter.said["compiling"] - t_kill, 3)
            else:
                takeovers[f"waiter on the {where} ({side})"] = None
            let_compile([waiter])
            holder.proc.wait(timeout=60)
            row = outcome([waiter], failures, f"killed holder on {a}, waiter on the {where} {side}")
        rows.extend(row["processes"])
    return {"case": "holder SIGKILLed mid-compile", "holder_mount": a, "takeover_s": takeovers, "processes": rows,
            "compiles": sum(bool(r.get("compiled")) for r in rows)}  # fmt: skip


def case_dead_node(mounts: Mounts, a: str, b: str, failures: list[str]) -> Result:
    """The holder's NFS client stops answering (its link cut): only the server's lease frees its lock.

    One waiter (on ``a``) may wait 120 s, another (on ``b``) 4 s: the first takes over once the
    server has given up the dead client; the second compiles at its bound, whatever the lock does.
    """
    md = mounts.mount("dead-node", "rw,vers=4.2", netns=NETNS, server=HOST_ADDR)
    ma, mb = mounts.made_or(a), mounts.made_or(b)
    root_d, root_a, root_b = (mounts.root(m, "dead") for m in (md, ma, mb))
    _new_cache(mounts, "dead")
    specs = [("holder (dead node)", root_d, md, 0.0), ("waiter, bound 120 s", root_a, ma, 120.0),
             ("waiter, bound 4 s", root_b, mb, 4.0)]  # fmt: skip
    figures: Result = {"lease_s": lease_s()}
    with started(specs, "dead") as (holder, slow, quick), contextlib.ExitStack() as undo:
        undo.callback(subprocess.run, ["ip", "link", "set", VETH_HOST, "up"], capture_output=True, timeout=60)
        holder.say("start")
        holder.wait_for("compiling")
        for p in (slow, quick):
            p.say("start")
            p.wait_for("waiting", "compiling")
        t_cut = time.monotonic()
        _sh("ip", "link", "set", VETH_HOST, "down")
        if quick.wait_for("compiling", timeout=60):
            figures["short_bound_compiled_after_cut_s"] = round(quick.said["compiling"] - t_cut, 3)
        quick.say("go on")
        if slow.wait_for("compiling", timeout=150):
            figures["takeover_after_cut_s"] = round(slow.said["compiling"] - t_cut, 3)
        slow.say("go on")
        row = outcome([slow, quick], failures, "dead node")
        # The node comes back: its client finds its lease gone (the lock lost); then the holder is killed.
        _sh("ip", "link", "set", VETH_HOST, "up")
        holder.kill()
        try:
            holder.proc.wait(timeout=60)
            figures["holder_exit"] = holder.proc.returncode
        except subprocess.TimeoutExpired:
            figures["holder_exit"] = "still exiting after 60 s"
    return {"case": "dead node (its link cut)", "holder_mount": mounts.options.get("dead-node"), **figures, **row}


def case_no_lock_daemon(mounts: Mounts, failures: list[str], which: str) -> Result:
    """NFSv3 with NLM locks and no lock daemon: the client's ``rpc.statd`` stopped (``statd``), or the
    server's lock manager gone from rpcbind (``nlm``). Each process gets no claim within its 5 s bound
    (ENOLCK, or a try that does not return), compiles, and ends with the right bytes."""
    figures: Result = {"statd_before": statd(True)}
    log_from = len(_kernel_log())
    name = f"v3-no-{which}"
    if which == "statd":
        mount = mounts.mount(name, "rw,vers=3")
        figures["statd_stopped"] = statd(False) or "(unregistered)"
    else:
        for version in ("1", "3", "4"):  # lockd's programs: what the server's rpcbind then lacks
            subprocess.run(["rpcinfo", "-d", "100021", version], capture_output=True, timeout=30, check=False)
        # Through the veth address: a server this client has never locked on (NLM binds a server once).
        mount = mounts.mount(name, "rw,vers=3", server=HOST_ADDR)
    root = mounts.root(mount, name)
    _new_cache(mounts, name)
    try:
        with started([(f"p{i}", root, mount, 5.0) for i in range(3)], name, hang_s=HANG_S) as procs:
            for p in procs:
                p.say("start")
            for p in procs:
                p.wait_for("waiting", "compiling")
            let_compile(procs)
            row = outcome(procs, failures, f"no lock daemon ({which})")
    finally:
        figures["statd_running_at_end"] = len(_statd_pids())
        if which == "statd":
            figures["statd_after"] = statd(True)
        figures["kernel_log"] = [line for line in _kernel_log()[log_from:] if _NFS_LOG.search(line)][-12:]
    label = "client's rpc.statd stopped" if which == "statd" else "server's lock manager not registered"
    return {"case": f"no lock daemon (v3, {label})", "options": mounts.options.get(name), **figures, **row}


_NFS_LOG = re.compile(r"lockd|statd|nfs|NFS|rpc|nlm", re.IGNORECASE)


def _kernel_log() -> list[str]:
    proc = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30, check=False)
    return proc.stdout.splitlines()


def _new_cache(mounts: Mounts, case: str) -> None:
    """The case's cache, made before its workers open it (as a node's cache would be), through the
    publisher's mount: a mount whose locks fail must not keep the case from starting."""
    from cuda_program_cas import CacheStore

    CacheStore(mounts.root(mounts.plain, case)).close()


def run(env: Any) -> Result:
    """Every case; NFS-only ones are skipped on plain directories. Returns failures and figures."""
    failures: list[str] = []
    cases: list[Result] = []
    mounts = Mounts(env)
    nfs = bool(env.export)
    # Every case's cache is new: <export>/claims, here through the publisher's mount.
    shutil.rmtree(os.path.join(os.path.dirname(env.publisher), "claims"), ignore_errors=True)

    def attempt(label: str, fn: Any, *args: Any) -> None:
        if env.claim_cases and label != "another NFS client" and not any(c in label for c in env.claim_cases):
            return
        t0 = time.monotonic()
        try:
            row = fn(*args)
        except Exception:
            failures.append(f"claims {label}: unexpected exception: {traceback.format_exc(limit=6)}")
            return
        if row is None:
            return
        row["seconds"] = round(time.monotonic() - t0, 1)
        cases.append(row)
        print(f"nfsh: claims: {label} done in {row['seconds']} s", flush=True)

    try:
        if nfs:
            # First: a v3 client that has never locked on this server (NLM asks rpc.statd to watch
            # a server once, at the first lock). The veth pair first: ENOLCK's second case mounts
            # through its address.
            attempt("another NFS client", make_other_client)
            attempt("no statd", case_no_lock_daemon, mounts, failures, "statd")
            for name, opts in MOUNTS.items():
                mounts.mount(name, opts)
            attempt("one mount v4.2", case_one_mount, mounts, "v4one", "rw,vers=4.2", failures)
            attempt("one mount v3", case_one_mount, mounts, "v3one", "rw,vers=3", failures)
            attempt("two mounts v4.2", case_two_mounts, mounts, "v4a", "v4b", failures, "two mounts, v4.2")
            attempt("two mounts v3", case_two_mounts, mounts, "v3a", "v3b", failures, "two mounts, v3")
            attempt("two mounts lookupcache=positive", case_two_mounts, mounts, "v4a", "v4pos", failures,
                    "two mounts, v4.2, waiters on lookupcache=positive")  # fmt: skip
            attempt("killed holder v4.2", case_killed, mounts, "v4a", "v4b", failures)
            attempt("killed holder v3", case_killed, mounts, "v3a", "v3b", failures)
            attempt("node-local v3 nolock", case_two_mounts, mounts, "nolock-x", "nolock-y", failures,
                    "two mounts, v3 nolock (local_lock=all)")  # fmt: skip
            try:
                mounts.mount("flock-x", "rw,vers=4.2,local_lock=flock")
                mounts.mount("flock-y", "rw,vers=4.2,local_lock=flock")
            except OSError as exc:
                cases.append({"case": "two mounts, v4.2 local_lock=flock", "not_mounted": str(exc)})
            else:
                attempt("node-local v4.2 local_lock=flock", case_two_mounts, mounts, "flock-x", "flock-y", failures,
                        "two mounts, v4.2 local_lock=flock")  # fmt: skip
            attempt("dead node", case_dead_node, mounts, "v4a", "v4b", failures)
            # Last: it leaves the server without its lock manager in rpcbind.
            attempt("no NLM", case_no_lock_daemon, mounts, failures, "nlm")
        else:
            attempt("one directory", case_one_mount, mounts, "plain", "", failures)
            attempt("two processes' views", case_two_mounts, mounts, "plain", "plain", failures, "two mounts, plain")
            attempt("killed holder", case_killed, mounts, "plain", "plain", failures)
            cases.append({"case": "NFS-only cases", "skipped": "no --nfs-export: plain directories"})
    finally:
        mounts.undo()
    failures += check_claims(cases)
    return {"failures": failures, "figures": {"claims": CLAIMS, "mounts": mounts.options, "cases": cases}}


def check_claims(cases: list[Result]) -> list[str]:
    """What docs/nfs.md says of claims on NFS, against one run's cases: one line per broken claim."""
    failures = []
    for row in cases:
        case = row["case"]
        label = case + (f" ({row['mount']})" if "mount" in row else "")
        procs = row.get("processes", [])
        for p in procs:
            bound = max(p.get("wait_s", 0.0), FIRST_TRY_S) + CLAIMS["wait_past_bound_max_s"]
            if p.get("claim_s", 0.0) > bound:
                failures.append(
                    f"CLAIM: {label}: {p['who']}: its claim returned after {p['claim_s']} s, over {bound:g} s"
                )
            for step in ("put_s", "close_s"):
                if p.get(step, 0.0) > CLAIMS["put_or_close_max_s"]:
                    failures.append(f"CLAIM: {label}: {p['who']}: {step[:-2]} took {p[step]} s")
            if "ENOLCK" in p.get("lock_errors", {}) and (p.get("held") or not p.get("compiled")):
                failures.append(f"CLAIM: {label}: {p['who']}: ENOLCK, yet a claim held or no compile: {p}")
        compiles = row.get("compiles")
        if case.startswith("one mount") and compiles != 1:
            failures.append(f"CLAIM: {label}: {compiles} compiles by 4 processes of one mount, not 1")
        if case.startswith("two mounts") and compiles is not None:
            most = 1 if "lookupcache=positive" in case else 2
            if compiles > most:
                failures.append(f"CLAIM: {label}: {compiles} compiles by the processes of two mounts, over {most}")
        if case == "holder SIGKILLed mid-compile":
            for side, took in row["takeover_s"].items():
                if took is None or took > CLAIMS["takeover_after_kill_max_s"]:
                    failures.append(f"CLAIM: {label}: the {side} took over after {took} s")
        if case.startswith("dead node"):
            took, lease = row.get("takeover_after_cut_s"), row.get("lease_s") or 90.0
            if took is None or took > CLAIMS["dead_node_leases_max"] * lease + CLAIMS["wait_past_bound_max_s"]:
                failures.append(
                    f"CLAIM: {label}: the waiter with a 120 s bound took over after {took} s (lease {lease:g} s)"
                )
        if case.startswith("no lock daemon"):
            for p in procs:
                if p.get("held") or not p.get("compiled"):
                    failures.append(f"CLAIM: {label}: {p['who']}: a claim held, or no compile: {p}")
    return failures


if __name__ == "__main__":
    spec = worker_spec(sys.argv[1:])
    if spec is not None:
        sys.exit(worker_main(spec))
    sys.exit("claim_scenario.py is run by tools/nfs/scenarios.py")
