"""The worker's side of the prime-rl main stack (``job.py``), driven with the stand-in prime-rl speaking main's layout
(``testing/fake_prime_rl.py``): the package installed, the configs resolved with the driver's flags, the processes of
each GPU layout, the adapter taken from ``broadcasts/step_<N>``, the reward per step read from ``metrics.jsonl``, and
the failures. The package here is a plain v1 taskset; the sandbox-served package of a v1 job is
``test_envpkg_v1.py``'s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from aitrainsai_trainer_prime_rl import rltoml_v1
from aitrainsai_trainer_prime_rl.config import PrimeRlJobConfigV1
from aitrainsai_trainer_prime_rl.inner import check_adapter
from aitrainsai_trainer_prime_rl.jobspec import TrainSpec
from aitrainsai_trainer_prime_rl.pins import MAIN_V1
from aitrainsai_trainer_prime_rl.testing import STAND_IN

ENV_ID = "aitrainsai-job-fixture"
TASKSET = '''import verifiers.v1 as vf


class FixtureConfig(vf.TasksetConfig):
    memory_mb: int = 4096
    wall_s: float = 3600.0


class FixtureTaskset(vf.Taskset[vf.Task, FixtureConfig]):
    def load(self):
        return []


__all__ = ["FixtureTaskset"]
'''
PYPROJECT = f'''[project]
name = "{ENV_ID}"
version = "0.1.0"

[build-system]
requires = ["hatchling>=1.24"]
build-backend = "hatchling.build"

[tool.hatch.build.targets.wheel]
packages = ["aitrainsai_job_fixture"]
'''


def workdir(tmp_path: Path, *, gpus: int, fault: str = "", env_id: str = ENV_ID, steps: int = 3) -> Path:
    work = tmp_path / "train"
    (work / "envpkg" / "aitrainsai_job_fixture").mkdir(parents=True)
    (work / "envpkg" / "pyproject.toml").write_text(PYPROJECT)
    (work / "envpkg" / "aitrainsai_job_fixture" / "__init__.py").write_text(TASKSET)
    (work / "wheels").mkdir()
    job = PrimeRlJobConfigV1(base_model="Qwen/Qwen3.5-0.8B", steps=steps, rollouts_per_step=16, group_size=4,
                             lora_rank=8)
    (work / "rl.toml").write_text(rltoml_v1.render(job, env_id, layout="two-gpu" if gpus >= 2 else "one-gpu",
                                                   infer_memory_fraction=0.3))
    (work / "job.json").write_text(TrainSpec(
        stack=MAIN_V1, source="unused", uv="uv", env_id=env_id, package="envpkg", wheels="wheels", rl_toml="rl.toml",
        steps=steps, gpus=gpus, wall_s=60, launcher=STAND_IN + (["--fault", fault] if fault else [])
    ).model_dump_json())
    return work


def drive(work: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aitrainsai_trainer_prime_rl.job", "job.json"], cwd=work,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # whole driver runs in processes (about 4 s each: an install, verifiers' import)
@pytest.mark.parametrize("gpus", [1, 2])
def test_a_run_on_main_brings_back_the_last_broadcast_and_the_rewards(tmp_path, gpus):
    work = workdir(tmp_path, gpus=gpus)
    done = drive(work)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    run = work / "outputs" / "job"
    check_adapter(work / "checkpoint")  # the adapter of the last step, as the trusted side accepts it
    assert json.loads((work / "checkpoint" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "Qwen/Qwen3.5-0.8B"
    steps = json.loads((work / "train.json").read_text())["metrics"]["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]  # main counts from 1; the trainer's lines carry no reward
    assert all(0 <= s["reward_mean"] <= 1 for s in steps)
    if gpus == 1:  # the driver started each process from the resolved configs, with this job's ports
        configs = run / "configs"
        inference = json.loads((configs / "inference.json").read_text())
        orchestrator = json.loads((configs / "orchestrator.json").read_text())
        assert orchestrator["model"]["client"]["base_url"] == f"http://localhost:{inference['server']['port']}/v1"
        assert (configs / "envs" / "train" / "job.json").is_file()
        logs = run / "logs" / "aitrainsai"
        assert {p.name for p in logs.iterdir()} == {"inference.log", "env-server.log", "orchestrator.log",
                                                    "trainer.log"}
        assert "loaded taskset aitrainsai-job-fixture" in (logs / "env-server.log").read_text()
    else:
        assert (run / "logs" / "aitrainsai" / "rl.log").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "said"), [
    ("crash", "orchestrator failed with exit code 1"),
    ("no_checkpoint", "no checkpoint: prime-rl broadcast no finished adapter for step 2"),
])
def test_failures_on_main_are_dead_jobs_with_a_reason(tmp_path, fault, said):
    work = workdir(tmp_path, gpus=1, fault=fault, steps=2)
    done = drive(work)
    assert done.returncode == 1 and said in done.stdout.strip().splitlines()[-1], done.stdout[-2000:]
    assert not (work / "checkpoint").exists()


@pytest.mark.slow
def test_a_taskset_prime_rl_cannot_import_fails_the_run(tmp_path):
    work = workdir(tmp_path, gpus=2, env_id="aitrainsai-job-nowhere", steps=1)
    done = drive(work)
    assert done.returncode == 1 and "rl failed with exit code 1" in done.stdout, done.stdout[-2000:]


def test_rewards_are_read_from_the_file_monitor_bounded_and_typed(tmp_path, monkeypatch):
    from aitrainsai_trainer_prime_rl import job

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "outputs" / "job"
    run.mkdir(parents=True)
    key = "train/agg/all/agent/reward/mean"
    lines = [{"step": 1, key: 0.25}, {"step": 1, "loss/mean": 3.0}, {"step": 2, key: "NaN"}, {"step": 2, key: 0.5},
             {"step": True, key: 0.9}, {"step": 9, key: 0.9}, {"step": 3, "eval/job/avg@1": 1.0},
             {"step": 3, "train/job/all/agent/reward/mean": 0.7}, {"step": 3, key: float("inf")}]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\nnot json\n[1]\n")
    assert job._rewards_main(3) == [{"step": 1, "reward_mean": 0.25}, {"step": 2, "reward_mean": 0.5}]
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    assert job._rewards_main(3) == []
