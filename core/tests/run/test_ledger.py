import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest

from aitrainsai.run.ledger import Ledger, LedgerError
from aitrainsai.run.record import EpisodeData, JobProgress, Reward


def test_records_round_trip(tmp_path):
    ledger = Ledger(tmp_path)
    run = ledger.create_run({"loop": {"steps": 1}}, [{"name": "aitrainsai", "version": "0.1.0"}], name="demo")
    run.upsert_episode("e1", status="running", step=0, family="calc_chain", data=EpisodeData(frozen_job="a"))
    run.upsert_episode("e1", status="done", reward=0.42, data=EpisodeData(components={"b": 2.0}))
    run.add_message("e1", {"role": "user", "content": "hi"})
    run.add_message("e1", {"role": "assistant", "content": "hello"})
    run.add_probe("e1", 1, False, ["config.toml: steps too large"], 0.5)
    run.upsert_job("j1", status="running", episode_id="e1", backend="local", handle={"pid": 1})
    run.upsert_job("j1", status="done", cost_usd=0.0, wall_s=12.5, progress=JobProgress(pre=0.1, post=0.3))
    run.record(Reward(episode="e1", total=0.42))
    again = Ledger(tmp_path).run("demo")
    assert again.info().config == {"loop": {"steps": 1}}
    (episode,) = again.episodes()
    assert episode.status == "done" and episode.reward == 0.42
    assert episode.data == EpisodeData(frozen_job="a", components={"b": 2.0})
    assert [m["content"] for m in again.transcript("e1")] == ["hi", "hello"]
    assert again.probes("e1")[0].problems == ["config.toml: steps too large"]
    (job,) = again.jobs()
    assert job.handle == {"pid": 1} and job.progress == JobProgress(pre=0.1, post=0.3) and job.wall_s == 12.5
    assert [e.data["total"] for e in again.events("reward")] == [0.42]
    (summary,) = Ledger(tmp_path).summaries()
    assert summary.episodes == 1 and summary.jobs_done == 1 and summary.mean_reward == 0.42


def test_run_references(tmp_path):
    ledger = Ledger(tmp_path)
    first = ledger.create_run({}, [])
    second = ledger.create_run({}, [], name="named")
    assert ledger.run("latest").id == second.id
    assert ledger.run(first.id).id == first.id
    assert ledger.run("named").id == second.id
    with pytest.raises(LedgerError, match="no run 'zzz'"):
        ledger.run("zzz")
    with pytest.raises(LedgerError, match="matches 2 runs"):
        ledger.run(first.id[:4])


