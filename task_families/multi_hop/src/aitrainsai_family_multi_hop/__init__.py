"""The multi_hop task family: its public generator and tools."""

from aitrainsai_family_multi_hop.world import TOOLS, generate

__all__ = ["TOOLS", "generate"]
