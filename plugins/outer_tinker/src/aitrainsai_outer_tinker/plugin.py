"""Registers the tinker outer trainer, its presets and the ``sft`` command (imports are deferred to use; the
``tinker-serve`` command is aitrainsai-tinker-local-server's)."""

from pathlib import Path

from aitrainsai import hookimpl

PRESETS = Path(__file__).parent / "presets"


@hookimpl
def register_outer_trainers(register):
    from aitrainsai_outer_tinker.trainer import TinkerTrainer

    register(TinkerTrainer)


@hookimpl
def register_presets(register):
    for path in sorted(PRESETS.glob("*.toml")):
        register(path.stem, path)


@hookimpl
def register_commands(cli):
    from aitrainsai_outer_tinker.sft_command import sft

    cli.add_command(sft)
