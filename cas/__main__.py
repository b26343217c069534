"""``python -m cuda_program_cas``: the ``cuda-program-cas`` console script, for an environment without it on PATH."""

from __future__ import annotations

import sys

from ._cli.main import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
