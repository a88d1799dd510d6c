import pytest

from aitrainsai.builtin.local_backend import LocalBackend
from aitrainsai.builtin.reward_components import JobQuality, TrainSpeed, Validation
from aitrainsai.rewards import EpisodeOutcome, ProbeAttempt
from aitrainsai.testing import GpuBackendConformance, RewardComponentConformance


class TestLocalBackend(GpuBackendConformance):
    backend = LocalBackend
    distribution = "aitrainsai"

    def vanish(self, backend, handle):
        """The worker dies: its runner's whole process group is SIGKILLed, so nothing records how the job ended."""
        import os
        import signal
        from pathlib import Path

        os.killpg(int((Path(handle.data["workdir"]) / ".job_pid").read_text()), signal.SIGKILL)


class TestValidation(RewardComponentConformance):
    component = Validation
    distribution = "aitrainsai"


class TestJobQuality(RewardComponentConformance):
    component = JobQuality
    distribution = "aitrainsai"


class TestTrainSpeed(RewardComponentConformance):
    component = TrainSpeed
    distribution = "aitrainsai"


def attempts(*oks):
    return [ProbeAttempt(attempt=i + 1, ok=ok) for i, ok in enumerate(oks)]


def episode(**kw):
    return EpisodeOutcome(family="f", level=1, parsed_submission=True, **kw)


def test_validation_decays_per_retry():
    v = Validation()
    assert v.score(episode(attempts=attempts(True))) == 1.0
    assert v.score(episode(attempts=attempts(False, True))) == 0.5
    assert v.score(episode(attempts=attempts(False, False, True))) == 0.25
    assert v.score(episode(attempts=attempts(False, False, False))) == 0.0
    assert Validation(Validation.Config(decay=0.8)).score(episode(attempts=attempts(False, True))) == 0.8


def test_job_quality_by_hand():
    q = JobQuality()
    # post 0.6, best pre 0.4 (two bases): uplift 0.2 -> term 0.5 + 0.5 * 0.2 / 0.25 = 0.9
    done = episode(attempts=attempts(True), job_status="done", baseline_scores={"a": 0.3, "b": 0.4}, post=0.6)
    assert q.score(done) == pytest.approx(0.25 * 0.6 + 0.75 * 0.9)
    # negative uplift is signed: post 0.2 vs best pre 0.4 -> term 0.5 - 0.4 = 0.1
    worse = done.model_copy(update={"post": 0.2})
    assert q.score(worse) == pytest.approx(0.25 * 0.2 + 0.75 * 0.1)
    # saturates at both ends
    assert q.uplift_term(1.0) == 1.0 and q.uplift_term(-1.0) == 0.0
    assert q.score(done.model_copy(update={"job_status": "dead"})) == 0.0


def test_train_speed_only_counts_success():
    s = TrainSpeed()
    fast = episode(job_status="done", train_seconds=450, train_budget_seconds=1800)
    assert s.score(fast) == pytest.approx(0.75)
    assert s.score(fast.model_copy(update={"job_status": "dead"})) == 0.0
    assert s.score(fast.model_copy(update={"train_seconds": 5000})) == 0.0


def test_train_speed_is_read_from_work_where_the_trainer_counts_it_so_load_cannot_reorder_a_group():
    s = TrainSpeed()
    small = episode(job_status="done", train_seconds=900, train_work=16_384, train_work_budget=65_536)
    large = small.model_copy(update={"train_seconds": 300, "train_work": 32_768})  # faster, on a quieter moment
    assert s.score(small) == pytest.approx(0.75) and s.score(large) == pytest.approx(0.5)
    assert s.score(small) > s.score(large)  # the job that asked for less work ranks first, whatever the clock said
    assert s.score(small.model_copy(update={"train_work": None})) == pytest.approx(0.5)  # no work count: seconds
    assert s.score(small.model_copy(update={"job_status": "infra"})) == 0.0


