"""kvtrim's error type: a ``ValueError`` whose message says what was wrong and what is allowed."""


class KVTrimError(ValueError):
    """Bad input to kvtrim (unknown method, budget out of range, unsupported model, ...)."""
