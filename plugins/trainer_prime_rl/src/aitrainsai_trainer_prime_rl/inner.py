"""``PrimeRlTrainer``: inner jobs trained by prime-rl (GRPO with LoRA) on Qwen3-0.6B or Qwen3-1.7B (and, on prime-rl
main, Qwen3.5-0.8B or Qwen3.5-2B), the agent's choice, on any backend that gives a payload a GPU. A classic job trains
on prime-rl v0.6.0, a verifiers-v1 job on prime-rl main (:func:`~.pins.select_stack`, the run option
``prime_rl.stack``).

Trust: the job's code runs in the core's sandbox on the worker, never in prime-rl's processes (its orchestrator loads
the package's :class:`aitrainsai.SandboxedEnv`, or on main the package's ``vf.Taskset`` (:mod:`.envpkg_v1`), which
ask the sandbox for rows, tool results and rewards); even so the
training payload carries nothing secret: the job's environment package (its files, the frozen dataset, the family's
*public* modules), the ``rl.toml`` generated here, and the core's wheel. The family's distribution, whose private module
holds the hidden eval's seed, is not part of its runtime. The evaluation payload starts only after the training payload
has ended; it carries the hidden questions and their tool worlds (never the answers), runs no job code, and brings back
transcripts. Scores are computed here, on the trusted side: each transcript must start with its item's messages and
every tool result in it must be what the family's tools return on replay, then the family's scorer scores it.
"""

from __future__ import annotations

import shutil
import struct
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from aitrainsai import (PYTHON, Constraints, EngineSpec, EvalResult, InnerTrainer, JobPayload, JobResult, Problem,
                        Runtime, TaskFamily, TaskSpec, TrainOutcome, UntrustedInputError, line_of, load_json,
                        lora_adapter_config, printable, read_json)
from pydantic import BaseModel

from aitrainsai_trainer_prime_rl.config import (MAX_LORA_ALPHA, MAX_LORA_RANK, PrimeRlJobConfig, PrimeRlJobConfigV1,
                                                PrimeRlTrainerConfig)
from aitrainsai_trainer_prime_rl.jobspec import Conversation, EvalSpec, TrainSpec
from aitrainsai_trainer_prime_rl.pins import (BASES, MAIN_V1, TOOL_PARSERS, V0_6_0, VLLM_LORA_RANKS, Stack,
                                              StackMismatch, offered_bases, select_stack)

SPEC_FILE = "job.json"
TRAIN_FILE = "train.json"
TRANSCRIPTS_FILE = "transcripts.json"
CHECKPOINT_DIR = "checkpoint"
PACKAGE_DIR = "envpkg"
WHEELS_DIR = "wheels"
PUBLIC_DIR = "public"
RL_TOML = "rl.toml"
COMMAND = [PYTHON, "-m", "aitrainsai_trainer_prime_rl.job", SPEC_FILE]
MAX_ADAPTER_BYTES = 512 * 2**20  # a rank-128 adapter of Qwen3-1.7B in fp32 is about 280 MB
MAX_TRANSCRIPTS_BYTES = 64 * 2**20
MAX_TRAIN_FILE_BYTES = 4 * 2**20
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # Qwen3's projections
MAX_HEADER_BYTES = 16 * 2**20  # a safetensors header of an adapter: names, dtypes, shapes and offsets


