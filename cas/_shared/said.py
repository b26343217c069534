"""What this process says once about shared stores: the first warning about each, and the entries refused as untrusted.

Untrusted entries are counted per store and said in one WARNING per store, at its close or at exit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from cuda_program_cas._base.fork import ForkSafeLock

__all__ = ["refused_untrusted", "say_untrusted", "warn_once_for"]

_log = logging.getLogger("cuda_program_cas")

_warned: set[str] = set()
_warned_lock = ForkSafeLock()
_untrusted: dict[str, int] = {}
_at_exit = False  # the report at exit arranged
os.register_at_fork(after_in_child=_untrusted.clear)  # a child says what it refused, not its parent's


def refused_untrusted(root: str) -> None:
    """Count one entry of ``root`` refused as untrusted; the first of the process arranges the report at exit."""
    global _at_exit
    with _warned_lock:
        first, _at_exit = not _at_exit, True
        _untrusted[root] = _untrusted.get(root, 0) + 1
    if first:
        import atexit

        atexit.register(say_untrusted)


def say_untrusted(roots: Sequence[str] | None = None) -> None:
    """One WARNING per store (of ``roots``; None: every one) whose entries this process refused as untrusted."""
    with _warned_lock:
        counts = {r: _untrusted.pop(r) for r in (list(_untrusted) if roots is None else roots) if r in _untrusted}
    for root, n in counts.items():
        _log.warning(
            "cuda-program-cas: shared store %s: %d %s refused in this process: not signed by a key in "
            "$CUDA_PROGRAM_CAS_TRUSTED_KEYS (each a miss, counted in untrusted); a node writing there without the "
            "site's signing key overwrites signed entries",
            root,
            n,
            "entry" if n == 1 else "entries",
        )


def warn_once_for(root: str) -> bool:
    """True the first time this process is to warn about ``root``."""
    with _warned_lock:
        if root in _warned:
            return False
        _warned.add(root)
        return True
