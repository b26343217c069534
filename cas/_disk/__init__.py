"""The cache on disk: files and the atomic write, the layout, blobs, the one writer, the one remover, scans, packs."""

__all__: list[str] = []
