"""The test servers and worker harness, one package for the tests and the tools.

docs/design.md's code map lists its modules. pytest finds it through ``pythonpath`` in
pyproject.toml, a tool in ``tools/`` beside itself, a child interpreter through the
``PYTHONPATH`` of :func:`testkit.workers.child_env`; nothing edits ``sys.path``. Submodules
are imported by name: importing the package imports nothing else.
"""

from __future__ import annotations

import os

#: The checkout (cas/, index/, tools/, tests/).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The folder that holds this package (and bench's workloads, tools/_bench/).
TOOLS = os.path.join(REPO, "tools")

__all__ = ["REPO", "TOOLS"]
