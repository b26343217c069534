"""``repack``: merge a shared store's loose entries and packs into one new pack (see :mod:`.packs`).

One repack at a time: two at once would each retire the packs the other is
reading, so it takes the store's ``evict.lock`` (the lock ``gc`` holds) without
blocking, and a second one does nothing (:class:`cuda_program_cas.CollectorBusyError`).
"""

from __future__ import annotations

import os

from cuda_program_cas._base.errors import CollectorBusyError, LayoutError
from cuda_program_cas._disk.layout import LayoutState, check_layout, is_shared_store

from .common import open_cache, refuse_url
from .packs import RepackReport, repack_locked

__all__ = ["RepackReport", "check_shared_store", "repack"]


def repack(root: str | os.PathLike[str]) -> RepackReport:
    """Merge the store at ``root`` into one new pack and retire the packs it replaced.

    Raises :class:`cuda_program_cas.CollectorBusyError` when another repack or a ``gc`` holds
    the store's lock (nothing was changed).
    """
    lay = open_cache(root, write=True, purpose="repack").lay
    with lay.collector_lock() as held:
        if not held:
            raise CollectorBusyError(
                f"store {lay.root!r} is busy: another repack or a gc holds {lay.lock}; nothing was changed"
            )
        return repack_locked(lay)


def check_shared_store(root: str | os.PathLike[str]) -> None:
    """Raise :class:`cuda_program_cas.LayoutError` when ``root`` is a cache that publish did not mark as shared.

    A repack there would keep each entry twice, loose and packed, until a ``gc``.
    :func:`repack` itself does not ask; the command does.
    """
    refuse_url(root)
    path = os.path.abspath(os.fspath(root))
    if check_layout(path) is LayoutState.OK and not is_shared_store(path):
        raise LayoutError(
            f"{path!r} is not a shared store (publish marks the stores it writes): repacking it would keep every "
            "entry twice, loose and packed; repack the shared store your nodes read"
        )
