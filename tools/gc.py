#!/usr/bin/env python3
"""Collect garbage in a cuda-program-cas cache: ``python tools/gc.py [PATH] [options]``.

The same as ``cuda-program-cas gc`` and ``python -m cuda_program_cas gc`` (see ``--help``), for a
source checkout; an installed package has the console script instead (``tools/``
is not in the wheel). Needs no CUDA: it runs on a storage server that has only
Python and the project's pure-Python dependencies, once the project is installed
(``pip install .``).
"""

from __future__ import annotations

import sys

try:
    from cuda_program_cas._cli.main import main
except ImportError as exc:  # the package (and its cuda_program_cas.index) is not installed
    sys.exit(f"tools/gc.py: cuda-program-cas is not installed in this Python ({exc}); run `pip install .` first")

if __name__ == "__main__":
    sys.exit(main(["gc", *sys.argv[1:]]))