def test_local_backend_kills_the_whole_process_group(tmp_path):
    import asyncio
    import time

    from aitrainsai.backends import JobPayload

    marker = tmp_path / "child_alive"
    child = tmp_path / "child.py"
    child.write_text(f"import time\ntime.sleep(2)\nopen({str(marker)!r}, 'w').write('x')\n")
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, {str(child)!r}]); time.sleep(60)"

    async def go():
        backend = LocalBackend(LocalBackend.Config(kill_grace_s=0.2), workdir=tmp_path)
        return await backend.run(JobPayload(job_id="j", workdir=tmp_path / "j", command=["python", "-c", code],
                                            timeout_s=0.5))

    result = asyncio.run(go())
    assert result.status == "dead" and result.reason == "timeout" and "timed out" in result.detail
    time.sleep(2.5)
    assert not marker.exists(), "a process the job forked outlived it"


def test_local_backend_reports_a_lost_job_after_restart(tmp_path):
    import asyncio

    from aitrainsai.backends import JobHandle

    backend = LocalBackend(LocalBackend.Config(), workdir=tmp_path)
    result = asyncio.run(backend.wait(JobHandle(backend="local", job_id="from-before")))
    assert result.status == "dead" and result.reason == "lost"


CONCURRENCY_PROBE = """
import pathlib, sys, time
shared, me, target, wait_s = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
(shared / f"start-{me}").touch()
peak, deadline = 0, time.monotonic() + wait_s
while True:  # wait (bounded) until target payloads have started; note the most seen running (started, not ended)
    started = len(list(shared.glob("start-*")))
    peak = max(peak, started - len(list(shared.glob("end-*"))))
    if started >= target or time.monotonic() > deadline:
        break
    time.sleep(0.02)
(shared / f"peak-{me}").write_text(str(peak))
(shared / f"end-{me}").touch()
"""


def test_local_backend_runs_jobs_concurrently_up_to_its_workers(tmp_path):
    """Four payloads on four workers all run at once; on one worker never two (seen by the payloads themselves,
    not timed)."""
    import asyncio

    from aitrainsai.backends import JobPayload

    def peaks(workers: int, target: int, wait_s: float) -> list[int]:
        shared = tmp_path / f"shared{workers}"
        shared.mkdir()

        async def go():
            backend = LocalBackend(LocalBackend.Config(workers=workers), workdir=tmp_path)
            payloads = [JobPayload(job_id=f"w{workers}-{i}", workdir=tmp_path / f"w{workers}-{i}",
                                   command=["python", "-c", CONCURRENCY_PROBE, f"../{shared.name}", str(i), str(target),
                                            str(wait_s)]) for i in range(4)]
            return await asyncio.gather(*(backend.run(p) for p in payloads))

        assert all(r.status == "done" for r in asyncio.run(go()))
        return [int((shared / f"peak-{i}").read_text()) for i in range(4)]

    # four workers: none ends before all four started, so the last to start sees four running
    assert max(peaks(4, target=4, wait_s=60)) == 4
    assert peaks(1, target=2, wait_s=0.3) == [1, 1, 1, 1]  # one worker: never two at once


