"""What the maintenance verbs share: opening an existing cache for maintenance, progress, the report base."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, ClassVar

from cuda_program_cas._base.config import default_cache_dir
from cuda_program_cas._base.errors import LayoutError, ReadOnlyCacheError
from cuda_program_cas._base.urls import is_store_url, shown
from cuda_program_cas._disk.blobs import BlobCheck, BlobState, BlobStore
from cuda_program_cas._disk.layout import Layout, LayoutState, check_layout, damaged_layout_error, unwritable_reason
from cuda_program_cas._disk.remove import Remover
from cuda_program_cas._disk.scan import Snapshot

__all__ = [
    "SHARED_MIN_GRACE_S",
    "MaintainedCache",
    "ProgressFn",
    "Report",
    "cache_root",
    "check_blobs",
    "check_writable",
    "iso_utc",
    "not_created",
    "open_cache",
    "refuse_url",
]

#: ``progress(phase, done, total)``: called now and then during long runs.
ProgressFn = Callable[[str, int, int], None]

#: The shortest grace period a shared store is collected with: a publish keeps its blobs as orphans until
#: its manifests land, and an NFS client may serve a removed manifest from its attribute cache for
#: ``actimeo`` seconds (60 s by default), then open its blob. An hour covers both.
SHARED_MIN_GRACE_S = 3600.0


@dataclass(frozen=True, slots=True)
class MaintainedCache:
    """An existing cache opened for maintenance; ``remover`` only when writable."""

    lay: Layout
    blobs: BlobStore
    remover: Remover | None
    state: LayoutState


def cache_root(path: str | os.PathLike[str] | None) -> str:
    """The absolute path of the cache at ``path``; None or empty: :func:`cuda_program_cas.default_cache_dir`."""
    refuse_url(path)
    return os.path.abspath(path) if path else os.fspath(default_cache_dir())


def refuse_url(path: object) -> None:
    """Raise :class:`LayoutError` when ``path`` is a store URL: maintenance needs the store's files."""
    if is_store_url(path):
        assert isinstance(path, str)
        if path[:5].lower() == "s3://":
            raise LayoutError(
                f"{shown(path)} is a bucket: this command needs a store's files; sync it to a directory and run "
                "it there (stats, verify, gc and repack take a bucket: docs/s3.md)"
            )
        raise LayoutError(
            f"{shown(path)} is a store URL: maintenance runs where the store's files are; "
            "run it there, on the directory the web server serves (docs/cluster.md)"
        )


def not_created(root: str | os.PathLike[str]) -> bool:
    """Whether no cache has been created at ``root`` yet (nothing, or an empty directory): the verbs report it
    as an empty cache (a nightly ``gc`` on a fresh node is not bad usage)."""
    refuse_url(root)
    return check_layout(os.path.abspath(os.fspath(root))) is LayoutState.MISSING


def open_cache(
    root: str | os.PathLike[str], *, write: bool, allow_damaged: bool = False, purpose: str = "maintain"
) -> MaintainedCache:
    """Open an existing cache for maintenance; never creates anything.

    Raises :class:`LayoutError` for a path that is missing, a file, foreign, newer or (unless
    ``allow_damaged``) damaged; :class:`ReadOnlyCacheError` when ``write`` cannot be honoured.
    """
    refuse_url(root)
    path = os.path.abspath(os.fspath(root))
    state = check_layout(path)
    if state is LayoutState.MISSING:
        if not os.path.isdir(path):
            raise LayoutError(f"no cache at {path!r}: no such directory")
        raise LayoutError(f"no cache at {path!r}: the directory holds no layout.json")
    if state is LayoutState.DAMAGED and not allow_damaged:
        raise damaged_layout_error(path)
    lay = Layout(path)
    if write:
        check_writable(lay, purpose)
    return MaintainedCache(lay, BlobStore(lay.blobs), Remover(lay) if write else None, state)


def check_writable(lay: Layout, purpose: str) -> None:
    why = unwritable_reason(lay)
    if why is not None:
        raise ReadOnlyCacheError(f"cannot {purpose}: cache {lay.root!r} is read-only ({why})")


def iso_utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat(timespec="seconds")


def check_blobs(snap: Snapshot, blobs: BlobStore, progress: ProgressFn | None = None) -> dict[str, BlobCheck]:
    """What hashing each blob of ``snap`` found, by digest in digest order; a blob gone meanwhile is left out."""
    found = {}
    total = len(snap.blobs)
    for n, digest in enumerate(sorted(snap.blobs)):
        if progress and n % 64 == 0:
            progress("verifying blobs", n, total)
        check = blobs.check(digest)
        if check.state is not BlobState.MISSING:
            found[digest] = check
    if progress:
        progress("verifying blobs", total, total)
    return found


#: At most this many problems are listed one by one (all are counted).
MAX_LISTED = 100


@dataclasses.dataclass(kw_only=True)
class Report:
    """The one shape of every verb's report: ``problems`` (one item each, a line or a
    :class:`~cuda_program_cas.Problem`) and ``problem_count`` (also those past :attr:`max_listed`);
    :meth:`as_dict` is what ``--json`` prints."""

    problems: list[Any] = dataclasses.field(default_factory=list)
    problem_count: int = 0
    max_listed: ClassVar[int | None] = MAX_LISTED

    def problem(self, item: Any) -> None:
        self.problem_count += 1
        if self.max_listed is None or len(self.problems) < self.max_listed:
            self.problems.append(item)

    def as_dict(self) -> dict[str, object]:
        """Every field, nested dataclasses as dicts (an elapsed time rounded to milliseconds)."""
        assert dataclasses.is_dataclass(self)
        out = dataclasses.asdict(self)
        if isinstance(out.get("elapsed_s"), float):
            out["elapsed_s"] = round(out["elapsed_s"], 3)
        return out
