"""The cache at run time: the reader, shared stores, the cap, counters, and :class:`CacheStore`."""

__all__: list[str] = []