class PrimeRlTrainer(InnerTrainer):
    name = "prime_rl"
    description = ("GRPO + LoRA with prime-rl (v0.6.0 for classic jobs, main for verifiers-v1 jobs) on Qwen3-0.6B or "
                   "Qwen3-1.7B (Qwen3.5-0.8B or -2B on main), on GPU workers; eval through vLLM")
    Config = PrimeRlTrainerConfig
    JobConfig = PrimeRlJobConfig
    base_models = BASES  # the class's (v0.6.0's); an instance offers those of its prime_rl.stack

    def __init__(self, config: PrimeRlTrainerConfig | None = None):
        super().__init__(config)
        self.config: PrimeRlTrainerConfig
        self._core_wheel: Path | None = None
        self.base_models = offered_bases(self.config.stack)  # the bases every format's stack trains
        if self.config.stack != V0_6_0.name:  # trainer.toml may name a Qwen3.5 base (bases_for: v1 jobs' tasks)
            self.JobConfig = PrimeRlJobConfigV1

    def bases_for(self, job_format: str) -> tuple[str, ...]:
        """The bases a task in ``job_format`` offers: those of the stack its jobs train on (a v1 task under
        ``auto`` also offers the two Qwen3.5 bases); :attr:`base_models` where no pinned stack loads the format."""
        try:
            return select_stack(self.config.stack, job_format).bases
        except StackMismatch:
            return self.base_models

    def stack(self, job_dir: Path) -> Stack:
        """The prime-rl the job in ``job_dir`` trains on: by its format (its files' shape) and ``prime_rl.stack``;
        :class:`~.pins.StackMismatch` (one line) where that prime-rl cannot load the job."""
        import os

        from aitrainsai import job_format

        return select_stack(self.config.stack, job_format(os.listdir(job_dir)))

    def eval_stack(self, base_model: str) -> Stack:
        """The prime-rl whose vLLM serves ``base_model`` in the hidden eval: by the base and the run option only,
        never by a job, so that pre and post of one base share an engine. v0.6.0's where it offers the base and the
        run does not name main (so the default run's baselines are today's), else main's."""
        if self.config.stack == MAIN_V1.name or base_model not in V0_6_0.bases:
            return MAIN_V1
        return V0_6_0

    # -- the agent's side: constraints, template, probe ----------------------------------------------------------------
    def check_config(self, job_dir: Path, constraints: Constraints) -> list[Problem]:
        try:
            stack = self.stack(job_dir)
        except StackMismatch as exc:  # one line: the job's format is not the one the run's prime-rl loads
            import os

            from aitrainsai import job_format

            entry = "taskset.py" if job_format(os.listdir(job_dir)) == "verifiers-v1" else "environment.py"
            return [Problem(file=entry, message=str(exc))]
        problems = super().check_config(job_dir, constraints)
        if problems:
            return problems
        text = (Path(job_dir) / "trainer.toml").read_text(errors="replace")
        config = self.job_config(job_dir)
        if config.base_model not in stack.bases:
            problems.append(Problem(file="trainer.toml", line=line_of(text, "base_model"), message=(
                f"base_model {config.base_model!r} does not train on prime-rl {stack.name}; use one of "
                f"{list(stack.bases)}")))
            return problems
        if config.lora_rank not in VLLM_LORA_RANKS:
            allowed = [r for r in VLLM_LORA_RANKS if r <= 128]
            problems.append(Problem(file="trainer.toml", line=line_of(text, "lora_rank"), message=(
                f"lora_rank = {config.lora_rank}: vLLM serves adapters of rank {allowed} only")))
            return problems
        from pydantic import ValidationError

        try:
            import tomllib

            model, rendered = self._rl_toml(stack, config, "probe", {})
            model.model_validate(tomllib.loads(rendered))
        except ValidationError as exc:  # a value prime-rl would refuse, caught before a GPU is paid for
            first = exc.errors()[0]
            problems.append(Problem(file="trainer.toml", message=f"prime-rl would refuse this config: {first['msg']}"))
        return problems

    def job_config(self, job_dir: Path) -> PrimeRlJobConfig:
        config = super().job_config(job_dir)
        assert isinstance(config, PrimeRlJobConfig)  # self.JobConfig: PrimeRlJobConfig or its v1 subclass
        return config

    @property
    def layout(self) -> Literal["one-gpu", "two-gpu"]:
        return "two-gpu" if self.config.gpus >= 2 else "one-gpu"

    def _rl_toml(self, stack: Stack, config: PrimeRlJobConfig, env_id: str,
                 env_args: dict) -> tuple[type[BaseModel], str]:
        """``rl.toml`` of ``config`` for ``stack``, and the plugin's model of that prime-rl's schema."""
        if stack == MAIN_V1:
            from aitrainsai_trainer_prime_rl import rltoml_v1

            return rltoml_v1.RLConfig, rltoml_v1.render(config, env_id, layout=self.layout,
                                                        infer_memory_fraction=self.config.infer_memory_fraction,
                                                        **env_args)
        from aitrainsai_trainer_prime_rl import rltoml

        return rltoml.RLConfig, rltoml.render(config, env_id, layout=self.layout, env_args=env_args,
                                              infer_memory_fraction=self.config.infer_memory_fraction)

    def expected_seconds(self, config: PrimeRlJobConfig) -> float:
        """A rough GPU estimate, used only to order queued jobs: start-up plus rollouts' tokens per step."""
        scale = {"0.6B": 1.0, "0.8B": 1.3, "1.7B": 2.5, "2B": 3.0}.get(config.base_model.rsplit("-", 1)[-1], 3.0)
        return 240.0 + config.steps * (5.0 + scale * config.rollouts_per_step * config.max_tokens / 20_000)

    def eval_settings(self, base_model: str) -> dict:
        return self._engine(base_model).model_dump(mode="json")

    def _engine(self, base_model: str) -> EngineSpec:
        return EngineSpec(engine="vllm", base_model=base_model, dtype="bfloat16",
                          max_new_tokens=self.config.eval_max_tokens, batch_size=self.config.eval_concurrency,
                          extra={"prime_rl": self.eval_stack(base_model).name, "thinking": False})

    def runtime(self) -> Runtime:
        """The drivers need the core and this trainer; never a task family (its private module is the hidden
        eval's seed)."""
        names = ["aitrainsai", "aitrainsai-trainer-prime-rl"]
        return Runtime(distributions={name: f"=={metadata.version(name)}" for name in names})

    def _worker_spec(self, stack: Stack) -> dict[str, Any]:
        """The fields of both specs that say where prime-rl comes from (:class:`~.jobspec.WorkerSpec`)."""
        c = self.config
        return {"stack": stack, "source": c.prime_rl_source, "uv": c.uv}

    # -- training ------------------------------------------------------------------------------------------------
    def payload(self, job_dir: Path, spec: TaskSpec, job_id: str, family: TaskFamily) -> JobPayload:
        from aitrainsai import job_digest, verify_job

        from aitrainsai_trainer_prime_rl import envpkg, envpkg_v1

        stack = self.stack(job_dir)
        build_package = envpkg_v1.build_package if stack == MAIN_V1 else envpkg.build_package
        workdir = Path(job_dir).parent / "train"
        if workdir.exists():
            shutil.rmtree(workdir)  # a rerun starts from the job alone
        workdir.mkdir(parents=True)
        digest = job_digest(job_dir)
        verify_job(job_dir, digest)
        problems = self.check_config(job_dir, spec.constraints)
        if problems:
            raise ValueError("trainer.toml does not pass the trainer's checks: " + "; ".join(map(str, problems)))
        config = self.job_config(job_dir)
        env_id = build_package(job_dir, family, digest, workdir / PACKAGE_DIR,
                               core_version=metadata.version("aitrainsai"))
        verify_job(job_dir, digest)  # unchanged while it was copied
        (workdir / WHEELS_DIR).mkdir()
        core = self._core()
        if core is not None:
            shutil.copyfile(core, workdir / WHEELS_DIR / core.name)
        env_args = {"memory_mb": self.config.sandbox_memory_mb, "wall_s": float(spec.constraints.max_wall_seconds)}
        (workdir / RL_TOML).write_text(self._rl_toml(stack, config, env_id, env_args)[1])
        (workdir / SPEC_FILE).write_text(TrainSpec(
            **self._worker_spec(stack), env_id=env_id, package=PACKAGE_DIR, wheels=WHEELS_DIR, rl_toml=RL_TOML,
            steps=config.steps, gpus=self.config.gpus, wall_s=spec.constraints.max_wall_seconds,
            launcher=self.config.launcher).model_dump_json())
        return JobPayload(job_id=job_id, workdir=workdir, command=COMMAND,
                          artifacts={"train": TRAIN_FILE, "checkpoint": CHECKPOINT_DIR},
                          timeout_s=spec.constraints.max_wall_seconds + 1_800,  # + a first install of prime-rl
                          expected_s=self.expected_seconds(config), runtime=self.runtime(), gpus=self.config.gpus,
                          gpu_type=self.config.gpu_type if self.config.gpus else None,
                          memory_gb=self.config.memory_gb, disk_gb=self.config.disk_gb)

    def _core(self) -> Path | None:
        """The core's wheel when it is installed here from a folder (the env package depends on it); built once."""
        if self._core_wheel is None or not self._core_wheel.exists():
            import tempfile
            import weakref

            from aitrainsai import build_local_wheels

            folder = Path(tempfile.mkdtemp(prefix="aitrainsai-core-wheel-"))
            weakref.finalize(self, shutil.rmtree, folder, True)  # gone with the trainer, or at exit
            self._core_wheel = build_local_wheels(["aitrainsai"], folder).get("aitrainsai")
        return self._core_wheel

    def result(self, outcome: JobResult) -> TrainOutcome:
        # metrics may hold NaN (a diverged run is still evaluated); the training time must be a finite number
        data = read_json(_artifact(outcome, "train"), max_bytes=MAX_TRAIN_FILE_BYTES, finite=False)
        seconds = data.get("train_seconds") if isinstance(data, dict) else None
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
            raise UntrustedInputError("train.json", f"train_seconds {seconds!r} is not a finite number of seconds")
        checkpoint = _artifact(outcome, "checkpoint")
        check_adapter(checkpoint)
        metrics = data.get("metrics")
        steps = metrics.get("steps") if isinstance(metrics, dict) else None
        return TrainOutcome(checkpoint=checkpoint, train_seconds=float(seconds),
                            metrics={"steps": [s for s in steps if isinstance(s, dict)][:10_000]
                                     if isinstance(steps, list) else []})

    # -- evaluation ----------------------------------------------------------------------------------------------
    def eval_payload(self, family: TaskFamily, level: int, base_model: str, checkpoint: Path | None,
                     workdir: Path, job_id: str) -> JobPayload:
        """The hidden eval's conversations for a worker: questions and tool worlds, never answers; the family's
        public modules for its tools; the adapter (checked) when scoring a trained job."""
        from aitrainsai_trainer_prime_rl.envpkg import public_files

        workdir = Path(workdir)
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        if checkpoint is not None:
            check_adapter(Path(checkpoint))
            shutil.copytree(checkpoint, workdir / CHECKPOINT_DIR)
        for relative, source in public_files(family).items():
            target = workdir / PUBLIC_DIR / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        items = family.hidden_eval(self.eval_size, level)
        (workdir / SPEC_FILE).write_text(EvalSpec(
            **self._worker_spec(self.eval_stack(base_model)), base_model=base_model,
            tool_parser=TOOL_PARSERS.get(base_model, "hermes"),
            checkpoint=CHECKPOINT_DIR if checkpoint is not None else None,
            conversations=[Conversation(messages=family.initial_messages(i), world=i.world) for i in items],
            schemas=family.tool_schemas(), turn_limit=family.turn_limit,
            public=PUBLIC_DIR, tools_module=family.public_modules[0],
            tool_names=[fn.__name__ for fn in family.tool_functions],
            engine=self._engine(base_model), max_model_len=self.config.eval_max_model_len, gpu_memory=0.85,
            server=self.config.eval_server).model_dump_json())
        return JobPayload(job_id=job_id, workdir=workdir, command=COMMAND, artifacts={"transcripts": TRANSCRIPTS_FILE},
                          timeout_s=3_600, expected_s=300.0, runtime=self.runtime(), gpus=min(self.config.gpus, 1),
                          gpu_type=self.config.gpu_type if self.config.gpus else None,
                          memory_gb=self.config.memory_gb, disk_gb=self.config.disk_gb)

    def eval_result(self, outcome: JobResult, *, family: TaskFamily | None = None, level: int | None = None,
                    base_model: str | None = None) -> EvalResult:
        """Scores computed here from the worker's transcripts, after checking each against its hidden item. The file
        is read capped and typed (:func:`aitrainsai.parsing.read_json`); any fault is an
        :class:`~aitrainsai.parsing.UntrustedInputError` or a ``ValueError`` naming it. Slow on a large file: the core
        calls it off the event loop."""
        if family is None or level is None or base_model is None:
            raise ValueError("the prime-rl trainer scores transcripts itself: it needs the family, level and base")
        transcripts = read_json(_artifact(outcome, "transcripts"), max_bytes=MAX_TRANSCRIPTS_BYTES)
        items = family.hidden_eval(self.eval_size, level)
        if not isinstance(transcripts, list) or len(transcripts) != len(items):
            raise ValueError(f"the evaluation brought back {len(transcripts) if isinstance(transcripts, list) else 0} "
                             f"transcripts for {len(items)} items")
        scores = []
        for number, (item, transcript) in enumerate(zip(items, transcripts)):
            problem = check_transcript(family, item, transcript)
            if problem:
                raise ValueError(f"transcript {number}: {problem}")
            scores.append(float(family.score(item, transcript)))
        return EvalResult(family=family.name, level=level, eval_seed=family.eval_seed, eval_size=len(items),
                          engine=self._engine(base_model), item_scores=scores, transcripts=transcripts)


