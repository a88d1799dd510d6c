"""trainer.toml as the probe checks it, and the rl.toml generated from it: this plugin's model of prime-rl's schema
always, prime-rl's own schema at the pinned tag when a checkout is at hand."""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

import pytest
from aitrainsai import Constraints
from aitrainsai_trainer_prime_rl.config import PrimeRlJobConfig
from aitrainsai_trainer_prime_rl.inner import PrimeRlTrainer
from aitrainsai_trainer_prime_rl.pins import STACK
from aitrainsai_trainer_prime_rl.rltoml import RLConfig, render
from aitrainsai_trainer_prime_rl.testing import frozen_job

FAMILIES = ["calc_chain", "multi_hop", "string_pipeline", "ledger", "dispatch", "triage"]

HOSTILE = {  # trainer.toml -> what the probe says (part of the message), and the line it names
    'base_model = "Qwen/Qwen3-8B"\nsteps = 5\n': ("base_model", 1),
    'base_model = "Qwen/Qwen3-0.6B"\nsteps = 500\n': ("exceeds the training budget of 100", 2),
    'steps = 5\nrollouts_per_step = 60\ngroup_size = 8\n': ("must be a multiple of group_size", None),
    'steps = 5\nmax_tokens = 4096\nseq_len = 2048\n': ("must be below seq_len", None),
    'steps = 5\n\nlora_rank = 12\n': ("vLLM serves adapters of rank [8, 16, 32, 64, 128] only", 3),
    'steps = 5\nlearning_rate = 1.0\n': ("learning_rate: Input should be less than or equal to 0.001", 2),
    'steps = 5\ntemperature = 0\n': ("temperature: Input should be greater than 0", 2),
    'steps = 5\nmicro_batch = 4\n': ("micro_batch: unknown key", 2),
    'steps = 5\nseq_len = "long"\n': ("seq_len: Input should be a valid integer", 2),
    'steps = [\n': ("not valid TOML", None),
    'steps = 5\nrollouts_per_step = 4096\n': ("rollouts_per_step: Input should be less than or equal to 1024", 2),
}


@pytest.mark.parametrize("text", list(HOSTILE))
def test_the_probe_names_file_line_and_fix(tmp_path, text):
    trainer = PrimeRlTrainer()
    (tmp_path / "trainer.toml").write_text(text)
    problems = trainer.check_config(tmp_path, trainer.constraints(Constraints()))
    expected, line = HOSTILE[text]
    assert problems and problems[0].file == "trainer.toml", problems
    assert expected in problems[0].message, problems
    assert problems[0].line == line, problems


@pytest.mark.parametrize("family", FAMILIES)
def test_every_template_passes_and_renders(tmp_path, family):
    trainer = PrimeRlTrainer()
    spec, job = frozen_job(tmp_path / "job", family, trainer)
    assert trainer.check_config(job, spec.constraints) == []
    text = render(trainer.job_config(job), "aitrainsai-job-x", layout="one-gpu", infer_memory_fraction=0.3)
    config = RLConfig.model_validate(tomllib.loads(text))
    assert config.model.name == "Qwen/Qwen3-0.6B" and config.orchestrator.train.env[0].id == "aitrainsai-job-x"
    assert config.trainer.ckpt.weights.save_adapter_separately and config.orchestrator.renderer.enable_thinking is False


def test_both_bases_and_the_job_s_choices_reach_rl_toml():
    job = PrimeRlJobConfig(base_model="Qwen/Qwen3-1.7B", steps=7, learning_rate=3e-5, rollouts_per_step=96,
                           group_size=16, lora_rank=32, lora_alpha=64, max_tokens=300, seq_len=2048, temperature=0.8)
    raw = tomllib.loads(render(job, "env", layout="two-gpu", infer_memory_fraction=0.3))
    assert raw["model"]["name"] == "Qwen/Qwen3-1.7B" and raw["max_steps"] == 7 and raw["seq_len"] == 2048
    assert raw["trainer"]["optim"]["lr"] == 3e-5 and raw["trainer"]["model"]["lora"] == {
        "rank": 32, "alpha": 64.0, "dropout": 0.0}
    assert (raw["orchestrator"]["batch_size"], raw["orchestrator"]["group_size"]) == (96, 16)
    assert raw["orchestrator"]["train"]["sampling"] == {"temperature": 0.8, "max_completion_tokens": 300}
    assert raw["inference"]["gpu_memory_utilization"] == 0.9  # its own GPU on the two-GPU layout


