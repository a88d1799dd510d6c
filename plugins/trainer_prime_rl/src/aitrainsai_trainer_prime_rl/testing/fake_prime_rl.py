"""A stand-in for prime-rl v0.6.0's entry points, for tests without a GPU:
``python -m aitrainsai_trainer_prime_rl.testing.fake_prime_rl [--fault F] ENTRY ARGS...``.

It reads the configs it is given, validates them with this plugin's model of prime-rl's schema (exit 1 with the
message, as prime-rl's CLI does), and writes prime-rl's output layout at that tag: ``configs/*.toml`` (``rl
--dry-run``), ``logs/*.log``, ``run_default/rollouts/step_N/train_rollouts.jsonl``, and at the end
``weights/step_<max_steps>/`` with ``lora_adapters/{adapter_model.safetensors, adapter_config.json}`` and ``STABLE``,
and ``checkpoints/step_<max_steps>/trainer/``. Its orchestrator really loads the job's environment with verifiers
(``vf.load_environment(id, **args)``, as prime-rl's does) and takes its rows; rewards are made up. Nothing trains.

Entries: ``rl @ rl.toml [--dry-run]`` (the launcher: on its own it runs all three roles in turn), ``inference @
inference.toml`` (serves nothing until killed), ``orchestrator @ orchestrator.toml``, ``torchrun ... -m
prime_rl.trainer.rl.train @ trainer.toml``.

For prime-rl main (an ``rl.toml`` with ``[[orchestrator.train.source]]``; configs ``*.json``) it speaks main's
layout instead, under the run's folder ``outputs/job``: ``configs/{trainer,orchestrator,inference}.json`` and
``configs/envs/train/job.json`` (``rl --dry-run``), the driver's flags checked, an ``env-server`` entry that loads
the taskset the source names (imported by id, built from the source's taskset config and its tasks iterated, as
main's schema and env server do; with main's verifiers where this Python has it, else verifiers 0.4.0 from the core's
pinned folder, said in its log) and serves nothing until killed, the orchestrator's
``metrics.jsonl`` lines (``step`` from 1, ``train/agg/all/agent/reward/mean``), and the trainer's filesystem
broadcasts ``broadcasts/step_1..N/{adapter_model.safetensors, adapter_config.json, STABLE}``.

Faults: ``daemon`` (the orchestrator starts a process in a session of its own that never ends), ``crash`` (the
orchestrator fails after one step), ``oom`` (the trainer fails with CUDA's out-of-memory message), ``hang`` (the trainer
never finishes), ``no_checkpoint`` (the trainer exits 0 and writes no weights).
"""

from __future__ import annotations

import json
import struct
import sys
import time
import tomllib
from pathlib import Path

import tomli_w


def _config(argv: list[str]) -> Path:
    if "@" not in argv or argv.index("@") + 1 >= len(argv):
        raise SystemExit("usage: ENTRY @ config.toml")
    return Path(argv[argv.index("@") + 1])


def rl(argv: list[str], fault: str) -> int:
    from pydantic import ValidationError

    from aitrainsai_trainer_prime_rl.rltoml import RLConfig

    path = _config(argv)
    raw = tomllib.loads(path.read_text())
    if "source" in raw.get("orchestrator", {}).get("train", {}):
        return rl_main(argv, raw, fault)
    try:
        config = RLConfig.model_validate(raw)
    except ValidationError as exc:
        print(f"╭─ config error ─╮\n{exc}\n╰────────────────╯", file=sys.stderr)
        return 1
    out = Path(config.output_dir)
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--") and argv[i] != "--dry-run"}
    unknown = set(flags) - {"--inference.server.port", "--orchestrator.student.client.base-url"}
    if unknown:
        print(f"unknown flags {sorted(unknown)}", file=sys.stderr)
        return 1
    port = int(flags.get("--inference.server.port", 8000))
    base_url = flags.get("--orchestrator.student.client.base-url", "http://localhost:8000/v1")
    if not base_url.endswith(f":{port}/v1"):  # prime-rl's launcher checks the same
        print(f"the orchestrator's client ({base_url}) is not on the inference port {port}", file=sys.stderr)
        return 1
    orchestrator = {"output_dir": f"{out}/run_default", "max_steps": config.max_steps, "seq_len": config.seq_len,
                    **config.orchestrator.model_dump(mode="json", exclude_none=True),
                    "student": {"model": {"name": config.model.name}, "client": {"base_url": [base_url]}}}
    trainer = {"output_dir": str(out), "max_steps": config.max_steps,
               **config.trainer.model_dump(mode="json", exclude_none=True)}
    trainer["model"] = {**trainer.get("model", {}), "name": config.model.name, "seq_len": config.seq_len}
    configs = out / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    (configs / "orchestrator.toml").write_text(tomli_w.dumps(orchestrator))
    (configs / "trainer.toml").write_text(tomli_w.dumps(trainer))
    if config.inference is not None:
        inference = config.inference.model_dump(mode="json", exclude_none=True)
        inference["model"] = {**inference.get("model", {}), "name": config.model.name}
        inference["server"] = {"port": port}
        (configs / "inference.toml").write_text(tomli_w.dumps(inference))
    if "--dry-run" in argv:
        print("Dry run complete. To start an RL run locally, remove --dry-run from your command.")
        return 0
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    code = orchestrate(["@", str(configs / "orchestrator.toml")], fault, log=logs / "orchestrator.log")
    if code == 0:
        code = train(["@", str(configs / "trainer.toml")], fault, log=logs / "trainer.log")
    print("Training finished!" if code == 0 else "Error: a child process failed")
    return 0 if code == 0 else 1


