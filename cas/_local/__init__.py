"""The local cache at run time: the reader, the cap, counters, the ledgers and the journal."""

__all__: list[str] = []
