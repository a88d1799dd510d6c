"""The run's typed records: every event kind round-trips, the job state machine refuses an illegal move, and a
ledger written before the types (events as free keyword arguments, groups known only by their ids) still reads,
resumes and reports."""

import json
import time
from pathlib import Path

import pytest

from aitrainsai.backends import JobPayload
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.record import (KINDS, BackendEvent, BaseChoice, ConfigChanged, EpisodeData, EpisodeError, Eval,
                                   Finished, GroupDropped, GroupLaunched, GroupRef, GroupSkipped, JobProgress, JobRerun,
                                   JobShared, JobState, JobStateError, LeftOut, OuterStep, PluginChange, ProbeShared,
                                   PluginVersionsChanged, PolicyExport, Resumed, Reward, RewardSpecCopy, StopSignal,
                                   Stopped, parse_record)
from aitrainsai.trainers import TrainOutcome

CHOICE = BaseChoice(family="calc_chain", base="b1", best_untrained="b2", bases=2, picked_best=False)
SAMPLES = [
    GroupLaunched(group=GroupRef.train(3, "calc_chain")),
    GroupLaunched(group=GroupRef.eval(2, "triage")),
    GroupDropped(group="g0001", lag=2),
    GroupSkipped(group="g0002", reward=0.25),
    LeftOut(group="g0003", episodes=["g0003-e2"]),
    OuterStep(step=1, mean_reward=0.5, groups=["g0000"], components={"validation": 0.5}, base_choices=[CHOICE],
              compute={"jobs_usd": 0.1}, metrics={"loss": 0.3, "note": "x"}, policy_version=1, seconds=2.5,
              dropped=1, skipped=0),
    Eval(step=1, family="triage", held_out=True, mean_reward=0.4, pre=[0.1], post=[0.3], uplift=[0.2],
         base_choices=[CHOICE]),
    PolicyExport(step=2, refs={"adapter": "tinker://x"},
                 reward_spec=RewardSpecCopy(name="default", formula="a + b", agent_text="t", file=None)),
    Reward(episode="g0000-e0", total=0.7, family="calc_chain", step=0, components={"validation": 1.0}),
    EpisodeError(episode="g0000-e1", phase="agent", error="boom"),
    JobRerun(job="g0000-e0-job", reason="lost: gone", rerun=1),
    JobShared(job="g0000-e1-job", shares="g0000-e0-job"),
    ProbeShared(episode="g0000-e2", attempt=1, shares="episodes/g0000-e0/probe-1/job"),
    Resumed(trained_steps=1, groups_in_progress=2),
    Stopped(reason="out of budget", resumable=True, steps=1),
    Finished(steps=2, dropped=0, skipped=1, launched=5),
    StopSignal(signal="SIGTERM", stop_timeout_s=60.0),
    ConfigChanged(overrides=["loop.steps=4"]),
    PluginVersionsChanged(changes=[PluginChange(name="p", recorded="1.0", installed=None)], selection="p"),
]


def test_every_kind_round_trips(tmp_path):
    assert {type(r) for r in SAMPLES} == set(KINDS.values()), "a kind without a sample"
    run = Ledger(tmp_path).create_run({}, [], name="kinds")
    for record in SAMPLES:
        run.record(record)
    pod = BackendEvent.of("pod", action="created", pod_id="p1", usd_per_hour=2.0)
    run.record(pod)
    again = Ledger(tmp_path).run("kinds")
    for kind in KINDS.values():
        assert again.records(kind) == [r for r in SAMPLES if isinstance(r, kind)]
    (read,) = again.records(BackendEvent)
    assert read == pod and read.kind == "backend_pod" and read.fields["pod_id"] == "p1"
    # stored as before: the kind in its column, the other fields as JSON (what ``events`` and old readers see)
    (stored,) = again.events("backend_pod")
    assert stored.data == {"action": "created", "pod_id": "p1", "usd_per_hour": 2.0}
    for record in SAMPLES:
        assert parse_record(record.kind, json.loads(json.dumps(record.data()))) == record


def test_a_record_checks_its_fields():
    with pytest.raises(ValueError):
        OuterStep(step="one", mean_reward=0.5)
    with pytest.raises(ValueError):
        EpisodeError(episode="e", phase="training", error="x")
    with pytest.raises(ValueError):
        parse_record("no_such_kind", {})


def test_a_group_ref_makes_ids_it_never_reads_back():
    train, evaluation = GroupRef.train(7, "calc_chain"), GroupRef.eval(3, "triage")
    assert (train.id, evaluation.id) == ("g0007", "eval3-triage")
    assert evaluation.episode_id(1) == "eval3-triage-e1" and evaluation.eval_key(1) == "triage-e1"
    assert GroupRef.eval(0, "triage").eval_key(1) == evaluation.eval_key(1)  # the same seed at every step


