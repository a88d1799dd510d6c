"""Jobs in the verifiers v1 format (issue 29): a job whose package exports one ``vf.Taskset`` (verifiers 0.4.0) is
probed with the same trust rules as a classic one — built and asked for rows, tools and rewards inside the sandbox,
judged on the trusted side."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from aitrainsai.families import Constraints, ToolSession
from aitrainsai.isolation import sandbox_works
from aitrainsai.jobs.format import job_format, verifiers_v1_path
from aitrainsai.jobs.job import job_template
from aitrainsai.jobs.probe import probe_job
from aitrainsai.jobs.remote_env import RemoteEnvironment
from aitrainsai.run.ledger import Ledger
from aitrainsai.run.record import EpisodeData
from aitrainsai.wheels import build_local_wheels
from episode_helpers import GivenNumbersTrainer

WHEELS = Path(sys.prefix) / "pinned" / "wheels"  # make install: verifiers 0.4.0, the core's and vf-eval's dependencies
FAMILIES = ("calc_chain", "dispatch", "ledger", "multi_hop", "string_pipeline", "triage")

pytestmark = [pytest.mark.skipif(not sandbox_works(), reason="this machine cannot build the sandbox"),
              pytest.mark.skipif(verifiers_v1_path() is None, reason="needs the v1 runtime (make install)")]


def write_job(folder, plugins, name="calc_chain", **overrides):
    family = plugins.task_families.get(name)()
    trainer = GivenNumbersTrainer()
    spec = family.task_spec(1, trainer.constraints(Constraints()))
    files = {**job_template(spec, trainer.config_template(spec), "verifiers-v1"), **overrides}
    folder.mkdir(parents=True, exist_ok=True)
    for file, text in files.items():
        if text is not None:
            (folder / file).write_text(text)
    return family, trainer, spec


def test_the_format_is_read_from_the_jobs_shape():
    assert job_format(["taskset.py", "rubric.py", "dataset.py", "trainer.toml"]) == "verifiers-v1"
    assert job_format(["environment.py", "rubric.py", "dataset.py", "trainer.toml"]) == "verifiers"


@pytest.mark.parametrize("name", FAMILIES)
def test_every_familys_v1_template_is_accepted_by_the_probe(tmp_path, plugins, name):
    if name not in plugins.task_families:
        pytest.skip(f"needs the {name} family")
    family, trainer, spec = write_job(tmp_path / "ws", plugins, name)
    report = probe_job(tmp_path / "ws", tmp_path / "probe", spec, family, trainer, hide=[], wall_s=90)
    assert report.ok, "\n".join(map(str, report.problems))
    assert sorted(report.details["tool_names"]) == sorted(t["function"]["name"] for t in spec.eval_interface.tools)
    assert report.details["reward_funcs"] == [{"name": "correct_answer", "weight": 1.0}]
    assert sorted(set(report.details["rubric_scores"])) == [0.0, 1.0]  # right answers 1, wrong and empty 0


def test_a_v1_jobs_rows_tools_and_rewards_come_from_its_taskset_in_the_sandbox(tmp_path, plugins):
    family, trainer, spec = write_job(tmp_path / "job", plugins)
    items = family.generate(5, 1, 3)
    (tmp_path / "job" / "dataset.jsonl").write_text("".join(
        json.dumps({"question": i.question, "answer": i.answer, "world": i.world}) + "\n" for i in items))
    with RemoteEnvironment(tmp_path / "job") as env:
        info = env.load()
        assert info.system_prompt == spec.eval_interface.system_prompt and info.rows == 3
        assert info.max_turns == spec.eval_interface.turn_limit
        # the eval's tools in the eval's order (verifiers would sort them by name: another prompt to train on)
        assert [s.function["name"] for s in info.tool_schemas] == [t["function"]["name"]
                                                                   for t in spec.eval_interface.tools]
        rows = env.rows(3)
        assert [r.answer for r in rows] == [i.answer for i in items]
        assert rows[0].messages()[-1] == {"role": "user", "content": items[0].question}
        state = env.start(row=0)
        tool = spec.eval_interface.tools[0]["function"]["name"]
        expected = ToolSession(family, items[0]).call(tool, a=7, b=5)  # what the eval's own tools answer
        assert env.tool(state, tool, json.dumps({"a": 7, "b": 5})) == expected
        assert env.score(state, [{"role": "assistant", "content": f"<answer>{items[0].answer}</answer>"}]).reward == 1
        state = env.start(row=1)
        assert env.score(state, [{"role": "assistant", "content": "<answer>no idea</answer>"}]).reward == 0


@pytest.mark.parametrize(("files", "where", "says"), [
    ({"rubric.py": "import verifiers.v1 as vf\n\nclass Rubric:\n    def broken(:\n"}, "rubric.py:4", "SyntaxError"),
    ({"taskset.py": "import verifiers.v1 as vf\n__all__ = []\n"}, "taskset.py", "exactly one vf.Taskset"),
    ({"rubric.py": None}, "rubric.py: missing", "write it"),  # a file of the v1 job's own set
])
def test_a_broken_v1_job_is_refused_with_the_file_and_line(tmp_path, plugins, files, where, says):
    family, trainer, spec = write_job(tmp_path / "ws", plugins, **files)  # None: the file is not written
    report = probe_job(tmp_path / "ws", tmp_path / "probe", spec, family, trainer, hide=[], wall_s=90)
    text = "\n".join(map(str, report.problems))
    assert not report.ok and where in text and says in text, text


@pytest.mark.slow  # a whole run through worker processes
def test_a_run_in_the_v1_format_trains_and_reports(tmp_path):
    """``aitrainsai run`` with ``families.job_format=verifiers-v1`` on the quickstart's design, at a tiny size: the
    agent (the recipe policy) is shown the v1 template and role, writes v1 jobs, the local trainer trains its tiny
    base on them through the sandboxed taskset, and the run reports as a classic one does."""
    pytest.importorskip("aitrainsai_trainer_local")
    pytest.importorskip("aitrainsai_outer_recipe")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITRAINSAI_")}
    env["AITRAINSAI_LOCAL_BASE"] = "tiny-llama"  # the mechanics, not learning
    settings = ["families.job_format='verifiers-v1'", "families.train=['calc_chain']", "families.held_out=[]",
                "loop.steps=1", "loop.group_size=2", "loop.groups_per_step=1", "loop.final_eval=false",
                "loop.max_group_factor=1",  # one group, trained on or (equal rewards: no signal) skipped
                "inner_trainer.local.eval_size=2", "inner_trainer.local.eval_max_new_tokens=4",
                "outer_trainer.recipe.choices={steps=[1], prompts_per_step=[1], group_size=[2], max_new_tokens=[4], "
                "max_turns=[1], dataset_size=[32], rubric=['shaped', 'exact+format'], level_mix=['task']}"]
    done = subprocess.run([sys.executable, "-m", "aitrainsai.cli", "run", "--runs-dir", str(tmp_path), "--preset",
                           "quickstart", *(a for s in settings for a in ("-s", s))], capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (name,) = [p.name for p in tmp_path.iterdir() if p.is_dir()]
    run = Ledger(tmp_path).run(name)
    assert run.info().status == "finished"
    episodes = run.episodes()
    assert len(episodes) == 2 and {e.status for e in episodes} == {"done"}, [e.status for e in episodes]
    for episode in episodes:
        assert episode.data.frozen_job is not None and episode.data.train is not None
        frozen = Path(episode.data.frozen_job)
        assert (frozen / "taskset.py").is_file() and not (frozen / "environment.py").exists()
        assert "@vf.reward" in (frozen / "rubric.py").read_text()
        assert episode.data.train.base_model == "tiny-llama"
    prompt = run.agent_prompts()["calc_chain"]
    assert "taskset.py" in prompt.messages[0]["content"] and "environment.py" not in prompt.messages[0]["content"]
    assert run.info().config["families"]["job_format"] == "verifiers-v1"
    assert "| step | mean reward |" in (run.dir / "report" / "report.md").read_text()


class StreamingChat(BaseHTTPRequestHandler):
    """A chat-completions server on loopback that streams as verifiers' client asks (SSE chunks): a scripted model
    that calls ``add(a=2, b=3)`` once, then answers each question with the answer ``answers`` holds for it."""

    answers: dict[str, str] = {}
    requests: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StreamingChat.requests.append(body)
        messages = body["messages"]
        question = next(m["content"] for m in messages if m["role"] == "user")
        question = question if isinstance(question, str) else "".join(p.get("text", "") for p in question)
        if not any(m["role"] == "tool" for m in messages):
            delta = {"role": "assistant", "content": None, "tool_calls": [{"index": 0, "id": "call_1", "type":
                     "function", "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}]}
            finish = "tool_calls"
        else:
            delta, finish = {"role": "assistant", "content": f"<answer>{self.answers[question]}</answer>"}, "stop"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in ({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                      {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}):
            event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                     **chunk}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        """No request log on stderr."""


def simple_index(wheels: Path, into: Path) -> str:
    """A PEP 503 index of a folder of wheels, as a file:// URL (what uv reads with no network)."""
    names: dict[str, list[Path]] = {}
    for wheel in wheels.glob("*.whl"):
        names.setdefault(re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower(), []).append(wheel)
    for name, files in names.items():
        (into / name).mkdir(parents=True)
        (into / name / "index.html").write_text("".join(f'<a href="{f.resolve().as_uri()}">{f.name}</a>\n'
                                                        for f in files))
    return into.resolve().as_uri()


