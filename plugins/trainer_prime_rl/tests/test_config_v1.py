"""The second prime-rl stack (main at the pinned commit, verifiers-v1 jobs): which stack a job gets, the bases each
offers, and the rl.toml generated for it: this plugin's model of that prime-rl's schema always, prime-rl's own schema
at the pinned commit when a checkout is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path

import pytest
from aitrainsai import Constraints
from aitrainsai_trainer_prime_rl import rltoml_v1
from aitrainsai_trainer_prime_rl.config import PrimeRlJobConfigV1
from aitrainsai_trainer_prime_rl.inner import PrimeRlTrainer
from aitrainsai_trainer_prime_rl.pins import (MAIN_V1, QWEN3_5_BASES, QWEN3_BASES, V0_6_0, StackMismatch, offered_bases,
                                              select_stack)
from aitrainsai_trainer_prime_rl.testing import frozen_job, installed_family

FAMILIES = ["calc_chain", "multi_hop", "string_pipeline", "ledger", "dispatch", "triage"]
MAIN = MAIN_V1.name  # "main-559b447"


def test_the_stack_follows_the_job_format_and_the_run_option():
    assert select_stack("auto", "verifiers") == V0_6_0 and select_stack("auto", "verifiers-v1") == MAIN_V1
    assert select_stack("v0.6.0", "verifiers") == V0_6_0 and select_stack(MAIN, "verifiers-v1") == MAIN_V1
    with pytest.raises(StackMismatch, match=r"prime-rl main-559b447 \(prime_rl.stack\) cannot load classic"):
        select_stack(MAIN, "verifiers")
    with pytest.raises(StackMismatch, match="cannot load verifiers v1 tasksets"):
        select_stack("v0.6.0", "verifiers-v1")
    assert MAIN_V1.tag == "" and MAIN_V1.commit.startswith("559b447") and V0_6_0.name == "v0.6.0"
    assert offered_bases("auto") == offered_bases("v0.6.0") == QWEN3_BASES  # the bases every format trains
    assert offered_bases(MAIN) == QWEN3_BASES + QWEN3_5_BASES


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_s_v1_job_passes_and_renders_for_main(tmp_path, family):
    for option in ("auto", MAIN):
        trainer = PrimeRlTrainer(PrimeRlTrainer.Config(stack=option))
        spec, job = frozen_job(tmp_path / option / "job", family, trainer, job_format="verifiers-v1")
        assert (job / "taskset.py").is_file() and not (job / "environment.py").exists()
        assert trainer.stack(job) == MAIN_V1
        assert trainer.check_config(job, spec.constraints) == []
        for layout in ("one-gpu", "two-gpu"):
            text = rltoml_v1.render(trainer.job_config(job), f"aitrainsai-job-{family}", layout=layout,
                                    infer_memory_fraction=0.3, memory_mb=2048, wall_s=900.0)
            config = rltoml_v1.RLConfig.model_validate(tomllib.loads(text))
            source = config.orchestrator.train.source[0]
            assert config.model.name == "Qwen/Qwen3-0.6B" and config.run.name == "job"
            assert (source.env.taskset.id, source.env.taskset.memory_mb, source.env.taskset.wall_s) == (
                f"aitrainsai-job-{family}", 2048, 900.0)
            assert (source.env.agent.harness.id, source.env.agent.runtime.type) == ("null", "subprocess")
            renderer = config.orchestrator.renderer
            assert renderer.name == "qwen3" and renderer.enable_thinking is False
            assert config.monitors.file.path == "metrics.jsonl" and "wandb" not in tomllib.loads(text)["monitors"]
            assert config.orchestrator.max_off_policy_steps == rltoml_v1.MAX_OFF_POLICY_STEPS
            assert config.weight_broadcast.type == "filesystem" and "ckpt" not in tomllib.loads(text)
            assert config.inference.vllm.gpu_memory_utilization == (0.3 if layout == "one-gpu" else 0.9)


def test_a_job_in_the_other_format_is_refused_in_one_line(tmp_path):
    main = PrimeRlTrainer(PrimeRlTrainer.Config(stack=MAIN))
    spec, classic = frozen_job(tmp_path / "classic", "calc_chain", main)
    problems = main.check_config(classic, spec.constraints)
    assert len(problems) == 1 and problems[0].file == "environment.py" and "\n" not in problems[0].message
    assert "cannot load classic verifiers environments" in problems[0].message, problems
    with pytest.raises(StackMismatch):
        main.payload(classic, spec, "job-1", installed_family("calc_chain"))
    old = PrimeRlTrainer(PrimeRlTrainer.Config(stack="v0.6.0"))
    spec, v1 = frozen_job(tmp_path / "v1", "calc_chain", old, job_format="verifiers-v1")
    problems = old.check_config(v1, spec.constraints)
    assert len(problems) == 1 and problems[0].file == "taskset.py" and "cannot load verifiers v1" in problems[0].message


def test_qwen3_5_bases_are_offered_where_the_run_names_main(tmp_path):
    main = PrimeRlTrainer(PrimeRlTrainer.Config(stack=MAIN))
    assert main.constraints(Constraints()).allowed_bases == list(QWEN3_BASES + QWEN3_5_BASES)
    assert main.JobConfig is PrimeRlJobConfigV1
    for base, renderer in (("Qwen/Qwen3.5-0.8B", "qwen3.5"), ("Qwen/Qwen3.5-2B", "qwen3.5"),
                           ("Qwen/Qwen3-1.7B", "qwen3")):
        spec, job = frozen_job(tmp_path / base.replace("/", "_"), "calc_chain", main, job_format="verifiers-v1",
                               trainer_toml=f'base_model = "{base}"\nsteps = 5\n')
        assert main.check_config(job, spec.constraints) == []
        raw = tomllib.loads(rltoml_v1.render(main.job_config(job), "x", layout="one-gpu", infer_memory_fraction=0.3))
        assert raw["model"]["name"] == base and raw["orchestrator"]["renderer"]["name"] == renderer
    auto = PrimeRlTrainer()  # a default run: a classic task offers the Qwen3 bases, as today; a v1 task all four
    assert auto.constraints(Constraints()).allowed_bases == list(QWEN3_BASES)
    assert auto.constraints(Constraints(), "verifiers-v1").allowed_bases == list(QWEN3_BASES + QWEN3_5_BASES)
    spec, job = frozen_job(tmp_path / "auto-v1", "calc_chain", auto, job_format="verifiers-v1",
                           trainer_toml='base_model = "Qwen/Qwen3.5-2B"\nsteps = 5\n')
    assert auto.check_config(job, spec.constraints) == []
    spec, job = frozen_job(tmp_path / "auto", "calc_chain", auto,
                           trainer_toml='base_model = "Qwen/Qwen3.5-2B"\nsteps = 5\n')
    problems = auto.check_config(job, spec.constraints)
    assert problems and problems[0].file == "trainer.toml" and problems[0].line == 1
    assert "base_model 'Qwen/Qwen3.5-2B' is not allowed" in problems[0].message, problems


def test_the_eval_engine_depends_on_the_base_and_the_run_option_only(tmp_path):
    auto, main = PrimeRlTrainer(), PrimeRlTrainer(PrimeRlTrainer.Config(stack=MAIN))
    assert auto.eval_settings("Qwen/Qwen3-0.6B")["extra"] == {"prime_rl": "v0.6.0", "thinking": False}  # unchanged
    assert main.eval_settings("Qwen/Qwen3-0.6B")["extra"]["prime_rl"] == MAIN  # a run on main: its own baselines
    assert auto.eval_settings("Qwen/Qwen3.5-2B")["extra"]["prime_rl"] == MAIN  # v0.6.0 does not offer it
    family = installed_family("calc_chain")
    for base, parser, stack in (("Qwen/Qwen3.5-0.8B", "qwen3_coder", MAIN_V1), ("Qwen/Qwen3-1.7B", "hermes", MAIN_V1)):
        payload = main.eval_payload(family, family.default_level, base, None, tmp_path / base.replace("/", "_"), "e")
        spec = json.loads((payload.workdir / "job.json").read_text())
        assert (spec["tool_parser"], spec["stack"]["commit"], spec["base_model"]) == (parser, stack.commit, base)


def test_the_model_refuses_what_that_prime_rl_refuses():
    from pydantic import ValidationError

    raw = tomllib.loads(rltoml_v1.render(PrimeRlJobConfigV1(steps=3), "x", layout="one-gpu",
                                         infer_memory_fraction=0.3))
    rltoml_v1.RLConfig.model_validate(raw)
    for change, message in (
            (lambda r: r["orchestrator"].update(batch_size=60), "divisible"),
            (lambda r: r.update(weight_broadcast={"type": "nccl"}), "weight_broadcast.type"),
            (lambda r: r["monitors"].update(wandb={"project": "x"}), "monitors.wandb"),
            (lambda r: r["orchestrator"]["train"]["source"][0].update(env={"id": "x"}), "taskset"),
            (lambda r: r["orchestrator"]["renderer"].update(name="qwen3.5"), "rendered by 'qwen3'"),
            (lambda r: r["trainer"]["model"]["lora"].update(rank=1024), "exceeds vLLM maximum"),
            (lambda r: r["orchestrator"].update(max_off_policy_steps=-1), "max_off_policy_steps"),
            (lambda r: r.pop("monitors"), "metrics.jsonl")):
        bad = json.loads(json.dumps(raw))
        change(bad)
        with pytest.raises(ValidationError, match=message):
            rltoml_v1.RLConfig.model_validate(bad)


# -- prime-rl's own schema at the pinned commit ------------------------------------------------------------------
CHECKOUT = os.environ.get("PRIME_RL_V1_CHECKOUT", "")
TASKSET = '''import verifiers.v1 as vf


class JobTasksetConfig(vf.TasksetConfig):  # the fields rl.toml sets on the job package's taskset config
    memory_mb: int = 4096
    wall_s: float = 3600.0


class JobTaskset(vf.Taskset[vf.Task, JobTasksetConfig]):
    def load(self):
        return []


__all__ = ["JobTaskset"]
'''
VALIDATE = """
import json, sys, warnings
from importlib import metadata
sys.path.insert(0, sys.argv[1] + "/packages/prime-rl-configs/src")
warnings.simplefilter("ignore")
from pydantic_config import cli
from prime_rl.configs.rl import RLConfig
flags = json.loads(sys.argv[2])
print("verifiers", metadata.version("verifiers"), flush=True)
for path in sys.argv[3:]:
    c = cli(RLConfig, args=["@", path, *flags])  # with the flags the driver adds
    source = c.orchestrator.train.source[0]
    print(json.dumps({
        "run_dir": str(c.run_dir), "model": c.trainer.model.name, "vllm_model": c.inference.vllm.model,
        "steps": [c.trainer.max_steps, c.orchestrator.max_steps], "seq_len": [c.trainer.model.seq_len,
        c.orchestrator.seq_len], "batch": [c.orchestrator.batch_size, c.orchestrator.group_size],
        "off_policy": c.orchestrator.max_off_policy_steps, "lr": c.trainer.optim.lr,
        "lora": [c.trainer.model.lora.rank, c.trainer.model.lora.alpha, c.orchestrator.model.lora.rank],
        "vllm_lora": [c.inference.vllm.enable_lora, c.inference.vllm.max_lora_rank],
        "broadcast": [c.weight_broadcast.type, c.trainer.weight_broadcast.type],
        "renderer": [c.orchestrator.renderer.name, c.orchestrator.renderer.enable_thinking],
        "sampling": [source.sampling.temperature, source.sampling.max_completion_tokens],
        "taskset": [source.env.taskset.id, source.env.taskset.memory_mb, source.env.taskset.wall_s],
        "agent": [source.env.agent.harness.id, source.env.agent.runtime.type],
        "monitors": [str(c.trainer.monitors.file.path), str(c.orchestrator.monitors.file.path),
                     c.trainer.monitors.wandb, c.orchestrator.monitors.wandb],
        "ports": [c.inference.server.port, c.inference.backend_port, c.orchestrator.model.client.base_url,
                  c.orchestrator.env_server_base_port],
        "memory": c.inference.vllm.gpu_memory_utilization, "max_model_len": c.inference.vllm.max_model_len,
        "gpus": [c.deployment.num_train_gpus, c.deployment.num_infer_gpus]}), flush=True)