def test_the_job_state_machine_refuses_an_illegal_move(tmp_path):
    run = Ledger(tmp_path).create_run({}, [], name="jobs")
    with pytest.raises(JobStateError, match="cannot move from nothing to evaluating"):
        run.upsert_job("j", status="evaluating")
    assert run.jobs() == []
    payload = JobPayload(job_id="j", workdir=tmp_path / "w", command=["true"])
    run.upsert_job("j", status=JobState.QUEUED, episode_id="e", backend="local", progress=JobProgress(payload=payload))
    with pytest.raises(JobStateError, match="from queued to done"):
        run.upsert_job("j", status="done", progress=JobProgress(post=1.0))
    run.upsert_job("j", status="running", handle={"pid": 1})
    run.upsert_job("j", status="queued")  # the backend lost it: submitted again
    run.upsert_job("j", status="running", handle={"pid": 2})
    trained = TrainOutcome(checkpoint=Path("c"), train_seconds=2.0)
    run.upsert_job("j", status="evaluating", wall_s=3.0, progress=JobProgress(train=trained))
    with pytest.raises(JobStateError, match="from evaluating to running"):
        run.upsert_job("j", status="running")
    run.upsert_job("j", status="done", cost_usd=0.5, progress=JobProgress(post=0.4))
    for illegal in ("queued", "running", "finished"):
        with pytest.raises(JobStateError):
            run.upsert_job("j", status=illegal)
    (job,) = run.jobs()
    assert job.state is JobState.DONE and job.handle == {"pid": 2} and job.wall_s == 3.0 and job.cost_usd == 0.5
    assert job.progress == JobProgress(payload=payload, train=trained, post=0.4)
    row = run.db.one("SELECT result FROM jobs WHERE id = 'j'")
    assert row is not None and json.loads(row["result"]) == job.progress.stored()  # the typed progress, nothing else
    # a job that waited for an identical one goes from queued to done with that job's outcome: it never ran
    run.upsert_job("k", status="queued", episode_id="f", progress=JobProgress(share_key="s", shared_with="j"))
    run.upsert_job("k", status="done", progress=JobProgress(post=0.4))
    assert run.job("k").state is JobState.DONE and run.job("k").progress.shared_with == "j"



def test_a_job_progress_is_typed_on_write_and_checked_on_read(tmp_path):
    import sqlite3

    from aitrainsai.run.ledger import LedgerError

    run = Ledger(tmp_path).create_run({}, [], name="progress")
    with pytest.raises(ValueError, match="uplift_ci"):  # a write that does not fit never reaches the row
        run.upsert_job("j", status="done", progress=JobProgress(uplift_ci="wide"))
    run.upsert_job("j", status="done", progress=JobProgress(pre=0.1, uplift_ci=(-0.1, 0.2)))
    run.upsert_job("j", status="done", progress=JobProgress(post=0.3))
    assert run.job("j").progress == JobProgress(pre=0.1, post=0.3, uplift_ci=(-0.1, 0.2)) and run.job("k") is None
    with sqlite3.connect(run.ledger.path) as db:
        db.execute("UPDATE jobs SET result = ?", (json.dumps({"post": 0.3, "grew_by_merging": 1}),))
    for read in (lambda: run.job("j"), run.jobs, lambda: run.upsert_job("j", status="done")):
        with pytest.raises(LedgerError, match="job j's progress does not fit its type"):
            read()

def _old_event(run, kind, **data):
    """An event exactly as the ledger wrote it before typed records: free keyword arguments as JSON."""
    run.db.write("INSERT INTO events (run_id, kind, data, created_at) VALUES (?, ?, ?, ?)",
                 (run.id, kind, json.dumps(data, sort_keys=True), time.time()))


