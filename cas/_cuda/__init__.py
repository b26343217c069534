"""The ``cuda.core`` side: the ``ProgramCacheResource`` adapter and the front door (the only importers of cuda.core)."""

__all__: list[str] = []
