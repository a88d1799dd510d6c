"""The second public module: the conformance kit (pytest classes that every plugin of a kind must pass) and the
helpers a plugin's tests use (payload checks, a payload moved elsewhere, pool workloads and their measures), and the
fakes (:mod:`aitrainsai.testing.fakes`: an inner trainer that reports given numbers, a scripted agent).

Subclass the class for your kind in a test module and point it at your component::

    from aitrainsai.testing import TaskFamilyConformance
    from aitrainsai_family_ledger.family import Ledger

    class TestLedger(TaskFamilyConformance):
        family = Ledger
        distribution = "aitrainsai-family-ledger"
"""

from aitrainsai.testing.backends import ORCHESTRATOR, GpuBackendConformance, payload_problems, relocate
from aitrainsai.testing.fakes import EVALUATING_MARKER, FAKES, GivenNumbersTrainer, ScriptedPolicy, call
from aitrainsai.testing.families import TaskFamilyConformance
from aitrainsai.testing.plugins import PluginConformance
from aitrainsai.testing.pool import describe, mixed_durations, sleeping_payload, utilisation
from aitrainsai.testing.rewards import RewardComponentConformance
from aitrainsai.testing.trackers import TrackerConformance
from aitrainsai.testing.trainers import InnerTrainerConformance, OuterTrainerConformance, check_spec_refused

__all__ = [
    "EVALUATING_MARKER",
    "FAKES",
    "ORCHESTRATOR",
    "GivenNumbersTrainer",
    "GpuBackendConformance",
    "InnerTrainerConformance",
    "OuterTrainerConformance",
    "PluginConformance",
    "RewardComponentConformance",
    "ScriptedPolicy",
    "TaskFamilyConformance",
    "TrackerConformance",
    "call",
    "check_spec_refused",
    "describe",
    "mixed_durations",
    "payload_problems",
    "relocate",
    "sleeping_payload",
    "utilisation",
]
