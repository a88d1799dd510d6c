"""Conformance checks for inner and outer trainers."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pydantic
import pytest

from aitrainsai.families import Constraints
from aitrainsai.testing.plugins import PluginConformance
from aitrainsai.trainers import InnerTrainer, OuterTrainer


class InnerTrainerConformance(PluginConformance):
    """Set ``trainer`` to the inner trainer class."""

    trainer: ClassVar[type[InnerTrainer]]
    kind = "inner_trainers"

    def component_names(self) -> list[str]:
        return [self.trainer.name]

    def test_offers_base_models(self):
        assert self.trainer.base_models, "an inner trainer declares the base models a job may choose"

    def test_config_rejects_unknown_keys(self):
        with pytest.raises(pydantic.ValidationError):
            self.trainer.Config.model_validate({"no_such_option_anywhere": 1})

    def test_check_config_refuses_what_the_budget_or_the_bases_do_not_allow(self, tmp_path):
        """What the probe and the trainer's own re-check before training run: a base the trainer does not offer, steps
        over the budget, an unknown key."""
        trainer = self.trainer()
        constraints = trainer.constraints(Constraints()).model_copy(update={"max_train_steps": 3})
        for text, says in (('base_model = "no-such-base"\nsteps = 1\n', "no-such-base"),
                           (f'base_model = "{trainer.base_models[0]}"\nsteps = 4\n', "budget"),
                           (f'base_model = "{trainer.base_models[0]}"\nsteps = 1\nno_such_key = 1\n', "unknown key")):
            (tmp_path / "trainer.toml").write_text(text)
            problems = trainer.check_config(tmp_path, constraints)
            assert problems and any(says in str(p) for p in problems), (text, problems)


    def test_eval_settings_name_the_base_and_serialise(self):
        """The baseline cache key holds them: they must be JSON, differ per base model, and be stable."""
        import json

        trainer = self.trainer()
        first, second = (trainer.eval_settings(base) for base in (trainer.base_models[0], "another-base"))
        assert json.loads(json.dumps(first, sort_keys=True)) == first
        assert first != second and trainer.eval_settings(trainer.base_models[0]) == first


class OuterTrainerConformance(PluginConformance):
    """Set ``trainer`` to the outer trainer class; override :meth:`make` when it needs more than defaults."""

    trainer: ClassVar[type[OuterTrainer]]
    kind = "outer_trainers"

    def component_names(self) -> list[str]:
        return [self.trainer.name]

    def make(self, tmp_path) -> OuterTrainer:
        return self.trainer(self.trainer.Config(), state_dir=tmp_path)

    def test_lifecycle_and_state_round_trip(self, tmp_path):
        """start, async save_state into a fresh folder, a second trainer's load_state, close: the version survives."""

        async def scenario():
            trainer = self.make(tmp_path / "a")
            await trainer.start()
            await trainer.save_state(tmp_path / "state")
            again = self.make(tmp_path / "b")
            await again.start()
            await again.load_state(tmp_path / "state")
            assert again.policy_version == trainer.policy_version
            await again.close()
            await trainer.close()

        asyncio.run(scenario())

    def test_state_methods_are_coroutines(self):
        """Saving must not block the event loop: the loop awaits both."""
        for name in ("start", "close", "save_state", "load_state", "sample", "update"):
            assert inspect.iscoroutinefunction(getattr(self.trainer, name)), f"{name} must be async"

    def test_sample_takes_a_mode(self):
        """``sample(..., mode="train" | "eval")``: the loop plays evaluation episodes with ``mode="eval"``."""
        parameter = inspect.signature(self.trainer.sample).parameters.get("mode")
        assert parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY
        assert parameter.default == "train"

    def test_update_with_no_groups_changes_nothing(self, tmp_path):
        trainer = self.make(tmp_path)
        version = trainer.policy_version
        metrics = asyncio.run(trainer.update([]))
        assert isinstance(metrics, dict) and trainer.policy_version == version


def check_spec_refused(module: str, main: Callable[[str], int], folder: Path, text: str, says: str,
                       capsys: Any) -> None:
    """A worker driver (``python -m module job.json``; ``main`` in-process) given ``text`` as its ``job.json``
    prints one line holding ``says`` and exits 2, called here and as its own process."""
    (folder / "job.json").write_text(text)
    assert main(str(folder / "job.json")) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and says in out, out
    done = subprocess.run([sys.executable, "-m", module, "job.json"], cwd=folder, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stdout.count("\n") == 1 and says in done.stdout and not done.stderr, done
