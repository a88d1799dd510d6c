"""Registers the local inner trainer."""

from aitrainsai import hookimpl


@hookimpl
def register_inner_trainers(register):
    from aitrainsai_trainer_local.inner import LocalTrainer

    register(LocalTrainer)
