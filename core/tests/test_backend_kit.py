"""Payloads that travel: the payload and result models, the local backend's refusals, cancel and secrets, and the
conformance kit's own helpers. (The kit itself runs against the local backend in test_builtins.py.)"""

import asyncio
import json
import signal
import sys
from pathlib import Path

import pydantic
import pytest

from aitrainsai.backends import JobHandle, JobPayload, JobResult, Runtime, blank_secrets
from aitrainsai.builtin import local_backend
from aitrainsai.builtin.local_backend import LocalBackend, unmet_requirements
from aitrainsai.run.record import JobProgress
from aitrainsai.testing.backends import payload_problems, relocate


def payload(tmp_path, **fields) -> JobPayload:
    return JobPayload(**{"job_id": "j", "workdir": tmp_path / "j", "command": ["python", "-c", "pass"], **fields})


def running_in_group(pgid: int) -> list[int]:
    """Processes of the group that are not zombies (a killed job's orphans wait there for init to reap them),
    after giving SIGKILLed ones a moment to finish dying."""
    import time

    for _ in range(50):
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                alive.append(int(stat.parent.name))
        if not alive:
            return []
        time.sleep(0.1)
    return alive


# -- the models ------------------------------------------------------------------------------------------------------
def test_a_payload_names_no_absolute_path_in_its_command(tmp_path):
    with pytest.raises(pydantic.ValidationError, match="absolute path"):
        payload(tmp_path, command=[sys.executable, "-m", "x"])
    with pytest.raises(pydantic.ValidationError, match="absolute path"):
        payload(tmp_path, command=["python", "/etc/job.py"])
    assert payload(tmp_path, command=["python", "-m", "x", "job.json"]).command[0] == "python"


@pytest.mark.parametrize("path", ["/abs/out", "../out", "a/../../b", "", "."])
def test_an_artifact_lies_inside_the_workdir(tmp_path, path):
    with pytest.raises(pydantic.ValidationError, match="inside the workdir"):
        payload(tmp_path, artifacts={"out": path})


def test_artifact_names_and_paths_are_normalised(tmp_path):
    assert payload(tmp_path, artifacts={"adapter": "./out//adapter"}).artifacts == {"adapter": "out/adapter"}
    with pytest.raises(pydantic.ValidationError, match="artifact name"):
        payload(tmp_path, artifacts={"no spaces": "x"})


def test_secrets_are_never_serialised(tmp_path):
    p = payload(tmp_path, env={"MODE": "x"}, secrets={"API_KEY": "sk-very-secret"})
    for text in (p.model_dump_json(), json.dumps(p.model_dump(mode="json")), repr(p), str(p)):
        assert "sk-very-secret" not in text and "API_KEY" not in text
    assert p.model_copy(update={"workdir": tmp_path / "x"}).secrets == {"API_KEY": "sk-very-secret"}
    with pytest.raises(pydantic.ValidationError, match="both in env and in secrets"):
        payload(tmp_path, env={"API_KEY": "a"}, secrets={"API_KEY": "b"})


def test_runtime_specifiers_are_checked():
    assert Runtime(distributions={"torch": ">=2.2,<3", "aitrainsai": ""}).distributions["torch"] == ">=2.2,<3"
    with pytest.raises(pydantic.ValidationError, match="not a version specifier"):
        Runtime(distributions={"torch": "two point two"})
    with pytest.raises(pydantic.ValidationError, match="not a distribution name"):
        Runtime(distributions={"torch; rm -rf": "==1"})


def test_a_dead_result_names_one_of_the_reasons():
    dead = JobResult(job_id="j", status="dead", reason="oom", detail="killed by SIGKILL")
    assert dead.why == "oom: killed by SIGKILL"
    assert JobResult.dead("j", "oom", "killed by SIGKILL") == dead
    assert JobResult.dead("j", "failed", "exit code 2", exit_code=2, wall_s=1.5).exit_code == 2
    with pytest.raises(pydantic.ValidationError):
        JobResult(job_id="j", status="dead", reason="timed out after 5 s")
    with pytest.raises(pydantic.ValidationError, match="names its reason"):
        JobResult(job_id="j", status="dead")
    with pytest.raises(pydantic.ValidationError, match="names its reason"):
        JobResult(job_id="j", status="done", reason="lost")


