"""The cli room: the commands (:mod:`~aitrainsai.cli.command`, the ``aitrainsai`` entry point), the report
(:mod:`~aitrainsai.cli.report`), the progress display (:mod:`~aitrainsai.cli.progress`) and the family scaffold
(:mod:`~aitrainsai.cli.scaffold`)."""

import importlib


def main() -> None:
    """The ``aitrainsai`` command."""
    importlib.import_module("aitrainsai.cli.command").main()

