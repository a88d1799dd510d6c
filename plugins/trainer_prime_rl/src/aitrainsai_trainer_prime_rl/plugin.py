"""Registers the prime-rl inner trainer and its preset."""

from pathlib import Path

from aitrainsai import hookimpl

PRESETS = Path(__file__).parent / "presets"


@hookimpl
def register_inner_trainers(register):
    from aitrainsai_trainer_prime_rl.inner import PrimeRlTrainer

    register(PrimeRlTrainer)


@hookimpl
def register_presets(register):
    for path in sorted(PRESETS.glob("*.toml")):
        register(path.stem, path)
