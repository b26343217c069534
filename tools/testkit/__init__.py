"""The test servers and worker harness, one package for the tests and the tools.

pytest finds it through ``pythonpath`` in pyproject.toml; a tool run as
``python tools/X.py`` has ``tools/`` first on ``sys.path`` already; a child interpreter
gets it through the ``PYTHONPATH`` of :func:`testkit.workers.child_env`. Nothing here
edits ``sys.path``.

- :mod:`testkit.workers`: a fresh interpreter that runs one piece of work and answers one
  JSON line (every tool's ``_worker`` mode, torture's loads, the NFS scenarios' nodes);
  :mod:`testkit.forks`, the same without the start-up: children forked from a server that
  imported once.
- :mod:`testkit.server`: the life cycle of a server run as a child on a loopback port (a free
  port, readiness, stop, the test's skip); :mod:`testkit.nginx` (static reads and WebDAV),
  :mod:`testkit.redis_server` and :mod:`testkit.weed` (S3) are such servers;
  :mod:`testkit.proxy` is a delaying TCP forwarder.
- :mod:`testkit.faults`: an HTTP server in this process that answers with the faults a test
  asks for (false ranges and WebDAV writes that keep less among them).
- :mod:`testkit.cudastub`: a stand-in CUDA driver for cuda.compute's builds on the CPU.
- :mod:`testkit.common`: the CUB kernel, the CCCL header search, the checkout's git state.
- :mod:`testkit.torture`: the torture run's scenarios and the cache checker.

Submodules are imported by name: importing the package imports nothing else.
"""

from __future__ import annotations

import os

#: The checkout (cas/, index/, tools/, tests/).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The folder that holds this package (and bench's workloads, tools/_bench/).
TOOLS = os.path.join(REPO, "tools")

__all__ = ["REPO", "TOOLS"]
