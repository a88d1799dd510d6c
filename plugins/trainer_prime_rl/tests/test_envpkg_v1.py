"""A verifiers-v1 job as the taskset package prime-rl main loads (``envpkg_v1.py``): it builds, installs (``pip
--target``) and loads in a fresh Python, and its rows, tool results and rewards are what the job's own taskset gives in
the core's sandbox, while the job's code never runs in the loading process.

The loading process stands in for main's env server and a rollout's tool server: it has verifiers 0.4.0 from the
core's pinned folder (``make install``'s ``.venv/pinned/verifiers-v1``; main's own verifiers, 0.3.1.dev62, is not
installed under the project's Python 3.11), the core's sources and this environment's third-party packages (read
through a path file that does not run their ``.pth`` files, so no family distribution is importable there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aitrainsai
import pytest
from aitrainsai_trainer_prime_rl import envpkg_v1
from aitrainsai_trainer_prime_rl.inner import PrimeRlTrainer
from aitrainsai_trainer_prime_rl.pins import MAIN_V1
from aitrainsai_trainer_prime_rl.testing import frozen_job, installed_family

PINNED = Path(sys.prefix) / "pinned" / "verifiers-v1"
FAMILIES = ["calc_chain", "multi_hop", "string_pipeline", "ledger", "dispatch", "triage"]
MARKER = "AITRAINSAI_TEST_V1_AGENT_CODE"
ROWS = 4
LIMITS = {"memory_mb": 2048, "wall_s": 600.0}
WRONG = "I cannot tell."

LOAD = r"""
import asyncio, json, os, subprocess, sys, threading, time, uuid
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import verifiers.v1 as vf

try:  # mcp 2 (verifiers 0.4.0)
    from mcp.server.mcpserver import MCPServer
except ImportError:  # mcp 1 (prime-rl main's verifiers)
    from mcp.server.fastmcp import FastMCP as MCPServer

REQUESTS = json.loads(sys.argv[1])


def trace_of(task, completion):
    messages = [vf.SystemMessage(content=task.data.system_prompt), vf.UserMessage(content=task.data.prompt)]
    for m in completion:
        if m["role"] == "assistant":
            calls = [vf.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                     for c in m.get("tool_calls") or []]
            messages.append(vf.AssistantMessage(content=m.get("content") or "", tool_calls=calls or None))
        else:
            messages.append(vf.ToolMessage(tool_call_id=m["tool_call_id"], content=m["content"]))
    nodes = [vf.MessageNode(parent=i - 1 if i else None, message=m, sampled=isinstance(m, vf.AssistantMessage))
             for i, m in enumerate(messages)]
    return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes)


def served(server, task, calls):
    # the rollout's tool server as verifiers starts it: `python -m <module>`, its config in VF_CONFIG, the task
    # fetched from the state channel's /task, the port reported in a file; then MCP over HTTP (JSON-RPC)
    body = json.dumps({"cls": f"{type(task.data).__module__}:{type(task.data).__qualname__}",
                       "task": task.data.model_dump_json()}).encode()

    class Channel(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/task" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body if self.path == "/task" else b"{}")

        def log_message(self, *args):
            return  # no request log on stderr

    channel = ThreadingHTTPServer(("127.0.0.1", 0), Channel)
    threading.Thread(target=channel.serve_forever, daemon=True).start()
    port_file = os.path.join(os.getcwd(), f"port-{uuid.uuid4().hex}")
    env = {**os.environ, "VF_CONFIG": server.config.model_dump_json(), "VF_STATE_SECRET": "secret",
           "VF_STATE_URL": f"http://127.0.0.1:{channel.server_port}/state", "MCP_PORT_FILE": port_file}
    process = subprocess.Popen([sys.executable, "-m", type(server).__module__], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            assert process.poll() is None and time.monotonic() < deadline, "the tool server did not start"
            time.sleep(0.1)
        url = f"http://127.0.0.1:{int(open(port_file).read())}/mcp"
        headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-06-18"}

        def rpc(method, params):
            while True:
                try:
                    answer = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params},
                                        headers=headers, timeout=120)
                    return answer.json()["result"]
                except httpx.TransportError:  # it serves once its setup (its own sandbox) is done
                    assert process.poll() is None and time.monotonic() < deadline, "the tool server died"
                    time.sleep(0.2)

        tools = {t["name"]: t["inputSchema"] for t in rpc("tools/list", {})["tools"]}
        results = [rpc("tools/call", {"name": name, "arguments": json.loads(arguments or "{}")})["content"][0]["text"]
                   for name, arguments in calls]
        return {"tools": tools, "results": results}
    finally:
        process.kill()
        process.wait()
        channel.shutdown()


