"""Registers the openai outer trainer."""

from aitrainsai import hookimpl


@hookimpl
def register_outer_trainers(register):
    from aitrainsai_outer_openai.agent import OpenAIAgent

    register(OpenAIAgent)
