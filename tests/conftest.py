"""Fixtures shared by the whole suite: real NVRTC compiles and fresh cache directories.

Helpers of one test file stay in that file; only what several files need lives here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: A small kernel; with NVRTC its cubin does not depend on `name`, unused macros or `std`.
SAXPY = r"""
extern "C" __global__ void saxpy(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


@pytest.fixture(autouse=True)
def _isolated_default_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test touches the real per-user cache, nor inherits the operator's settings."""
    monkeypatch.setenv("CUDA_PROGRAM_CAS_DIR", str(tmp_path_factory.mktemp("default-cas")))
    monkeypatch.delenv("CUDA_PROGRAM_CAS_SHARED", raising=False)
    monkeypatch.delenv("CUDA_PROGRAM_CAS_MAX_SIZE", raising=False)
    monkeypatch.delenv("CUDA_PROGRAM_CAS_CLAIM_WAIT", raising=False)
    monkeypatch.delenv("CUDA_PROGRAM_CAS", raising=False)  # the tests turn the switch on where they mean to
    # No warm sets unless a test names its job: the set's requests would change every count of requests.
    monkeypatch.setenv("CUDA_PROGRAM_CAS_JOB", "off")


@pytest.fixture(autouse=True)
def _untrusted_said_in_their_test() -> Iterator[None]:
    """What a test's unclosed stores refused as untrusted is said in that test's own output, not at the end."""
    yield
    said = sys.modules.get("cuda_program_cas._shared.tier")
    if said is not None:
        said.say_untrusted()


# -- sockets left open ------------------------------------------------------------------
#
# pytest 9 collects garbage once more at the end of the session, and a socket found open
# then fails the session (filterwarnings = error) without naming a test or a place. One
# client socket on loopback was found so in a few full runs, and its origin was not. So
# every socket made in this process notes where, and a socket freed while open says that
# place: inside a test as the ResourceWarning that fails the test (as before, with the
# place added), and from the session's last collection (run here, before pytest's) as a
# report line naming it, since no test is left to fail then.

_made_at: dict[int, object] = {}
#: Sockets freed open at the end of the session: (repr, where made).
_freed_open: list[tuple[str, str]] = []
_session_ending = False


def _note_sockets() -> None:
    import socket
    import traceback
    import warnings

    init = socket.socket.__init__

    def noted(self: socket.socket, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        _made_at[id(self)] = traceback.extract_stack(limit=12)[:-1]

    def freed(self: socket.socket) -> None:
        # Replaces _socket's finalizer for socket.socket and its subclasses: it warned and closed.
        # Forgotten here, not by a weakref callback: a collection clears those before finalizers run.
        where = _made_at.pop(id(self), None)
        if self.fileno() == -1:
            return
        text = "".join(traceback.format_list(where)) if where else "  (made before the session began)\n"
        described = repr(self)
        self.close()
        if _session_ending:
            _freed_open.append((described, text))
        else:
            warnings.warn(f"unclosed {described}, made at:\n{text}", ResourceWarning, stacklevel=2)

    socket.socket.__init__ = noted  # type: ignore[method-assign]
    socket.socket.__del__ = freed  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import gc

    global _session_ending
    _session_ending = True
    gc.collect()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for described, text in _freed_open:
        if reporter is not None:
            reporter.write_line(f"socket left open at the end of the session: {described}, made at:\n{text}")
    _freed_open.clear()


def pytest_configure(config: pytest.Config) -> None:
    """An operator's ``CUDA_PROGRAM_CAS=1`` armed the switch in this process at start-up: off again."""
    _note_sockets()
    if os.environ.get("CUDA_PROGRAM_CAS", "").strip() not in ("", "0"):
        from cuda_program_cas import uninstall

        uninstall()  # takes the start-up hook off sys.meta_path, and the classes back if it ran


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    """A path for a new cache (not yet created)."""
    return tmp_path / "cas"


def compile_program(source: str = SAXPY, target: str = "cubin", cache=None, **options):
    """Program(source).compile(target) with real NVRTC; options default to arch sm_80."""
    from cuda.core import Program, ProgramOptions

    options.setdefault("arch", "sm_80")
    if target == "ltoir":
        options.setdefault("relocatable_device_code", True)
        options.setdefault("link_time_optimization", True)
    return Program(source, "c++", options=ProgramOptions(**options)).compile(target, cache=cache)


def _nvrtc_record() -> int:
    from cuda_program_cas._cuda import nvrtcver

    return 1 if nvrtcver._predict(loaded_ok=True) is not None else 0


#: NVRTC's version record (cuda_program_cas._cuda.nvrtcver) that a store's first front-door miss
#: writes where the library file is known unloaded (the NVIDIA wheel): one entry and one write,
#: besides the compiles'.
NVRTC_RECORD = _nvrtc_record()


def run_python(
    code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (the repo importable), capturing output."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=full_env, check=False
    )


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    """Mount points a test made (appended by it): unmounted (lazily) when it ends."""
    made: list[Path] = []
    yield made
    for target in reversed(made):
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture(scope="session")
def one_second_fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real file system whose times are whole seconds: ext4 made with 128-byte inodes, on a loop device.

    As ext2, ext3, FAT or a coarse NFS export stamp files: a change within the second of
    the last one leaves every stat field as it was. Needs root and a loop device.
    """
    if not is_root():
        pytest.skip("a one-second file system needs root (mkfs.ext4 on a loop device, mount)")
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 (e2fsprogs) is not installed")
    base = tmp_path_factory.mktemp("one-second-fs")
    image, target = base / "ext4-128.img", base / "mnt"
    target.mkdir()
    with open(image, "wb") as f:
        f.truncate(128 * 2**20)
    made = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-I", "128", "-O", "^has_journal", str(image)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 -I 128 failed: {made.stderr.strip()}")
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(target)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"no loop device to mount a one-second file system on: {mounted.stderr.strip()}")
    try:
        probe = target / "probe"
        probe.write_bytes(b"")
        assert probe.stat().st_ctime_ns % 10**9 == 0, "ext4 with 128-byte inodes gave a time finer than a second"
        probe.unlink()
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def cccl_or_skip() -> str:
    """The CCCL headers' include directory (``testkit.common.cccl_include``), or a skip naming what to install."""
    from testkit.common import cccl_include

    include = cccl_include()
    if include is None:
        pytest.skip("no CCCL headers (install nvidia-cuda-cccl, or a CUDA toolkit with include/cccl)")
    return include


@pytest.fixture
def redis(tmp_path: Path):
    """A redis-server of the test's own on loopback (``testkit.redis_server``), stopped after it."""
    from testkit.redis_server import redis_or_skip

    server = redis_or_skip(tmp_path / "redis")
    yield server
    server.stop()


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """``directory`` bind-mounted on itself read-only for the duration (root only; skips where impossible)."""
    if not is_root():
        pytest.skip("bind mounts need root")
    if subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True).returncode:
        pytest.skip("mount --bind is not available here")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def write_orphan(root: os.PathLike[str] | str, data: bytes) -> str:
    """Put a blob with no manifest into the cache at ``root``, as a writer that died between the two leaves it."""
    from cuda_program_cas import digest_of

    digest = digest_of(data)
    path = Path(root) / "blobs" / digest[:2] / digest[2:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


def write_manifest(root: os.PathLike[str] | str, key: str | bytes, digest: str, size: int) -> Path:
    """Write a manifest by hand (naming whatever blob the test wants), bypassing the write protocol."""
    from cuda_program_cas.index import Manifest, key_id

    kid = key_id(key)
    path = Path(root) / "index" / kid[:2] / kid[2:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(Manifest(digest, size, kid).encode())
    if (Path(root) / "keys").exists():  # a store's key list names it too, as a writer's would
        from cuda_program_cas._disk.direngine import DirEngine
        from cuda_program_cas._shared.keylist import merge_into, number

        merge_into(DirEngine(os.fspath(root)), {number(kid): 0})
    return path


# -- signals between processes: a test waits for what a child says, never for a duration -----------------


class ChildLines:
    """What a child process says on stdout, line by line, for a parent that waits on it.

    A child that reaches a point prints a line saying so (flushed); the parent blocks in
    :meth:`wait` until that line has come, and fails when the child exits first or the
    timeout passes: never a sleep of a guessed length. Threads read stdout (and stderr,
    when it is a pipe) as it comes, so a child that prints a lot never blocks on a pipe.
    """

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        import threading

        assert proc.stdout is not None, "the child's stdout must be a pipe"
        self.proc = proc
        self.lines: list[str] = []
        self.stderr = ""
        self.timed_out = False
        self._next = 0  # the first line that no wait has looked at yet
        self._eof = False
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._read_stdout, daemon=True)]
        if proc.stderr is not None:
            self._threads.append(threading.Thread(target=self._read_stderr, daemon=True))
        for thread in self._threads:
            thread.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()

    def wait(self, word: str, at_least: int | None = None, timeout: float = 60.0) -> str:
        """Block until the child prints the line ``word`` (with ``at_least``: ``word N``, N >= at_least); return it.

        Each line is looked at by one wait only: a later wait sees the lines after it.
        """
        import time

        def says(line: str) -> bool:
            if at_least is None:
                return line == word
            parts = line.split()
            return len(parts) == 2 and parts[0] == word and parts[1].isdigit() and int(parts[1]) >= at_least

        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                while self._next < len(self.lines):
                    line = self.lines[self._next]
                    self._next += 1
                    if says(line):
                        return line
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    break
                self._cond.wait(left)
        what = word if at_least is None else f"{word} N, N >= {at_least}"
        if self._eof:
            code = self.finish(timeout=30)
            raise AssertionError(f"the child exited {code} before it said {what!r}:\n{self.output()}")
        raise AssertionError(f"the child did not say {what!r} within {timeout:g} s:\n{self.output()}")

    def finish(self, timeout: float = 60.0) -> int:
        """Wait for the child to exit and return its exit status; past ``timeout`` it is killed (``timed_out``)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.proc.kill()
            self.proc.wait()
        for thread in self._threads:
            thread.join(timeout=30)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        return self.proc.returncode

    def kill(self) -> None:
        """Kill the child if it still runs, and reap it (for clean-up after a failure)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.finish()

    def output(self) -> str:
        """Everything the child said, stdout then stderr (for failure messages)."""
        with self._cond:
            out = "\n".join(self.lines)
        return ("[timed out and killed]\n" if self.timed_out else "") + out + "\n" + self.stderr


class StartGate:
    """A start line for child processes: their stdin is one pipe, and each blocks reading a byte from it.

    Pass ``stdin=gate.fd`` to each Popen. :meth:`open` writes a byte for every child in
    one write, so they all start together; a parent that gives up (or dies) first only
    closes the pipe, and the children, reading end of file, exit. The child's side::

        if os.read(0, 1) != b"g":
            sys.exit("the parent gave up before the start")
    """

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        self._open_fds = [self.fd, self._write_fd]

    def open(self, children: int) -> None:
        os.write(self._write_fd, b"g" * children)
        self.close()

    def close(self) -> None:
        while self._open_fds:
            os.close(self._open_fds.pop())


class MovableClock:
    """A stand-in for the ``time`` module whose monotonic clock a test moves ``ahead`` (the rest is the real one).

    Patched into ``cuda_program_cas._shared.tier`` to step past its retry interval without sleeping.
    """

    def __init__(self) -> None:
        self.ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


class Compiles:
    """Counts real NVRTC compiles through cuda-core's compile seam (the compile still runs)."""

    def __init__(self, original: Callable[..., object]) -> None:
        self.original = original
        self.count = 0

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.count += 1
        return self.original(*args, **kwargs)


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> Compiles:
    """Every uncached NVRTC compile of the test, counted (``Program.compile`` with or without a cache)."""
    import cuda.core._program as program_mod

    calls = Compiles(program_mod._program_compile_uncached)
    monkeypatch.setattr(program_mod, "_program_compile_uncached", calls)
    return calls
