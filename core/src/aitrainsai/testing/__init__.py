"""The second public module: the conformance kit (pytest classes that every plugin of a kind must pass) and the
helpers a plugin's tests use (payload checks, a payload moved elsewhere, pool workloads and their measures), and the
fakes (:mod:`aitrainsai.testing.fakes`: an inner trainer that reports given numbers, a scripted agent; and
:mod:`aitrainsai.testing.tally`, a task family). Names load on first use, so that a job importing the tally family's
public module in its sandbox loads none of the kits.

Subclass the class for your kind in a test module and point it at your component::

    from aitrainsai.testing import TaskFamilyConformance
    from aitrainsai_family_ledger.family import Ledger

    class TestLedger(TaskFamilyConformance):
        family = Ledger
        distribution = "aitrainsai-family-ledger"
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, for type checkers (``X as X``: an explicit re-export)
    from aitrainsai.testing.backends import (ORCHESTRATOR as ORCHESTRATOR,
                                             GpuBackendConformance as GpuBackendConformance,
                                             payload_problems as payload_problems, relocate as relocate)
    from aitrainsai.testing.fakes import (EVALUATING_MARKER as EVALUATING_MARKER, FAKES as FAKES,
                                          GivenNumbersTrainer as GivenNumbersTrainer, ScriptedPolicy as ScriptedPolicy,
                                          call as call)
    from aitrainsai.testing.families import TaskFamilyConformance as TaskFamilyConformance
    from aitrainsai.testing.plugins import PluginConformance as PluginConformance
    from aitrainsai.testing.pool import (describe as describe, mixed_durations as mixed_durations,
                                         sleeping_payload as sleeping_payload, utilisation as utilisation)
    from aitrainsai.testing.rewards import RewardComponentConformance as RewardComponentConformance
    from aitrainsai.testing.tally.family import FAKE_FAMILIES as FAKE_FAMILIES
    from aitrainsai.testing.trackers import TrackerConformance as TrackerConformance
    from aitrainsai.testing.trainers import (InnerTrainerConformance as InnerTrainerConformance,
                                             OuterTrainerConformance as OuterTrainerConformance,
                                             check_spec_refused as check_spec_refused)

_MODULES: dict[str, tuple[str, ...]] = {
    "aitrainsai.testing.backends": ("ORCHESTRATOR", "GpuBackendConformance", "payload_problems", "relocate"),
    "aitrainsai.testing.fakes": ("EVALUATING_MARKER", "FAKES", "GivenNumbersTrainer", "ScriptedPolicy", "call"),
    "aitrainsai.testing.families": ("TaskFamilyConformance",),
    "aitrainsai.testing.plugins": ("PluginConformance",),
    "aitrainsai.testing.pool": ("describe", "mixed_durations", "sleeping_payload", "utilisation"),
    "aitrainsai.testing.rewards": ("RewardComponentConformance",),
    "aitrainsai.testing.tally.family": ("FAKE_FAMILIES",),
    "aitrainsai.testing.trackers": ("TrackerConformance",),
    "aitrainsai.testing.trainers": ("InnerTrainerConformance", "OuterTrainerConformance", "check_spec_refused"),
}
_EXPORTS: dict[str, str] = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aitrainsai.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
