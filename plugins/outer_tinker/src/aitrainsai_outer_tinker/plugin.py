"""Registers the tinker outer trainer, its presets and the ``tinker-serve`` and ``sft`` commands (imports are deferred
to use)."""

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
    from aitrainsai_outer_tinker.serve_command import tinker_serve
    from aitrainsai_outer_tinker.sft_command import sft

    cli.add_command(tinker_serve)
    cli.add_command(sft)