# -- prime-rl's own schema ---------------------------------------------------------------------------------------------
CHECKOUT = os.environ.get("PRIME_RL_CHECKOUT", "")
VALIDATE = """
import sys
sys.path.insert(0, sys.argv[1] + "/packages/prime-rl-configs/src")
from pydantic_config import cli
from prime_rl.configs.rl import RLConfig
PORTS = ["--inference.server.port", "8123", "--orchestrator.student.client.base-url", "http://localhost:8123/v1"]
for path in sys.argv[2:]:
    config = cli(RLConfig, args=["@", path, *PORTS])  # the driver always adds these flags
    lora = config.trainer.model.lora
    assert config.inference.server.port == 8123
    print(path, config.orchestrator.batch_size, lora.rank, config.inference.max_lora_rank,
          config.orchestrator.renderer.name, flush=True)
"""


@pytest.mark.skipif(not CHECKOUT, reason="set PRIME_RL_CHECKOUT to a prime-rl checkout at the pinned tag (and "
                                         "PRIME_RL_PYTHON to a Python with its config package's dependencies)")
def test_generated_configs_validate_against_prime_rl_s_own_schema(tmp_path):
    python = os.environ.get("PRIME_RL_PYTHON") or str(Path(CHECKOUT) / ".venv" / "bin" / "python")
    version = tomllib.loads((Path(CHECKOUT) / "pyproject.toml").read_text())["project"]["version"]
    assert f"v{version}" == STACK.tag, f"the checkout is prime-rl {version}, the pin {STACK.tag}"
    trainer = PrimeRlTrainer()
    paths = []
    for family in FAMILIES:
        spec, job = frozen_job(tmp_path / family, family, trainer)
        for layout in ("one-gpu", "two-gpu"):
            path = tmp_path / f"{family}-{layout}.toml"
            path.write_text(render(trainer.job_config(job), f"aitrainsai-job-{family}", layout=layout,
                                   infer_memory_fraction=0.3))
            paths.append(path)
    for text in ['base_model = "Qwen/Qwen3-1.7B"\nsteps = 100\nrollouts_per_step = 1024\ngroup_size = 64\n'
                 'lora_rank = 128\nlora_alpha = 1024\nmax_tokens = 8191\nseq_len = 8192\ntemperature = 2.0\n',
                 'steps = 1\nrollouts_per_step = 2\ngroup_size = 2\nlora_rank = 8\nlora_alpha = 0.5\nmax_tokens = 16\n'
                 'seq_len = 512\nlearning_rate = 1e-3\n']:
        job = PrimeRlJobConfig.model_validate(tomllib.loads(text))  # the extremes the probe accepts
        path = tmp_path / f"extreme-{len(paths)}.toml"
        path.write_text(render(job, "aitrainsai-job-x", layout="one-gpu", infer_memory_fraction=0.3))
        paths.append(path)
    done = subprocess.run([python, "-c", VALIDATE, CHECKOUT, *map(str, paths)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.strip().splitlines()) == len(paths)
    # and what this plugin's model refuses, prime-rl refuses too
    bad = tmp_path / "bad.toml"
    raw = tomllib.loads(paths[0].read_text())
    raw["orchestrator"]["batch_size"] = 60
    import tomli_w

    bad.write_text(tomli_w.dumps(raw))
    with pytest.raises(Exception, match="divisible"):
        RLConfig.model_validate(raw)
    refused = subprocess.run([python, "-c", VALIDATE, CHECKOUT, str(bad)], capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "divisible" in refused.stderr + refused.stdout