def test_local_backend_reattaches_to_a_job_that_outlived_its_orchestrator(tmp_path):
    """SIGKILL the process that submitted a job; a new backend instance reattaches instead of rerunning it."""
    import signal
    import subprocess
    import sys
    import textwrap

    from aitrainsai.backends import JobHandle

    counter = tmp_path / "runs.txt"
    script = textwrap.dedent(f"""
        import asyncio, json, os, signal, sys
        from pathlib import Path
        from aitrainsai.backends import JobPayload
        from aitrainsai.builtin.local_backend import LocalBackend

        async def main():
            backend = LocalBackend(LocalBackend.Config(), workdir=Path({str(tmp_path)!r}))
            code = ("import time; open({str(counter)!r}, 'a').write('ran\\\\n'); time.sleep(2); "
                    "open('out.txt', 'w').write('ok')")
            payload = JobPayload(job_id="long", workdir=Path({str(tmp_path / "job")!r}), command=["python", "-c", code],
                                 artifacts={{"out": "out.txt"}}, timeout_s=60)
            handle = await backend.submit(payload)
            Path({str(tmp_path / "handle.json")!r}).write_text(handle.model_dump_json())
            while not Path({str(tmp_path / "job" / ".job_pid")!r}).exists():
                await asyncio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

        asyncio.run(main())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    handle = JobHandle.model_validate_json((tmp_path / "handle.json").read_text())

    import asyncio

    backend = LocalBackend(LocalBackend.Config(), workdir=tmp_path)
    result = asyncio.run(backend.wait(handle))
    assert result.status == "done", result
    assert counter.read_text() == "ran\n", "the job ran twice"
    # once finished, any later instance reads the recorded outcome
    again = asyncio.run(LocalBackend(LocalBackend.Config(), workdir=tmp_path).wait(handle))
    assert again.status == "done" and counter.read_text() == "ran\n"


def test_local_backend_records_status_for_a_relative_workdir(tmp_path, monkeypatch):
    """`runs/` is relative by default: the runner, started inside the job's folder, must still find its status files."""
    import asyncio

    from aitrainsai.backends import JobPayload

    monkeypatch.chdir(tmp_path)
    backend = LocalBackend(LocalBackend.Config(), workdir=tmp_path)

    async def go():
        payload = JobPayload(job_id="rel", workdir="runs/x/job", command=["python", "-c", "pass"])
        handle = await backend.submit(payload)
        return handle, await backend.wait(handle)

    handle, result = asyncio.run(go())
    assert result.status == "done", result.log_tail
    job = tmp_path / "runs/x/job"
    assert (job / ".job_status").read_text().strip() == "0" and (job / ".job_pid").is_file()
    assert handle.data["workdir"] == str(job)
    assert "cannot create" not in result.log_tail


def test_local_backend_starts_a_burst_longest_expected_first(tmp_path):
    import asyncio

    from aitrainsai.backends import JobPayload

    release = tmp_path / "release"

    async def go():
        backend = LocalBackend(LocalBackend.Config(workers=2), workdir=tmp_path)
        expected = [1.0, 5.0, 2.0, 9.0, 3.0]
        # each job says it started, then holds its worker until released: the first two to start are alone
        payloads = [JobPayload(job_id=f"b{i}", workdir=tmp_path / f"b{i}", expected_s=e, command=[
            "sh", "-c", f"touch {tmp_path}/start-b{i}; while [ ! -e {release} ]; do sleep 0.05; done"])
                    for i, e in enumerate(expected)]
        burst = asyncio.gather(*(backend.run(p) for p in payloads))
        for _ in range(600):
            started = {i for i in range(len(expected)) if (tmp_path / f"start-b{i}").exists()}
            if len(started) >= 2:
                break
            await asyncio.sleep(0.05)
        release.touch()
        results = await burst
        assert all(r.status == "done" for r in results)
        return started

    # submitted together: the two longest take the two workers, whatever the submission order
    assert asyncio.run(go()) == {1, 3}


def test_a_closed_local_backend_starts_nothing_more(tmp_path):
    import asyncio

    from aitrainsai.backends import JobPayload

    async def go():
        backend = LocalBackend(LocalBackend.Config(workers=1), workdir=tmp_path)
        payloads = [JobPayload(job_id=f"c{i}", workdir=tmp_path / f"c{i}",
                               command=["sh", "-c", f"touch {tmp_path}/started-c{i}; sleep 30"]) for i in range(3)]
        tasks = [asyncio.ensure_future(backend.run(p)) for p in payloads]
        while not list(tmp_path.glob("started-*")):
            await asyncio.sleep(0.05)
        await backend.close()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.3)
        return results

    results = asyncio.run(go())
    assert len(list(tmp_path.glob("started-*"))) == 1  # the running one was stopped, the queued ones never began
    assert all(isinstance(r, asyncio.CancelledError) for r in results)


