"""aitrainsai: an outer agent is RL-trained to write training jobs that really train small language models."""

from aitrainsai.hookspecs import hookimpl

__all__ = ["hookimpl"]