def orchestrate(argv: list[str], fault: str, log: Path | None = None) -> int:
    import verifiers as vf

    config = tomllib.loads(_config(argv).read_text())
    out = Path(config["output_dir"])
    env_config = config["train"]["env"][0]
    env = vf.load_environment(env_config["id"], **env_config.get("args", {}))
    rows = len(env.dataset)
    say = _sayer(log)
    if fault == "daemon":  # what agent code in the orchestrator could do: a process that leaves the session
        import subprocess

        daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                                  start_new_session=True)
        (out / "daemon.pid").parent.mkdir(parents=True, exist_ok=True)
        (out / "daemon.pid").write_text(str(daemon.pid))
    say(f"loaded environment {env_config['id']}: {rows} rows, {len(getattr(env, 'tool_defs', None) or [])} tools")
    batch, group = int(config["batch_size"]), int(config["group_size"])
    for step in range(int(config["max_steps"])):
        if fault == "crash" and step == 1:
            say("Traceback (most recent call last):\nRuntimeError: environment worker died")
            return 1
        folder = out / "rollouts" / f"step_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"example_id": (step * batch + i) // group % max(rows, 1),
                             "reward": ((step + i) % group) / group}) for i in range(batch)]
        (folder / "train_rollouts.jsonl").write_text("\n".join(lines) + "\n")
        say(f"step {step}: reward {sum(((step + i) % group) / group for i in range(batch)) / batch:.3f}")
    say("Orchestrator step loop done")
    return 0


def train(argv: list[str], fault: str, log: Path | None = None) -> int:
    config = tomllib.loads(_config(argv).read_text())
    out = Path(config["output_dir"])
    steps = int(config["max_steps"])
    say = _sayer(log)
    last = out / "run_default" / "rollouts" / f"step_{steps - 1}" / "train_rollouts.jsonl"
    if fault == "oom":
        say("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        return 1
    while not last.exists() or fault == "hang":  # the orchestrator's batches come first
        time.sleep(0.2)
    if fault == "no_checkpoint":
        say("RL trainer finished!")
        return 0
    lora = config["model"]["lora"]
    weights = out / "weights" / f"step_{steps}"
    adapters = weights / "lora_adapters"
    adapters.mkdir(parents=True, exist_ok=True)
    (adapters / "adapter_model.safetensors").write_bytes(_safetensors({
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (int(lora["rank"]), 8)}))
    (adapters / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": config["model"]["name"],
        "r": int(lora["rank"]), "lora_alpha": float(lora["alpha"]), "lora_dropout": 0.0, "bias": "none",
        "target_modules": ["q_proj"], "modules_to_save": None}))
    (weights / "config.json").write_text(json.dumps({"_name_or_path": config["model"]["name"]}))
    (weights / "model.safetensors").write_bytes(_safetensors({"lm_head.weight": (4, 8)}))
    (weights / "STABLE").write_text("")
    trainer_ckpt = out / "checkpoints" / f"step_{steps}" / "trainer"
    trainer_ckpt.mkdir(parents=True, exist_ok=True)
    (trainer_ckpt / ".metadata").write_bytes(b"")
    say("Writing final weight checkpoint\nRL trainer finished!")
    return 0


# -- prime-rl main -----------------------------------------------------------------------------------------------
MAIN_FLAGS = ("--inference.server.port", "--inference.backend-port", "--orchestrator.model.client.base-url",
              "--orchestrator.env-server-base-port")


