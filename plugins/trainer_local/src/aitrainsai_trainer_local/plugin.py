"""Registers the local inner trainer and the presets that use it (``default`` among them)."""

from pathlib import Path

from aitrainsai import hookimpl

PRESETS = Path(__file__).parent / "presets"


@hookimpl
def register_inner_trainers(register):
    from aitrainsai_trainer_local.inner import LocalTrainer

    register(LocalTrainer)


@hookimpl
def register_presets(register):
    for path in sorted(PRESETS.glob("*.toml")):
        register(path.stem, path)
