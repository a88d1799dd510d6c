"""The driver of a prime-rl payload on a worker: ``python -m aitrainsai_trainer_prime_rl.job job.json``.

It works in the folder of ``job.json`` (the payload's workdir); every path in it is relative to that folder.

``train``: makes sure prime-rl is installed at the pinned tag or commit (once per worker and stack, under a lock),
installs the job's environment package into prime-rl's environment, and runs prime-rl: on two GPUs its own ``rl``
launcher; on one GPU ``rl --dry-run`` to resolve the configs, then vLLM, the orchestrator and the trainer (on main also
the training source's env server) side by side on that GPU (the launcher cannot share a GPU). v0.6.0's logs go where
its launcher puts them (``outputs/logs/``), main's under ``outputs/job/logs/``. When all of them have ended it copies
the last step's LoRA adapter to ``checkpoint/`` (v0.6.0: ``outputs/weights/step_<N>/lora_adapters``; main: the
broadcast ``outputs/job/broadcasts/step_<N>``) and writes ``train.json`` (time, per-step reward: v0.6.0's rollout
files, main's ``metrics.jsonl``). A crash, out-of-memory, the time limit or a missing checkpoint is a non-zero exit
whose last lines say which, after the tails of prime-rl's logs.

The job's code runs in the core's sandbox, served to prime-rl's orchestrator by the environment package; still,
what prime-rl's processes wrote is not trusted beyond its shape: files are read with size caps, the adapter is
checked here and again on the trusted side, and every process started here is ended with the job.

``eval``: serves the base model (and the adapter in ``checkpoint/``, if any) with vLLM and plays the conversations in
``job.json`` through it with the family's public tools (:func:`aitrainsai.evaluation.converse`); writes
``transcripts.json``. It never scores: the hidden answers and the scorer stay with the trusted side. It imports no
job code and loads no task family.

``job.json`` is a :class:`aitrainsai_trainer_prime_rl.jobspec.JobSpec`; one that cannot be read as one is exit 2 after
one line saying why.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from aitrainsai import SpecError
from aitrainsai_trainer_prime_rl.jobspec import EvalSpec, TrainSpec, WorkerSpec, read_spec

TRAIN_FILE = "train.json"
CHECKPOINT_DIR = "checkpoint"
TRANSCRIPTS_FILE = "transcripts.json"
LOG_TAIL = 3000
MAX_ROLLOUT_FILE = 64 * 2**20
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
TAG = "AITRAINSAI_PROCESS_TAG"
OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "torch.OutOfMemoryError", "CUDA error: out of memory")


class Failed(RuntimeError):
    """The payload cannot finish; the message is its last line."""


# -- prime-rl on this worker -------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    return Path(os.environ.get("AITRAINSAI_CACHE_DIR") or Path.home() / ".cache" / "aitrainsai")


def ensure_prime_rl(spec: WorkerSpec) -> Path:
    """The prime-rl checkout at the pinned tag (or, for a commit of main no tag names, that commit) with its
    environment synced, made once per worker and stack (a lock keeps two jobs on one machine from installing it
    twice)."""
    stack = spec.stack
    root = cache_dir() / "prime-rl" / stack.name
    ready = root / ".aitrainsai-ready"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{stack.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.exists():
            return root
        if root.exists():
            shutil.rmtree(root)
        uv = _uv(spec)
        source = spec.source
        print(f"installing prime-rl {stack.name} ({stack.commit[:12]}) from {source}", flush=True)
        if stack.tag:
            _run(["git", "clone", "--quiet", "--branch", stack.tag, "--depth", "1", "--recurse-submodules",
                  "--shallow-submodules", source, str(root)], timeout=1800, what="git clone of prime-rl")
        else:  # a commit of main: fetched by its hash (GitHub serves any reachable commit), then its submodules
            root.mkdir(parents=True)
            for argv in (["init", "--quiet"], ["fetch", "--quiet", "--depth", "1", source, stack.commit],
                         ["checkout", "--quiet", "FETCH_HEAD"],
                         ["submodule", "update", "--init", "--recursive", "--depth", "1", "--quiet"]):
                _run(["git", "-C", str(root), *argv], timeout=1800, what=f"git {argv[0]} of prime-rl")
        head = _run(["git", "-C", str(root), "rev-parse", "HEAD"], timeout=60, what="git rev-parse").strip()
        if head != stack.commit:
            raise Failed(f"prime-rl {stack.name} is commit {head} at {source}, not the pinned {stack.commit}")
        _run([uv, "sync", "--all-extras", "--project", str(root)], timeout=3600, what="uv sync of prime-rl")
        ready.write_text(stack.commit)
        return root


def _uv(spec: WorkerSpec) -> str:
    uv = spec.uv or "uv"
    if shutil.which(uv):
        return uv
    print("uv not found: installing it with pip", flush=True)
    _run([sys.executable, "-m", "pip", "install", "-q", "uv>=0.11.1"], timeout=600, what="pip install uv")
    found = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not Path(found).exists():
        raise Failed("uv could not be installed")
    return found


def _run(argv: list[str], *, timeout: float, what: str, env: dict | None = None, cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise Failed(f"{what} did not finish within {timeout:.0f} s") from None
    except OSError as exc:
        raise Failed(f"{what} could not start: {exc}") from None
    if done.returncode != 0:
        tail = " ".join((done.stderr or done.stdout).split())[-600:]
        raise Failed(f"{what} failed (exit {done.returncode}): {tail}")
    return done.stdout


# -- processes ---------------------------------------------------------------------------------------------------------
class Group:
    """Child processes, each in its own session, all killed together; so are their descendants that left the
    session (a daemon that agent code started): every process started here carries a tag in its environment, and
    :meth:`kill` ends every process of this user that still carries it."""

    def __init__(self):
        self.children: dict[str, subprocess.Popen] = {}
        self.logs: list[Path] = []
        self.tag = f"{os.getpid()}-{secrets.token_hex(8)}"

    def start(self, name: str, argv: list[str], log: Path, env: dict) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as handle:
            process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env={**env, TAG: self.tag}, start_new_session=True)
        self.children[name] = process
        self.logs.append(log)
        return process

    def kill(self) -> None:
        for process in self.children.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for process in self.children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)
        deadline = time.monotonic() + 10
        while (left := tagged(self.tag)) and time.monotonic() < deadline:  # a killed process takes a moment to go
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def tails(self) -> str:
        out = []
        for log in self.logs:
            if log.is_file():
                out.append(f"--- {log.name} (last {LOG_TAIL} bytes) ---\n{_tail(log)}")
        return "\n".join(out)


def tagged(tag: str) -> list[int]:
    """The processes (other than this one) whose environment carries ``TAG=tag``."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