def check_transcript(family: TaskFamily, item, transcript: Any) -> str:
    """Why ``transcript`` is not a conversation the evaluation could have had on ``item`` ("" when it is): it must
    start with the item's messages, alternate replies and tool results as the evaluation does, stay within the turn
    limit, and every tool result must be what the family's tools return when the calls are replayed here."""
    from aitrainsai import call_tool

    if not isinstance(transcript, list) or not all(isinstance(m, dict) for m in transcript):
        return "not a list of messages"
    start = family.initial_messages(item)
    if transcript[:len(start)] != start:
        return "it does not start with its item's messages"
    tools = family.tools(item)
    replies = 0
    index = len(start)
    while index < len(transcript):
        message = transcript[index]
        if message.get("role") != "assistant" or not isinstance(message.get("content", ""), str):
            return f"message {index} should be an assistant reply"
        replies += 1
        if replies > family.turn_limit:
            return f"more than {family.turn_limit} replies"
        calls = message.get("tool_calls") or []
        index += 1
        if not calls:
            break
        if not isinstance(calls, list):
            return f"message {index - 1} has malformed tool calls"
        if replies == family.turn_limit:  # the last reply's calls are not run
            break
        for call in calls:
            if index >= len(transcript):
                return "a tool call has no result"
            result = transcript[index]
            function = call.get("function") if isinstance(call, dict) else None
            if (not isinstance(function, dict) or result.get("role") != "tool"
                    or result.get("tool_call_id") != call.get("id")):
                name = call.get("id") if isinstance(call, dict) else "?"
                return f"message {index} should be the result of call {name}"
            tool: Any = function.get("name")  # untrusted: call_tool answers a name that is not a str with an error
            expected = call_tool(tools, tool, function.get("arguments"))
            if result.get("content") != expected:
                return f"message {index}: the tool result differs from the tool's own on replay"
            index += 1
    if index != len(transcript):
        return "messages after the conversation ended"
    return ""


