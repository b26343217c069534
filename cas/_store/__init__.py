"""The cache at run time: :class:`CacheStore`, which composes the local cache and the cluster layer."""

__all__: list[str] = []
