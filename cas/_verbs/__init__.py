"""The maintenance verbs (gc, verify, publish, import, stats, repack), each a library function with a report."""

__all__: list[str] = []