def rl_main(argv: list[str], raw: dict, fault: str) -> int:
    from pydantic import ValidationError

    from aitrainsai_trainer_prime_rl.rltoml_v1 import RLConfig

    try:
        config = RLConfig.model_validate(raw)
    except ValidationError as exc:
        print(f"config error\n{exc}", file=sys.stderr)
        return 1
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--") and argv[i] != "--dry-run"}
    if set(flags) != set(MAIN_FLAGS):
        print(f"expected the flags {sorted(MAIN_FLAGS)}, got {sorted(flags)}", file=sys.stderr)
        return 1
    port = int(flags["--inference.server.port"])
    if flags["--orchestrator.model.client.base-url"] != f"http://localhost:{port}/v1":  # main's launcher checks it
        print("orchestrator.model.client.base_url port does not match inference.server.port", file=sys.stderr)
        return 1
    run = Path(config.output_dir) / str(config.run.name)
    source = config.orchestrator.train.source[0]
    orchestrator = {"output_dir": str(run), "max_steps": config.max_steps, "seq_len": config.seq_len,
                    **config.orchestrator.model_dump(mode="json", exclude_none=True),
                    "model": {"name": config.model.name, "client": {"base_url": f"http://localhost:{port}/v1"}}}
    trainer = {"output_dir": str(run), "max_steps": config.max_steps,
               **config.trainer.model_dump(mode="json", exclude_none=True)}
    trainer["model"] = {**trainer.get("model", {}), "name": config.model.name, "seq_len": config.seq_len}
    configs = run / "configs"
    (configs / "envs" / "train").mkdir(parents=True, exist_ok=True)
    (configs / "orchestrator.json").write_text(json.dumps(orchestrator))
    (configs / "trainer.json").write_text(json.dumps(trainer))
    (configs / "envs" / "train" / f"{source.name}.json").write_text(json.dumps({
        "env": source.env.model_dump(mode="json"),
        "serve": {"address": f"tcp://127.0.0.1:{flags['--orchestrator.env-server-base-port']}"}}))
    if config.inference is not None:
        inference = {**config.inference.model_dump(mode="json", exclude_none=True),
                     "server": {"port": port}, "backend_port": int(flags["--inference.backend-port"])}
        (configs / "inference.json").write_text(json.dumps(inference))
    if "--dry-run" in argv:
        print("Dry run complete. To start an RL run locally, remove --dry-run from your command.")
        return 0
    logs = run / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if _load_taskset(source.env.taskset.model_dump(mode="json"), _sayer(logs / "env-server.log")) is None:
        return 1
    (configs / "envs" / "train" / f"{source.name}.ready").write_text("")
    code = orchestrate_main(["@", str(configs / "orchestrator.json")], fault, log=logs / "orchestrator.log")
    if code == 0:
        code = train_main(["@", str(configs / "trainer.json")], fault, log=logs / "trainer.log")
    print("Training finished!" if code == 0 else "Error: a child process failed")
    return 0 if code == 0 else 1


def _main_verifiers(say) -> str:
    """Make ``verifiers.v1`` importable as main's env server has it: main's own verifiers (its submodule's version,
    :data:`~..pins.MAIN_V1`) where this Python has it; else verifiers 0.4.0 from the core's pinned folder (main's
    verifiers is not installed under the project's Python; its ``verifiers.v1`` API is the same for what the job
    package uses), first on the path. The version used."""
    from importlib import metadata

    from aitrainsai import verifiers_v1_path

    from aitrainsai_trainer_prime_rl.pins import MAIN_V1

    try:
        installed = metadata.version("verifiers")
    except metadata.PackageNotFoundError:
        installed = ""
    pinned = verifiers_v1_path()
    if installed != MAIN_V1.verifiers and pinned is not None and "verifiers" not in sys.modules:
        sys.path.insert(0, str(pinned))
        say(f"main's verifiers {MAIN_V1.verifiers} is not installed here (verifiers {installed or 'none'}): "
            f"loading with verifiers 0.4.0 from {pinned}")
        return "0.4.0"
    return installed


def _load_taskset(config: dict, say):
    """The job package's taskset, loaded as main's env server does: its module imported by id (``-`` to ``_``), its
    one ``vf.Taskset`` subclass built from the source's taskset config (``vf.load_taskset``) and its tasks iterated;
    None (said) where that fails."""
    import importlib

    _main_verifiers(say)
    import verifiers.v1 as vf

    taskset_id = config["id"]
    try:
        module = importlib.import_module(taskset_id.replace("-", "_").lower())
    except ImportError as exc:
        say(f"taskset {taskset_id!r} not found: {exc}")
        return None
    found = [c for c in (getattr(module, n, None) for n in getattr(module, "__all__", ()))
             if isinstance(c, type) and issubclass(c, vf.Taskset)]
    if len(found) != 1:
        say(f"taskset module {module.__name__} exports {len(found)} Taskset subclasses")
        return None
    taskset = vf.load_taskset(vf.taskset_config_type(taskset_id).model_validate(config))
    tasks = list(taskset)
    say(f"loaded taskset {taskset_id}: {found[0].__name__}, {len(tasks)} tasks")
    return taskset