def test_a_killed_writer_loses_nothing_it_had_finished(tmp_path):
    """SIGKILL a process in the middle of writing: every record it finished is there, none is half-written."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        from aitrainsai.run.ledger import Ledger
        from aitrainsai.run.record import EpisodeData
        run = Ledger({str(tmp_path)!r}).create_run({{"x": 1}}, [], name="killed")
        for i in range(200):
            run.upsert_episode(f"e{{i}}", status="done", reward=i / 200, data=EpisodeData(frozen_job="x" * 1000))
            run.add_message(f"e{{i}}", {{"role": "assistant", "content": str(i)}})
            print(i, flush=True)
            if i == 150:
                os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL
    finished = int(proc.stdout.split()[-1])
    run = Ledger(tmp_path).run("killed")
    episodes = run.episodes()
    assert len(episodes) == finished + 1 == 151
    assert all(len(e.data.frozen_job or "") == 1000 for e in episodes)
    assert run.transcript("e150") == [{"role": "assistant", "content": "150"}]
    assert not os.path.exists(tmp_path / "ledger.sqlite-journal")


def damaged_ledger(runs_dir, kind: str) -> None:
    """A ledger in ``runs_dir`` with a run named "demo", then damaged: ``text`` (a text file named ledger.sqlite),
    ``truncated`` (cut in half) or ``garbage`` (a page of random bytes in the middle of an otherwise valid file)."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    path = runs_dir / "ledger.sqlite"
    if kind == "text":
        path.write_text("these are not the runs you are looking for\n" * 50)
        return
    ledger = Ledger(runs_dir)
    run = ledger.create_run({"families": {"train": ["a"], "held_out": []}}, [], name="demo")
    for i in range(100):
        run.upsert_episode(f"e{i}", status="done", step=0, family="a", reward=0.5,
                           data=EpisodeData(design={"pad": "x" * 2000}))
    ledger.close()  # checkpoints the WAL into the file
    size = path.stat().st_size
    if kind == "truncated":
        os.truncate(path, size // 2)
    else:
        page = 4096
        with open(path, "r+b") as handle:
            handle.seek(size // page // 2 * page)
            handle.write(random.Random(0).randbytes(page))


DAMAGE = ["text", "truncated", "garbage"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_ledger_is_one_clear_error_wherever_it_is_noticed(tmp_path, kind):
    damaged_ledger(tmp_path, kind)
    with pytest.raises(LedgerError) as caught:
        ledger = Ledger(tmp_path)  # a text file fails here; damage inside the file only at the first query
        ledger.summaries()
    message = str(caught.value)
    assert str(tmp_path / "ledger.sqlite") in message and "damaged" in message and "move it aside" in message
    assert "\n" not in message
    if kind != "text":
        with pytest.raises(LedgerError, match="damaged"):
            Ledger(tmp_path).check()


def test_a_read_query_on_a_damaged_page_is_a_ledger_error(tmp_path):
    damaged_ledger(tmp_path, "garbage")
    run = Ledger(tmp_path).run("demo")  # the runs table is intact
    with pytest.raises(LedgerError, match="damaged"):
        run.episodes()


def test_an_unusable_runs_directory_is_a_ledger_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(LedgerError, match="cannot use the runs directory .*file"):
        Ledger(tmp_path / "file")


def test_a_transaction_records_all_or_nothing(tmp_path):
    run = Ledger(tmp_path).create_run({}, [], name="t")
    with pytest.raises(RuntimeError):
        with run.transaction():
            run.upsert_episode("e1", status="done", reward=1.0)
            run.record(Reward(episode="e1"))
            raise RuntimeError("killed in between")
    assert run.episodes() == [] and list(run.events()) == []
    with run.transaction():
        with run.transaction():  # nested blocks join the outer one
            run.upsert_episode("e1", status="done", reward=1.0)
        run.record(Reward(episode="e1"))
    assert len(run.episodes()) == 1 and len(list(run.events())) == 1


def test_one_runner_per_run_and_a_killed_runner_shows_interrupted(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from aitrainsai.run.ledger import Ledger
        run = Ledger({str(tmp_path)!r}).create_run({{"x": 1}}, [], name="held")
        with run.hold():
            run.set_status("running")
            print("holding", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        ledger = Ledger(tmp_path)
        run = ledger.run("held")
        assert run.info().status == "running" and ledger.summaries()[0].status == "running"
        with pytest.raises(LedgerError, match="being run by another process"):
            with run.hold():
                pass
    finally:
        proc.kill()
        proc.wait()
    assert run.info().status == "interrupted" and ledger.summaries()[0].status == "interrupted"
    with run.hold():  # a resume takes it over
        run.set_status("running")
        assert run.info().status == "running"


def test_a_read_only_ledger_reads_and_never_writes_or_creates(tmp_path):
    with pytest.raises(LedgerError, match="no run ledger"):
        Ledger(tmp_path / "none", readonly=True)
    assert not (tmp_path / "none").exists()
    run = Ledger(tmp_path).create_run({"loop": {}}, [])
    run.record(Reward(episode="e0", total=0.5))
    file = tmp_path / "ledger.sqlite"
    before = (file.read_bytes(), file.stat().st_mtime_ns)
    reader = Ledger(tmp_path, readonly=True)
    assert [r.total for r in reader.run(run.id).records(Reward)] == [0.5]
    with pytest.raises(LedgerError, match="read-only"):
        reader.run(run.id).record(Reward(episode="e1", total=1.0))
    (tmp_path / run.id).rmdir()
    reader.run(run.id)
    assert not (tmp_path / run.id).exists()  # a reader's Run makes no folder
    assert (file.read_bytes(), file.stat().st_mtime_ns) == before
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "ledger.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(LedgerError):
        Ledger(tmp_path / "garbage", readonly=True)
