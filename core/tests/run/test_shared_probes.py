"""Identical submissions are probed twice, then share (``loop.share_identical_probes``): once two probes of a job
accepted it and froze the same job, byte for byte, later submissions of it take that verdict and a copy of that
frozen job, checked against its digest, without running the job's code again. A refusal, two probes that froze it
otherwise, or a frozen job changed since, and every probe of it runs."""

from pathlib import Path

import pytest

from aitrainsai.jobs.job import job_digest
from aitrainsai.jobs.probe import ProbeReport, SharedVerdicts
from aitrainsai.testing import call
from aitrainsai.testing.runs import needs_verifiers, run_episode, template_calls


def _submit(make_episode, episode_id: str, **config):
    episode = make_episode(episode_id=episode_id, **config)
    result = run_episode(episode, [*template_calls(episode), call("submit_job")])
    return episode, result


@needs_verifiers
def test_the_third_identical_submission_takes_the_verdict_two_probes_agreed_on(make_episode):
    runs = [_submit(make_episode, f"ep-{n}") for n in (1, 2, 3)]
    run = runs[0][0].run
    assert [r.status for _, r in runs] == ["done"] * 3
    assert [r.components["validation"] for _, r in runs] == [1.0] * 3
    ((first, _), (_, _), (third, _)) = runs
    assert [(e.data["episode"], e.data["attempt"], e.data["shares"]) for e in run.events("probe_shared")] == [
        ("ep-3", 1, str(first.accepted_job.relative_to(run.dir)))]
    assert third.accepted_job != first.accepted_job and third.accepted_job.is_dir()
    assert third.accepted_digest == first.accepted_digest == job_digest(third.accepted_job)
    assert not (third.accepted_job.parent / "sandbox-out").exists(), "the job's code did not run for the third"
    assert third.accepted_design == first.accepted_design
    assert [p.ok for p in run.probes("ep-3")] == [True]
    assert "accepted" in third.messages[-1]["content"]


@needs_verifiers
@pytest.mark.slow  # three whole probes: 11 s
def test_with_sharing_off_every_submission_is_probed(make_episode):
    runs = [_submit(make_episode, f"ep-{n}", loop={"share_identical_probes": False}) for n in (1, 2, 3)]
    run = runs[0][0].run
    assert list(run.events("probe_shared")) == []
    assert all((episode.accepted_job.parent / "sandbox-out").is_dir() for episode, _ in runs)


def _accepted(tmp_path: Path, name: str, content: str = "rows", **details) -> ProbeReport:
    job = tmp_path / name / "job"
    job.mkdir(parents=True)
    (job / "dataset.jsonl").write_text(content)
    return ProbeReport(True, [], 1.0, job, rows=1, details=dict(details), digest=job_digest(job), built=1)


def _frozen(tmp_path: Path, name: str) -> Path:
    frozen = tmp_path / name / "job"
    frozen.mkdir(parents=True)
    (frozen / "dataset.py").write_text("the agent's files")
    return frozen


def test_a_verdict_is_shared_only_after_two_probes_froze_the_same_job(tmp_path):
    verdicts = SharedVerdicts()
    verdicts.record("k", _accepted(tmp_path, "p1", scores=[0.0, 1.0]))
    assert verdicts.take("k", _frozen(tmp_path, "p2")) is None, "one probe is no evidence"
    verdicts.record("k", _accepted(tmp_path, "p2b", scores=[0.0, 1.0]))
    frozen = _frozen(tmp_path, "p3")
    shared = verdicts.take("k", frozen)
    assert shared is not None and shared.ok and shared.job_dir == frozen and shared.shared_from == tmp_path / "p1/job"
    assert (frozen / "dataset.jsonl").read_text() == "rows" and not (frozen / "dataset.py").exists()
    assert shared.details == {"scores": [0.0, 1.0]} and shared.digest == job_digest(frozen)
    shared.details["scores"].append(9)  # a caller's change stays its own
    assert verdicts.take("k", _frozen(tmp_path, "p4")).details == {"scores": [0.0, 1.0]}
    assert verdicts.take("other", _frozen(tmp_path, "p5")) is None


@pytest.mark.parametrize("second", ["other rows", "refused", "other details"])
def test_two_probes_that_disagree_refuse_the_key(tmp_path, second):
    verdicts = SharedVerdicts()
    verdicts.record("k", _accepted(tmp_path, "p1", scores=[0.0, 1.0]))
    if second == "refused":
        verdicts.record("k", ProbeReport(False, [], 1.0))
    else:
        verdicts.record("k", _accepted(tmp_path, "p2", "other" if second == "other rows" else "rows",
                                       scores=[0.0, 0.5] if second == "other details" else [0.0, 1.0]))
    verdicts.record("k", _accepted(tmp_path, "p3", scores=[0.0, 1.0]))
    verdicts.record("k", _accepted(tmp_path, "p4", scores=[0.0, 1.0]))
    assert verdicts.take("k", _frozen(tmp_path, "p5")) is None, "a refused key stays refused"


@pytest.mark.parametrize("change", ["edited", "removed", "linked"])
def test_a_frozen_job_changed_since_is_not_shared(tmp_path, change):
    verdicts = SharedVerdicts()
    first = _accepted(tmp_path, "p1")
    verdicts.record("k", first)
    verdicts.record("k", _accepted(tmp_path, "p2"))
    assert first.job_dir is not None
    if change == "edited":
        (first.job_dir / "dataset.jsonl").write_text("swapped")
    elif change == "removed":
        (first.job_dir / "dataset.jsonl").unlink()
        first.job_dir.rmdir()
    else:
        (first.job_dir / "extra.py").symlink_to("/etc/passwd")  # a link the digest does not hash
    frozen = _frozen(tmp_path, "p3")
    assert verdicts.take("k", frozen) is None
    assert (frozen / "dataset.py").read_text() == "the agent's files", "the probe goes on with its own files"
    assert not frozen.with_name("job.shared").exists()
    verdicts.record("k", _accepted(tmp_path, "p4"))
    verdicts.record("k", _accepted(tmp_path, "p5"))
    assert verdicts.take("k", _frozen(tmp_path, "p6")) is None, "the key stays refused"
