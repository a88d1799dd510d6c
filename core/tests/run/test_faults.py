"""Kill the orchestrator at every phase of a job, resume, and check that the run ends as if it had not been killed.

The orchestrator is a real process running the loop on the fakes (one local worker, real probes, real subprocess
payloads from the given-numbers inner trainer, the scripted policy, the tally families); this test watches the ledger
and the payloads' files and sends SIGKILL, SIGINT or SIGTERM the moment a phase is reached: a job queued behind a full
backend, an episode in its probe, a payload training, a payload evaluating. Then ``--resume`` (once, or killed again
and resumed twice) must finish the run with every outer step recorded, no finished job run twice, and every reward
counted exactly once.
"""

from __future__ import annotations

import collections
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from collections.abc import Callable

import pytest

from aitrainsai.run.ledger import Ledger
from aitrainsai.run.loop import FINISHED, STOP_TIMEOUT_S
from aitrainsai.run.record import Job
from aitrainsai.testing import EVALUATING_MARKER
from aitrainsai.testing.runs import needs_verifiers, orchestrator_script, signal_when

pytestmark = needs_verifiers  # every run here trains its jobs

STEPS, GROUP_SIZE = 2, 2
FAMILIES = {"tally", "tally_held_out"}  # evaluated at the end: the one trained on and the held-out one

SETTINGS = ("families.train=['tally']", "families.held_out=['tally_held_out']", "gpu_backend.local.workers=1",
            f"loop.steps={STEPS}", f"loop.group_size={GROUP_SIZE}", "loop.groups_per_step=1",
            "inner_trainer.given-numbers.job_seconds=0.8", "inner_trainer.given-numbers.eval_seconds=0.8",
            "inner_trainer.given-numbers.spread=0.3")


# -- the phases, read from the ledger and the payloads' files --------------------------------------------------------
def _jobs(run) -> list[tuple[Job, Path | None]]:
    """Agent jobs (not baselines) with the working directories of their payloads: training, then evaluation."""
    found = []
    for job in run.jobs():
        evaluation = job.progress.eval_handle
        handles = [job.handle, evaluation.model_dump(mode="json") if evaluation else None]
        workdirs = [Path(h["data"]["workdir"]) for h in handles if h]
        found += [(job, w) for w in workdirs] or [(job, None)]
    return found


def _finished_jobs(run) -> int:
    return sum(job.state in ("done", "dead") for job in run.jobs())