async def play(env_id, request):
    config = vf.taskset_config_type(env_id).model_validate({"id": env_id, **request["limits"]})
    taskset = vf.load_taskset(config)
    tasks = list(taskset)
    task = tasks[0]
    servers = type(task).toolsets(task.config) + type(taskset).toolsets(taskset.config)
    server = servers[0]
    subprocess_server = (asyncio.to_thread(served, server, task, request["calls"]) if request["serve"] else None)
    await server.setup()
    await server.setup_task(task.data)
    mcp = MCPServer("job")
    server.register(mcp)  # what the rollout's tool server registers, and what its model is shown
    listed = await mcp.list_tools()
    results = []
    for name, arguments in request["calls"]:
        answer = await mcp.call_tool(name, json.loads(arguments or "{}"))
        content = answer.content if hasattr(answer, "content") else answer[0]  # mcp 1 answers (content, structured)
        results.append(content[0].text)
    rewards = []
    for completion in request["completions"]:
        trace = trace_of(task, completion)
        await task.score(trace)
        rewards.append([trace.reward, trace.rewards["job_reward"].score])
    return {"tasks": len(tasks), "prompt": task.data.prompt, "system": task.data.system_prompt,
            "max_turns": task.data.max_turns, "servers": [type(s).__module__ for s in servers],
            "tools": {t.name: getattr(t, "input_schema", None) or t.inputSchema for t in listed},
            "results": results, "rewards": rewards,
            "stops": [fn.__name__ for fn in task.hooks("stop")],
            "limits": [task.config.tools.memory_mb, task.config.tools.wall_s],
            "served": await subprocess_server if subprocess_server is not None else None}


with ThreadPoolExecutor(len(REQUESTS)) as pool:  # the families side by side (each waits on its sandbox)
    futures = {env_id: pool.submit(asyncio.run, play(env_id, request)) for env_id, request in REQUESTS.items()}
    out = {env_id: future.result() for env_id, future in futures.items()}
from importlib import metadata
out["_verifiers"] = metadata.version("verifiers")
out["_agent_code_ran"] = os.environ.get(sys.argv[2]) is not None
out["_job_modules"] = sorted(m for m in sys.modules if m.split(".")[0] in ("taskset", "rubric", "dataset")
                             or m.startswith("aitrainsai_family"))
