"""Episodes through real training by the local trainer, on its tiny base (the same tokenizer, chat format and
architecture as SmolLM2-135M, two narrow layers: the mechanics, not learning): a live job, a crashing job, a hanging
job."""

import asyncio
import re

import pytest

from aitrainsai.config import load_config, resolve
from aitrainsai.run.policy import SubmitFiles
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.session import Session

pytest.importorskip("aitrainsai_trainer_local")

TINY = ('base_model = "tiny-llama"\nsteps = 1\nprompts_per_step = 2\ngroup_size = 2\nmax_new_tokens = 4\n'
        'learning_rate = 0.001\n')
DATASET = ('from aitrainsai_family_multi_hop import generate\n\n'
           'def build():\n    return [{"question": i.question, "answer": i.answer, "world": i.world} '
           'for i in generate(5, 1, 8)]\n')


@pytest.fixture(autouse=True)
def tiny_base(monkeypatch):
    """The trainer offers the tiny base alone; each payload names its base to its worker."""
    monkeypatch.setenv("AITRAINSAI_LOCAL_BASE", "tiny-llama")


def play(tmp_path, plugins, files, **trainer_options):
    options = {"eval_size": 4, "eval_max_new_tokens": 4, **trainer_options}
    config = load_config(None, ["families.train=[]", "families.held_out=[]",
                                *(f"inner_trainer.local.{k}={v!r}" for k, v in options.items())],
                         presets=plugins.presets)
    resolved = resolve(config, plugins, outer=False)
    run = Ledger(tmp_path / "runs").create_run(resolved.snapshot(), [], name="tiny")
    episode = Session(resolved, plugins, run).episode("multi_hop", 1, "tiny", step=0, group_id="g")
    result = asyncio.run(episode.play(SubmitFiles({"trainer.toml": TINY, "dataset.py": DATASET, **files})))
    return result, run


@pytest.mark.slow
def test_an_episode_trains_a_model(tmp_path, plugins):
    result, run = play(tmp_path, plugins, {})
    assert result.status == "done", (run.jobs()[0].progress.log_tail or "")[-2000:]
    train = result.train
    assert train.eval_size == 4 and 0.0 <= train.post <= 1.0
    assert train.uplift == pytest.approx(train.post - train.pre)
    assert train.uplift_ci[0] <= train.uplift <= train.uplift_ci[1]
    steps = train.metrics["steps"]
    assert len(steps) == 1 and steps[0]["tokens_generated"] > 0
    assert result.components["validation"] == 1.0
    (job,) = run.jobs()
    assert job.state == "done" and "step 1: reward" in (job.progress.log_tail or "")
    assert train.base_model == "tiny-llama"


CRASH = ('import os\nimport verifiers as vf\n\ndef r(completion, **kwargs) -> float:\n'
         '    text = str(completion[-1].content) if completion else ""\n'
         '    if text and "<answer>" not in text:  # the probe\'s samples all have one, or nothing: a model\'s reply\n'
         '        os._exit(3)\n    return float("<answer>" in text)\n\n'
         'def build_rubric(parser):\n    return vf.Rubric(funcs=[r], parser=parser)\n')
HANG = CRASH.replace("os._exit(3)", "import time; time.sleep(3600)")


@pytest.mark.slow
@pytest.mark.parametrize("rubric, reason, wall", [(CRASH, r"exit code 3", 600),
                                                  # 20 s on a quiet machine, stretched by load as the probe's
                                                  (HANG, r"did not answer within (20|[2-9]\d|1[0-5]\d) s", 20)])
def test_a_job_that_crashes_or_hangs_is_dead_with_its_log(tmp_path, plugins, rubric, reason, wall):
    result, run = play(tmp_path, plugins, {"rubric.py": rubric}, max_wall_seconds=wall)
    assert result.status == "dead"
    assert result.components["job_quality"] == 0.0 and result.components["validation"] == 1.0
    (job,) = run.jobs()
    assert job.state == "dead" and "exit code 1" in (job.progress.reason or "")
    failure = (job.progress.log_tail or "").split("training failed: ", 1)[-1]
    assert "environment" in failure.splitlines()[0] and re.search(reason, failure.splitlines()[0]), failure