def _tail(path: Path, size: int = LOG_TAIL) -> str:
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - size))
        return handle.read().decode("utf-8", "replace")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- train -------------------------------------------------------------------------------------------------------------
def train(spec: TrainSpec) -> int:
    started = time.monotonic()
    deadline = started + float(spec.wall_s)
    launcher = spec.launcher
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if launcher:  # a stand-in prime-rl (tests): the package goes into a folder on its path
        site = Path(".envsite")
        _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
              "--target", str(site), str(Path(spec.package).resolve())],
             timeout=600, what="installing the job's environment package")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site.resolve()), env.get("PYTHONPATH", "")]))
        prefix = list(launcher)
    else:
        checkout = ensure_prime_rl(spec)
        uv = _uv(spec)
        _run([uv, "pip", "install", "--python", str(checkout / ".venv" / "bin" / "python"), "--find-links",
              spec.wheels, "--reinstall-package", spec.env_id, str(Path(spec.package).resolve())],
             timeout=1200, what="installing the job's environment package into prime-rl's environment")
        prefix = [uv, "run", "--project", str(checkout), "--no-sync"]
    outputs = Path("outputs")
    if outputs.exists():
        shutil.rmtree(outputs)  # a rerun starts from nothing
    group = Group()
    v1 = spec.stack.job_format == "verifiers-v1"
    try:
        watch = (_start_main if v1 else _start_v0_6_0)(spec, prefix, group, env)
        failure = _wait(group, watch, deadline)
    finally:
        group.kill()  # vLLM (and main's env server) serve until killed; anything else still running goes too
    if failure:
        print(group.tails(), flush=True)
        text = group.tails()
        if any(marker in text for marker in OOM_MARKERS):
            failure += " (out of memory)"
        raise Failed(failure)
    adapter = _final_adapter_main(spec.steps) if v1 else _final_adapter(outputs, spec.steps)
    if Path(CHECKPOINT_DIR).exists():
        shutil.rmtree(CHECKPOINT_DIR)
    Path(CHECKPOINT_DIR).mkdir()
    for name in ADAPTER_FILES:
        shutil.copyfile(adapter / name, Path(CHECKPOINT_DIR) / name)
    seconds = time.monotonic() - started
    steps = _rewards_main(spec.steps) if v1 else _rewards(outputs)
    Path(TRAIN_FILE).write_text(json.dumps({"train_seconds": seconds, "metrics": {"steps": steps}}))
    print(f"trained in {seconds:.0f} s; adapter of step {spec.steps} in {CHECKPOINT_DIR}/", flush=True)
    return 0


