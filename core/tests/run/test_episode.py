"""Whole episodes of the tally family driven by a scripted agent, with rewards checked against hand-computed
values."""

import json

import pytest

from aitrainsai.testing import call
from aitrainsai.testing.runs import needs_verifiers, run_episode, template_calls

# default spec: 0.35 validation + 0.60 job_quality + 0.05 train_speed
# job_quality = 0.25 post + 0.75 clip(0.5 + 0.5 (post - best_pre) / 0.25); train_speed = 1 - seconds / 1800
# given numbers: best_pre = 0.4 (tiny-b), post = 0.6 -> uplift_term 0.9, job_quality 0.825; 450 s -> 0.75
JOB_QUALITY = 0.25 * 0.6 + 0.75 * 0.9
TRAIN_SPEED = 1 - 450 / 1800
# a build() that fails: the probe names it and loads no environment in a sandbox (4-5 s of CPU a probe saved)
NO_ROWS = call("write_file", path="dataset.py", content="def build():\n    raise ValueError('no rows yet')\n")


@needs_verifiers
def test_valid_on_the_first_try(make_episode):
    episode = make_episode()
    result = run_episode(episode, [*template_calls(episode), call("get_baseline_scores"), call("submit_job")])
    assert result.status == "done"
    assert result.components["validation"] == 1.0
    assert result.components["job_quality"] == pytest.approx(JOB_QUALITY)
    assert result.reward == pytest.approx(0.35 * 1.0 + 0.60 * JOB_QUALITY + 0.05 * TRAIN_SPEED)
    baseline_reply = next(m for m in episode.messages if m.get("name") == "get_baseline_scores")
    assert baseline_reply["content"] == '{"tiny-a": 0.3, "tiny-b": 0.4}'
    run = episode.run
    (row,) = run.episodes()
    assert row.status == "done" and row.reward == pytest.approx(result.reward)
    (job,) = run.jobs()
    assert job.state == "done" and job.progress.post == 0.6 and job.handle["backend"] == "local"
    assert [p.ok for p in run.probes("ep-1")] == [True]
    transcript = run.transcript("ep-1")
    assert transcript[0]["role"] == "system" and "How you are rewarded" in transcript[0]["content"]
    assert "accepted" in transcript[-1]["content"]


@needs_verifiers
def test_valid_after_two_retries(make_episode):
    episode = make_episode()
    files = {json.loads(m["tool_calls"][0]["function"]["arguments"])["path"]: m for m in template_calls(episode)}
    broken_config = call("write_file", path="trainer.toml", content='base_model = "gpt-9"\nsteps = 100000\n')
    not_toml = call("write_file", path="trainer.toml", content="steps = = 3\n")
    script = [NO_ROWS, not_toml, call("submit_job"),             # not TOML (and no rows: no environment loaded)
              broken_config, call("submit_job"),                 # base not allowed, steps over budget
              files["dataset.py"], files["trainer.toml"], call("submit_job")]
    result = run_episode(episode, script)
    attempts = episode.run.probes("ep-1")
    assert [a.ok for a in attempts] == [False, False, True]
    assert "trainer.toml: not valid TOML" in attempts[0].problems[0]
    assert any("base_model 'gpt-9' is not allowed" in p for p in attempts[1].problems)
    assert any("exceeds the training budget" in p for p in attempts[1].problems)
    assert result.components["validation"] == 0.25
    assert result.reward == pytest.approx(0.35 * 0.25 + 0.60 * JOB_QUALITY + 0.05 * TRAIN_SPEED)


def test_never_valid(make_episode):
    episode = make_episode()
    broken = call("write_file", path="trainer.toml", content='base_model = "gpt-9"\n')
    result = run_episode(episode, [broken, NO_ROWS] + [call("submit_job")] * 5)  # the workspace starts valid: break it
    assert len(episode.attempts) == 3, "the reward spec caps attempts at 3"
    assert result.status == "invalid" and result.reward == 0.0
    assert result.components == {"validation": 0.0, "job_quality": 0.0, "train_speed": 0.0}
    assert episode.run.jobs() == []


def test_unparseable_output(make_episode):
    episode = make_episode()
    result = run_episode(episode, ["I will now write the job", "<tool_call>{oops", "still thinking"])
    assert result.status == "no_submission" and result.reward == pytest.approx(-0.1)
    errors = [m for m in episode.messages if m["role"] == "user" and "could not be parsed" in m["content"]]
    assert len(errors) == 3


@needs_verifiers
def test_a_job_that_dies_keeps_its_validation_term(make_episode):
    episode = make_episode(crash=True)
    result = run_episode(episode, [*template_calls(episode), call("submit_job")])
    assert result.status == "dead"
    assert result.components == {"validation": 1.0, "job_quality": 0.0, "train_speed": 0.0}
    assert result.reward == pytest.approx(0.35)
    (job,) = episode.run.jobs()
    assert job.state == "dead" and "exit code 3" in (job.progress.reason or "")