def test_an_old_format_ledger_still_reads_and_reports(tmp_path):
    pytest.importorskip("matplotlib")
    from aitrainsai.cli.report import write_report

    run = Ledger(tmp_path).create_run({}, [], name="old")
    train = {"base_model": "b", "pre": 0.0, "post": 0.2, "uplift": 0.2, "uplift_ci": [0.1, 0.3], "eval_size": 8,
             "train_seconds": 1.0}
    for episode, group, family in (("g0000-e0", "g0000", "calc_chain"), ("g0011-e0", "g0011", "ledger"),
                                   ("eval1-triage-e0", "eval1-triage", "triage")):
        run.upsert_episode(episode, status="done", step=1, family=family, level=1, group_id=group, reward=0.5,
                           data=EpisodeData.model_validate({"train": train}))
    _old_event(run, "reward", episode="g0000-e0", family="calc_chain", step=1, total=0.5, validation=1.0,
               job_quality=0.2)
    _old_event(run, "outer_step", step=1, mean_reward=0.5, components={"validation": 1.0}, base_choices=[],
               groups=["g0000"])
    _old_event(run, "eval", step=1, family="triage", held_out=True, mean_reward=0.5, pre=[0.0], post=[0.2],
               uplift=[0.2], base_choices=[])
    _old_event(run, "stopped", reason="no signal")  # written without resumable
    _old_event(run, "policy_export", step=1, refs={"adapter": "x"})  # written without the reward spec
    _old_event(run, "backend_head", action="started", address="ray://h")

    (reward,) = run.records(Reward)
    assert reward.total == 0.5 and reward.components == {"validation": 1.0, "job_quality": 0.2}
    (step,) = run.records(OuterStep)
    assert step.groups == ["g0000"] and step.metrics == {} and step.policy_version == 0
    assert run.records(Stopped)[0].resumable is None and run.records(PolicyExport)[0].reward_spec is None
    assert run.records(BackendEvent)[0].fields == {"action": "started", "address": "ray://h"}
    # no group_launched records: the groups come from the old ids, once, here
    assert run.groups() == {"g0000": GroupRef.train(0, "calc_chain"), "g0011": GroupRef.train(11, "ledger"),
                            "eval1-triage": GroupRef.eval(1, "triage")}
    text = write_report(run).read_text()
    assert "| 1 | calc_chain | done |" in text and "| triage |" not in text.split("## Jobs")[1].split("##")[0]
    # and a new record beside the old ones takes precedence for its group
    run.record(GroupLaunched(group=GroupRef.train(12, "ledger")))
    assert run.groups()["g0012"] == GroupRef.train(12, "ledger")


@pytest.mark.slow  # a whole run, its payloads in processes
def test_a_run_recorded_the_old_way_resumes(tmp_path):
    """A run finished its steps and was killed in its final evaluation, recorded the way the ledger was written
    before typed records (no group records, flat reward components): the resume finds the begun evaluation from
    the old group ids, finishes it from the recorded episodes and reports."""
    from episode_helpers import plugins_with_given_numbers, resolved_config, session_of

    from aitrainsai.cli.report import write_report
    from aitrainsai.run.loop import run_loop

    plugins = plugins_with_given_numbers()
    resolved = resolved_config(plugins, "loop.steps=1", "loop.group_size=2", "loop.groups_per_step=1",
                               "loop.eval_episodes=1", "inner_trainer.given-numbers.spread=0.3")
    run = Ledger(tmp_path).create_run(resolved.snapshot(), [], name="old")
    run_loop(session_of(run, plugins))
    evals = [(e.step, e.family) for e in run.records(Eval)]
    assert evals and all(step == 1 for step, _ in evals)
    with run.transaction():  # back to the old format, and to the moment the final evaluation began
        run.db.write("DELETE FROM events WHERE run_id = ? AND kind IN ('group_launched', 'eval', 'finished', "
                     "'policy_export')", (run.id,))
        for row in run.db.rows("SELECT seq, data FROM events WHERE run_id = ? AND kind = 'reward'", (run.id,)):
            data = json.loads(row["data"])
            flat = {**{k: v for k, v in data.items() if k != "components"}, **data["components"]}
            run.db.write("UPDATE events SET data = ? WHERE seq = ?", (json.dumps(flat), row["seq"]))
    assert run.records(GroupLaunched) == [] and {g.kind for g in run.groups().values()} == {"train", "eval"}
    episodes = {e.id: e.updated_at for e in run.episodes()}
    run_loop(session_of(Ledger(tmp_path).run("old"), plugins), resume=True)
    assert sorted((e.step, e.family) for e in run.records(Eval)) == sorted(evals)
    assert {e.id: e.updated_at for e in run.episodes()} == episodes, "an episode was played again"
    assert run.info().status == "finished" and write_report(run).exists()


def test_an_episode_row_written_before_its_outcome_had_its_name_still_reads():
    from aitrainsai.rewards import EpisodeOutcome

    outcome = EpisodeOutcome(family="f", level=1, parsed_submission=True, job_status="done", pre=0.2, post=0.5)
    old = EpisodeData.model_validate({"components": {"a": 1.0}, "record": outcome.model_dump(mode="json")})
    new = EpisodeData.model_validate_json(EpisodeData(components={"a": 1.0}, outcome=outcome).model_dump_json())
    assert old.outcome == new.outcome == outcome
    assert "outcome" in json.loads(new.model_dump_json()) and "record" not in json.loads(new.model_dump_json())
