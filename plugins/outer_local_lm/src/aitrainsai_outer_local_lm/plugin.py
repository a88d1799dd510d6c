"""Registers the local-lm outer trainer."""

from aitrainsai import hookimpl


@hookimpl
def register_outer_trainers(register):
    from aitrainsai_outer_local_lm.agent import LocalLMAgent

    register(LocalLMAgent)