@needs_verifiers
def test_a_job_the_infrastructure_could_not_run_is_no_job_failure(make_episode):
    """Its payload exits as a driver does for a machine too slow for the budget: the job row is dead with the reason
    word ``infra``, the episode's status is ``infra`` (the loop leaves it out of its group's signal)."""
    make_episode(infra=[1])  # a run whose trainer's payloads for episodes ...-e1 die so
    episode = make_episode(episode_id="g0-e1")
    result = run_episode(episode, [*template_calls(episode), call("submit_job")])
    assert result.status == "infra" and result.outcome.job_status == "infra"
    (job,) = episode.run.jobs()
    assert job.state == "dead" and job.progress.dead_reason == "infra" and "exit code 75" in (job.progress.reason or "")


@needs_verifiers
def test_probe_flags_a_constant_rubric_and_says_nothing_of_hidden_items(make_episode):
    episode = make_episode()
    files = template_calls(episode)
    constant = call("write_file", path="rubric.py", content=(
        "import verifiers as vf\n\ndef always(completion, **kwargs) -> float:\n    return 1.0\n\n"
        "def build_rubric(parser):\n    return vf.Rubric(funcs=[always], parser=parser)\n"))
    family = episode.family
    leak = call("write_file", path="dataset.py", content=(
        f"from aitrainsai.testing.tally import generate\n\ndef build():\n"
        f"    return [{{'question': i.question, 'answer': i.answer, 'world': i.world}} "
        f"for i in generate({family.eval_seed}, 1, 50)]\n"))
    run_episode(episode, [*files, constant, leak, call("submit_job")])
    (attempt,) = episode.run.probes("ep-1")
    text = "\n".join(attempt.problems)
    assert "rubric.py: every sample scored 1" in text
    assert "dataset.py" not in text and "hidden" not in text  # the leak is hidden from training, never told


@needs_verifiers
@pytest.mark.parametrize("losses, status", [(1, "done"), (3, "dead")], ids=["rerun", "given-up"])
def test_a_lost_payload_is_run_again_a_bounded_number_of_times(make_episode, losses, status):
    """A training payload whose worker vanished mid-run (a node died, a Ray head restarted) is submitted again, at
    most MAX_LOST_RERUNS times; then the job is dead, reason lost."""
    from aitrainsai.run.job_phase import MAX_LOST_RERUNS

    episode = make_episode()
    backend = episode.context.backend
    real_wait, submitted = backend.wait, []
    real_submit = backend.submit

    async def submit(payload):
        submitted.append(payload.job_id)
        return await real_submit(payload)

    async def wait(handle):
        outcome = await real_wait(handle)
        if handle.job_id.endswith("-job") and submitted.count(handle.job_id) <= losses:
            return outcome.model_copy(update={"status": "dead", "reason": "lost", "detail": "its node died"})
        return outcome

    backend.submit, backend.wait = submit, wait
    result = run_episode(episode, [*template_calls(episode), call("submit_job")])
    assert result.status == status
    train = [j for j in submitted if j.endswith("-job")]
    assert len(train) == min(losses, MAX_LOST_RERUNS) + 1
    reruns = episode.run.events("job_rerun")
    assert [e.data["rerun"] for e in reruns] == list(range(1, len(train)))
    assert all(e.data["reason"] == "lost: its node died" for e in reruns)
    (job,) = episode.run.jobs()
    assert job.state == status
    if status == "dead":
        assert job.progress.dead_reason == "lost"


@needs_verifiers
def test_an_accepted_job_records_what_it_chose_for_the_report(make_episode):
    """An agent that records no choices (an LLM) still gets its jobs' choices in the report: the rubric's functions
    as the probe's sandboxed environment named them, and trainer.toml's values, read from the frozen job."""
    pytest.importorskip("matplotlib")
    from aitrainsai.cli.report import write_report

    short = call("edit_file", path="rubric.py", old="\n\ndef build_rubric",
                 new="\n\ndef short(completion, **kwargs) -> float:\n    return float(len(str(completion)) < 400)\n"
                     "\n\ndef build_rubric")
    weigh = call("edit_file", path="rubric.py", old="funcs=[correct_answer], weights=[1.0]",
                 new="funcs=[correct_answer, short], weights=[1.0, 0.25]")
    first, second = make_episode(), make_episode(episode_id="ep-2")
    assert run_episode(first, [call("submit_job")]).status == "done"  # the template's job
    assert run_episode(second, [short, weigh, call("submit_job")]).status == "done"
    designs = {row.id: row.data.design for row in first.run.episodes()}
    assert designs["ep-1"]["rubric"] == "correct_answer" and designs["ep-2"]["rubric"] == "correct_answer+short*0.25"
    toml = first.workspace.read_file("trainer.toml")
    assert len(designs["ep-1"]) > 1 and all(f"{key} = " in toml for key in designs["ep-1"] if key != "rubric")
    assert {k: v for k, v in designs["ep-1"].items() if k != "rubric"} == {
        k: v for k, v in designs["ep-2"].items() if k != "rubric"}
    rows = [line for line in write_report(first.run).read_text().splitlines() if line.startswith("| - | tally")]
    assert [row.rsplit("|", 2)[-2].strip() for row in rows] == ["rubric=correct_answer",
                                                                 "rubric=correct_answer+short*0.25"]
