"""``repack``: merge a shared store's loose entries and packs into one new pack (see :mod:`.packs`).

One repack at a time: it takes the store's ``evict.lock`` without blocking, the
lock ``gc`` holds. Two repacks at once would each retire the packs the other is
reading (one then failed with ENOENT and two full packs stayed); a second one
finds the lock taken and does nothing (:class:`cuda_program_cas.CollectorBusyError`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from cuda_program_cas._base.errors import CollectorBusyError

from .common import check_writable, open_cache
from .packs import RepackReport, repack_locked

__all__ = ["RepackReport", "repack"]


def repack(
    root: str | os.PathLike[str],
    *,
    keep: Callable[[str, int], bool] | None = None,
    fsync: bool = True,
) -> RepackReport:
    """Merge the store at ``root`` into one new pack and retire the packs it replaced.

    Raises :class:`cuda_program_cas.CollectorBusyError` when another repack or a ``gc`` holds
    the store's lock (nothing was changed).
    """
    cache = open_cache(root, write=True, purpose="repack")
    lay = cache.lay
    check_writable(lay, "repack")
    import filelock

    lock = filelock.FileLock(lay.lock, timeout=0)
    try:
        lock.acquire(blocking=False)
    except filelock.Timeout:
        raise CollectorBusyError(
            f"store {lay.root!r} is busy: another repack or a gc holds {lay.lock}; nothing was changed"
        ) from None
    try:
        return repack_locked(lay, keep=keep, fsync=fsync)
    finally:
        lock.release()