def orphan_job(tmp_path, job_id: str, code: str, timeout_s: float = 60):
    """Submit a payload from a process that is then SIGKILLed; return the stored handle (the payload runs on)."""
    import signal
    import subprocess
    import sys
    import textwrap

    from aitrainsai.backends import JobHandle

    workdir = tmp_path / job_id
    script = textwrap.dedent(f"""
        import asyncio, os, signal, sys, time
        from pathlib import Path
        from aitrainsai.backends import JobPayload
        from aitrainsai.builtin.local_backend import LocalBackend

        async def main():
            backend = LocalBackend(LocalBackend.Config(), workdir=Path({str(tmp_path)!r}))
            payload = JobPayload(job_id={job_id!r}, workdir=Path({str(workdir)!r}),
                                 command=["python", "-c", {code!r}], timeout_s={timeout_s!r})
            handle = await backend.submit(payload)
            Path({str(tmp_path / f"{job_id}.json")!r}).write_text(handle.model_dump_json())
            while not Path({str(workdir / ".job_pid")!r}).exists():
                await asyncio.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)

        asyncio.run(main())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return JobHandle.model_validate_json((tmp_path / f"{job_id}.json").read_text())


def test_local_backend_reruns_a_lost_job_in_the_same_process_but_never_one_still_running(tmp_path):
    """A resumed run reattaches (wait on an old handle); a job reported lost is submitted again under its id."""
    import asyncio

    from aitrainsai.backends import JobHandle, JobPayload

    async def go():
        backend = LocalBackend(LocalBackend.Config(workers=1), workdir=tmp_path)
        lost = await backend.wait(JobHandle(backend="local", job_id="j", data={"workdir": str(tmp_path / "j")}))
        assert lost.status == "dead" and lost.reason == "lost"
        payload = JobPayload(job_id="j", workdir=tmp_path / "j", command=["python", "-c", "pass"])
        again = await backend.run(payload)  # refused before: "job j was already submitted"
        assert again.status == "done", again
        slow = payload.model_copy(update={"command": ["python", "-c", "import time; time.sleep(30)"]})
        handle = await backend.submit(slow)
        with pytest.raises(ValueError, match="already submitted"):
            await backend.submit(slow)  # still running: never twice at once
        await backend.cancel(handle)

    asyncio.run(go())


def test_local_backend_counts_a_reattached_job_against_its_workers(tmp_path):
    """One worker, a job still running from before the restart: a new job starts only once that one ends."""
    import asyncio

    from aitrainsai.backends import JobPayload

    handle = orphan_job(tmp_path, "old", "import time; time.sleep(1.5); open('end', 'w').write(repr(time.time()))")

    async def go():
        backend = LocalBackend(LocalBackend.Config(workers=1), workdir=tmp_path)
        old = asyncio.ensure_future(backend.wait(handle))
        await asyncio.sleep(0.2)
        new = JobPayload(job_id="new", workdir=tmp_path / "new",
                         command=["python", "-c", "import time; open('start', 'w').write(repr(time.time()))"])
        return await asyncio.gather(old, backend.run(new))

    old, new = asyncio.run(go())
    assert old.status == "done" and new.status == "done", (old, new)
    started, ended = float((tmp_path / "new" / "start").read_text()), float((tmp_path / "old" / "end").read_text())
    assert started >= ended, "two payloads ran at once on one worker"


def test_local_backend_times_a_reattached_job_from_its_start_not_its_submission(tmp_path):
    """A job that waited in the queue keeps its whole timeout once it starts, also after a restart."""
    import asyncio

    handle = orphan_job(tmp_path, "late", "import time; time.sleep(1); open('out', 'w').write('ok')", timeout_s=30)
    queued_long = handle.model_copy(update={"data": {**handle.data, "submitted_at": handle.data["submitted_at"] - 600}})
    result = asyncio.run(LocalBackend(LocalBackend.Config(), workdir=tmp_path).wait(queued_long))
    assert result.status == "done", result


GPU_PROBE = """
import contextlib, json, os, pathlib, sys, time
shared, name = pathlib.Path(sys.argv[1]), sys.argv[2]
gpus = os.environ['CUDA_VISIBLE_DEVICES']
mine = shared / f'{name}.running'
mine.write_text(gpus)
time.sleep(float(sys.argv[3]))
running = []
for other in shared.glob('*.running'):
    with contextlib.suppress(FileNotFoundError):  # that payload ended between the listing and the read
        running.append(other.read_text())
(shared / f'{name}.json').write_text(json.dumps({'gpus': gpus, 'slots': os.environ['AITRAINSAI_GPU_SLOTS'],
                                                'seen': running}))
mine.unlink()
"""


def test_local_backend_pins_payloads_to_gpus_with_slots_per_gpu(tmp_path, monkeypatch):
    """Two GPUs (as the driver would list them) with two slots each: four one-GPU payloads run at once, two per
    GPU, each seeing only its own; a payload asking for both GPUs gets both (named in order); without slots_per_gpu no
    payload is pinned."""
    import asyncio
    import json

    from aitrainsai.backends import JobPayload
    from aitrainsai.builtin import local_backend

    monkeypatch.setattr(local_backend, "visible_gpus", lambda: [("0", "Fake H200"), ("1", "Fake H200")])
    shared = tmp_path / "shared"
    shared.mkdir()

    def payload(name: str, gpus: int, wait_s: float) -> JobPayload:
        return JobPayload(job_id=name, workdir=tmp_path / name, gpus=gpus,
                          command=["python", "-c", GPU_PROBE, "../shared", name, str(wait_s)])

    async def go():
        backend = LocalBackend(LocalBackend.Config(slots_per_gpu=2), workdir=tmp_path)
        assert backend.capacity == 4
        both = payload("both", 2, 0.1)
        ones = [payload(f"one{i}", 1, 1.5) for i in range(4)]
        return await asyncio.gather(*(backend.run(p) for p in [*ones, both]))

    results = asyncio.run(go())
    assert all(r.status == "done" for r in results), results
    seen = {p.stem: json.loads(p.read_text()) for p in shared.glob("*.json")}
    ones = [seen[f"one{i}"] for i in range(4)]
    assert sorted(o["gpus"] for o in ones) == ["0", "0", "1", "1"] and {o["slots"] for o in ones} == {"2"}
    # never more than two payloads on a GPU: the two-GPU payload holds a slot on each (it may start beside ones
    # once a slot on each GPU is free, whichever ones still run)
    assert max(len(o["seen"]) for o in ones) >= 2
    assert all(sum(o["gpus"] in s.split(",") for s in o["seen"]) <= 2 for o in ones), ones
    assert seen["both"]["gpus"] == "0,1" and len(seen["both"]["seen"]) <= 3, seen["both"]
    assert LocalBackend(LocalBackend.Config(workers=3), workdir=tmp_path / "plain").capacity == 3


@pytest.mark.parametrize("setting, here, expected", [
    ({"workers": 1}, None, None),  # one at a time: torch's default
    ({"workers": 2}, None, "cores // 2"),  # two at once split the cores
    ({"workers": 2}, "3", "3"),  # set here: passed on as it is
    ({"workers": 1, "threads_per_payload": 5}, None, "5"),
    ({"workers": 4, "threads_per_payload": 1}, "3", "1"),
])
def test_local_backend_splits_the_cores_among_payloads_that_run_at_once(tmp_path, monkeypatch, setting, here,
                                                                         expected):
    import asyncio
    import os

    from aitrainsai.backends import JobPayload

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if here is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", here)
    out = tmp_path / "threads.txt"
    payload = JobPayload(job_id="t", workdir=tmp_path / "t", command=[
        "python", "-c", f"import os; open({str(out)!r}, 'w').write(os.environ.get('OMP_NUM_THREADS', 'unset'))"])
    result = asyncio.run(LocalBackend(LocalBackend.Config(**setting), workdir=tmp_path).run(payload))
    assert result.status == "done", result
    cores = len(os.sched_getaffinity(0))
    want = {None: "unset", "cores // 2": str(max(1, cores // 2))}.get(expected, expected)
    assert out.read_text() == want
