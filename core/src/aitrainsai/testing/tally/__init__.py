"""The tally family's public module: its generator and tools (:mod:`aitrainsai.testing.tally.world`)."""

from aitrainsai.testing.tally.world import TOOLS, generate

__all__ = ["TOOLS", "generate"]
