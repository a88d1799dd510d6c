"""The nested loop on a real local Ray cluster.

With the local trainer: `aitrainsai run`, the default command plus the backend switch, each job a Ray job that really
trains the local trainer's tiny base (SmolLM2-135M's tokenizer and architecture, two narrow layers) on CPU, on an
existing cluster. The orchestrator is SIGKILLed while a job trains
on the cluster; `aitrainsai run --resume` reattaches to that Ray job, sends no job to Ray twice (one the killed
orchestrator still held in its queue is submitted anew), and ends the run with its report.

With the given-numbers trainer (real payloads, no model) on the head the backend starts itself: SIGTERM and SIGINT
mid-job stop that head with the run (nothing of it left running), SIGKILL leaves it to its keeper, which stops it
after its grace unless a resumed run adopted it first; each time the resumed run finishes, no job that had finished
runs again, and the jobs a stop cut short come back lost and run again.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aitrainsai.run.ledger import Ledger, LedgerError
from episode_helpers import orchestrator_script, signal_when


pytest.importorskip("aitrainsai_backend_ray")
pytest.importorskip("aitrainsai_trainer_local")

# jobs the recipe policy writes at a size two CPU cores train in seconds: one step, one prompt, two rollouts
TINY = ["loop.steps=1", "loop.group_size=2", "loop.groups_per_step=1", "loop.final_eval=false",
        "families.train=['calc_chain']", "families.held_out=[]", "inner_trainer.local.eval_size=2",
        "inner_trainer.local.eval_max_new_tokens=4",
        # the two sizes do different work (train speed): a group has a signal where the tiny base learns nothing
        "outer_trainer.recipe.choices={steps=[1], prompts_per_step=[1], group_size=[2, 3], max_new_tokens=[4, 6], "
        "max_turns=[1], dataset_size=[32], rubric=['exact', 'exact+format'], level_mix=['task']}"]


@pytest.fixture(scope="module")
def cluster():
    from aitrainsai_backend_ray.cluster import LOCAL_ENV, LocalCluster

    with LocalCluster(num_cpus=2, num_gpus=0, object_store_mb=96) as head:
        yield head
    assert LOCAL_ENV  # the head's own environment was set by LocalCluster, not by this process


def aitrainsai(runs: Path, *args: str, kill_when=None) -> subprocess.CompletedProcess | subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AITRAINSAI_", "RAY_"))}
    env["AITRAINSAI_LOCAL_BASE"] = "tiny-llama"  # the mechanics, not learning: the local trainer's tiny base
    process = subprocess.Popen([sys.executable, "-m", "aitrainsai.cli", "run", "--runs-dir", str(runs), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        if kill_when is not None:
            signal_when(process, lambda: kill_when(runs), signal.SIGKILL, within_s=600, every_s=0.2)
        out, err = process.communicate(timeout=900)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def the_run(runs: Path):
    names = [p.name for p in runs.iterdir() if p.is_dir()] if runs.is_dir() else []
    return Ledger(runs).run(names[0]) if len(names) == 1 else None


def ray_jobs(cluster, run) -> dict[str, str]:
    """The run's jobs the cluster has heard of: submission id -> job id (the backend's journal names them)."""
    from ray.job_submission import JobSubmissionClient

    journal = [json.loads(line) for line in (run.dir / "backend" / "submissions.jsonl").read_text().splitlines()]
    ours = {entry["submission_id"]: entry["job_id"] for entry in journal}
    known = {job.submission_id for job in JobSubmissionClient(cluster.url).list_jobs()}
    return {sid: job_id for sid, job_id in ours.items() if sid in known}


def training_on_ray(runs: Path) -> bool:
    """An agent's job trains as a Ray job: its runner has started on the cluster."""
    try:
        run = the_run(runs)
        jobs = run.jobs() if run else []
    except LedgerError:
        return False
    for job in jobs:
        handle = job.handle or {}
        folder = (handle.get("data") or {}).get("job_dir")
        if job.state == "running" and job.id.endswith("-job") and folder and (Path(folder) / "pid").exists():
            return True
    return False