def env_server(argv: list[str], fault: str) -> int:
    path = _config(argv)
    config = json.loads(path.read_text())
    if _load_taskset(config["env"]["taskset"], _sayer(None)) is None:
        return 1
    path.with_suffix(".ready").write_text("")  # what the orchestrator waits for (main's polls the address)
    print(f"env server stand-in at {config['serve']['address']}: serving nothing until killed", flush=True)
    while True:
        time.sleep(60)


def orchestrate_main(argv: list[str], fault: str, log: Path | None = None) -> int:
    config = json.loads(_config(argv).read_text())
    run = Path(config["output_dir"])
    say = _sayer(log)
    deadline = time.monotonic() + 120
    for server in (run / "configs" / "envs" / "train").glob("*.json"):  # main's connects to its env servers first
        while not server.with_suffix(".ready").exists():
            if time.monotonic() > deadline:
                say(f"RuntimeError: env server {server.stem} did not come up")
                return 1
            time.sleep(0.1)
    if fault == "daemon":
        import subprocess

        daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
        (run / "daemon.pid").parent.mkdir(parents=True, exist_ok=True)
        (run / "daemon.pid").write_text(str(daemon.pid))
    batch, group = int(config["batch_size"]), int(config["group_size"])
    for step in range(1, int(config["max_steps"]) + 1):  # main counts steps from 1
        if fault == "crash" and step == 2:
            say("Traceback (most recent call last):\nRuntimeError: env server died")
            return 1
        reward = sum(((step + i) % group) / group for i in range(batch)) / batch
        with open(run / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps({"step": step, "time": time.time(), "train/agg/all/agent/reward/mean": reward,
                                     "train/agg/all/agent/num_turns/mean": 1.0}) + "\n")
        (run / "rollouts" / f"step_{step}").mkdir(parents=True, exist_ok=True)
        say(f"Step {step} | Reward {reward:.4f}")
    say("Orchestrator finished")
    return 0


def train_main(argv: list[str], fault: str, log: Path | None = None) -> int:
    config = json.loads(_config(argv).read_text())
    run = Path(config["output_dir"])
    steps = int(config["max_steps"])
    say = _sayer(log)
    if fault == "oom":
        say("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        return 1
    while not (run / "rollouts" / f"step_{steps}").exists() or fault == "hang":
        time.sleep(0.2)
    if fault == "no_checkpoint":
        say("RL trainer finished!")
        return 0
    lora = config["model"]["lora"]
    for step in range(max(1, steps - 1), steps + 1):  # filesystem broadcast keeps the newest two
        folder = run / "broadcasts" / f"step_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_model.safetensors").write_bytes(_safetensors({
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (int(lora["rank"]), 8)}))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": config["model"]["name"],
            "r": int(lora["rank"]), "lora_alpha": float(lora["alpha"]), "lora_dropout": 0.0, "bias": "none",
            "target_modules": ["q_proj"], "modules_to_save": None}))
        (folder / "STABLE").write_text("")
    with open(run / "metrics.jsonl", "a") as handle:  # the trainer's own lines share the file
        handle.write(json.dumps({"step": steps, "time": time.time(), "loss/mean": 0.1}) + "\n")
    say("RL trainer finished!")
    return 0


def inference(argv: list[str], fault: str) -> int:
    _config(argv)
    print("vLLM stand-in: serving nothing until killed", flush=True)
    while True:
        time.sleep(60)


def _safetensors(tensors: dict[str, tuple[int, int]]) -> bytes:
    """A valid safetensors file of zero-filled float32 tensors."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = shape[0] * shape[1] * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(offset)


def _sayer(log: Path | None):
    def say(text: str) -> None:
        if log is not None:
            with open(log, "a") as handle:
                handle.write(text + "\n")
        print(text, flush=True)
    return say


def main(argv: list[str]) -> int:
    fault = ""
    if argv[:1] == ["--fault"]:
        fault, argv = argv[1], argv[2:]
    entry, rest = argv[0], argv[1:]
    if entry == "rl":
        return rl(rest, fault)
    if entry == "orchestrator":
        return (orchestrate_main if _config(rest).suffix == ".json" else orchestrate)(rest, fault)
    if entry == "env-server":
        return env_server(rest, fault)
    if entry == "inference":
        return inference(rest, fault)
    if entry == "torchrun" and "prime_rl.trainer.rl.train" in rest:
        return (train_main if _config(rest).suffix == ".json" else train)(rest, fault)
    print(f"fake prime-rl: unknown entry {entry!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
