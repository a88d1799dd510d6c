"""Episodes through real (tiny) training by the local trainer: a live job, a crashing job, a hanging job."""

import asyncio

import pytest

from aitrainsai.builtin.local_backend import LocalBackend
from aitrainsai.episode import Baselines, Episode, EpisodeContext, SubmitFiles
from aitrainsai.ledger import Ledger
from aitrainsai.reward_spec import load_reward_spec

pytest.importorskip("aitrainsai_trainer_local")

TINY = 'steps = 1\nprompts_per_step = 2\ngroup_size = 2\nmax_new_tokens = 4\nlearning_rate = 0.001\n'
DATASET = ('from aitrainsai_family_multi_hop import generate\n\n'
           'def build():\n    return [{"question": i.question, "answer": i.answer, "world": i.world} '
           'for i in generate(5, 1, 8)]\n')


def play(tmp_path, plugins, files, **trainer_options):
    from aitrainsai_trainer_local.inner import LocalTrainer

    ledger = Ledger(tmp_path / "runs")
    run = ledger.create_run({}, [], name="tiny")
    trainer = LocalTrainer(LocalTrainer.Config(eval_size=4, eval_max_new_tokens=4, **trainer_options))
    backend = LocalBackend(LocalBackend.Config(), workdir=run.dir)
    family = plugins.task_families.get("multi_hop")()
    context = EpisodeContext(run=run, trainer=trainer, backend=backend,
                             reward_spec=load_reward_spec("default", plugins),
                             baselines=Baselines(ledger, trainer, backend, run.dir / "baselines"),
                             hide=[ledger.runs_dir])
    episode = Episode(context, family, 1, "tiny", step=0, group_id="g")
    result = asyncio.run(episode.play(SubmitFiles({"trainer.toml": TINY, "dataset.py": DATASET, **files})))
    return result, run


@pytest.mark.slow
def test_an_episode_trains_a_real_model(tmp_path, plugins):
    result, run = play(tmp_path, plugins, {})
    assert result.status == "done", run.jobs()[0]["result"].get("log_tail", "")[-2000:]
    train = result.train
    assert train.eval_size == 4 and 0.0 <= train.post <= 1.0
    assert train.uplift == pytest.approx(train.post - train.pre)
    assert train.uplift_ci[0] <= train.uplift <= train.uplift_ci[1]
    steps = train.metrics["steps"]
    assert len(steps) == 1 and steps[0]["tokens_generated"] > 0
    assert result.components["validation"] == 1.0
    (job,) = run.jobs()
    assert job["status"] == "done" and "step 1: reward" in job["result"]["log_tail"]


CRASH = ('import os\nimport verifiers as vf\n\ndef r(completion, **kwargs) -> float:\n'
         '    if os.environ.get("AITRAINSAI_PHASE") == "train":  # set in training, not in the probe\n'
         '        os._exit(3)\n    return float(bool(completion) and "<answer>" in str(completion[-1].content))\n\n'
         'def build_rubric(parser):\n    return vf.Rubric(funcs=[r], parser=parser)\n')
HANG = CRASH.replace("os._exit(3)", "import time; time.sleep(3600)")


@pytest.mark.slow
@pytest.mark.parametrize("rubric, reason, wall", [(CRASH, "exit code 3", 600), (HANG, "ran out of wall-clock time", 60)])
def test_a_job_that_crashes_or_hangs_is_dead_with_its_log(tmp_path, plugins, rubric, reason, wall):
    result, run = play(tmp_path, plugins, {"rubric.py": rubric}, max_wall_seconds=wall)
    assert result.status == "dead"
    assert result.components["job_quality"] == 0.0 and result.components["validation"] == 1.0
    (job,) = run.jobs()
    assert job["status"] == "dead" and "exit code 1" in job["result"]["reason"]
    failure = job["result"]["log_tail"].split("training failed: ", 1)[-1]
    assert "environment" in failure.splitlines()[0] and reason in failure.splitlines()[0], failure