def check_adapter(folder: Path) -> None:
    """A LoRA adapter as prime-rl writes it: exactly ``adapter_model.safetensors`` (a well-formed header within a
    bounded size) and ``adapter_config.json`` (a plain LoRA config of a rank a job trains and vLLM serves, alpha
    finite and bounded, Qwen3's projections only, no shape-changing option:
    :func:`aitrainsai.parsing.lora_adapter_config`); regular files only."""
    if folder.is_symlink() or not folder.is_dir():
        raise ValueError(f"the checkpoint {folder} is not a folder")
    names = sorted(printable(p.name) for p in folder.iterdir())
    if names != sorted(ADAPTER_FILES):
        raise ValueError(f"the checkpoint holds {names}, not {sorted(ADAPTER_FILES)}")
    total = 0
    for name in ADAPTER_FILES:
        path = folder / name
        if path.is_symlink() or not path.is_file():
            raise ValueError(f"the checkpoint's {name} is not a regular file")
        total += path.stat().st_size
    if total > MAX_ADAPTER_BYTES:
        raise ValueError(f"the checkpoint exceeds {MAX_ADAPTER_BYTES} bytes")
    lora_adapter_config(read_json(folder / "adapter_config.json", max_bytes=65_536),
                        ranks=[r for r in VLLM_LORA_RANKS if r <= MAX_LORA_RANK], modules=LORA_MODULES,
                        max_alpha=MAX_LORA_ALPHA)
    what = "adapter_model.safetensors"
    with open(folder / "adapter_model.safetensors", "rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise ValueError("adapter_model.safetensors is truncated")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise ValueError("adapter_model.safetensors has an oversized header")
        header = load_json(handle.read(length), what=f"{what}'s header", max_bytes=MAX_HEADER_BYTES, max_depth=4)
    if not isinstance(header, dict):
        raise UntrustedInputError(f"{what}'s header", "not a JSON object")
    size = (folder / "adapter_model.safetensors").stat().st_size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise UntrustedInputError(f"{what}'s header", f"tensor {printable(name)!r} has no data_offsets")
        start, end = offsets
        if not (0 <= start <= end <= size):
            raise ValueError(f"adapter_model.safetensors: tensor {printable(name)} lies outside the file")


def _artifact(outcome: JobResult, name: str) -> Path:
    if name not in outcome.artifacts:
        raise ValueError(f"the payload brought back no {name!r} artifact")
    return Path(outcome.artifacts[name])

