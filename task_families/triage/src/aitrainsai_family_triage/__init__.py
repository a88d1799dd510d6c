"""The triage task family: its public generator and tools."""

from aitrainsai_family_triage.world import TOOLS, generate

__all__ = ["TOOLS", "generate"]
