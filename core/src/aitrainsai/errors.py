"""The base of every exception the core raises."""


class AitrainsaiError(Exception):
    """The base of the core's exceptions: ``except AitrainsaiError`` catches any of them.

    Each also keeps the builtin base it had (``ValueError``, ``RuntimeError``, ...), so code that catches those is
    unchanged. ``Interrupted`` is the one exception: a ``KeyboardInterrupt``, outside ``Exception`` on purpose.
    """
