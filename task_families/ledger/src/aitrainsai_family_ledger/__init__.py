"""The ledger task family: its public generator and tools."""

from aitrainsai_family_ledger.world import TOOLS, bind_tools, generate

__all__ = ["TOOLS", "bind_tools", "generate"]
