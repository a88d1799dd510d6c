"""Identical jobs train once (``loop.share_identical_jobs``): where the inner trainer declares its training
deterministic, a job with the files, trainer settings, base and seed of a job of the run that is done or in flight
takes that job's outcome instead of training; its row says whom it shares with, and a resumed run keeps it so.

The given-numbers trainer (real subprocess payloads that report given numbers) declares determinism as configured;
``GIVEN_NUMBERS_LOG`` counts its payload executions."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest

from aitrainsai.config import RunConfig, resolve
from aitrainsai.jobs.job import job_digest
from aitrainsai.run.ledger import Ledger, Run
from aitrainsai.run.session import Session
from episode_helpers import ROOT, ScriptedPolicy, call, given_plugins, session_of, template_calls

# the default reward spec on the given numbers (tests/test_episode.py): validation 1, job quality, train speed
JOB_QUALITY = 0.25 * 0.6 + 0.75 * 0.9
REWARD = 0.35 * 1.0 + 0.60 * JOB_QUALITY + 0.05 * (1 - 450 / 1800)


def new_session(tmp_path: Path, *, share: bool = True, run: Run | None = None, **given) -> Session:
    """A session with the given-numbers trainer, deterministic unless ``given`` says otherwise (``run``: another
    session on that run, as a resume with these settings would build it)."""
    plugins = given_plugins()
    resolved = resolve(RunConfig.model_validate({
        "reward_spec": str(ROOT / "reward_specs" / "default.toml"),
        "gpu_backend": {"use": "local", "local": {"workers": 2}},
        "inner_trainer": {"use": "given-numbers", "given-numbers": {"deterministic": True, **given}},
        "loop": {"share_identical_jobs": share},
        "families": {"train": [], "held_out": []}}), plugins, outer=False)
    if run is None:
        run = Ledger(tmp_path / "runs").create_run(resolved.record(), [], name="shared")
    return Session(resolved, plugins, run)


@pytest.fixture
def executions(tmp_path, monkeypatch) -> Callable[[], list[str]]:
    """The payloads run so far, by job id (a job's evaluation: ``ID-eval``)."""
    log = tmp_path / "executions.log"
    monkeypatch.setenv("GIVEN_NUMBERS_LOG", str(log))
    return lambda: log.read_text().split() if log.exists() else []


def frozen(session: Session, member: int, edit: Callable[[Path], None] | None = None):
    """Episode ``g0000-e{member}`` with the job template frozen as its accepted job (``edit`` changes it first), as
    a run stopped right after the probe leaves it: ``resume()`` trains the job and records the reward."""
    episode = session.episode("calc_chain", 1, f"g0000-e{member}", step=0, group_id="g0000")
    job = episode.dir / "frozen"
    job.mkdir(parents=True)
    for name, text in episode.template().items():
        (job / name).write_text(text)
    if edit is not None:
        edit(job)
    session.run.upsert_episode(episode.id, status="training", step=0, family="calc_chain", level=1, group_id="g0000",
                               data={"turns": [], "frozen_job": str(job), "frozen_digest": job_digest(job)})
    return episode


def resume_all(*episodes):
    async def go():
        return await asyncio.gather(*(e.resume() for e in episodes))

    return asyncio.run(go())


def trainings(ran: list[str]) -> list[str]:
    return [job for job in ran if job.endswith("-job")]


def rows(run: Run) -> dict[str, dict]:
    """The job rows by id, without their timestamps."""
    return {job.id: job.model_dump(exclude={"created_at", "updated_at"}) for job in run.job_records()}


def test_two_identical_jobs_of_a_group_train_once_and_score_the_same_reward(tmp_path, executions):
    """Two episodes of one group write the same files at once: one job trains and is evaluated, the other waits for
    it and takes its outcome (done, shared with it, at no cost), and both episodes score the same reward."""
    from aitrainsai.cli.report import _job_lines, collect

    session = new_session(tmp_path)
    episodes = [session.episode("calc_chain", 1, f"g0000-e{i}", step=0, group_id="g0000") for i in range(2)]
    script = [*template_calls(episodes[0]), call("submit_job")]

    async def play():
        return await asyncio.gather(*(e.play(ScriptedPolicy(list(script))) for e in episodes))

    results = asyncio.run(play())
    assert [r.status for r in results] == ["done", "done"]
    assert results[0].reward == results[1].reward == pytest.approx(REWARD)
    assert results[0].components == results[1].components and results[0].train == results[1].train
    run = session.run
    jobs = {job.id: job for job in run.job_records()}
    (leader,) = [job for job in jobs.values() if job.result.shared_with is None]
    (follower,) = [job for job in jobs.values() if job.result.shared_with is not None]
    assert follower.result.shared_with == leader.id and follower.state.value == leader.state.value == "done"
    assert trainings(executions()) == [leader.id] and executions().count(f"{leader.id}-eval") == 1
    assert follower.cost_usd == 0.0 and follower.wall_s == 0.0 and follower.result.payload is None
    assert follower.result.outcome() == leader.result.outcome() and follower.result.train == leader.result.train
    assert follower.result.share_key == leader.result.share_key is not None
    assert [(e["data"]["job"], e["data"]["shares"]) for e in run.events("job_shared")] == [(follower.id, leader.id)]
    # the report says which job a shared one took its outcome from
    data = collect(run)
    assert {j["episode"]: j["shared_with"] for j in data["jobs"]} == {
        leader.episode_id: None, follower.episode_id: leader.id}
    assert f"done (shared with {leader.id})" in "\n".join(_job_lines(data))


EDITS = {
    "one byte": lambda job: (job / "dataset.py").write_text((job / "dataset.py").read_text() + "\n"),
    "a setting": lambda job: (job / "trainer.toml").write_text(
        (job / "trainer.toml").read_text().replace("learning_rate = 0.0001", "learning_rate = 0.0002")),
    "the seed": lambda job: (job / "trainer.toml").write_text(
        (job / "trainer.toml").read_text().replace("seed = 0", "seed = 1")),
}


@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
def test_a_job_that_differs_in_one_byte_setting_or_seed_trains(tmp_path, executions, edit):
    session = new_session(tmp_path)
    first, second = frozen(session, 0), frozen(session, 1, EDITS[edit])
    assert job_digest(first.dir / "frozen") != job_digest(second.dir / "frozen")  # the edit changed the job
    results = resume_all(first, second)
    assert [r.status for r in results] == ["done", "done"]
    assert sorted(trainings(executions())) == [first.job_id, second.job_id]
    assert all(job.result.shared_with is None for job in session.run.job_records())
    assert list(session.run.events("job_shared")) == []


@pytest.mark.parametrize("settings", [{"share": False}, {"deterministic": False}, {"spread": 0.1}],
                         ids=["sharing off", "not deterministic", "numbers per episode"])
def test_identical_jobs_train_where_sharing_is_off_or_the_trainer_is_not_deterministic(tmp_path, executions,
                                                                                         settings):
    """loop.share_identical_jobs = false, or a trainer that does not declare its training deterministic (the fake
    never does with spread, which makes a job's numbers depend on its episode): every job trains."""
    session = new_session(tmp_path, **settings)
    results = resume_all(frozen(session, 0), frozen(session, 1))
    assert [r.status for r in results] == ["done", "done"]
    assert len(trainings(executions())) == 2
    assert all(job.result.shared_with is None and job.result.share_key is None
               for job in session.run.job_records())


@pytest.mark.parametrize("reproducible", [False, None], ids=["not reproducible", "not checked"])
def test_identical_jobs_whose_code_did_not_replay_the_same_all_train(tmp_path, executions, reproducible):
    """The trainer is deterministic but the job's code was not found reproducible (its payload says so, or says
    nothing): the twin waiting for it trains itself, and so does a later identical job, also after a resume; none
    shares an outcome."""
    session = new_session(tmp_path, reproducible=reproducible, job_seconds=0.5)
    results = resume_all(frozen(session, 0), frozen(session, 1))
    assert [r.status for r in results] == ["done", "done"]
    assert len(trainings(executions())) == 2
    (third,) = resume_all(frozen(session, 2))
    resumed = session_of(session.run, given_plugins())
    (fourth,) = resume_all(frozen(resumed, 3))
    assert len(trainings(executions())) == 4 and third.status == fourth.status == "done"
    assert all(job.result.shared_with is None for job in session.run.job_records())
    assert list(session.run.events("job_shared")) == []


def test_a_run_setting_that_changed_on_resume_makes_another_job(tmp_path, executions):
    """A job done before the run was resumed with another trainer setting is not the same job as an identical one
    after it."""
    session = new_session(tmp_path)
    (done,) = resume_all(frozen(session, 0))
    other = new_session(tmp_path, run=session.run, post=0.7)
    (again,) = resume_all(frozen(other, 1))
    assert len(trainings(executions())) == 2 and again.record.post == 0.7 != done.record.post
    assert all(job.result.shared_with is None for job in session.run.job_records())


def test_a_resumed_run_keeps_a_shared_outcome_and_shares_with_jobs_done_before(tmp_path, executions):
    """Stopped after the jobs shared (both episodes left in training, as a kill before their rewards leaves them):
    the resumed run finishes both with the same rows and rewards and runs nothing; a new identical job after the
    resume takes the outcome of the job done before it."""
    session = new_session(tmp_path)
    before = resume_all(frozen(session, 0), frozen(session, 1))
    run = session.run
    recorded, ran = rows(run), executions()
    assert len(trainings(ran)) == 1 and len(list(run.events("job_shared"))) == 1
    for member in (0, 1):
        run.upsert_episode(f"g0000-e{member}", status="training")
    resumed = session_of(run, given_plugins())
    after = resume_all(*(resumed.episode("calc_chain", 1, f"g0000-e{m}", step=0, group_id="g0000") for m in (0, 1)))
    assert [r.reward for r in after] == [r.reward for r in before] and after[0].reward == after[1].reward
    (leader,) = [job_id for job_id, row in recorded.items() if row["result"]["shared_with"] is None]
    (follower,) = set(recorded) - {leader}
    now = rows(run)  # both rows as they were: a done job stands (its cost and time are not counted again)
    assert now == recorded
    assert executions() == ran and len(list(run.events("job_shared"))) == 1
    (third,) = resume_all(frozen(resumed, 2))
    assert run.job(third.id + "-job").result.shared_with == leader and executions() == ran
    assert third.reward == before[0].reward


def test_a_run_stopped_while_a_job_waits_resumes_to_the_shared_outcome(tmp_path, executions):
    """Stopped while one job trains and its twin waits for it: the resumed run finishes the first (its payload,
    killed with the run, is run again) and the twin waits for it again and takes its outcome, never training."""
    session = new_session(tmp_path, job_seconds=1.0)
    run = session.run

    def waiting() -> bool:
        states = {job.state.value: job for job in run.job_records()}
        return "running" in states and "queued" in states and states["queued"].result.shared_with is not None

    async def stop_while_waiting():
        task = asyncio.ensure_future(asyncio.gather(frozen(session, 0).resume(), frozen(session, 1).resume()))
        for _ in range(400):
            if waiting():
                break
            await asyncio.sleep(0.025)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(stop_while_waiting())
    assert waiting()
    (follower,) = [job for job in run.job_records() if job.result.shared_with is not None]
    leader = follower.result.shared_with
    resumed = session_of(run, given_plugins())
    results = resume_all(*(resumed.episode("calc_chain", 1, f"g0000-e{m}", step=0, group_id="g0000")
                           for m in (0, 1)))
    assert [r.status for r in results] == ["done", "done"] and results[0].reward == results[1].reward
    assert follower.id not in executions() and leader in executions()
    assert run.job(follower.id).state.value == "done" and run.job(follower.id).result.shared_with == leader
    assert [e["data"]["shares"] for e in run.events("job_shared")] == [leader]


def test_a_job_whose_twin_dies_trains_itself(tmp_path, executions):
    """The job waited for dies (here: its payload's result could not be read): the waiting job trains itself."""
    session = new_session(tmp_path, job_seconds=0.5)
    trainer, calls, waiting = session.inner_trainer, [], []
    real_result = trainer.result

    def result_once_broken(outcome):
        calls.append(outcome.job_id)
        if len(calls) == 1:  # the first job's: the other one waits for it
            waiting.extend(job.id for job in session.run.job_records() if job.result.shared_with == outcome.job_id)
            raise ValueError("unreadable")
        return real_result(outcome)

    trainer.result = result_once_broken
    results = resume_all(frozen(session, 0), frozen(session, 1))
    assert sorted(r.status for r in results) == ["dead", "done"]
    assert len(trainings(executions())) == 2
    (done,) = [job for job in session.run.job_records() if job.state.value == "done"]
    assert waiting == [done.id] and done.result.shared_with is None and done.result.payload is not None
    assert list(session.run.events("job_shared")) == []


def test_the_local_trainer_is_deterministic_only_on_the_cpu_with_fixed_threads(tmp_path, monkeypatch):
    from aitrainsai import LocalBackend
    from aitrainsai.testing import GivenNumbersTrainer
    from aitrainsai_trainer_local.inner import LocalTrainer

    def backend(**config) -> LocalBackend:
        return LocalBackend(LocalBackend.Config(**config), workdir=tmp_path)

    trainer = LocalTrainer()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(LocalBackend, "gpus", lambda self: [])
    assert trainer.deterministic(backend(workers=2))  # two payloads at once split the cores: a fixed count each
    assert trainer.deterministic(backend(threads_per_payload=3))
    assert not trainer.deterministic(backend(workers=1))  # torch's default thread count
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert trainer.deterministic(backend(workers=1))
    monkeypatch.setattr(LocalBackend, "gpus", lambda self: ["NVIDIA H100 80GB HBM3"])
    assert not trainer.deterministic(backend(threads_per_payload=1))  # torch trains on the GPU it sees
    assert not GivenNumbersTrainer().deterministic(backend())  # declared only where configured
