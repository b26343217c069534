"""A blob's bytes as an engine takes them in (:func:`verified_intake`): decoded, hashed, held in memory up to
:data:`IN_MEMORY_BYTES`, then staged, and returned only once they hash to the blob's digest."""

from __future__ import annotations

import errno
from collections.abc import Callable
from contextlib import ExitStack
from types import TracebackType

from cuda_program_cas._base.engine import LOCAL, StoreFailure
from cuda_program_cas._base.frame import Inflow

from .atomic import Staging, staging
from .files import blake3_hasher

__all__ = ["IN_MEMORY_BYTES", "Intake", "Take", "verified_intake"]

#: Where a stored object's chunks go, as they come.
Take = Callable[[bytes | memoryview], object]

#: A blob's raw bytes up to this are gathered in memory while they are verified; more are staged in the local
#: cache's ``tmp/`` (when there is one that can be written) and read back once verified.
IN_MEMORY_BYTES = 1 << 20
#: A staging disk with no room left: the body goes on in memory, as where there is no staging folder.
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class Intake:
    """A body as it arrives (:meth:`take`): counted, hashed, held in memory up to :data:`IN_MEMORY_BYTES`, then staged.

    ``staging``: the staging file's folder (the local cache's ``tmp/``; None: in memory, bounded before it was
    asked for). A staging file that cannot be made, or fills its disk, leaves the body in memory; another write
    error fails the read (``OSError``). The file goes when the intake is closed.
    """

    def __init__(self, staging: str | None, *, hashed: bool = True) -> None:
        self.size = 0
        self._dir = staging
        self._hash = blake3_hasher()() if hashed else None
        self._parts: list[bytes] = []
        self._stage: Staging | None = None
        self._stack = ExitStack()

    def __enter__(self) -> Intake:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._parts = []
        self._stack.close()

    def take(self, chunk: bytes | memoryview) -> None:
        chunk = bytes(chunk)  # bytes as they come (no copy), a view of a buffer the sender reuses copied
        self.size += len(chunk)
        if self._hash is not None:
            self._hash.update(chunk)
        if self._stage is not None:
            try:
                self._stage.write(chunk)
                return
            except OSError as exc:
                self._unstage(exc)
        self._parts.append(chunk)
        if self.size > IN_MEMORY_BYTES and self._dir is not None:
            try:
                self._stage = self._stack.enter_context(staging(self._dir))
            except OSError:
                self._dir = None  # a full or read-only disk: in memory, as bounded before the request
                return
            for i, part in enumerate(self._parts):
                try:
                    self._stage.write(part)
                except OSError as exc:
                    self._parts = self._parts[i:]  # the ones before are read back
                    self._unstage(exc)
                    return
            self._parts = []

    def _unstage(self, exc: OSError) -> None:
        """The staging disk is full: what it took back in memory, and the rest kept there (as bounded before the
        request, as without a staging folder); another error fails the read."""
        if exc.errno not in _FULL:
            raise exc
        assert self._stage is not None
        self._parts = [self._stage.read(), *self._parts]
        self._stage, self._dir = None, None
        self._stack.close()

    def hexdigest(self) -> str:
        assert self._hash is not None
        return self._hash.hexdigest()

    def read(self) -> bytes:
        """The whole body: from memory, or read back from the staging file."""
        if self._stage is not None:
            return self._stage.read()
        return self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)


def verified_intake(
    where: str, digest: str, limit: int, staging: str | None, feed: Callable[[Take], bool]
) -> bytes | None:
    """The raw bytes of the stored object ``feed(take)`` passes in chunks (False: there was none, so None), decoded
    once as they come (:class:`~cuda_program_cas._base.frame.Inflow`, at most ``limit``) and held by one
    :class:`Intake`, returned only when they hash to ``digest``: the bytes returned are the bytes hashed.

    What the frame refuses and the wrong bytes are ``damaged``; running out of memory or of staging disk is
    this node's trouble (:data:`~cuda_program_cas._base.engine.LOCAL`, never an outage).
    """
    try:
        with Intake(staging) as body:
            flow = Inflow(where, limit, body.take)
            if not feed(flow.take):
                return None
            flow.finish()  # a frame cut short: refused
            if body.hexdigest() != digest:
                detail = f"{body.size:,} raw bytes that do not hash to {digest}"
                raise StoreFailure(where, "damaged", detail, outage=False)
            return body.read()
    except (MemoryError, OSError) as exc:  # out of memory for a large hit, or its staging file unwritable
        raise StoreFailure(where, LOCAL, type(exc).__name__, outage=False) from None
