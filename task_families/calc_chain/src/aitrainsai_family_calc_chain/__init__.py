"""The calc_chain task family: its public generator and tools."""

from aitrainsai_family_calc_chain.world import TOOLS, generate

__all__ = ["TOOLS", "generate"]