@pytest.mark.slow
def test_the_default_run_on_a_ray_cluster_killed_mid_job_resumes_by_reattaching(cluster, tmp_path):
    runs = tmp_path / "runs"
    # one job at a time on the cluster: the other waits in the orchestrator's queue when the kill comes
    backend = ["gpu_backend.use=ray", f"gpu_backend.ray.address='{cluster.url}'", "gpu_backend.ray.poll_s=0.3",
               "gpu_backend.ray.cpus_per_job=2"]
    sets = [arg for setting in [*TINY, *backend] for arg in ("-s", setting)]
    killed = aitrainsai(runs, *sets, kill_when=training_on_ray)
    assert killed.returncode == -signal.SIGKILL, (f"not killed mid-job (exit {killed.returncode}): "
                                                  f"{killed.stderr[-3000:]}")
    run = the_run(runs)
    running = {j.id: j.handle["data"]["submission_id"] for j in run.jobs() if j.state == "running" and j.handle}
    assert running, run.jobs()
    time.sleep(1.0)  # a submission the kill cut short has reached the dashboard, or never will
    on_ray = ray_jobs(cluster, run)
    reached = {job_id: sid for job_id, sid in running.items() if sid in on_ray}
    assert reached and set(running) - set(reached), (running, on_ray)  # one trained on the cluster, one waited

    resumed = aitrainsai(runs, "--resume", run.dir.name)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "report:" in resumed.stdout

    info = run.info()
    assert info.status == "finished"
    assert [e.data["step"] for e in run.events("outer_step")] == [1]
    # every job went to Ray once: the one that trained while the orchestrator was dead was reattached, not rerun; one
    # still queued in the killed orchestrator (handed to the backend, never sent to Ray) was submitted anew
    per_job = collections.Counter(job_id for job_id in ray_jobs(cluster, run).values())
    assert per_job and max(per_job.values()) == 1, f"a job went to Ray twice: {per_job}"
    reruns = {e.data["job"]: e.data["reason"] for e in run.events("job_rerun")}
    assert set(reruns) == set(running) - set(reached), (reruns, running, reached)
    assert all("never submitted" in why for why in reruns.values()), reruns
    after = {j.id: j for j in run.jobs()}
    for job_id, sid in reached.items():  # followed to their end by the resumed orchestrator
        assert after[job_id].state == "done" and (after[job_id].handle or {})["data"]["submission_id"] == sid
    trained = [j for j in run.jobs() if j.id.endswith("-job") and j.state == "done"]
    assert trained, run.jobs()
    for job in trained:
        result = job.progress
        assert result.eval_size == 2 and result.post is not None and 0.0 <= result.post <= 1.0, result
        assert (result.train_seconds or 0) > 0, result
        assert (job.handle or {})["backend"] == "ray"
    report = (run.dir / "report" / "report.md").read_text()
    assert "calc_chain" in report


# -- the head the backend starts: stops, the keeper, adoption ---------------------------------------------------------
GRACE_S = 12.0  # the keeper's: longer than a resumed orchestrator takes to reach its backend (about 1 s here)

SETTINGS = ("families.train=['calc_chain']", "families.held_out=['triage']", "loop.steps=2", "loop.group_size=2",
            "loop.groups_per_step=1", "inner_trainer.given-numbers.job_seconds=4",
            "inner_trainer.given-numbers.spread=0.3")
OWN_HEAD = ["gpu_backend.use=ray", "gpu_backend.ray.local_num_cpus=2", "gpu_backend.ray.local_num_gpus=0",
            "gpu_backend.ray.local_object_store_mb=80", "gpu_backend.ray.poll_s=0.2",
            f"gpu_backend.ray.keeper_grace_s={GRACE_S}"]


class Stopped:
    """What a signal found: the jobs done, the ones that had just started training on the head (their payloads run
    4 s: they cannot end before the signal lands), and the head's processes."""

    def __init__(self, run, head: dict, training: dict[str, str], *, started_head: bool):
        self.done = {j.id for j in run.jobs() if j.id.endswith("-job") and j.state == "done"}
        self.training = training  # job id -> submission id
        self.head, self.started_head = head, started_head
        self.processes = head_processes(head)
        self.at, self.wall = time.monotonic(), time.time()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def head_of(orchestrator: int) -> dict | None:
    """The head an orchestrator started, from its child processes (``ray start --head --temp-dir=...``, the
    keeper); None when it started none (it adopted one)."""
    import psutil

    head = None
    keeper = None
    for child in psutil.Process(orchestrator).children():
        try:
            command = child.cmdline()
            if "--head" in command and "start" in command:
                temp_dir = next(a.split("=", 1)[1] for a in command if a.startswith("--temp-dir="))
                head = {"root": {"pid": child.pid, "started": child.create_time()}, "temp_dir": temp_dir}
            elif "aitrainsai_backend_ray.keeper" in command:
                keeper = {"pid": child.pid}
        except psutil.Error:
            continue
    return head and {**head, "keeper": keeper}