print(json.dumps(out))
"""


def v1_job(folder: Path, name: str) -> tuple:
    """A frozen v1 job of family ``name`` whose taskset leaves a trace (an environment variable) where it runs."""
    spec, job = frozen_job(folder, name, rows=ROWS, job_format="verifiers-v1")
    taskset = job / "taskset.py"
    taskset.write_text(f"import os\nos.environ[{MARKER!r}] = 'ran here'\n" + taskset.read_text())
    return spec, job


@pytest.fixture(scope="module", params=["0.4.0", "main"])
def fresh_python(request, tmp_path_factory):
    """The loading Python and the verifiers version it has. ``0.4.0``: a virtual environment with no site packages
    of its own but verifiers 0.4.0, the core's sources and this one's third-party packages, read through a path
    file that does not run their .pth files (the workspace's editable family distributions are not importable
    there). ``main``: ``$PRIME_RL_V1_LOADER``, a Python 3.12 with prime-rl main's own verifiers (0.3.1.dev62), the
    core and its dependencies, where one is named (skipped otherwise); there the sandbox serves the job with that
    verifiers too, as on a worker."""
    if request.param == "main":
        python = os.environ.get("PRIME_RL_V1_LOADER", "")
        if not python:
            pytest.skip("PRIME_RL_V1_LOADER names no Python with prime-rl main's verifiers and the core")
        return Path(python), MAIN_V1.verifiers
    if not (PINNED / "verifiers" / "v1").is_dir():
        pytest.skip(f"needs verifiers 0.4.0 in {PINNED} (make install puts it there)")
    root = tmp_path_factory.mktemp("fresh")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    core = Path(aitrainsai.__file__).resolve().parent.parent
    (Path(site) / "outer.pth").write_text(f"{PINNED}\n{core}\n{sysconfig.get_paths()['purelib']}\n")
    return python, "0.4.0"


def test_the_package_holds_the_job_and_the_family_s_public_modules_only(tmp_path):
    family = installed_family("calc_chain")
    _, job = frozen_job(tmp_path / "job", "calc_chain", rows=ROWS, job_format="verifiers-v1")
    env_id = envpkg_v1.build_package(job, family, "cd" * 20, tmp_path / "pkg", core_version="1.2.3")
    module = envpkg_v1.module_name(env_id)
    assert env_id == "aitrainsai-job-cdcdcdcdcdcd" and module == "aitrainsai_job_cdcdcdcdcdcd"
    files = sorted(p.relative_to(tmp_path / "pkg").as_posix() for p in (tmp_path / "pkg").rglob("*") if p.is_file())
    job_files = sorted(p.name for p in job.iterdir())
    assert files == sorted(["pyproject.toml", f"{module}/__init__.py", f"{module}/tools.py",
                            f"{module}/job/aitrainsai_family_calc_chain/__init__.py",
                            f"{module}/job/aitrainsai_family_calc_chain/world.py",
                            *(f"{module}/job/{name}" for name in job_files)])
    project = tomllib.loads((tmp_path / "pkg" / "pyproject.toml").read_text())
    assert project["project"]["name"] == env_id and project["project"]["dependencies"] == ["aitrainsai==1.2.3"]
    assert project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == [module]
    for name in ("__init__.py", "tools.py"):  # the package's own code compiles, and never imports the job's
        source = (tmp_path / "pkg" / module / name).read_text()
        compile(source, name, "exec")
        assert "import taskset" not in source and "import rubric" not in source
    assert '__all__ = ["JobTaskset"]' in (tmp_path / "pkg" / module / "__init__.py").read_text()
    (job / "taskset.py").unlink()
    with pytest.raises(ValueError, match="no regular file taskset.py"):
        envpkg_v1.build_package(job, family, "cd" * 20, tmp_path / "pkg", core_version="1.2.3")


def test_the_v1_payload_carries_the_taskset_package_and_names_it_in_rl_toml(tmp_path):
    from aitrainsai_trainer_prime_rl.jobspec import TrainSpec

    trainer = PrimeRlTrainer(PrimeRlTrainer.Config(sandbox_memory_mb=2048))
    spec, job = frozen_job(tmp_path / "episode" / "job", "calc_chain", trainer, job_format="verifiers-v1")
    payload = trainer.payload(job, spec, "job-1", installed_family("calc_chain"))
    train = TrainSpec.model_validate_json((payload.workdir / "job.json").read_text())
    assert train.stack == MAIN_V1 and train.env_id.startswith("aitrainsai-job-")
    package = payload.workdir / train.package / envpkg_v1.module_name(train.env_id)
    assert (package / "tools.py").is_file() and (package / "job" / "taskset.py").is_file()
    assert not (package / "job" / "environment.py").exists()
    source = tomllib.loads((payload.workdir / train.rl_toml).read_text())["orchestrator"]["train"]["source"][0]
    assert source["env"]["taskset"] == {"id": train.env_id, "memory_mb": 2048,
                                        "wall_s": float(spec.constraints.max_wall_seconds)}


@pytest.mark.slow  # a sandbox per family on each side (verifiers' import in each: about 5 s)
def test_every_family_s_taskset_is_served_from_the_sandbox(fresh_python, tmp_path):
    python, verifiers = fresh_python
    from aitrainsai import Limits, RemoteEnvironment

    jobs, packages, requests = {}, [], {}
    for number, name in enumerate(FAMILIES):
        family = installed_family(name)
        _, job = v1_job(tmp_path / "jobs" / name, name)
        item = family.generate(7, family.default_level, ROWS)[0]  # the frozen dataset's first row
        start = family.initial_messages(item)
        reference = family.reference_transcript(item)
        completion = reference[len(start):]
        calls = [(c["function"]["name"], c["function"]["arguments"])
                 for m in completion if m["role"] == "assistant" for c in m.get("tool_calls") or []]
        wrong = [*completion[:-1], {"role": "assistant", "content": WRONG}]
        env_id = envpkg_v1.build_package(job, family, f"{number:02d}" + "ef" * 20, tmp_path / "pkgs" / name,
                                         core_version="0.1.0")
        packages.append(tmp_path / "pkgs" / name)
        jobs[env_id] = {"family": family, "job": job, "start": start, "completion": completion, "calls": calls}
        requests[env_id] = {"limits": LIMITS, "calls": calls, "completions": [completion, wrong],
                            "serve": number == 0}  # one family's tools also through a real tool server process
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
                    "--target", str(target), *map(str, packages)], check=True, capture_output=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AITRAINSAI_VERIFIERS_V1")}
    loader = subprocess.Popen([python, "-c", LOAD, json.dumps(requests), MARKER], cwd=tmp_path,
                              env={**env, "PYTHONPATH": str(target)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    def ask(env_id: str) -> dict:  # the job's own taskset in the core's sandbox, asked directly
        case = jobs[env_id]
        with RemoteEnvironment(case["job"], limits=limits) as remote:
            info = remote.load()
            rows = remote.rows(info.rows)
            rewards = []
            for answer in requests[env_id]["completions"]:
                state = remote.start(0)
                results = [remote.tool(state, name, arguments) for name, arguments in case["calls"]]
                rewards.append(remote.score(state, answer).reward)
        return {"info": info, "row": rows[0].messages(), "results": results, "rewards": rewards}

    limits = Limits(wall_s=LIMITS["wall_s"], cpu_s=int(LIMITS["wall_s"]), memory_mb=LIMITS["memory_mb"], tmp_mb=256,
                    out_mb=16)  # what the package asks for
    with ThreadPoolExecutor(len(jobs)) as pool:  # meanwhile, side by side
        expected = dict(zip(jobs, pool.map(ask, jobs)))
    out, err = loader.communicate(timeout=600)
    assert loader.returncode == 0, err[-4000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got.pop("_verifiers") == verifiers
    assert got.pop("_agent_code_ran") is False, "the job's code ran in the loading process"
    assert got.pop("_job_modules") == []  # nor was any of its modules (or a family's) imported there
    for env_id, case in jobs.items():
        family, mine, theirs = case["family"], got[env_id], expected[env_id]
        module = envpkg_v1.module_name(env_id)
        assert mine["tasks"] == theirs["info"].rows == ROWS
        assert [{"role": "system", "content": mine["system"]}, {"role": "user", "content": mine["prompt"]}] == \
            theirs["row"] == case["start"]
        assert mine["max_turns"] == theirs["info"].max_turns == family.turn_limit and mine["stops"] == ["out_of_turns"]
        assert mine["servers"] == [f"{module}.tools"]  # verifiers starts it as `python -m <module>.tools`
        assert mine["limits"] == [LIMITS["memory_mb"], LIMITS["wall_s"]]  # the tool server's sandbox's limits
        schemas = {s.function["name"]: s.function.get("parameters") for s in theirs["info"].tool_schemas}
        assert mine["tools"] == schemas and sorted(schemas) == sorted(t["function"]["name"]
                                                                      for t in family.tool_schemas())
        reference = [m["content"] for m in case["completion"] if m["role"] == "tool"]
        assert mine["results"] == theirs["results"] == reference, env_id  # the family's own tools agree too
        assert [r for r, _ in mine["rewards"]] == [s for _, s in mine["rewards"]] == theirs["rewards"], env_id
        assert theirs["rewards"][0] > theirs["rewards"][1], env_id  # the right answer pays, the wrong one less
        if mine["served"] is not None:  # the real tool server shows and answers the same
            assert mine["served"] == {"tools": mine["tools"], "results": mine["results"]}
    assert sum(mine["served"] is not None for mine in got.values()) == 1


@pytest.mark.slow  # a whole training payload in processes; the stand-in's env server starts the job's sandbox
def test_a_v1_job_trains_on_main_s_layout_with_its_taskset_served_from_the_sandbox(tmp_path):
    import asyncio

    from aitrainsai import LocalBackend
    from aitrainsai_trainer_prime_rl.testing import stand_in_trainer

    trainer = stand_in_trainer()
    spec, job = v1_job(tmp_path / "ep" / "probe-1" / "job", "calc_chain")
    payload = trainer.payload(job, spec, "ep-job", installed_family("calc_chain"))

    async def run():
        backend = LocalBackend(LocalBackend.Config(kill_grace_s=1), workdir=tmp_path / "backend")
        try:
            return await backend.run(payload)
        finally:
            await backend.close()

    outcome = asyncio.run(run())
    assert outcome.status == "done", (outcome.why, outcome.log_tail)
    trained = trainer.result(outcome)
    assert [s["step"] for s in trained.metrics["steps"]] == list(range(1, trainer.job_config(job).steps + 1))
    log = (payload.workdir / "outputs" / "job" / "logs" / "aitrainsai" / "env-server.log").read_text()
    assert "loading with verifiers 0.4.0" in log  # main's verifiers is not installed under this Python
    assert f"JobTaskset, {ROWS} tasks" in log and "aitrainsai-job-" in log  # rows from the sandbox
    assert MARKER not in os.environ