def _start_v0_6_0(spec: TrainSpec, prefix: list[str], group: Group, env: dict) -> list[str]:
    """prime-rl v0.6.0's processes: its launcher on two GPUs; on one, vLLM, the orchestrator and the trainer from the
    configs ``rl --dry-run`` resolves (``outputs/configs/*.toml``). The names of the processes to wait for."""
    outputs = Path("outputs")
    logs = outputs / "logs"
    port = _free_port()  # vLLM's, so that jobs sharing a machine do not collide on prime-rl's default 8000
    ports = ["--inference.server.port", str(port), "--orchestrator.student.client.base-url",
             f"http://localhost:{port}/v1"]
    if spec.gpus >= 2:
        group.start("rl", prefix + ["rl", "@", spec.rl_toml, *ports], logs / "rl.log", env)
        return ["rl"]
    _run(prefix + ["rl", "@", spec.rl_toml, *ports, "--dry-run"], timeout=600, env=env,
         what="prime-rl's config resolution (rl --dry-run)")
    configs = outputs / "configs"
    group.start("inference", prefix + ["inference", "@", str(configs / "inference.toml")], logs / "inference.log", env)
    group.start("orchestrator", prefix + ["orchestrator", "@", str(configs / "orchestrator.toml")],
                logs / "orchestrator.log", env)
    group.start("trainer", prefix + ["torchrun", "--nproc-per-node=1", f"--master-port={_free_port()}",
                                     "-m", "prime_rl.trainer.rl.train", "@", str(configs / "trainer.toml")],
                logs / "trainer.log", {**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    return ["orchestrator", "trainer"]


def _start_main(spec: TrainSpec, prefix: list[str], group: Group, env: dict) -> list[str]:
    """prime-rl main's processes, in the run's folder ``outputs/job``: its launcher on two GPUs; on one (the launcher
    hands out disjoint GPUs), vLLM behind its router, the training source's env server, the orchestrator and the
    trainer from the configs ``rl --dry-run`` resolves (``configs/*.json``, ``configs/envs/train/job.json``), with
    the run identity the launcher would give them. Ports of this job's own (:func:`~.rltoml_v1.driver_flags`)."""
    from aitrainsai_trainer_prime_rl.rltoml_v1 import RUN_NAME, SOURCE_NAME, driver_flags, run_dir

    run = run_dir(Path("."))
    logs = run / "logs" / "aitrainsai"
    flags = driver_flags(_free_port(), _free_port(), _free_port())
    env = {**env, "PRL_RUN_ID": secrets.token_hex(16), "PRL_RUN_NAME": RUN_NAME}
    if spec.gpus >= 2:
        group.start("rl", prefix + ["rl", "@", spec.rl_toml, *flags], logs / "rl.log", env)
        return ["rl"]
    _run(prefix + ["rl", "@", spec.rl_toml, *flags, "--dry-run"], timeout=600, env=env,
         what="prime-rl's config resolution (rl --dry-run)")
    configs = run / "configs"
    group.start("inference", prefix + ["inference", "@", str(configs / "inference.json")], logs / "inference.log", env)
    group.start("env-server", prefix + ["env-server", "@", str(configs / "envs" / "train" / f"{SOURCE_NAME}.json")],
                logs / "env-server.log", env)
    group.start("orchestrator", prefix + ["orchestrator", "@", str(configs / "orchestrator.json")],
                logs / "orchestrator.log", env)
    group.start("trainer", prefix + ["torchrun", "--nproc-per-node=1", f"--master-port={_free_port()}",
                                     "-m", "prime_rl.trainer.rl.train", "@", str(configs / "trainer.json")],
                logs / "trainer.log", {**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    return ["orchestrator", "trainer"]


def _wait(group: Group, watch: list[str], deadline: float) -> str:
    """Until every watched process has exited 0 (""), one failed, or the deadline passed: why it stopped."""
    while True:
        for name, process in group.children.items():
            code = process.poll()
            if code not in (None, 0):
                return f"{name} failed with exit code {code}"
            if code == 0 and name not in watch:
                return f"{name} exited while training went on"
        if all(group.children[name].poll() == 0 for name in watch):
            return ""
        if time.monotonic() > deadline:
            return "training exceeded its time limit"
        time.sleep(1.0)


def _final_adapter(outputs: Path, steps: int) -> Path:
    step = outputs / "weights" / f"step_{steps}"
    adapter = step / "lora_adapters"
    if not (step / "STABLE").is_file():
        raise Failed(f"no checkpoint: prime-rl wrote no finished weights for step {steps} ({step}/STABLE)")
    for name in ADAPTER_FILES:
        path = adapter / name
        if path.is_symlink() or not path.is_file():
            raise Failed(f"no checkpoint: the adapter of step {steps} lacks {name}")
    return adapter


def _final_adapter_main(steps: int) -> Path:
    """prime-rl main's adapter of the last step (steps count from 1): its filesystem broadcast
    ``outputs/job/broadcasts/step_<N>``, finished when ``STABLE`` is there."""
    from aitrainsai_trainer_prime_rl.rltoml_v1 import final_adapter_dir

    adapter = final_adapter_dir(Path("."), steps)
    if not (adapter / "STABLE").is_file():
        raise Failed(f"no checkpoint: prime-rl broadcast no finished adapter for step {steps} ({adapter}/STABLE)")
    for name in ADAPTER_FILES:
        path = adapter / name
        if path.is_symlink() or not path.is_file():
            raise Failed(f"no checkpoint: the adapter of step {steps} lacks {name}")
    return adapter


def _rewards_main(steps: int) -> list[dict]:
    """Mean reward per step from prime-rl main's file monitor (``outputs/job/metrics.jsonl``: one JSON object a
    line, ``step`` and the orchestrator's ``train/agg/all/<agent>/reward/mean``; the trainer writes its own lines
    there too). Bounded; a malformed line or value is skipped; the last value of a step wins."""
    from aitrainsai_trainer_prime_rl.rltoml_v1 import METRICS_FILE, run_dir

    path = run_dir(Path(".")) / METRICS_FILE
    if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_ROLLOUT_FILE:
        return []
    found: dict[int, float] = {}
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, TypeError, AttributeError, RecursionError):
            row = json.loads(line)
            step = row.get("step")
            if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= steps:
                continue
            for key, value in row.items():
                parts = key.split("/")
                if len(parts) == 6 and parts[:3] == ["train", "agg", "all"] and parts[4:] == ["reward", "mean"]:
                    reward = float(value)
                    if math.isfinite(reward):
                        found[step] = reward
    return [{"step": step, "reward_mean": found[step]} for step in sorted(found)]


def _rewards(outputs: Path) -> list[dict]:
    """Mean reward per step, read from prime-rl's rollout files (bounded; a malformed line is skipped)."""
    steps = []
    root = outputs / "run_default" / "rollouts"
    for folder in sorted(root.glob("step_*"), key=lambda p: int(p.name[5:]) if p.name[5:].isdigit() else -1):
        path = folder / "train_rollouts.jsonl"
        if not folder.name[5:].isdigit() or path.is_symlink() or not path.is_file():
            continue
        if path.stat().st_size > MAX_ROLLOUT_FILE:
            continue
        rewards = []
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                reward = float(json.loads(line).get("reward"))
                if math.isfinite(reward):
                    rewards.append(reward)
        if rewards:
            steps.append({"step": int(folder.name[5:]), "reward_mean": sum(rewards) / len(rewards),
                          "rollouts": len(rewards)})
    return steps


# -- eval --------------------------------------------------------------------------------------------------------------
def evaluate(spec: EvalSpec) -> int:
    from aitrainsai import converse

    from aitrainsai_trainer_prime_rl.engine import OpenAIChatEngine, wait_ready

    tools_module = _public_tools(spec)
    port = _free_port()
    checkpoint = spec.checkpoint
    args = ["--model", spec.base_model, "--port", str(port), "--host", "127.0.0.1", "--seed", "0",
            "--max-model-len", str(spec.max_model_len), "--gpu-memory-utilization", str(spec.gpu_memory),
            "--enable-auto-tool-choice", "--tool-call-parser", spec.tool_parser]
    if checkpoint:
        rank = json.loads((Path(checkpoint) / "adapter_config.json").read_text())["r"]
        args += ["--enable-lora", "--max-lora-rank", str(rank), "--lora-modules", f"job={Path(checkpoint).resolve()}"]
    server = spec.server
    if server:
        argv = list(server) + args
    else:
        checkout = ensure_prime_rl(spec)
        argv = [_uv(spec), "run", "--project", str(checkout), "--no-sync", "vllm", "serve"] + args
    group = Group()
    try:
        process = group.start("vllm", argv, Path("logs") / "vllm.log", {**os.environ, "PYTHONUNBUFFERED": "1"})
        base_url = f"http://127.0.0.1:{port}/v1"
        wait_ready(base_url, timeout_s=spec.ready_s, alive=lambda: process.poll() is None)
        engine = OpenAIChatEngine(base_url, "job" if checkpoint else spec.base_model, spec.engine,
                                  concurrency=spec.engine.batch_size)
        starts = [(c.messages, _bind(tools_module, c.world)) for c in spec.conversations]
        transcripts = converse(starts, spec.schemas, engine, turn_limit=spec.turn_limit)
    except Exception as exc:
        print(group.tails(), flush=True)
        raise Failed(f"the evaluation failed: {type(exc).__name__}: {exc}") from None
    finally:
        group.kill()
    Path(TRANSCRIPTS_FILE).write_text(json.dumps(transcripts))
    print(f"{len(transcripts)} conversations played through {engine.requests_sent} requests", flush=True)
    return 0


def _public_tools(spec: EvalSpec):
    import importlib

    sys.path.insert(0, str(Path(spec.public).resolve()))
    module = importlib.import_module(spec.tools_module)
    tools = {fn.__name__: fn for fn in module.TOOLS}
    missing = [name for name in spec.tool_names if name not in tools]
    if missing:
        raise Failed(f"the family's public module lacks the tools {missing}")
    return [tools[name] for name in spec.tool_names]


def _bind(functions, world) -> dict:
    """As ``TaskFamily.tools``: each tool bound to a private copy of the item's world."""
    import copy

    from aitrainsai import bind

    world = copy.deepcopy(world)
    return {fn.__name__: bind(fn, world) for fn in functions}


def main(spec_path: str) -> int:
    spec_file = Path(spec_path).resolve()
    try:
        spec = read_spec(spec_file)
    except SpecError as exc:
        print(f"the payload cannot start: {exc}", flush=True)
        return 2
    os.chdir(spec_file.parent)
    try:
        return train(spec) if isinstance(spec, TrainSpec) else evaluate(spec)
    except Failed as exc:
        print(f"{spec.mode} failed: {exc}", flush=True)
        return 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if len(sys.argv) != 2:
        print("usage: python -m aitrainsai_trainer_prime_rl.job job.json", flush=True)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
