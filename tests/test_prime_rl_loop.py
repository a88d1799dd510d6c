"""The nested loop with the prime-rl trainer, on the local backend, with the stand-ins for prime-rl and vLLM: the
recipe policy's jobs pass the prime-rl probe, train (the stand-in writes prime-rl's layout), are evaluated through
the OpenAI API and scored on the trusted side; baselines of both bases are cached; the report has the base choice."""

import sys

import pytest
from aitrainsai.config import load_config, resolve
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.loop import run_loop
from aitrainsai.plugins import Plugins
from aitrainsai.cli.report import write_report
from aitrainsai.run.session import Session

STAND_IN = [sys.executable, "-m", "aitrainsai_trainer_prime_rl.testing.fake_prime_rl"]
FAKE_VLLM = [sys.executable, "-m", "aitrainsai_trainer_prime_rl.testing.fake_vllm"]


@pytest.mark.slow
def test_the_loop_runs_prime_rl_jobs_end_to_end(tmp_path):
    plugins = Plugins.load()
    if "prime_rl" not in plugins.inner_trainers.names():
        pytest.skip("needs aitrainsai-trainer-prime-rl installed (the whole workspace)")
    config = load_config(None, [
        "inner_trainer.use=prime_rl", f"inner_trainer.prime_rl.launcher={STAND_IN!r}",
        f"inner_trainer.prime_rl.eval_server={FAKE_VLLM!r}", "inner_trainer.prime_rl.gpus=0",
        "inner_trainer.prime_rl.eval_size=4", "inner_trainer.prime_rl.memory_gb=1",
        "inner_trainer.prime_rl.disk_gb=0.5", "inner_trainer.prime_rl.max_train_steps=16",
        "families.train=['calc_chain']", "families.held_out=[]", "gpu_backend.local.workers=2",
        "loop.steps=1", "loop.group_size=4", "loop.groups_per_step=1", "loop.final_eval=false"],
        presets=plugins.presets)
    resolved = resolve(config, plugins)
    run = Ledger(tmp_path).create_run(resolved.snapshot(), [])
    summary = run_loop(Session(resolved, plugins, run))
    assert run.info().status == "finished", summary
    jobs = run.jobs()
    done = [j for j in jobs if j.state == "done"]
    assert done, [(j.state, j.progress.reason) for j in jobs]
    for job in done:
        result = job.progress
        assert result.base_model in ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B") and result.eval_size == 4
        metrics = result.metrics or {}
        assert metrics["engine"]["engine"] == "vllm" and metrics["steps"]
    records = [e.data.outcome for e in run.episodes() if e.data.outcome is not None]
    scored = [r for r in records if r.baseline_scores]
    assert scored and all(set(r.baseline_scores) == {"Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B"} for r in scored)
    assert "## Base choice" in write_report(run).read_text()
