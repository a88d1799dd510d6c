"""The nested loop on the Runpod backend (the fake Runpod: the real SDK over HTTP, pods that are real sshd servers),
stopped mid-job by SIGINT or SIGKILL and resumed (SIGTERM takes SIGINT's path): a SIGINT stop ends within
STOP_BOUND_S with no pod of the run left; after either the resumed run ends as if never stopped, no finished job runs
again, and no pod of the run is left in the account."""

from __future__ import annotations

import getpass
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aitrainsai.run.ledger import Ledger
from episode_helpers import orchestrator_script

GPU = "NVIDIA GeForce RTX 4090"
STOP_BOUND_S = 40.0  # signal to exit: the core's stop bound (30 s) plus this process's slack on a busy machine

SETTINGS = ("families.train=['calc_chain']", "families.held_out=['triage']", "loop.steps=2", "loop.group_size=2",
            "loop.groups_per_step=1", "inner_trainer.given-numbers.job_seconds=1.5",
            "inner_trainer.given-numbers.spread=0.3")


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    from aitrainsai_backend_runpod.testing import require_sshd

    require_sshd()
    from aitrainsai_backend_runpod.testing.fake_runpod import FakeRunpod

    with FakeRunpod(tmp_path_factory.mktemp("fake-runpod")) as server:
        yield server


def pods_of(fake, runs: Path) -> list[str]:
    run_ids = [p.name for p in runs.iterdir() if p.is_dir()]
    return [p["id"] for p in fake.pods() if any(p["name"].startswith(f"aitrainsai-{r}-") for r in run_ids)]


def orchestrate(fake, tmp_path: Path, mode: str, stop: signal.Signals | None = None) -> float:
    """Run the orchestrator; with ``stop``, send it that signal once one job is done and one running. Returns the
    seconds from the signal to the process's exit."""
    runs = tmp_path / "runs"
    backend = ["gpu_backend.use=runpod", f"gpu_backend.runpod.api_base_url='{fake.url}'",
               f"gpu_backend.runpod.rest_url='{fake.rest_url}'", f"gpu_backend.runpod.gpu_types=['{GPU}']",
               "gpu_backend.runpod.max_pods=2", "gpu_backend.runpod.poll_s=0.2", "gpu_backend.runpod.wait_s=2",
               f"gpu_backend.runpod.ssh_user='{getpass.getuser()}'", f"gpu_backend.runpod.python='{sys.executable}'"]
    script = orchestrator_script(runs, "rp", *SETTINGS, *backend)
    env = {**os.environ, "GIVEN_NUMBERS_LOG": str(tmp_path / "executions.log"), "RUNPOD_API_KEY": fake.api_key}
    process = subprocess.Popen([sys.executable, "-c", script, mode], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    signalled = None
    try:
        if stop is not None:
            signalled = signal_mid_job(process, runs, stop)
        _out, err = process.communicate(timeout=300)
        took = time.monotonic() - signalled if signalled is not None else 0.0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if stop is None:
        assert process.returncode == 0, err[-3000:]
    elif stop == signal.SIGKILL:
        assert process.returncode == -signal.SIGKILL, f"not killed mid-job (exit {process.returncode}): {err[-3000:]}"
    else:
        assert signalled is not None, f"the run ended before it was one job in: {err[-3000:]}"
        assert process.returncode == 128 + stop and f"interrupted by {stop.name}" in err, \
            f"exit {process.returncode}: {err[-3000:]}"
        assert "Traceback" not in err, err[-3000:]
    return took


def signal_mid_job(process: subprocess.Popen, runs: Path, sig: signal.Signals) -> float | None:
    """Send ``sig`` once one job is done and another running; the monotonic time it was sent (None: never)."""
    from aitrainsai.run.ledger import LedgerError

    deadline = time.monotonic() + 240
    while process.poll() is None and time.monotonic() < deadline:
        try:
            jobs = Ledger(runs).run("rp").jobs()
        except LedgerError:  # the run is not in the ledger yet
            jobs = []
        if sum(j.state == "done" for j in jobs) >= 1 and any(j.state == "running" for j in jobs):
            process.send_signal(sig)
            return time.monotonic()
        time.sleep(0.1)
    return None


@pytest.mark.slow
# SIGTERM takes SIGINT's code path (aitrainsai.stopping), checked for both in a real process by the core's tests
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_a_run_on_runpod_stopped_mid_job_resumes_to_the_end_and_leaves_no_pod(fake, tmp_path, sig):
    runs = tmp_path / "runs"
    took = orchestrate(fake, tmp_path, "new", stop=sig)
    finished = {j.id for j in Ledger(runs).run("rp").jobs() if j.state == "done"}
    if sig == signal.SIGKILL:
        assert pods_of(fake, runs), "a killed orchestrator's pods should still be there to reattach to"
    else:
        assert not pods_of(fake, runs), f"{sig.name} left pods billing"
        assert took < STOP_BOUND_S, f"the stop after {sig.name} took {took:.1f} s"
        assert Ledger(runs).run("rp").info().status == "interrupted"
    orchestrate(fake, tmp_path, "resume")
    assert not pods_of(fake, runs), "the finished run left pods billing"

    run = Ledger(runs).run("rp")
    assert run.info().status == "finished"
    assert [e.data["step"] for e in run.events("outer_step")] == [1, 2]
    executions = (tmp_path / "executions.log").read_text().split()
    again = {i for i in executions if executions.count(i) > 1}
    assert finished and not again & finished, f"finished jobs ran again: {sorted(again & finished)}"
    if sig == signal.SIGKILL:  # reattached to on the pods it left, never rerun
        assert not again, f"payloads run twice: {sorted(executions)}"
    # after SIGTERM/SIGINT, a payload running at the stop (a job not yet recorded done, or the eval of an episode not
    # yet recorded, which logs as it starts) went with its pod and runs again, once
    assert all(executions.count(i) <= 2 for i in executions), sorted(executions)
    done = [j.id for j in run.jobs() if j.state in ("done", "dead")]
    assert all(j.state == "done" for j in run.jobs() if j.id in done), run.jobs()
    assert {*done, *(f"{i}-eval" for i in done)} <= set(executions)
    costs = [j.cost_usd for j in run.jobs() if j.state == "done"]
    assert costs and all(c > 0 for c in costs), costs
    pods = [e.data for e in run.events("backend_pod")]
    created = {p["pod_id"] for p in pods if "created_at" in p}
    assert created and created == {p["pod_id"] for p in pods if "terminated" in p}, pods
    compute = [e.data["compute"] for e in run.events("outer_step")]
    assert all(c["jobs_usd"] > 0 and c["pool_usd"] >= c["idle_usd"] > 0 for c in compute), compute

    from aitrainsai.cli.report import write_report

    report = write_report(run).read_text()
    assert "## Compute cost" in report and f"All jobs of the run: ${run.jobs_cost():.2f}" in report