def _running(workdir: Path | None) -> bool:
    """The payload's runner is alive (a killed one leaves its pid file and no status)."""
    if workdir is None or (workdir / ".job_status").exists():
        return False
    try:
        os.kill(int((workdir / ".job_pid").read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def queued(run) -> bool:
    """The backend is full (its one worker runs a payload) and a submitted job waits behind it."""
    jobs = [(job, workdir) for job, workdir in _jobs(run) if job.state in ("running", "evaluating")]
    return any(_running(w) for _, w in jobs) and any(w is not None and not (w / ".job_pid").exists() for _, w in jobs)


def probing(run) -> bool:
    """An episode has called submit_job and the probe has not answered yet."""
    for episode in run.episodes():
        if episode.status != "agent":
            continue
        answered, asked = 0, 0
        for message in run.transcript(episode.id):
            calls = [c.get("function", {}).get("name") for c in message.get("tool_calls") or []]
            asked += calls.count("submit_job")
            answered += message.get("role") == "tool" and message.get("name") == "submit_job"
        if asked > answered:
            return True
    return False


def training(run) -> bool:
    return any(_running(w) and not (w / EVALUATING_MARKER).exists() for _, w in _jobs(run))


def evaluating(run) -> bool:
    return any(_running(w) and (w / EVALUATING_MARKER).exists() for _, w in _jobs(run))


PHASES: dict[str, Callable] = {"queued": queued, "probing": probing, "training": training, "evaluating": evaluating}


# -- driving the orchestrator ----------------------------------------------------------------------------------------
def orchestrate(tmp_path: Path, mode: str, kill: tuple[str, int, signal.Signals] | None = None) -> str:
    """Run the orchestrator (``new`` or ``resume``); with ``kill = (phase, after, signal)``, send the signal once the
    phase is seen with at least ``after`` jobs finished. Returns its output."""
    runs = tmp_path / "runs"
    script = orchestrator_script(runs, "faults", *SETTINGS)
    env = {**os.environ, "GIVEN_NUMBERS_LOG": str(tmp_path / "executions.log")}
    process = subprocess.Popen([sys.executable, "-c", script, mode], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        if kill is None:
            out, err = process.communicate(timeout=300)
            assert process.returncode == 0, err[-3000:]
            return out
        phase, after, sig = kill
        ledger = functools.cache(lambda: Ledger(runs))  # opened once, when it can be

        def reached() -> bool:
            run = ledger().run("faults")
            return _finished_jobs(run) >= after and PHASES[phase](run)

        signal_when(process, reached, sig, every_s=0.03)
        signalled = time.monotonic()
        out, err = process.communicate(timeout=300)
        stop_s = time.monotonic() - signalled
        expected = -signal.SIGKILL if sig == signal.SIGKILL else 128 + sig
        assert process.returncode == expected, \
            f"the orchestrator was not stopped while {phase} (exit {process.returncode}):\n{err[-3000:]}"
        run = Ledger(runs).run("faults")
        assert run.info().status == "interrupted"  # not "failed": it can be resumed
        if sig != signal.SIGKILL:  # a stop closes what the run started, within its bound, and says why
            # well inside the bound (30 s): nothing waits for a call still running (a probe's took 11 s)
            assert stop_s < STOP_TIMEOUT_S / 3, f"the stop took {stop_s:.1f} s"
            assert [e.data["signal"] for e in run.events("interrupted")][-1:] == [sig.name]
        return out
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def assert_finished_as_if_never_killed(tmp_path: Path, resumes: int) -> None:
    run = Ledger(tmp_path / "runs").run("faults")
    assert run.info().status == "finished"
    events = list(run.events())
    kinds = collections.Counter(e.kind for e in events)
    assert kinds["resumed"] == resumes and kinds["finished"] == 1 and not kinds["episode_error"], kinds
    episodes = {e.id: e for e in run.episodes()}

    # every outer step, once, on groups that no other step (nor a drop or skip) used
    steps = [e.data for e in events if e.kind == "outer_step"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["policy_version"] for s in steps] == list(range(1, STEPS + 1)), "an update was applied twice or lost"
    consumed = [g for s in steps for g in s["groups"]]
    consumed += [e.data["group"] for e in events if e.kind in ("group_dropped", "group_skipped")]
    assert len(consumed) == len(set(consumed)), f"a group was consumed twice: {consumed}"

    # each step learned from the rewards the ledger holds for its groups' whole episodes
    for step in steps:
        members = [e for e in episodes.values() if e.group_id in step["groups"]]
        assert len(members) == GROUP_SIZE * len(step["groups"])
        assert all(e.status in FINISHED and e.reward is not None for e in members), members
        assert step["mean_reward"] == pytest.approx(sum(e.reward for e in members) / len(members))

    # one reward per finished episode, none for an unfinished one; no job died (the given-numbers jobs never fail)
    rewards = collections.Counter(e.data["episode"] for e in events if e.kind == "reward")
    finished = {i for i, e in episodes.items() if e.status in FINISHED}
    assert set(rewards) == finished and set(rewards.values()) == {1}, rewards
    assert not [i for i in finished if episodes[i].status == "dead"], "a job died of the kill"

    # no finished payload ran twice (a job's training, then its evaluation), and every one that ran is recorded
    executions = (tmp_path / "executions.log").read_text().split()
    assert len(executions) == len(set(executions)), f"payloads run twice: {sorted(executions)}"
    done = [j.id for j in run.jobs() if j.state in ("done", "dead")]
    assert sorted(executions) == sorted([*done, *(f"{i}-eval" for i in done)])

    # the final evaluation covers every family once
    evals = collections.Counter((e.data["step"], e.data["family"]) for e in events if e.kind == "eval")
    assert set(evals) == {(STEPS, f) for f in FAMILIES} and set(evals.values()) == {1}, evals


# Each phase is hit once a job has finished (so that a rerun of a finished one would show), but probing: every
# training episode probes before the first job ends.
KILL_POINTS = [("queued", 1), ("probing", 0), ("training", 1), ("evaluating", 1)]


# SIGTERM takes SIGINT's code path (aitrainsai.stopping: both cancel the loop), which core/tests/test_stopping.py
# checks in a real process for both; here each phase is stopped by SIGINT and killed by SIGKILL
SIGNALS = [signal.SIGKILL, signal.SIGINT]
CASES = [(phase, after, sig) for phase, after in KILL_POINTS for sig in SIGNALS]


@pytest.mark.slow
@pytest.mark.parametrize("phase, after, sig", CASES, ids=[f"{p}-after-{n}-{s.name}" for p, n, s in CASES])
def test_a_run_killed_at_any_phase_resumes_to_the_end(tmp_path, phase, after, sig):
    orchestrate(tmp_path, "new", kill=(phase, after, sig))
    orchestrate(tmp_path, "resume")
    assert_finished_as_if_never_killed(tmp_path, resumes=1)


@pytest.mark.slow
@pytest.mark.parametrize("sig", SIGNALS, ids=[s.name for s in SIGNALS])
def test_a_resumed_run_killed_again_resumes_to_the_end(tmp_path, sig):
    """The second kill lands in the final evaluation, in the evaluation payload of its last job, once the other five
    jobs have finished (whichever order the one worker took the final jobs' payloads in)."""
    orchestrate(tmp_path, "new", kill=("training", 1, sig))
    orchestrate(tmp_path, "resume", kill=("evaluating", 5, sig))
    orchestrate(tmp_path, "resume")
    assert_finished_as_if_never_killed(tmp_path, resumes=2)


POLICY_KILLER = textwrap.dedent("""
    import os, signal, sys
    from aitrainsai.testing import ScriptedPolicy

    save = ScriptedPolicy.save_state

    async def save_then_die(self, path):  # killed after the policy's state is written, before its step is recorded
        await save(self, path)
        os.kill(os.getpid(), signal.SIGKILL)

    ScriptedPolicy.save_state = save_then_die
    sys.argv = ["-", "new"]
    exec(compile(open({orchestrator!r}).read(), "orchestrator", "exec"))
""")


@pytest.mark.slow
def test_a_run_killed_between_saving_the_policy_and_recording_its_step_trains_that_step_once(tmp_path):
    orchestrator = tmp_path / "orchestrator.py"
    orchestrator.write_text(orchestrator_script(tmp_path / "runs", "faults", *SETTINGS))
    env = {**os.environ, "GIVEN_NUMBERS_LOG": str(tmp_path / "executions.log")}
    killed = subprocess.run([sys.executable, "-c", POLICY_KILLER.format(orchestrator=str(orchestrator))],
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not list(Ledger(tmp_path / "runs").run("faults").events("outer_step"))
    orchestrate(tmp_path, "resume")
    assert_finished_as_if_never_killed(tmp_path, resumes=1)
