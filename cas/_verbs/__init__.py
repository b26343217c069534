"""The maintenance verbs (gc, verify, publish, import, stats, repack, clear, config), each a function with a report."""

__all__: list[str] = []