"""
FLAGS = rltoml_v1.driver_flags(8123, 8124, 5123)


@pytest.mark.skipif(not CHECKOUT, reason="set PRIME_RL_V1_CHECKOUT to a prime-rl checkout at the pinned commit of main "
                                         "(and PRIME_RL_PYTHON to a Python with its config package's dependencies, "
                                         "verifiers from its deps/verifiers)")
def test_generated_configs_validate_against_prime_rl_main_s_own_schema(tmp_path):
    import tomli_w
    from pydantic import ValidationError

    python = os.environ.get("PRIME_RL_PYTHON") or str(Path(CHECKOUT) / ".venv" / "bin" / "python")
    head = subprocess.run(["git", "-C", CHECKOUT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert head == MAIN_V1.commit, f"the checkout is prime-rl {head or '(no git)'}, the pin {MAIN_V1.commit}"
    modules = tmp_path / "modules"  # prime-rl's schema imports the taskset a source names: one per id here
    trainer = PrimeRlTrainer(PrimeRlTrainer.Config(stack=MAIN))
    cases = []  # (path, job, layout, env id)
    for family in FAMILIES:
        spec, job = frozen_job(tmp_path / family, family, trainer, job_format="verifiers-v1")
        cases += [(trainer.job_config(job), layout, f"aitrainsai-job-{family.replace('_', '-')}")
                  for layout in ("one-gpu", "two-gpu")]
    for base in QWEN3_5_BASES + ("Qwen/Qwen3-1.7B",):
        cases.append((PrimeRlJobConfigV1(base_model=base, steps=5), "one-gpu", "aitrainsai-job-bases"))
    for text in ['base_model = "Qwen/Qwen3.5-2B"\nsteps = 100\nrollouts_per_step = 1024\ngroup_size = 64\n'
                 'lora_rank = 128\nlora_alpha = 1024\nmax_tokens = 8191\nseq_len = 8192\ntemperature = 2.0\n',
                 'steps = 1\nrollouts_per_step = 2\ngroup_size = 2\nlora_rank = 8\nlora_alpha = 0.5\nmax_tokens = 16\n'
                 'seq_len = 512\nlearning_rate = 1e-3\n']:  # the extremes the probe accepts
        cases.append((PrimeRlJobConfigV1.model_validate(tomllib.loads(text)), "two-gpu", "aitrainsai-job-extreme"))
    paths = []
    for number, (job, layout, env_id) in enumerate(cases):
        module = modules / (env_id.replace("-", "_") + ".py")
        module.parent.mkdir(exist_ok=True)
        module.write_text(TASKSET)
        path = tmp_path / f"rl-{number}.toml"
        path.write_text(rltoml_v1.render(job, env_id, layout=layout, infer_memory_fraction=0.3, memory_mb=2048,
                                         wall_s=900.0))
        paths.append(path)
    env = {**os.environ, "PYTHONPATH": str(modules)}
    done = subprocess.run([python, "-c", VALIDATE, CHECKOUT, json.dumps(FLAGS), *map(str, paths)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == f"verifiers {MAIN_V1.verifiers}", lines[0]  # its deps/verifiers, the version pins.py names
    assert len(lines) == 1 + len(paths)
    for (job, layout, env_id), line in zip(cases, lines[1:]):
        got = json.loads(line)  # what prime-rl resolved: every choice of the job arrived where it trains
        assert got["run_dir"] == "outputs/job" and got["model"] == got["vllm_model"] == job.base_model
        assert got["steps"] == [job.steps] * 2 and got["seq_len"] == [job.seq_len] * 2
        assert got["batch"] == [job.rollouts_per_step, job.group_size] and got["off_policy"] == 8
        assert got["lr"] == job.learning_rate and got["lora"] == [job.lora_rank, job.lora_alpha, job.lora_rank]
        assert got["vllm_lora"] == [True, job.lora_rank] and got["broadcast"] == ["filesystem", "filesystem"]
        assert got["renderer"] == [rltoml_v1.RENDERERS[job.base_model], False]
        assert got["sampling"] == [job.temperature, job.max_tokens]
        assert got["taskset"] == [env_id, 2048, 900.0] and got["agent"] == ["null", "subprocess"]
        assert got["monitors"] == ["metrics.jsonl", "metrics.jsonl", None, None]
        assert got["ports"] == [8123, 8124, "http://localhost:8123/v1", 5123]
        assert got["memory"] == (0.3 if layout == "one-gpu" else 0.9) and got["max_model_len"] == job.seq_len
        assert got["gpus"] == [1, 1]
    # and what this plugin's model refuses, prime-rl refuses too
    raw = tomllib.loads(paths[0].read_text())
    for change, message in ((lambda r: r["orchestrator"].update(batch_size=60), "divisible"),
                            (lambda r: r.update(weight_broadcast={"type": "nccl"}), "LoRA training is not yet "
                                                                                     "supported with in-memory")):
        bad = json.loads(json.dumps(raw))
        change(bad)
        (tmp_path / "bad.toml").write_text(tomli_w.dumps(bad))
        with pytest.raises(ValidationError):
            rltoml_v1.RLConfig.model_validate(bad)
        refused = subprocess.run([python, "-c", VALIDATE, CHECKOUT, json.dumps(FLAGS), str(tmp_path / "bad.toml")],
                                 capture_output=True, text=True, timeout=600, env=env)
        assert refused.returncode != 0 and message in refused.stderr + refused.stdout, refused.stderr[-2000:]
    # a source whose taskset is not importable is refused by prime-rl's schema (it imports it), so the package must be
    # installed where prime-rl runs
    missing = tmp_path / "missing.toml"
    missing.write_text(paths[0].read_text().replace('"aitrainsai-job-calc-chain"', '"aitrainsai-job-nowhere"'))
    refused = subprocess.run([python, "-c", VALIDATE, CHECKOUT, json.dumps(FLAGS), str(missing)],
                             capture_output=True, text=True, timeout=600, env=env)
    assert refused.returncode != 0 and "aitrainsai_job_nowhere" in refused.stderr + refused.stdout
