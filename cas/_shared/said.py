"""The entries this process refused as untrusted: counted per store, one WARNING per store at its close or at exit.

(What is said once otherwise goes through :func:`cuda_program_cas._base.config.say_once`.)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from cuda_program_cas._base.fork import ForkSafeLock

__all__ = ["refused_untrusted", "say_untrusted"]

_log = logging.getLogger("cuda_program_cas")

_lock = ForkSafeLock()
_untrusted: dict[str, int] = {}
_at_exit = False  # the report at exit arranged
os.register_at_fork(after_in_child=_untrusted.clear)  # a child says what it refused, not its parent's


def refused_untrusted(root: str) -> None:
    """Count one entry of ``root`` refused as untrusted; the first of the process arranges the report at exit."""
    global _at_exit
    with _lock:
        first, _at_exit = not _at_exit, True
        _untrusted[root] = _untrusted.get(root, 0) + 1
    if first:
        import atexit

        atexit.register(say_untrusted)


def say_untrusted(roots: Sequence[str] | None = None) -> None:
    """One WARNING per store (of ``roots``; None: every one) whose entries this process refused as untrusted."""
    with _lock:
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
