"""The dispatch task family: its public generator and tools."""

from aitrainsai_family_dispatch.world import TOOLS, generate

__all__ = ["TOOLS", "generate"]
