"""Identical jobs train twice, then share (``loop.share_identical_jobs``): where the inner trainer declares its
training deterministic, the first two jobs with the same files, trainer settings, base and seed train apart (a leader
and a confirmer); once both are done with the same checkpoint and scores, each job's code found reproducible, every
later one takes the leader's outcome instead of training; its row says whom it shares with, and a resumed run keeps
it so. Trainings that differ share nothing.

The given-numbers trainer (real subprocess payloads that report given numbers) declares determinism as configured;
``GIVEN_NUMBERS_LOG`` counts its payload executions. The jobs are the tally family's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from aitrainsai.jobs.job import job_digest
from aitrainsai.run.ledger import Run
from aitrainsai.run.session import Session
from aitrainsai.run.record import EpisodeData
from aitrainsai.testing import ScriptedPolicy, call
from aitrainsai.testing.runs import episode_session, fake_plugins, needs_verifiers, session_of, template_calls

pytestmark = needs_verifiers  # every job here is accepted and trained

given_plugins = cache(fake_plugins)  # one plugin set for this test process

# the default reward spec on the given numbers (test_episode.py): validation 1, job quality, train speed
JOB_QUALITY = 0.25 * 0.6 + 0.75 * 0.9
REWARD = 0.35 * 1.0 + 0.60 * JOB_QUALITY + 0.05 * (1 - 450 / 1800)


def new_session(tmp_path: Path, *, share: bool = True, run: Run | None = None, **given) -> Session:
    """A session with the given-numbers trainer, deterministic unless ``given`` says otherwise (``run``: another
    session on that run, as a resume with these settings would build it)."""
    return episode_session(tmp_path / "runs", given_plugins(), run=run, name="shared",
                           loop={"share_identical_jobs": share}, **{"deterministic": True, **given})


@pytest.fixture
def executions(tmp_path, monkeypatch) -> Callable[[], list[str]]:
    """The payloads run so far, by job id (a job's evaluation: ``ID-eval``)."""
    log = tmp_path / "executions.log"
    monkeypatch.setenv("GIVEN_NUMBERS_LOG", str(log))
    return lambda: log.read_text().split() if log.exists() else []


def frozen(session: Session, member: int, edit: Callable[[Path], None] | None = None):
    """Episode ``g0000-e{member}`` with the job template frozen as its accepted job (``edit`` changes it first), as
    a run stopped right after the probe leaves it: ``resume()`` trains the job and records the reward."""
    episode = session.episode("tally", 1, f"g0000-e{member}", step=0, group_id="g0000")
    job = episode.dir / "frozen"
    job.mkdir(parents=True)
    for name, text in episode.template().items():
        (job / name).write_text(text)
    if edit is not None:
        edit(job)
    session.run.upsert_episode(episode.id, status="training", step=0, family="tally", level=1, group_id="g0000",
                               data=EpisodeData(turns=[], frozen_job=str(job), frozen_digest=job_digest(job)))
    return episode


def resume_all(*episodes):
    async def go():
        return await asyncio.gather(*(e.resume() for e in episodes))

    return asyncio.run(go())


def trainings(ran: list[str]) -> list[str]:
    return [job for job in ran if job.endswith("-job")]


def rows(run: Run) -> dict[str, dict]:
    """The job rows by id, without their timestamps."""
    return {job.id: job.model_dump(exclude={"created_at", "updated_at"}) for job in run.jobs()}


def test_identical_jobs_train_twice_and_the_third_takes_the_outcome(tmp_path, executions):
    """Three episodes of one group write the same files at once: two train (the second beside the first, not waiting
    for it), and once they agree the third takes the first's outcome (done, shared with it, at no cost); all three
    score the same reward."""
    from aitrainsai.cli.report import _job_lines, collect

    session = new_session(tmp_path, job_seconds=0.5)
    episodes = [session.episode("tally", 1, f"g0000-e{i}", step=0, group_id="g0000") for i in range(3)]
    script = [*template_calls(episodes[0]), call("submit_job")]

    async def play():
        return await asyncio.gather(*(e.play(ScriptedPolicy(list(script))) for e in episodes))

    results = asyncio.run(play())
    assert [r.status for r in results] == ["done"] * 3
    assert results[0].reward == results[1].reward == results[2].reward == pytest.approx(REWARD)
    run = session.run
    jobs = {job.id: job for job in run.jobs()}
    trained = sorted(job.id for job in jobs.values() if job.progress.shared_with is None)
    (follower,) = [job for job in jobs.values() if job.progress.shared_with is not None]
    assert len(trained) == 2 and sorted(trainings(executions())) == trained
    leader = jobs[follower.progress.shared_with]
    assert leader.id in trained and follower.state.value == leader.state.value == "done"
    assert follower.cost_usd == 0.0 and follower.wall_s == 0.0 and follower.progress.payload is None
    assert follower.progress.outcome() == leader.progress.outcome() and follower.progress.train == leader.progress.train
    assert len({job.progress.train.checkpoint_digest for job in jobs.values()}) == 1  # the two trainings agreed
    assert follower.progress.share_key == leader.progress.share_key is not None
    assert [(e.data["job"], e.data["shares"]) for e in run.events("job_shared")] == [(follower.id, leader.id)]
    # the report says which job a shared one took its outcome from
    data = collect(run)
    assert {j.episode: j.shared_with for j in data.jobs}[follower.episode_id] == leader.id
    assert f"done (shared with {leader.id})" in "\n".join(_job_lines(data))


def test_two_trainings_that_differ_share_nothing(tmp_path, executions):
    """The trainer is deterministic and each payload says its job's code replayed the same, yet two trainings of
    the job came out different (a job whose randomness the replay missed): the key is refused, and the jobs waiting
    for it, and those to come, train themselves."""
    session = new_session(tmp_path, jitter=0.1, job_seconds=0.5)
    results = resume_all(frozen(session, 0), frozen(session, 1), frozen(session, 2))
    assert [r.status for r in results] == ["done"] * 3
    (fourth,) = resume_all(frozen(session, 3))
    assert fourth.status == "done" and len(trainings(executions())) == 4
    assert all(job.progress.shared_with is None for job in session.run.jobs())
    assert list(session.run.events("job_shared")) == []


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
    assert all(job.progress.shared_with is None for job in session.run.jobs())
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
    assert all(job.progress.shared_with is None and job.progress.share_key is None
               for job in session.run.jobs())


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
    assert all(job.progress.shared_with is None for job in session.run.jobs())
    assert list(session.run.events("job_shared")) == []


def test_a_run_setting_that_changed_on_resume_makes_another_job(tmp_path, executions):
    """A job done before the run was resumed with another trainer setting is not the same job as an identical one
    after it."""
    session = new_session(tmp_path)
    (done,) = resume_all(frozen(session, 0))
    other = new_session(tmp_path, run=session.run, post=0.7)
    (again,) = resume_all(frozen(other, 1))
    assert len(trainings(executions())) == 2 and again.outcome.post == 0.7 != done.outcome.post
    assert all(job.progress.shared_with is None for job in session.run.jobs())


def test_a_resumed_run_keeps_a_shared_outcome_and_shares_with_jobs_done_before(tmp_path, executions):
    """Stopped after the jobs shared (both episodes left in training, as a kill before their rewards leaves them):
    the resumed run finishes both with the same rows and rewards and runs nothing; a new identical job after the
    resume takes the outcome of the job done before it."""
    session = new_session(tmp_path, job_seconds=0.5)
    before = resume_all(frozen(session, 0), frozen(session, 1), frozen(session, 2))
    run = session.run
    recorded, ran = rows(run), executions()
    assert len(trainings(ran)) == 2 and len(list(run.events("job_shared"))) == 1
    for member in (0, 1, 2):
        run.upsert_episode(f"g0000-e{member}", status="training")
    resumed = session_of(run, given_plugins())
    after = resume_all(*(resumed.episode("tally", 1, f"g0000-e{m}", step=0, group_id="g0000")
                         for m in (0, 1, 2)))
    assert [r.reward for r in after] == [r.reward for r in before] and len({r.reward for r in after}) == 1
    (leader,) = {row["progress"]["shared_with"] for row in recorded.values()} - {None}
    now = rows(run)  # every row as it was: a done job stands (its cost and time are not counted again)
    assert now == recorded
    assert executions() == ran and len(list(run.events("job_shared"))) == 1
    (fourth,) = resume_all(frozen(resumed, 3))
    assert run.job(fourth.id + "-job").progress.shared_with == leader and executions() == ran
    assert fourth.reward == before[0].reward


def test_a_run_stopped_while_a_job_waits_resumes_to_the_shared_outcome(tmp_path, executions):
    """Stopped while two identical jobs train and a third waits for them: the resumed run finishes the two (their
    payloads, killed with the run, are run again) and the third waits for them again and takes the outcome, never
    training."""
    session = new_session(tmp_path, job_seconds=1.0)
    run = session.run

    def waiting() -> bool:
        jobs = run.jobs()
        return (any(job.state.value == "running" for job in jobs)
                and any(job.state.value == "queued" and job.progress.shared_with is not None for job in jobs))

    async def stop_while_waiting():
        task = asyncio.ensure_future(asyncio.gather(*(frozen(session, m).resume() for m in (0, 1, 2))))
        for _ in range(400):
            if waiting():
                break
            await asyncio.sleep(0.025)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(stop_while_waiting())
    assert waiting()
    (follower,) = [job for job in run.jobs() if job.progress.shared_with is not None]
    leader = follower.progress.shared_with
    resumed = session_of(run, given_plugins())
    results = resume_all(*(resumed.episode("tally", 1, f"g0000-e{m}", step=0, group_id="g0000")
                           for m in (0, 1, 2)))
    assert [r.status for r in results] == ["done"] * 3 and len({r.reward for r in results}) == 1
    assert follower.id not in executions() and leader in executions()
    assert run.job(follower.id).state.value == "done" and run.job(follower.id).progress.shared_with == leader
    assert [e.data["shares"] for e in run.events("job_shared")] == [leader]


def test_a_job_whose_twin_dies_trains_itself(tmp_path, executions):
    """A job that trains for the key dies (here: its payload's result could not be read): the job waiting for it
    trains itself instead (confirming the one left), and shares nothing."""
    session = new_session(tmp_path, job_seconds=0.5)
    trainer, calls, waiting = session.inner_trainer, [], []
    real_result = trainer.result

    def result_once_broken(outcome):
        calls.append(outcome.job_id)
        if len(calls) == 1:  # the first trainer's to finish: the third job waits for the two
            waiting.extend(job.id for job in session.run.jobs() if job.progress.shared_with is not None)
            raise ValueError("unreadable")
        return real_result(outcome)

    trainer.result = result_once_broken
    results = resume_all(frozen(session, 0), frozen(session, 1), frozen(session, 2))
    assert sorted(r.status for r in results) == ["dead", "done", "done"]
    assert len(trainings(executions())) == 3
    done = [job for job in session.run.jobs() if job.state.value == "done"]
    assert len(waiting) == 1 and waiting[0] in {job.id for job in done}
    assert all(job.progress.shared_with is None and job.progress.payload is not None for job in done)
    assert list(session.run.events("job_shared")) == []
