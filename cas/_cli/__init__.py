"""The ``cuda-program-cas`` console script: parse arguments, call a verb, print its report."""

__all__: list[str] = []