@pytest.mark.slow  # a fresh virtual environment and a vf-eval run
@pytest.mark.skipif(not any(WHEELS.glob("verifiers-0.4.0-*.whl")), reason="needs the wheelhouse (make install)")
def test_an_exported_v1_job_installs_in_a_fresh_venv_and_evaluates_with_vf_eval(tmp_path, plugins):
    """``aitrainsai export`` of a run's accepted v1 job: a package that installs, with verifiers 0.4.0, the core and
    the family's distribution, into a fresh virtual environment (no index: make install's wheelhouse), where
    verifiers' own ``vf-eval`` evaluates it against a loopback model — the job's tools called in the rollout's tool
    server, its rubric scoring each rollout. A classic job is refused in one line."""
    family, trainer, spec = write_job(tmp_path / "ws", plugins)
    run = Ledger(tmp_path / "runs").create_run({}, [], name="exported")
    report = probe_job(tmp_path / "ws", run.dir / "episodes" / "g0000-e0" / "probe-1", spec, family, trainer, hide=[],
                       wall_s=90)  # where an episode's probe leaves it: export reads no other folder
    assert report.ok, report.problems
    run.upsert_episode("g0000-e0", status="done", family="calc_chain", level=1,
                       data=EpisodeData(frozen_job=str(report.job_dir), frozen_digest=report.digest))

    def export(*args):
        return subprocess.run([sys.executable, "-m", "aitrainsai.cli", "export", "--runs-dir", str(tmp_path / "runs"),
                               "exported", *args], capture_output=True, text=True)

    done = export("g0000-e0", "--out", str(tmp_path / "pkg"))
    assert done.returncode == 0, done.stderr
    built = tmp_path / "wheels"
    build_local_wheels(["aitrainsai", "aitrainsai-family-calc-chain"], built)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                    str(built), str(tmp_path / "pkg")], check=True, capture_output=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", "--no-index",
                    "--find-links", str(WHEELS), "--find-links", str(built), "aitrainsai-calc-chain-g0000-e0"],
                   check=True, capture_output=True)

    rows = [json.loads(line) for line in (report.job_dir / "dataset.jsonl").read_text().splitlines()][:2]
    StreamingChat.answers = {rows[0]["question"]: rows[0]["answer"], rows[1]["question"]: "no idea"}
    StreamingChat.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StreamingChat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uv = Path(shutil.which("uv", path=str(Path(sys.executable).parent)) or "uv")  # the null harness runs a uv script
    env = {"PATH": os.pathsep.join([str(venv / "bin"), str(uv.parent), "/usr/bin", "/bin"]), "HOME": str(tmp_path),
           "UV_DEFAULT_INDEX": simple_index(WHEELS, tmp_path / "simple"), "UV_PYTHON_DOWNLOADS": "never",
           "HF_HUB_OFFLINE": "1", "FAKE_KEY": "sk-loopback"}
    try:
        evaluated = subprocess.run(
            [str(venv / "bin" / "vf-eval"), "aitrainsai-calc-chain-g0000-e0", "--env.agent.harness.id", "null",
             "--env.agent.runtime.type", "subprocess", "-m", "loopback", "--client.base-url",
             f"http://127.0.0.1:{server.server_port}/v1", "--client.api-key-var", "FAKE_KEY", "-n", "2", "-r", "1",
             "--no-push", "-o", str(tmp_path / "eval"), "--run.name", "e"],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    finally:
        server.shutdown()
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    episodes = [json.loads(line) for line in (tmp_path / "eval" / "e" / "traces.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 and all(e["ok"] for e in episodes), [e.get("errors") for e in episodes]
    rewards = {}
    for episode in episodes:
        (trace,) = episode["traces"]
        tool_results = [n["message"]["content"] for n in trace["nodes"] if n["message"]["role"] == "tool"]
        assert tool_results == ["5"], trace["nodes"]  # the job's add tool ran in the rollout's tool server
        rewards[episode["task"]["data"]["answer"]] = {k: r["score"] for k, r in trace["rewards"].items()}
    assert rewards == {rows[0]["answer"]: {"correct_answer": 1.0}, rows[1]["answer"]: {"correct_answer": 0.0}}
    assert {t["function"]["name"] for t in StreamingChat.requests[0]["tools"]} == {
        t["function"]["name"] for t in spec.eval_interface.tools}  # the eval's own tool names reach the model

    classic = tmp_path / "classic"
    classic.mkdir()
    for file, text in job_template(spec, trainer.config_template(spec)).items():
        (classic / file).write_text(text)
    old = probe_job(classic, run.dir / "episodes" / "g0000-e1" / "probe-1", spec, family, trainer, hide=[], wall_s=90)
    run.upsert_episode("g0000-e1", status="done", family="calc_chain", level=1,
                       data=EpisodeData(frozen_job=str(old.job_dir), frozen_digest=old.digest))
    refused = export("g0000-e1")
    assert refused.returncode == 1 and "only a verifiers-v1 job" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