# -- the local backend's requirements ---------------------------------------------------------------------------------
def test_the_local_backend_meets_what_this_environment_has(tmp_path):
    from importlib import metadata

    version = metadata.version("pydantic")
    pinned = payload(tmp_path, runtime={"distributions": {"pydantic": f"=={version}"}})
    assert unmet_requirements(pinned, tmp_path) == ""
    why = unmet_requirements(payload(tmp_path, runtime={"distributions": {"pydantic": "<1"}}), tmp_path)
    assert why == f"distribution pydantic {version} is installed here; the payload needs pydantic<1"
    why = unmet_requirements(payload(tmp_path, runtime={"image": "org/trainer:1"}), tmp_path)
    assert "runs no container images" in why


def test_the_local_backend_counts_gpus_without_torch(tmp_path, monkeypatch):
    monkeypatch.setattr(local_backend, "gpu_names", list)
    assert unmet_requirements(payload(tmp_path, gpus=1), tmp_path) == \
        "the payload needs 1 GPU(s); this machine has none"
    monkeypatch.setattr(local_backend, "gpu_names", lambda: ["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"])
    assert unmet_requirements(payload(tmp_path, gpus=2, gpu_type="h100"), tmp_path) == ""
    assert "needs 1 A100 GPU(s); this machine has NVIDIA H100" in \
        unmet_requirements(payload(tmp_path, gpu_type="A100"), tmp_path)
    assert "needs 3 GPU(s)" in unmet_requirements(payload(tmp_path, gpus=3), tmp_path)
    monkeypatch.setattr(local_backend, "memory_gb", lambda: 16.0)
    assert unmet_requirements(payload(tmp_path, memory_gb=8), tmp_path) == ""
    assert unmet_requirements(payload(tmp_path, memory_gb=32), tmp_path) == \
        "the payload needs 32 GB of memory; this machine has 16.0 GB"


