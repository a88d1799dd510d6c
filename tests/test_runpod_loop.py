"""The nested loop on the Runpod backend (the fake Runpod: the real SDK over HTTP, pods that are real sshd servers),
killed mid-job by SIGKILL or Ctrl-C and resumed: the run ends as if never killed, no job runs twice, and no pod of
the run is left in the account."""

from __future__ import annotations

import getpass
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from aitrainsai.ledger import Ledger
from episode_helpers import signal_when

ROOT = Path(__file__).resolve().parents[1]
GPU = "NVIDIA GeForce RTX 4090"

ORCHESTRATOR = textwrap.dedent("""
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {tests!r})
    from episode_helpers import plugins_with_given_numbers, resolved_config, session_of
    from aitrainsai.ledger import Ledger
    from aitrainsai.loop import run_loop

    plugins = plugins_with_given_numbers()
    ledger = Ledger({runs!r})
    if sys.argv[1] == "new":
        resolved = resolved_config(plugins, "families.train=['calc_chain']", "families.held_out=['triage']",
                                   "loop.steps=2", "loop.group_size=2", "loop.groups_per_step=1",
                                   "inner_trainer.given-numbers.job_seconds=1.5",
                                   "inner_trainer.given-numbers.spread=0.3", *{backend!r})
        run = ledger.create_run(resolved.record(), [], name="rp")
    else:
        run = ledger.run("rp")
    print(run_loop(session_of(run, plugins), resume=sys.argv[1] == "resume"), flush=True)
""")


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


def orchestrate(fake, tmp_path: Path, mode: str, kill: signal.Signals | None = None) -> subprocess.Popen:
    runs = tmp_path / "runs"
    backend = ["gpu_backend.use=runpod", f"gpu_backend.runpod.api_base_url='{fake.url}'",
               f"gpu_backend.runpod.rest_url='{fake.rest_url}'", f"gpu_backend.runpod.gpu_types=['{GPU}']",
               "gpu_backend.runpod.max_pods=2", "gpu_backend.runpod.poll_s=0.2", "gpu_backend.runpod.wait_s=2",
               f"gpu_backend.runpod.ssh_user='{getpass.getuser()}'", f"gpu_backend.runpod.python='{sys.executable}'"]
    script = ORCHESTRATOR.format(tests=str(ROOT / "tests"), runs=str(runs), backend=backend)
    env = {**os.environ, "GIVEN_NUMBERS_LOG": str(tmp_path / "executions.log"), "RUNPOD_API_KEY": fake.api_key}
    process = subprocess.Popen([sys.executable, "-c", script, mode], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        if kill is not None:
            def one_done_one_running() -> bool:
                jobs = Ledger(runs).run("rp").jobs()
                return sum(j["status"] == "done" for j in jobs) >= 1 and any(j["status"] == "running" for j in jobs)

            signal_when(process, one_done_one_running, kill)
        _out, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if kill is None:
        assert process.returncode == 0, err[-3000:]
    elif kill == signal.SIGKILL:
        assert process.returncode == -signal.SIGKILL, f"not killed mid-job (exit {process.returncode}): {err[-3000:]}"
    else:
        assert process.returncode in (1, -signal.SIGINT) and "KeyboardInterrupt" in err, err[-3000:]
    return process


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "Ctrl-C"])
def test_a_run_on_runpod_killed_mid_job_resumes_to_the_end_and_leaves_no_pod(fake, tmp_path, sig):
    runs = tmp_path / "runs"
    orchestrate(fake, tmp_path, "new", kill=sig)
    if sig == signal.SIGKILL:
        assert pods_of(fake, runs), "a killed orchestrator's pods should still be there to reattach to"
    else:
        assert not pods_of(fake, runs), "Ctrl-C left pods billing"
    orchestrate(fake, tmp_path, "resume")
    assert not pods_of(fake, runs), "the finished run left pods billing"

    run = Ledger(runs).run("rp")
    assert run.info()["status"] == "finished"
    assert [e["data"]["step"] for e in run.events("outer_step")] == [1, 2]
    executions = (tmp_path / "executions.log").read_text().split()
    assert len(executions) == len(set(executions)), f"payloads run twice: {sorted(executions)}"
    done = [j["id"] for j in run.jobs() if j["status"] in ("done", "dead")]
    assert all(j["status"] == "done" for j in run.jobs() if j["id"] in done), run.jobs()
    assert {*done, *(f"{i}-eval" for i in done)} <= set(executions)
    costs = [j["cost_usd"] for j in run.jobs() if j["status"] == "done"]
    assert costs and all(c > 0 for c in costs), costs
    pods = [e["data"] for e in run.events("backend_pod")]
    created = {p["pod_id"] for p in pods if "created_at" in p}
    assert created and created == {p["pod_id"] for p in pods if "terminated" in p}, pods
    compute = [e["data"]["compute"] for e in run.events("outer_step")]
    assert all(c["jobs_usd"] > 0 and c["pool_usd"] >= c["idle_usd"] > 0 for c in compute), compute

    from aitrainsai.report import write_report

    report = write_report(run).read_text()
    assert "## Compute cost" in report and f"All jobs of the run: ${run.jobs_cost():.2f}" in report
