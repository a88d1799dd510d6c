"""The string_pipeline task family: its public generator and tools."""

from aitrainsai_family_string_pipeline.world import TOOLS, generate

__all__ = ["TOOLS", "generate"]
