"""The conformance kit: pytest classes that every plugin of a kind must pass.

Subclass the class for your kind in a test module and point it at your component::

    from aitrainsai.testing import TaskFamilyConformance
    from aitrainsai_family_ledger.family import Ledger

    class TestLedger(TaskFamilyConformance):
        family = Ledger
        distribution = "aitrainsai-family-ledger"
"""

from aitrainsai.testing.backends import GpuBackendConformance
from aitrainsai.testing.families import TaskFamilyConformance
from aitrainsai.testing.plugins import PluginConformance
from aitrainsai.testing.rewards import RewardComponentConformance
from aitrainsai.testing.trainers import InnerTrainerConformance, OuterTrainerConformance

__all__ = [
    "GpuBackendConformance",
    "InnerTrainerConformance",
    "OuterTrainerConformance",
    "PluginConformance",
    "RewardComponentConformance",
    "TaskFamilyConformance",
]