def test_cuda_visible_devices_narrows_the_gpus(tmp_path, monkeypatch):
    gpus = tmp_path / "gpus"
    for index, model in enumerate(["NVIDIA A100-SXM4-40GB", "NVIDIA H200"]):
        (gpus / f"0000:0{index}:00.0").mkdir(parents=True)
        (gpus / f"0000:0{index}:00.0" / "information").write_text(f"Model: \t\t {model}\nIRQ: 1\n")
    monkeypatch.setattr(local_backend, "NVIDIA_GPUS", gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local_backend.gpu_names() == ["NVIDIA A100-SXM4-40GB", "NVIDIA H200"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert local_backend.gpu_names() == ["NVIDIA H200"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_backend.gpu_names() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,1")
    assert local_backend.gpu_names() == ["NVIDIA A100-SXM4-40GB"]


def test_a_refused_payload_never_runs_and_stays_refused_after_a_restart(tmp_path):
    marker = tmp_path / "j" / "ran"
    p = payload(tmp_path, command=["python", "-c", "open('ran', 'w')"], memory_gb=1e9)

    async def go():
        backend = LocalBackend(LocalBackend.Config(), workdir=tmp_path)
        handle = await backend.submit(p)
        result = await backend.wait(handle)
        again = await LocalBackend(LocalBackend.Config(), workdir=tmp_path).wait(
            JobHandle.model_validate_json(handle.model_dump_json()))
        return result, again

    result, again = asyncio.run(go())
    assert result.status == "dead" and result.reason == "infra" and "GB of memory" in result.detail
    assert again == result and not marker.exists()


# -- the local backend at work ---------------------------------------------------------------------------------------
def test_python_is_the_backends_own_interpreter(tmp_path):
    code = "import sys; open('which', 'w').write(sys.executable)"
    result = asyncio.run(LocalBackend(LocalBackend.Config(), workdir=tmp_path).run(
        payload(tmp_path, command=["python", "-c", code], artifacts={"which": "which"})))
    assert result.status == "done", result
    assert Path(result.artifacts["which"]).read_text() == sys.executable


def test_cancel_kills_the_running_job_and_a_queued_one_never_starts(tmp_path):
    async def go():
        backend = LocalBackend(LocalBackend.Config(workers=1), workdir=tmp_path)
        running = await backend.submit(payload(tmp_path, job_id="a", workdir=tmp_path / "a",
                                               command=["python", "-c", "import time; time.sleep(60)"]))
        queued = await backend.submit(payload(tmp_path, job_id="b", workdir=tmp_path / "b",
                                              command=["sh", "-c", "touch started; sleep 60"]))
        while not (tmp_path / "a" / ".job_pid").exists():
            await asyncio.sleep(0.05)
        pid = int((tmp_path / "a" / ".job_pid").read_text())
        await backend.cancel(queued)
        await backend.cancel(running)
        results = await asyncio.gather(backend.wait(running), backend.wait(queued))
        await backend.cancel(running)  # once ended, cancel does nothing
        return pid, results, await backend.wait(running)

    pid, (running, queued), again = asyncio.run(go())
    assert (running.reason, queued.reason) == ("cancelled", "cancelled"), (running, queued)
    assert "while running" in running.detail and "while queued" in queued.detail and again == running
    assert not (tmp_path / "b" / "started").exists()
    assert not running_in_group(pid)


def test_cancel_reaches_a_job_an_earlier_process_started(tmp_path):
    import subprocess

    from aitrainsai.testing.backends import ORCHESTRATOR

    orphan = payload(tmp_path, job_id="orphan", workdir=tmp_path / "orphan",
                     command=["python", "-c", "import time; time.sleep(60)"])
    proc = subprocess.run([sys.executable, "-c", ORCHESTRATOR, LocalBackend.__module__, "LocalBackend", "{}",
                           str(tmp_path), orphan.model_dump_json(), str(tmp_path / "handle.json"), "0.5"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    handle = JobHandle.model_validate_json((tmp_path / "handle.json").read_text())
    pid = int((tmp_path / "orphan" / ".job_pid").read_text())

    async def go():
        backend = LocalBackend(LocalBackend.Config(), workdir=tmp_path)
        await backend.cancel(handle)
        return await backend.wait(handle)

    result = asyncio.run(go())
    assert result.status == "dead" and result.reason == "cancelled", result
    assert not running_in_group(pid)


def test_a_job_killed_by_sigkill_is_oom_and_a_signal_or_exit_code_is_failed(tmp_path):
    async def go():
        backend = LocalBackend(LocalBackend.Config(workers=3), workdir=tmp_path)
        codes = {"kill9": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                 "term": "import os, signal; os.kill(os.getpid(), signal.SIGTERM)", "exit": "raise SystemExit(7)"}
        return await asyncio.gather(*(backend.run(payload(tmp_path, job_id=k, workdir=tmp_path / k,
                                                          command=["python", "-c", c])) for k, c in codes.items()))

    oom, term, exit_ = asyncio.run(go())
    assert (oom.reason, oom.exit_code) == ("oom", -signal.SIGKILL) and "out of memory" in oom.detail
    assert (term.reason, term.detail) == ("failed", f"killed by signal {int(signal.SIGTERM)}")
    assert (exit_.reason, exit_.detail, exit_.exit_code) == ("failed", "exit code 7", 7)


def test_a_failed_payloads_last_line_is_its_dead_detail(tmp_path):
    """What the payload said last (a sandbox that could not start, a plugin it refused) is the dead job's reason."""
    said = ("print('starting'); print('training failed: load: bwrap: Unknown option --x', flush=True); "
            "raise SystemExit(1)")
    result = asyncio.run(LocalBackend(LocalBackend.Config(), workdir=tmp_path).run(
        payload(tmp_path, command=["python", "-c", said])))
    assert (result.reason, result.detail) == ("failed", "exit code 1: training failed: load: bwrap: Unknown option --x")
    assert result.why == "failed: exit code 1: training failed: load: bwrap: Unknown option --x"


def test_secret_values_are_blanked_in_the_log_tail(tmp_path):
    p = payload(tmp_path, command=["python", "-c", "import os; print('key is', os.environ['API_KEY'])"],
                secrets={"API_KEY": "sk-do-not-store"})
    result = asyncio.run(LocalBackend(LocalBackend.Config(), workdir=tmp_path).run(p))
    assert result.status == "done" and "key is [secret]" in result.log_tail
    assert "sk-do-not-store" not in result.model_dump_json()


def test_blank_secrets_blanks_every_value_and_ignores_empty_ones():
    assert blank_secrets("a=sk-1 b=tok c=sk-1", ["sk-1", "", "tok"]) == "a=[secret] b=[secret] c=[secret]"
    assert blank_secrets("nothing here", []) == "nothing here"


def test_an_artifact_that_leaves_the_workdir_is_missing(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("not the job's")
    code = f"import os; os.symlink({str(outside)!r}, 'out.txt')"
    result = asyncio.run(LocalBackend(LocalBackend.Config(), workdir=tmp_path).run(
        payload(tmp_path, command=["python", "-c", code], artifacts={"out": "out.txt"})))
    assert result.status == "dead" and result.reason == "artifact" and "out (out.txt)" in result.detail


# -- the kit's helpers -----------------------------------------------------------------------------------------------
def test_payload_problems_finds_paths_outside_the_workdir(tmp_path):
    workdir = tmp_path / "episode" / "train"
    workdir.mkdir(parents=True)
    (workdir / "job.json").write_text(json.dumps({"job_dir": "job"}))
    good = payload(tmp_path, workdir=workdir)
    assert payload_problems(good) == []
    (workdir / "job.json").write_text(json.dumps({"job_dir": str(tmp_path / "episode" / "job")}))
    assert payload_problems(good) == [f"job.json names {tmp_path / 'episode'}, a path outside the workdir"]
    (workdir / "job.json").write_text("{}")
    (workdir / "link").symlink_to(tmp_path)
    assert payload_problems(payload(tmp_path, workdir=workdir, env={"DATA": str(tmp_path / "episode" / "d")})) == [
        f"env DATA names {str(tmp_path / 'episode' / 'd')!r}, outside the workdir",
        "link is a symbolic link (it would not travel)"]


def test_relocate_moves_the_workdir(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("x")
    moved = relocate(payload(tmp_path, workdir=tmp_path / "a", secrets={"K": "v"}), tmp_path / "b" / "a")
    assert not (tmp_path / "a").exists() and (moved.workdir / "f").read_text() == "x" and moved.secrets == {"K": "v"}


def test_the_ledger_never_holds_a_secret(tmp_path):
    """What the episode stores of a job (its payload, its handle, its result) holds no secret value."""
    from aitrainsai.run.ledger import Ledger

    secret = "sk-ledger-must-not-see-this"
    p = payload(tmp_path, command=["python", "-c", "import os; assert os.environ['API_KEY']"],
                secrets={"API_KEY": secret})
    run = Ledger(tmp_path / "runs").create_run({}, [])

    async def go():
        backend = LocalBackend(LocalBackend.Config(), workdir=tmp_path)
        run.upsert_job("j", status="queued", episode_id="e", backend="local",
                       progress=JobProgress(payload=p))
        handle = await backend.submit(p)
        run.upsert_job("j", status="running", handle=handle.model_dump(mode="json"))
        result = await backend.wait(handle)
        run.upsert_job("j", status=result.status, progress=JobProgress(reason=result.why, log_tail=result.log_tail))
        return result

    assert asyncio.run(go()).status == "done"
    stored = [path for path in (tmp_path / "runs").rglob("*") if path.is_file()]
    assert stored and not [path for path in stored if secret.encode() in path.read_bytes()]
    assert secret not in json.dumps([job.model_dump(mode="json") for job in run.jobs()])
