#!/usr/bin/env python3
"""Collect garbage in a cuda-program-cas cache: ``python tools/gc.py [PATH] [options]``.

The same as ``cuda-program-cas gc`` (see ``--help``). Needs no CUDA: it runs on a
storage server that has only Python and the project's pure-Python dependencies.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from cas._cli import main
except ImportError:  # run from a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from cas._cli import main

if __name__ == "__main__":
    sys.exit(main(["gc", *sys.argv[1:]]))
