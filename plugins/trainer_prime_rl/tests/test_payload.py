"""The training and evaluation payloads end to end on the local backend, with stand-ins for prime-rl and vLLM that
read the generated configs and write prime-rl's output layout at the pinned tag: artifact collection, dead jobs with
prime-rl's log tail, the eval hand-off and the trusted scoring of transcripts."""

from __future__ import annotations

import asyncio
import json
import shutil
import tomllib
from pathlib import Path

import pytest
from aitrainsai import JobPayload, JobResult, LocalBackend
from aitrainsai.testing import check_spec_refused
from aitrainsai_trainer_prime_rl import job as driver
from aitrainsai_trainer_prime_rl.inner import check_adapter
from aitrainsai_trainer_prime_rl.testing import frozen_job, installed_family, stand_in_trainer


def run(payload: JobPayload, state: Path) -> JobResult:
    async def go():
        backend = LocalBackend(LocalBackend.Config(kill_grace_s=1), workdir=state)
        try:
            return await backend.run(payload)
        finally:
            await backend.close()
    return asyncio.run(go())


@pytest.mark.slow  # a payload run through the local backend's worker process
def test_a_job_trains_and_its_adapter_comes_back(tmp_path):
    trainer = stand_in_trainer()
    spec, job = frozen_job(tmp_path / "ep" / "probe-1" / "job", trainer=trainer,
                           trainer_toml='steps = 3\nrollouts_per_step = 16\ngroup_size = 4\nlora_rank = 32\n')
    payload = trainer.payload(job, spec, "ep-job", installed_family(spec.family))
    assert set(payload.runtime.distributions) == {"aitrainsai", "aitrainsai-trainer-prime-rl"}  # no family
    package = payload.workdir / "envpkg"
    assert not list(package.rglob("family.py")) and list(package.rglob("world.py"))
    outcome = run(payload, tmp_path / "backend")
    assert outcome.status == "done", (outcome.why, outcome.log_tail)
    trained = trainer.result(outcome)
    check_adapter(trained.checkpoint)
    assert json.loads((trained.checkpoint / "adapter_config.json").read_text())["r"] == 32
    steps = trained.metrics["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2] and all(s["rollouts"] == 16 for s in steps)
    configs = payload.workdir / "outputs" / "configs"  # vLLM on a port of its own, the orchestrator pointed at it
    port = tomllib.loads((configs / "inference.toml").read_text())["server"]["port"]
    assert port != 8000 and tomllib.loads((configs / "orchestrator.toml").read_text())["student"]["client"][
        "base_url"] == [f"http://localhost:{port}/v1"]
    assert "loaded environment aitrainsai-job-" in outcome.log_tail + (
        payload.workdir / "outputs" / "logs" / "orchestrator.log").read_text()


@pytest.mark.slow  # a payload run through the local backend's worker process
@pytest.mark.parametrize("fault,words", [
    ("crash", ["orchestrator failed with exit code 1", "environment worker died"]),
    ("oom", ["trainer failed with exit code 1", "(out of memory)", "CUDA out of memory"]),
    ("no_checkpoint", ["no checkpoint: prime-rl wrote no finished weights for step 2"]),
])
def test_a_failed_job_is_dead_with_prime_rl_s_log_tail(tmp_path, fault, words):
    trainer = stand_in_trainer(fault)
    spec, job = frozen_job(tmp_path / "ep" / "probe-1" / "job", trainer=trainer,
                           trainer_toml='steps = 2\nrollouts_per_step = 8\ngroup_size = 4\n')
    outcome = run(trainer.payload(job, spec, "ep-job", installed_family(spec.family)), tmp_path / "backend")
    assert outcome.status == "dead" and outcome.reason == "failed", outcome
    for word in words:
        assert word in outcome.log_tail, (word, outcome.log_tail[-2000:])


@pytest.mark.slow  # a payload run through the local backend's worker process
def test_a_job_past_its_time_is_dead_and_leaves_nothing_running(tmp_path):
    trainer = stand_in_trainer("hang")
    spec, job = frozen_job(tmp_path / "ep" / "probe-1" / "job", trainer=trainer,
                           trainer_toml='steps = 2\nrollouts_per_step = 8\ngroup_size = 4\n')
    spec = spec.model_copy(update={"constraints": spec.constraints.model_copy(update={"max_wall_seconds": 8})})
    payload = trainer.payload(job, spec, "ep-job", installed_family(spec.family))
    outcome = run(payload, tmp_path / "backend")
    assert outcome.status == "dead" and "training exceeded its time limit" in outcome.log_tail, outcome
    import subprocess

    left = subprocess.run(["pgrep", "-f", str(payload.workdir / "outputs")], capture_output=True, text=True)
    assert left.stdout.strip() == "", "a prime-rl process outlived its job"


@pytest.mark.slow  # a payload run through the local backend's worker process
def test_a_process_that_left_the_session_does_not_outlive_the_job(tmp_path):
    trainer = stand_in_trainer("daemon")
    spec, job = frozen_job(tmp_path / "ep" / "probe-1" / "job", trainer=trainer,
                           trainer_toml='steps = 2\nrollouts_per_step = 8\ngroup_size = 4\n')
    payload = trainer.payload(job, spec, "ep-job", installed_family(spec.family))
    assert driver.main(str(payload.workdir / "job.json")) == 0  # the driver alone: not every backend ends strays
    pid = int((payload.workdir / "outputs" / "run_default" / "daemon.pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), \
        "a process the job's code started is still running after the job"


@pytest.mark.slow  # a payload run through the local backend's worker process
def test_the_two_gpu_layout_runs_prime_rl_s_own_launcher(tmp_path):
    trainer = stand_in_trainer(gpus=0)
    spec, job = frozen_job(tmp_path / "ep" / "probe-1" / "job", trainer=trainer,
                           trainer_toml='steps = 2\nrollouts_per_step = 8\ngroup_size = 4\n')
    payload = trainer.payload(job, spec, "ep-job", installed_family(spec.family))
    spec_file = payload.workdir / "job.json"
    data = json.loads(spec_file.read_text())
    spec_file.write_text(json.dumps({**data, "gpus": 2}))  # the driver on a worker with two GPUs
    assert driver.main(str(spec_file)) == 0
    assert (payload.workdir / "outputs" / "logs" / "rl.log").read_text().strip().endswith("Training finished!")
    check_adapter(payload.workdir / "checkpoint")


@pytest.mark.slow  # a payload run through the local backend's worker process
def test_the_eval_scores_transcripts_on_the_trusted_side(tmp_path):
    trainer = stand_in_trainer()
    family = installed_family("calc_chain")
    spec, job = frozen_job(tmp_path / "ep" / "probe-1" / "job", trainer=trainer,
                           trainer_toml='steps = 1\nrollouts_per_step = 8\ngroup_size = 4\n')
    trained = trainer.result(run(trainer.payload(job, spec, "ep-job", family), tmp_path / "backend"))
    base = "Qwen/Qwen3-0.6B"
    pre_payload = trainer.eval_payload(family, 1, base, None, tmp_path / "base-eval", "b")
    sent = json.loads((pre_payload.workdir / "job.json").read_text())
    answers = {item.answer for item in family.hidden_eval(6, 1)}
    assert "answer" not in json.dumps(sent["conversations"][0]) or not answers & {
        json.dumps(c) for c in sent["conversations"]}
    assert not list(pre_payload.workdir.rglob("family.py"))  # the scorer and the seed stay here
    pre_outcome = run(pre_payload, tmp_path / "backend")
    assert pre_outcome.status == "done", pre_outcome.log_tail
    pre = trainer.eval_result(pre_outcome, family=family, level=1, base_model=base)
    assert pre.eval_size == 6 and pre.engine.engine == "vllm" and pre.engine.base_model == base
    assert pre.transcripts[0][-1]["content"].endswith("[temperature=0.0 thinking=False]")  # greedy, no thinking

    post_outcome = run(trainer.eval_payload(family, 1, base, trained.checkpoint, tmp_path / "post", "p"),
                       tmp_path / "backend")
    assert post_outcome.status == "done", post_outcome.log_tail
    post = trainer.eval_result(post_outcome, family=family, level=1, base_model=base)
    assert post.engine == pre.engine
    transcript = post.transcripts[0]
    assert transcript[2]["tool_calls"] and transcript[3]["role"] == "tool"  # the adapter called a tool, run there
    assert transcript[-1]["content"].startswith("<answer>1</answer>")

    # a transcript that did not come from its item's tools is refused
    path = Path(post_outcome.artifacts["transcripts"])
    data = json.loads(path.read_text())
    data[0][3]["content"] = "the answer is 42"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="transcript 0: message 3: the tool result differs"):
        trainer.eval_result(post_outcome, family=family, level=1, base_model=base)
    data[0][1]["content"] = "an easier question"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="does not start with its item's messages"):
        trainer.eval_result(post_outcome, family=family, level=1, base_model=base)


def test_a_tampered_checkpoint_is_refused(tmp_path):
    good = tmp_path / "ckpt"
    good.mkdir()
    from aitrainsai_trainer_prime_rl.testing.fake_prime_rl import _safetensors

    (good / "adapter_model.safetensors").write_bytes(_safetensors({"a.lora_A.weight": (8, 4)}))
    (good / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    check_adapter(good)
    for name, change in [("link", lambda d: (d / "x").symlink_to("/etc/passwd")),
                         ("rank", lambda d: (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 12}')),
                         ("header", lambda d: (d / "adapter_model.safetensors").write_bytes(b"\xff" * 8 + b"{}")),
                         ("pickle", lambda d: (d / "adapter_model.bin").write_bytes(b"\x80\x04"))]:
        bad = tmp_path / name
        shutil.copytree(good, bad)
        change(bad)
        with pytest.raises(ValueError):
            check_adapter(bad)


def test_a_spec_round_trips_through_its_model(tmp_path):
    from aitrainsai_trainer_prime_rl.jobspec import EvalSpec, JobSpec, TrainSpec

    trainer = stand_in_trainer()
    family = installed_family("calc_chain")
    spec, job = frozen_job(tmp_path / "ep" / "probe-1" / "job", trainer=trainer,
                           trainer_toml='steps = 2\nrollouts_per_step = 8\ngroup_size = 4\n')
    for payload, kind in ((trainer.payload(job, spec, "ep-job", family), TrainSpec),
                          (trainer.eval_payload(family, 1, "Qwen/Qwen3-0.6B", None, tmp_path / "eval", "b"), EvalSpec)):
        text = (payload.workdir / "job.json").read_text()
        read = JobSpec.model_validate_json(text).root
        assert isinstance(read, kind) and read.model_dump_json() == text
        assert json.loads(text)["stack"]["tag"] == read.stack.tag  # the pinned stack travels as a plain object


@pytest.mark.parametrize("text, says", [
    ("{not json", "job.json is not a prime-rl trainer's job spec: Invalid JSON"),
    ('{"mode": "serve"}', "job.json is not a prime-rl trainer's job spec: Input tag 'serve'"),
    ('{"mode": "train", "stack": {}}', "job.json is not a prime-rl trainer's job spec: train.stack.tag: "
                                       "Field required"),
])
def test_a_malformed_spec_is_one_line_and_exit_2(tmp_path, capsys, text, says):
    check_spec_refused("aitrainsai_trainer_prime_rl.job", driver.main, tmp_path, text, says, capsys)
