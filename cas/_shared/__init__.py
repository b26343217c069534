"""The cluster layer: shared stores (tiers), write-back, leases, warm sets and key lists."""

__all__: list[str] = []
