"""The local trainer's payloads travel: the frozen job rides in the workdir, job.json names only relative paths, the
command runs on the worker's python, and results come back as named artifacts."""

import json
from importlib import metadata

import pytest

from aitrainsai.backends import JobResult
from aitrainsai.families import Constraints
from aitrainsai.jobs import DATASET_FILE, job_digest, job_template
from aitrainsai.plugins import Plugins
from aitrainsai.testing.backends import payload_problems, relocate
from aitrainsai.trainers import Baseline
from aitrainsai_trainer_local.inner import LocalTrainer


@pytest.fixture
def frozen(tmp_path):
    """A frozen calc_chain job in an episode folder, as the probe leaves it."""
    trainer = LocalTrainer()
    family = Plugins.load().task_families.get("calc_chain")()
    spec = family.task_spec(1, trainer.constraints(Constraints()))
    job = tmp_path / "episode" / "probe-1" / "job"
    job.mkdir(parents=True)
    for name, text in job_template(spec, trainer.config_template(spec)).items():
        (job / name).write_text(text)
    (job / DATASET_FILE).write_text('{"answer": "1", "question": "q", "world": {}}\n')
    baseline = Baseline(family="calc_chain", level=1, base_model="SmolLM2-135M-Instruct", eval_seed=0, eval_size=2,
                        score=0.5, item_scores=[0.0, 1.0])
    return trainer, spec, job, baseline


def test_the_training_payload_carries_its_frozen_job(frozen):
    trainer, spec, job, baseline = frozen
    payload = trainer.payload(job, spec, "e1-job", baseline)
    assert payload.workdir == job.parent / "train"
    assert job_digest(payload.workdir / "job") == job_digest(job)
    data = json.loads((payload.workdir / "job.json").read_text())
    assert data["job_dir"] == "job" and data["digest"] == job_digest(job)
    assert payload.command == ["python", "-m", "aitrainsai_trainer_local.job", "job.json"]
    assert payload.artifacts == {"result": "result.json", "adapter": "adapter"}
    assert payload_problems(payload) == []
    version = metadata.version("aitrainsai-trainer-local")
    assert payload.runtime.distributions["aitrainsai-trainer-local"] == f"=={version}"
    assert set(payload.runtime.distributions) == {"aitrainsai", "aitrainsai-trainer-local",
                                                  "aitrainsai-family-calc-chain"}
    assert payload.gpus == 0 and payload.memory_gb == trainer.config.memory_gb + 2
    # a rerun (the job was lost) starts again from the job alone
    (payload.workdir / "result.json").write_text("{}")
    (payload.workdir / "job" / "planted.py").write_text("")
    again = trainer.payload(job, spec, "e1-job", baseline)
    assert not (again.workdir / "result.json").exists() and job_digest(again.workdir / "job") == job_digest(job)


def test_the_driver_checks_the_copy_wherever_the_workdir_went(frozen, tmp_path, capsys, monkeypatch):
    """Relocated, with the frozen job it came from deleted: the driver finds and verifies its own copy."""
    import shutil

    from aitrainsai_trainer_local import job as driver

    trainer, spec, job, baseline = frozen
    payload = trainer.payload(job, spec, "e1-job", baseline)
    shutil.rmtree(job)
    moved = relocate(payload, tmp_path / "worker" / "w1")
    data = json.loads((moved.workdir / "job.json").read_text())
    (moved.workdir / "job.json").write_text(json.dumps({**data, "eval_size": 2,
                                                        "constraints": {**data["constraints"], "max_train_steps": 1}}))
    monkeypatch.chdir(tmp_path)
    assert driver.main(str(moved.workdir / "job.json")) == 1
    assert "exceeds the training budget of 1" in capsys.readouterr().out  # the hash of the copy matched
    (moved.workdir / "job" / "rubric.py").write_text("# changed on the worker\n")
    assert driver.main(str(moved.workdir / "job.json")) == 1
    assert "changed after it was accepted" in capsys.readouterr().out


def test_the_baseline_payload_travels(tmp_path):
    trainer = LocalTrainer()
    payload = trainer.baseline_payload("calc_chain", 1, "SmolLM2-135M-Instruct", tmp_path / "baselines" / "b", "b")
    assert payload.artifacts == {"baseline": "baseline.json"} and payload.command[0] == "python"
    assert payload_problems(payload) == []
    assert json.loads((payload.workdir / "job.json").read_text())["mode"] == "baseline"


def test_results_are_read_from_their_artifacts(tmp_path):
    trainer = LocalTrainer()
    (tmp_path / "result.json").write_text(json.dumps({
        "base_model": "SmolLM2-135M-Instruct", "pre": 0.2, "post": 0.5, "uplift": 0.3, "uplift_ci": [0.1, 0.4],
        "eval_size": 2, "train_seconds": 9.0}))
    done = JobResult(job_id="j", status="done", artifacts={"result": tmp_path / "result.json",
                                                           "adapter": tmp_path})
    assert trainer.result(done).post == 0.5
    with pytest.raises(ValueError, match="no 'result' artifact"):
        trainer.result(done.model_copy(update={"artifacts": {}}))
    with pytest.raises(ValueError, match="no 'baseline' artifact"):
        trainer.baseline_result(done)
