"""SIGINT and SIGTERM stop a run the same way, in bounded time (``aitrainsai.stopping``), with real signals sent to a
real process."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "cli"))  # the cli tests' folder is not on pytest's path
from test_cli import needs_default_plugins  # noqa: E402

SCRIPT = textwrap.dedent("""
    import asyncio, signal, sys, time
    from aitrainsai.stopping import Interrupted, run_until_stopped

    mode = sys.argv[1]

    async def main():
        try:
            if mode == "blocked-thread":
                asyncio.get_running_loop().run_in_executor(None, time.sleep, 120)
                await asyncio.to_thread(lambda: None)  # the executor serves other calls meanwhile
            print("started", flush=True)
            await asyncio.sleep(120)
        finally:
            if mode == "hanging-close":
                time.sleep(120)  # a close that never ends (blocking, so cancelling cannot help)
            await asyncio.sleep(0.3)  # a close that takes a while, signals arriving meanwhile
            print("closed", flush=True)

    try:
        run_until_stopped(main, timeout_s=float(sys.argv[2]), on_signal=lambda s: print("signal", s, flush=True))
    except Interrupted as stop:
        print("interrupted", stop.name, flush=True)
        sys.exit(stop.exit_code)
""")


def stop(mode: str, sig: signal.Signals, *, timeout_s: float = 20.0, again: bool = False) -> tuple[int, str, float]:
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(timeout_s)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "started", process.stderr.read()
        sent = time.monotonic()
        process.send_signal(sig)
        if again:
            time.sleep(0.1)
            process.send_signal(sig)
        out, err = process.communicate(timeout=60)
        return process.returncode, out + err, time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_sigint_and_sigterm_close_what_was_started_then_exit_128_plus_the_signal(sig):
    code, output, _ = stop("plain", sig)
    assert code == 128 + sig, output
    assert output.splitlines()[:3] == [f"signal {int(sig)}", "closed", f"interrupted {sig.name}"], output


def test_a_second_signal_during_the_stop_does_not_cut_the_closes_short():
    code, output, _ = stop("plain", signal.SIGTERM, again=True)
    assert code == 143 and "closed" in output and output.count("signal 15") == 1, output


def test_a_close_that_hangs_ends_the_process_at_the_bound():
    code, output, seconds = stop("hanging-close", signal.SIGTERM, timeout_s=1.5)
    assert code == 143 and "closed" not in output, output
    assert "took over 2 s; exiting now" in output
    assert 1.4 < seconds < 15, seconds


def test_a_thread_blocked_in_a_call_does_not_hold_the_stop():
    code, output, seconds = stop("blocked-thread", signal.SIGINT, timeout_s=60)
    assert code == 130 and "closed" in output and "exiting now" not in output, output
    assert seconds < 15, seconds  # the thread sleeps 120 s, the bound is 60 s: the process did not wait for either


def test_a_stopped_run_command_says_so_in_one_line_and_exits_128_plus_the_signal(tmp_path, monkeypatch):
    needs_default_plugins(["run"])
    from click.testing import CliRunner

    import aitrainsai.run.loop
    from aitrainsai.cli.command import cli
    from aitrainsai.run.ledger import Ledger
    from aitrainsai.stopping import Interrupted

    def stopped(session, **_):
        session.run.set_status("interrupted")
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(aitrainsai.run.loop, "run_loop", stopped)
    result = CliRunner().invoke(cli, ["run", "--runs-dir", str(tmp_path / "runs"), "-s", "loop.steps=1"])
    run = Ledger(tmp_path / "runs").run("latest")
    assert result.exit_code == 143, result.output
    assert result.output.splitlines()[-1] == (f"SIGTERM: run {run.id} interrupted; continue with: "
                                              f"aitrainsai run --resume {run.id}")
    assert run.info().status == "interrupted"


@pytest.mark.parametrize("resumable", [True, False])
def test_a_run_its_outer_trainer_stopped_says_whether_a_resume_can_help(tmp_path, monkeypatch, resumable):
    needs_default_plugins(["run"])
    from click.testing import CliRunner

    import aitrainsai.run.loop
    from aitrainsai.cli.command import cli
    from aitrainsai.run.ledger import Ledger

    monkeypatch.setattr(aitrainsai.run.loop, "run_loop", lambda session, **_: aitrainsai.run.loop.LoopSummary(
        steps=0, launched=0, skipped=0, dropped=0, stopped="outer_trainer.tinker: base model 'x' is not offered",
        resumable=resumable))
    result = CliRunner().invoke(cli, ["run", "--runs-dir", str(tmp_path / "runs"), "-s", "loop.steps=1"])
    run = Ledger(tmp_path / "runs").run("latest")
    if resumable:
        assert result.exit_code == 3 and f"continue with: aitrainsai run --resume {run.id}" in result.output
    else:
        assert result.exit_code == 1 and "--resume" not in result.output, result.output
        assert result.output.strip().splitlines()[-1] == (
            f"Error: run {run.id} refused: outer_trainer.tinker: base model 'x' is not offered; start a new run with "
            "another setting")


def test_the_loops_executor_runs_calls_side_by_side_and_waits_for_them_at_a_normal_end():
    import asyncio

    from aitrainsai.stopping import run_until_stopped

    ended: list[int] = []

    def call(i: int) -> int:
        time.sleep(0.2)
        ended.append(i)
        return i * i

    async def main():
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, call, 99)  # not awaited: a normal end still waits for it
        return await asyncio.gather(*(asyncio.to_thread(call, i) for i in range(8)))

    started = time.monotonic()
    assert run_until_stopped(main) == [i * i for i in range(8)]
    assert sorted(ended) == [*range(8), 99] and time.monotonic() - started < 1.5  # side by side, not 9 × 0.2 s


def test_a_call_submitted_as_a_thread_takes_another_gets_a_thread_of_its_own():
    """The moment between a thread taking a call off the queue and counting itself busy: a call submitted then
    must not wait behind the one just taken (in a full suite one waited behind a 120 s call)."""
    import queue
    import threading

    from aitrainsai.stopping import _DaemonThreads

    class SlowToCount(queue.SimpleQueue):
        def get(self, *args, **kwargs):
            item = super().get(*args, **kwargs)
            time.sleep(0.3)  # holds the moment open
            return item

    executor = _DaemonThreads(4)
    executor._work = SlowToCount()
    release = threading.Event()
    try:
        blocked = executor.submit(release.wait, 30)
        time.sleep(0.1)  # the first thread has taken the blocking call and is still counting itself idle
        assert executor.submit(lambda: 7).result(timeout=10) == 7
        assert not blocked.done()
    finally:
        release.set()
        executor.shutdown(wait=True)