def head_record(runs: Path) -> dict:
    """The head the backend recorded in the run's folder."""
    return json.loads((Ledger(runs).run("ray").dir / "backend" / "head.json").read_text())


def head_processes(head: dict) -> list:
    """The head's live processes, found apart from the backend's own code: ray start and what it started, its
    session, whatever names its temp dir, and its keeper."""
    import psutil

    found = {}
    for process in psutil.process_iter(["cmdline", "create_time", "status"]):
        try:
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            ours = (process.pid in (head["root"]["pid"], (head.get("keeper") or {}).get("pid"))
                    or any(head["temp_dir"] in arg for arg in process.info["cmdline"] or [])
                    or (os.getsid(process.pid) == head["root"]["pid"]
                        and process.info["create_time"] >= head["root"]["started"] - 1))
            if ours:
                found[process.pid] = process
                found.update({child.pid: child for child in process.children(recursive=True)})
        except (psutil.Error, OSError):
            continue
    return list(found.values())


def running(processes: list) -> list[str]:
    import psutil

    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
        except psutil.Error:
            continue
    return left


def orchestrate(tmp_path: Path, mode: str, sig: signal.Signals | None = None, *, after: int = 1) -> Stopped | None:
    """Run the orchestrator (``new`` or ``resume``) to its end, or send it ``sig`` once ``after`` jobs are done and
    another trains on the head; then what the signal found."""
    runs = tmp_path / "runs"
    script = orchestrator_script(runs, "ray", *SETTINGS, *OWN_HEAD)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AITRAINSAI_", "RAY_"))},
           "GIVEN_NUMBERS_LOG": str(tmp_path / "executions.log")}
    process = subprocess.Popen([sys.executable, "-c", script, mode], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    found: list[Stopped] = []

    def ready() -> bool:
        run = Ledger(runs).run("ray")
        jobs = [j for j in run.jobs() if j.id.endswith("-job")]
        if sum(j.state == "done" for j in jobs) < after:
            return False
        started = {}
        for job in jobs:
            if job.handle is None or job.state != "running":
                continue
            pid = Path(job.handle["data"]["job_dir"]) / "pid"
            if pid.exists() and time.time() - _mtime(pid) < 2:
                started[job.id] = job.handle["data"]["submission_id"]
        if not started:
            return False
        own = head_of(process.pid)
        found.append(Stopped(run, own or head_record(runs), started, started_head=own is not None))
        return True

    try:
        if sig is not None:
            assert signal_when(process, ready, sig, within_s=600, every_s=0.1), "never mid-job with a job done"
        _out, err = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    expected = 0 if sig is None else -signal.SIGKILL if sig == signal.SIGKILL else 128 + sig
    assert process.returncode == expected, f"{mode} {sig!r}: exit {process.returncode}: {err[-3000:]}"
    return found[0] if found else None


def assert_finished(tmp_path: Path, stops: list[Stopped], *, reattached: set[str] = frozenset()) -> None:
    """The run finished; no job that was done at a stop ran again; the jobs a stop cut short came back lost and ran
    again (but those a resumed run adopted with their head: they ran once); no other payload ran twice."""
    run = Ledger(tmp_path / "runs").run("ray")
    assert run.info().status == "finished"
    assert [e.data["step"] for e in run.events("outer_step")] == [1, 2]
    jobs = {j.id: j for j in run.jobs()}
    assert all(j.state == "done" for j in jobs.values()), {i: j.state for i, j in jobs.items()}
    executions = collections.Counter((tmp_path / "executions.log").read_text().split())
    for stop in stops:
        for job_id in stop.done:
            assert executions[job_id] == 1 and executions[f"{job_id}-eval"] == 1, f"{job_id} ran again: {executions}"
    reruns = {e.data["job"] for e in run.events("job_rerun") if e.data["reason"].startswith("lost")}
    cut_short = {job_id for stop in stops for job_id in stop.training} - set(reattached)
    assert cut_short <= reruns, f"not rerun: {cut_short - reruns}"
    for job_id in reattached:
        assert job_id not in reruns and executions[job_id] == 1, f"{job_id} ran again although its head was adopted"
    twice = {payload for payload, count in executions.items() if count > 1}
    assert twice <= reruns, f"payloads run twice that were not lost: {twice - reruns} ({executions})"


@pytest.mark.slow
def test_sigterm_stops_the_head_the_run_started_and_the_resumed_run_finishes(tmp_path):
    """SIGINT takes SIGTERM's path (aitrainsai.stopping; both checked in a real process by the core's tests, and
    SIGINT mid-job by the local and Runpod loops' tests)."""
    stops = []
    for sig in (signal.SIGTERM,):
        stop = orchestrate(tmp_path, "new" if not stops else "resume", sig, after=len(stops) + 1)
        stop_s = time.monotonic() - stop.at
        assert stop.started_head and stop.processes and stop.training, "the signal came with nothing on the head"
        assert not running(stop.processes), f"{sig.name} left the head running: {running(stop.processes)}"
        assert stop_s < 30, f"the stop after {sig.name} took {stop_s:.1f} s"
        head = head_record(tmp_path / "runs")
        assert head["state"] == "stopped" and head["stopped_by"] == "the orchestrator", head
        assert not Path(head["temp_dir"]).exists()
        print(f"\n{sig.name}: the run and its head ({len(stop.processes)} processes) stopped in {stop_s:.1f} s")
        stops.append(stop)
    orchestrate(tmp_path, "resume")
    assert not running(head_processes(head_record(tmp_path / "runs")))
    assert_finished(tmp_path, stops)
    started = [e.data for e in Ledger(tmp_path / "runs").run("ray").events("backend_head")]
    assert [e["action"] for e in started] == ["started"] * 2, started  # a new head each time; none adopted


@pytest.mark.slow
def test_a_sigkilled_run_leaves_its_head_to_the_keeper_or_to_the_resumed_run_that_adopts_it(tmp_path):
    runs = tmp_path / "runs"
    # killed: the head runs on with its job; the run resumed at once adopts both
    first = orchestrate(tmp_path, "new", signal.SIGKILL)
    assert running(first.processes), "the head went with its orchestrator"
    second = orchestrate(tmp_path, "resume", signal.SIGKILL, after=len(first.done) + 1)
    run = Ledger(runs).run("ray")
    events = list(run.events("backend_head"))
    assert [e.data["action"] for e in events] == ["started", "adopted"], events
    assert first.started_head and not second.started_head, "the resumed run started a head of its own"
    assert second.head["root"]["pid"] == first.head["root"]["pid"]
    print(f"\nthe resumed run adopted the head {events[1].created_at - first.wall:.1f} s after the kill")
    adopted = {j: sid for j, sid in first.training.items() if j not in second.training}
    assert adopted, "the second kill came before the job the resumed run adopted had trained"
    jobs = {j.id: j for j in run.jobs()}
    for job_id, sid in adopted.items():  # followed to its end by the resumed run, under its first id
        assert jobs[job_id].state in ("evaluating", "done"), jobs[job_id]
        assert (jobs[job_id].handle or {})["data"]["submission_id"] == sid, jobs[job_id]

    # killed again: nothing adopts the head in time, so its keeper stops it, all of it
    assert running(second.processes), "the head went with its orchestrator"
    deadline = second.at + GRACE_S + 20
    while running(second.processes):
        assert time.monotonic() < deadline, f"the keeper left the head running: {running(second.processes)}"
        time.sleep(0.5)
    stopped_after = time.monotonic() - second.at
    assert stopped_after > GRACE_S * 0.8, f"the keeper stopped the head {stopped_after:.1f} s after the kill"
    head = head_record(runs)
    assert head["state"] == "stopped" and head["stopped_by"].startswith("keeper: its orchestrator"), head
    assert not Path(head["temp_dir"]).exists()
    print(f"the keeper stopped the head ({len(second.processes)} processes) {stopped_after:.1f} s after the kill")

    orchestrate(tmp_path, "resume")  # a new head; the jobs the old one ran come back lost and run again
    assert not running(head_processes(head_record(runs)))
    actions = [e.data["action"] for e in Ledger(runs).run("ray").events("backend_head")]
    assert actions == ["started", "adopted", "started"], actions
    assert_finished(tmp_path, [first, second], reattached=set(adopted))
