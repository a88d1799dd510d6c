"""The cli room: the commands (:mod:`~aitrainsai.cli.command`, the ``aitrainsai`` entry point), the report
(:mod:`~aitrainsai.cli.report`), the progress display (:mod:`~aitrainsai.cli.progress`) and the family scaffold
(:mod:`~aitrainsai.cli.scaffold`).

``aitrainsai.cli`` was one module; its names stay importable from here for one release, loaded on first use."""

import importlib


def main() -> None:
    """The ``aitrainsai`` command."""
    importlib.import_module("aitrainsai.cli.command").main()


def __getattr__(name: str):
    command = importlib.import_module("aitrainsai.cli.command")
    try:
        return getattr(command, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
