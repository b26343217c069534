"""What every floor uses: the exceptions, the fork registry, the environment's knobs, the logger."""

__all__: list[str] = []
