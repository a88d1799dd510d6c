"""The nested loop on a real local Ray cluster with the local trainer: `aitrainsai run`, the default command plus the
backend switch, each job a Ray job that really trains SmolLM2-135M on CPU (at a tiny size). The orchestrator is
SIGKILLed while a job trains on the cluster; `aitrainsai run --resume` reattaches to that Ray job, runs no submitted
job again, and ends the run with its report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from aitrainsai.ledger import Ledger, LedgerError
from episode_helpers import signal_when

pytest.importorskip("aitrainsai_backend_ray")
pytest.importorskip("aitrainsai_trainer_local")

# jobs the recipe policy writes at a size two CPU cores train in seconds: one step, one prompt, two rollouts
TINY = ["loop.steps=1", "loop.group_size=2", "loop.groups_per_step=1", "loop.final_eval=false",
        "families.train=['calc_chain']", "families.held_out=[]", "inner_trainer.local.eval_size=2",
        "inner_trainer.local.eval_max_new_tokens=4",
        "outer_trainer.recipe.choices={steps=[1], prompts_per_step=[1], group_size=[2], max_new_tokens=[4], "
        "max_turns=[1], dataset_size=[32], rubric=['exact', 'exact+format'], level_mix=['task']}"]


@pytest.fixture(scope="module")
def cluster():
    from aitrainsai_backend_ray.cluster import LOCAL_ENV, LocalCluster

    with LocalCluster(num_cpus=2, num_gpus=0, object_store_mb=96) as head:
        yield head
    assert LOCAL_ENV  # the head's own environment was set by LocalCluster, not by this process


def aitrainsai(runs: Path, *args: str, kill_when=None) -> subprocess.CompletedProcess | subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AITRAINSAI_", "RAY_"))}
    process = subprocess.Popen([sys.executable, "-m", "aitrainsai.cli", "run", "--runs-dir", str(runs), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        if kill_when is not None:
            signal_when(process, lambda: kill_when(runs), signal.SIGKILL, within_s=600, every_s=0.2)
        out, err = process.communicate(timeout=900)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def the_run(runs: Path):
    names = [p.name for p in runs.iterdir() if p.is_dir()] if runs.is_dir() else []
    return Ledger(runs).run(names[0]) if len(names) == 1 else None


def training_on_ray(runs: Path) -> bool:
    """An agent's job trains as a Ray job: its runner has started on the cluster."""
    try:
        run = the_run(runs)
        jobs = run.jobs() if run else []
    except LedgerError:
        return False
    for job in jobs:
        handle = job.get("handle") or {}
        folder = (handle.get("data") or {}).get("job_dir")
        if job["status"] == "running" and job["id"].endswith("-job") and folder and (Path(folder) / "pid").exists():
            return True
    return False


@pytest.mark.slow
def test_the_default_run_on_a_ray_cluster_killed_mid_job_resumes_by_reattaching(cluster, tmp_path):
    runs = tmp_path / "runs"
    backend = ["gpu_backend.use=ray", f"gpu_backend.ray.address='{cluster.url}'", "gpu_backend.ray.poll_s=0.3"]
    sets = [arg for setting in [*TINY, *backend] for arg in ("-s", setting)]
    killed = aitrainsai(runs, *sets, kill_when=training_on_ray)
    assert killed.returncode == -signal.SIGKILL, f"not killed mid-job (exit {killed.returncode}): {killed.stderr[-3000:]}"
    run = the_run(runs)
    running = {j["id"]: j["handle"]["data"]["submission_id"] for j in run.jobs() if j["status"] == "running"}
    assert running, run.jobs()

    resumed = aitrainsai(runs, "--resume", run.dir.name)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "report:" in resumed.stdout

    info = run.info()
    assert info["status"] == "finished"
    assert [e["data"]["step"] for e in run.events("outer_step")] == [1]
    # every job went to Ray once: the one that trained while the orchestrator was dead was reattached, not rerun
    submissions = [json.loads(line) for line in (run.dir / "backend" / "submissions.jsonl").read_text().splitlines()]
    ids = [s["job_id"] for s in submissions]
    assert len(ids) == len(set(ids)), f"a job was submitted twice: {sorted(ids)}"
    assert not list(run.events("job_rerun"))
    after = {j["id"]: j for j in run.jobs()}
    for job_id, sid in running.items():  # followed to their end by the resumed orchestrator
        assert after[job_id]["status"] == "done" and after[job_id]["handle"]["data"]["submission_id"] == sid
    trained = [j for j in run.jobs() if j["id"].endswith("-job") and j["status"] == "done"]
    assert trained, run.jobs()
    for job in trained:
        result = job["result"]
        assert result["eval_size"] == 2 and 0.0 <= result["post"] <= 1.0 and result["train_seconds"] > 0, result
        assert job["handle"]["backend"] == "ray"
    report = (run.dir / "report" / "report.md").read_text()
    assert "calc_chain" in report
