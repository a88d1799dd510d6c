"""A run killed during sampling, during forward_backward, or between optim_step and saving its state resumes to the
end with no update applied twice: a process trains the way the loop does (sample, update, save after every
update), the local server hangs the chosen call in the second step, the process is SIGKILLed there, and a new
process resumes from the last saved state to the end. The final training client's Adam step count (the service's
own ``step:max``) equals the number of updates: none was lost, none counted twice."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest


HARNESS = textwrap.dedent("""
    import asyncio, json, sys, time
    from pathlib import Path
    from aitrainsai.trainers import ScoredEpisode
    from aitrainsai_outer_tinker.trainer import TinkerConfig, TinkerTrainer

    options, root, steps, resume = json.loads(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    progress = root / "progress.jsonl"

    def say(**what):
        with progress.open("a") as out:
            out.write(json.dumps(what) + "\\n")

    async def main():
        trainer = TinkerTrainer(TinkerConfig(**options), state_dir=root / "run" / "policy")
        await trainer.start()
        try:
            saved = sorted(root.glob("v*"), key=lambda p: int(p.name[1:]))
            if resume and saved:
                await trainer.load_state(saved[-1])
            say(phase="started", version=trainer.policy_version)
            metrics = {}
            while trainer.policy_version < steps:
                version = trainer.policy_version
                if version > 0:  # the test arms its fault, then lets the step go
                    while not (root / f"go-{version}").exists():
                        time.sleep(0.05)
                say(phase="sampling", version=version)
                messages = [{"role": "user", "content": "Name a colour."}]
                turns = [await trainer.sample(messages, [], None) for _ in range(2)]
                say(phase="updating", version=version)
                metrics = await trainer.update([[ScoredEpisode(id=f"v{version}-e{i}", turns=[t], reward=float(i))
                                                 for i, t in enumerate(turns)]])
                say(phase="saving", version=trainer.policy_version)
                await trainer.save_state(root / f"v{trainer.policy_version}")
                say(phase="saved", version=trainer.policy_version)
            say(phase="done", version=trainer.policy_version, metrics=metrics)
        finally:
            await trainer.close()

    asyncio.run(main())
""")


def _events(root):
    path = root / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _wait(process, root, predicate, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(predicate(e) for e in _events(root)):
            return
        assert process.poll() is None, f"the process ended ({process.returncode}): {_events(root)[-3:]}"
        time.sleep(0.1)
    raise AssertionError(f"timed out; last events {_events(root)[-3:]}")


def _at(phase, version):
    """A predicate for :func:`_wait`: an event of ``phase`` at ``version``."""
    return lambda e: e["phase"] == phase and e["version"] == version


def _run(settings, root, resume, steps):
    return subprocess.Popen([sys.executable, "-c", HARNESS, json.dumps(settings), str(root), str(steps),
                             "1" if resume else "0"], env=dict(os.environ), start_new_session=True)


KILLS = [("asample", "sampling"), ("forward_backward", "updating"), ("save_weights", "saving")]


@pytest.mark.slow  # a whole run in a process, killed three times and resumed
def test_killed_mid_call_three_times_then_resumed_runs_to_the_end_with_each_update_once(server, tmp_path):
    """Killed in step 2 while sampling, in step 3 inside forward_backward, in step 4 between optim_step and its
    save; each time a new process resumes from the last saved state; the last one runs to the end."""
    steps = len(KILLS) + 1
    settings = {"base_url": server.base_url, "base_model": "SmolLM2-135M-Instruct", "max_tokens": 2,
                "retries": 0, "call_timeout_s": 120.0, "learning_rate": 1e-3, "seed": 3}
    for k, (op, phase) in enumerate(KILLS):
        version = k + 1  # the last saved state before this kill
        process = _run(settings, tmp_path, resume=k > 0, steps=steps)
        try:
            _wait(process, tmp_path, _at("saved", version))
            server.faults(op=op, hang=True)
            (tmp_path / f"go-{version}").touch()
            _wait(process, tmp_path, _at(phase, version + 1 if phase == "saving" else version))
            time.sleep(1.0)  # inside the hung call
            assert process.poll() is None
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait()
        server.clear_faults()
        assert not (tmp_path / f"v{version + 1}").exists(), op  # the step the kill cut short was not saved
    for version in range(len(KILLS) + 1, steps):
        (tmp_path / f"go-{version}").touch()
    last = _run(settings, tmp_path, resume=True, steps=steps)
    try:
        assert last.wait(timeout=240) == 0
    finally:
        if last.poll() is None:
            last.kill()
    events = _events(tmp_path)
    assert [e["version"] for e in events if e["phase"] == "started"] == [0, 1, 2, 3]
    done = events[-1]
    assert done["phase"] == "done" and done["version"] == steps
    assert done["metrics"]["optimizer_steps"] == float(steps)  # the service applied each update once
    assert json.loads((tmp_path / f"v{steps}" / "tinker.json").read_text())["policy_version"] == steps
