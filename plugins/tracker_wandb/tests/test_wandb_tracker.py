"""The wandb tracker against the real wandb (offline only), read back with wandb's own reader (``wandb leet
inspect --json``, via :func:`read_records`).

One run is written by two processes, as a killed and resumed aitrainsai run writes it: process A (a subprocess, in a
network namespace of its own when ``unshare -rn`` works) starts the tracker, logs a batch and is SIGKILLed at once;
this process then resumes with an overlapping batch (points A wrote, some with changed values, then new ones),
finishes and closes. wandb starts slowly, so that is the only run the tests open (plus one that fails before)."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import TypeAdapter

from aitrainsai import AnyPoint, EpisodePoint, EvalPoint, JobPoint, RunEnd, StepPoint, TrackedRun
from aitrainsai.testing import TrackerConformance
from aitrainsai_tracker_wandb import plugin
from aitrainsai_tracker_wandb.tracker import WandbConfig, WandbTracker, read_records, wandb_id

RUN_ID = "20260101-120000-ab12"
POINTS = TypeAdapter(list[AnyPoint])


def step(x, reward):
    return StepPoint(seq=x * 10, x=x, mean_reward=reward, components={"validation": 0.5}, jobs_trained=2,
                     mean_uplift=0.01 * x, update={"loss": 1.0 / x})


def episode(x, reward):
    return EpisodePoint(seq=x * 10 + 1, x=x, episode=f"e{x}", family="calc_chain", status="scored", reward=reward,
                        components={"validation": 1.0}, attempts=1)


def job(x, uplift):
    if x == 2:
        return JobPoint(seq=x * 10 + 2, x=x, job=f"j{x}", episode="e2", family="calc_chain", status="dead",
                        dead_reason="oom")
    return JobPoint(seq=x * 10 + 2, x=x, job=f"j{x}", episode="e1", family="calc_chain", status="done", pre=0.2,
                    post=0.2 + uplift, uplift=uplift, uplift_ci=(uplift - 0.1, uplift + 0.1), eval_size=64,
                    train_rewards=[0.1, 0.3, 0.4], train_seconds=12.0, wall_seconds=20.0)


def evaluation(x, reward):
    return EvalPoint(seq=x * 10 + 3, axis="eval/calc_chain", x=x, family="calc_chain", held_out=True,
                     mean_reward=reward, jobs=4)


# Process A logs these, then is killed.
BATCH_A = [evaluation(0, 0.05), step(1, 0.1), episode(1, 0.1), episode(2, 0.2), job(1, 0.05), step(2, 0.2),
           episode(3, 0.3), step(3, 0.3), episode(4, 0.4)]
# The resumed process is fed again from before the kill (values changed: the run holds A's), then new points.
BATCH_B = [evaluation(0, 9.0), step(2, 9.0), episode(3, 9.0), step(3, 9.0), episode(4, 9.0), job(1, 9.0),
           step(4, 0.4), episode(5, 0.5), job(2, 0.0), episode(6, 0.6), step(5, 0.5), evaluation(2, 0.25),
           *(episode(x, x / 100) for x in range(7, 101))]  # enough to cross the file's 32 KiB blocks

PROCESS_A = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from pydantic import TypeAdapter
    from aitrainsai import AnyPoint, TrackedRun
    from aitrainsai_tracker_wandb.tracker import WandbTracker

    run_dir, points = Path(sys.argv[1]), TypeAdapter(list[AnyPoint]).validate_json(sys.argv[2])
    tracker = WandbTracker(run_dir=run_dir)
    tracker.start(TrackedRun(run_id=sys.argv[3], name="nested", run_dir=run_dir, config={"loop": {"steps": 5}},
                             plugins={"aitrainsai-tracker-wandb": "0.1.0"}))
    tracker.log(points)
    print(tracker.file, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # killed right after log returned: no finish, no close
""")


def _network_namespace() -> list[str]:
    try:
        works = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        works = False
    return ["unshare", "-rn"] if works else []


def _wandb_services(parent: int) -> list[str]:
    """Live wandb-core processes started for process ``parent`` (a zombie has no command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"wandb-core") and f"{parent}".encode() in args:
            found.append(entry.name)
    return found


def _outside_loopback(event: str, args: tuple) -> bool:
    if event == "socket.getaddrinfo":
        host = args[0]
        host = host.decode() if isinstance(host, bytes) else host
        return host not in (None, "localhost") and not _loopback(host)
    address = args[1]
    return isinstance(address, tuple) and not _loopback(str(address[0]))


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _rows(path: Path) -> list[dict]:
    return [record["history"]["item"] for record in read_records(path) if record["type"] == "history"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    reached: list[str] = []
    active = [True]

    def audit(event, args):  # never raises: an audit hook that raises fails the audited call
        if not active or event not in ("socket.connect", "socket.sendto", "socket.getaddrinfo"):
            return
        try:
            if _outside_loopback(event, args):
                reached.append(f"{event} {args!r:.200}")
        except Exception as exc:  # noqa: BLE001
            reached.append(f"{event} (unreadable: {exc!r})")

    sys.addaudithook(audit)  # hooks cannot be removed: it stops recording when the fixture ends
    home = tmp_path_factory.mktemp("home")  # wandb's per-user folders, to see that nothing lands there
    saved = {key: os.environ.get(key) for key in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "WANDB_CONFIG_DIR")}
    os.environ.update(XDG_CACHE_HOME=str(home / "cache"), XDG_CONFIG_HOME=str(home / "config"),
                      WANDB_CONFIG_DIR=str(home / "config" / "wandb"))
    try:
        yield _resume(run_dir, reached)
    finally:
        active.clear()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _resume(run_dir: Path, reached: list[str]) -> SimpleNamespace:
    namespace = _network_namespace()
    a = subprocess.Popen([*namespace, sys.executable, "-c", PROCESS_A, str(run_dir),
                          POINTS.dump_json(BATCH_A).decode(), RUN_ID],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = a.communicate(timeout=120)
    assert a.returncode == -signal.SIGKILL, err[-2000:]
    file_a = Path(out.strip())
    leftover = []
    for _ in range(100):  # wandb-core notices its parent is gone within a poll
        if not (leftover := _wandb_services(a.pid)):
            break
        time.sleep(0.1)
    tracker = WandbTracker(run_dir=run_dir)
    seen: dict = {}

    def feed() -> None:  # as the core feeds a tracker: every call from one thread that is not the main one
        tracker.start(TrackedRun(run_id=RUN_ID, name="nested", run_dir=run_dir, config={"loop": {"steps": 5}},
                                 plugins={"aitrainsai-tracker-wandb": "0.1.0"}, resumed=True))
        seen.update(high_on_resume=dict(tracker.written), services_while_open=_wandb_services(os.getpid()))
        tracker.log(BATCH_B)
        tracker.finish(RunEnd(status="finished", steps=5))
        tracker.close()
        seen["closed"] = True

    thread = threading.Thread(target=feed)
    thread.start()
    thread.join(120)
    assert seen.get("closed"), "the resumed tracker failed (see the thread's traceback above)"
    return SimpleNamespace(run_dir=run_dir, file_a=file_a, file_b=tracker.file, tracker=tracker, **seen,
                           leftover_a=leftover, namespace=namespace, services_after=_wandb_services(os.getpid()),
                           reached=reached, home=Path(os.environ["XDG_CACHE_HOME"]).parent)


def test_a_killed_process_left_what_it_logged(resumed):
    """log() returned only once its rows were in the file: a SIGKILL right after loses none of them."""
    assert resumed.file_a.parent.parent == resumed.run_dir / "trackers" / "wandb" / "wandb"
    types = [record["type"] for record in read_records(resumed.file_a)]
    assert "exit" not in types  # it really was killed
    rows = _rows(resumed.file_a)
    assert [(row.get("step/x"), row.get("episode/x"), row.get("job/x"), row.get("eval/calc_chain/x")) for row in rows] \
        == [(None, None, None, 0), (1, None, None, None), (None, 1, None, None), (None, 2, None, None),
            (None, None, 1, None), (2, None, None, None), (None, 3, None, None), (3, None, None, None),
            (None, 4, None, None)]
    assert rows[1]["step/reward"] == pytest.approx(0.1) and rows[1]["step/update/loss"] == 1.0
    assert rows[4]["job/uplift_low"] == pytest.approx(-0.05) and rows[4]["job/train_reward_last"] == 0.4


def test_resume_starts_from_what_the_files_hold(resumed):
    assert resumed.high_on_resume == {"step": 3, "episode": 4, "job": 1, "eval/calc_chain": 0}
    assert resumed.file_b != resumed.file_a and resumed.file_b.parent.parent == resumed.file_a.parent.parent
    assert resumed.file_b.stat().st_size > 32768  # log() followed its rows across a block boundary


def test_each_point_is_in_the_run_once(resumed):
    rows = _rows(resumed.file_a) + _rows(resumed.file_b)
    xs = Counter()
    for row in rows:
        for key in row:
            if not key.startswith("_") and not key.endswith("/x"):
                axis = next(a for a in ("eval/calc_chain", "step", "episode", "job") if key.startswith(a + "/"))
                xs[(key, row[f"{axis}/x"])] += 1
    assert max(xs.values()) == 1
    by_axis = {axis: sorted(row[f"{axis}/x"] for row in rows if f"{axis}/x" in row)
               for axis in ("step", "episode", "job", "eval/calc_chain")}
    assert by_axis == {"step": [1, 2, 3, 4, 5], "episode": list(range(1, 101)), "job": [1, 2],
                       "eval/calc_chain": [0, 2]}
    rewards = {row["step/x"]: row["step/reward"] for row in rows if "step/x" in row}
    assert rewards == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4, 5: 0.5})  # A's values were kept
    assert {row["episode/x"]: row["episode/reward"] for row in rows if "episode/x" in row}[3] == pytest.approx(0.3)
    dead = next(row for row in rows if row.get("job/x") == 2)
    assert dead["job/dead"] == 1.0 and "job/uplift" not in dead
    assert [row["_step"] for row in rows] == list(range(len(rows)))  # one history across both processes


def test_axes_are_charted_against_their_own_x(resumed):
    metrics = [record["metric"] for record in read_records(resumed.file_b) if record["type"] == "metric"]
    assert {"glob_name": "step/*", "step_metric": "step/x", "options": {"defined": True, "step_sync": True}} \
        in metrics
    assert any(m.get("glob_name") == "eval/calc_chain/*" and m.get("step_metric") == "eval/calc_chain/x"
               for m in metrics)


def test_run_record_config_and_end(resumed):
    records = read_records(resumed.file_b)
    run = next(record["run"] for record in records if record["type"] == "run")
    assert run["run_id"] == RUN_ID and run["display_name"] == "nested" and run["project"] == "aitrainsai"
    config = run["config"]["update"]
    assert config["loop"] == {"steps": 5}
    assert config["aitrainsai"]["plugins"] == {"aitrainsai-tracker-wandb": "0.1.0"}
    summary = {}
    for record in records:
        if record["type"] == "summary":
            summary.update(record["summary"].get("update") or {})
    assert summary["aitrainsai/status"] == "finished" and summary["aitrainsai/steps"] == 5
    assert next(record["exit"] for record in records if record["type"] == "exit").get("exit_code", 0) == 0


def test_no_process_outlives_its_tracker(resumed):
    assert resumed.leftover_a == []  # A's wandb-core went with A
    assert len(resumed.services_while_open) == 1  # the resumed tracker's own wandb-core ...
    assert resumed.services_after == []  # ... stopped by close()


def test_everything_is_written_under_the_run(resumed):
    assert list(resumed.home.rglob("*")) == []
    assert list((resumed.run_dir / "trackers" / "wandb" / "service" / "wandb" / "logs").glob("core-debug-*.log"))


def test_offline_reaches_no_network(resumed):
    """This process (the resumed tracker) connected to nothing outside loopback; process A ran with no network at
    all where ``unshare -rn`` works. wandb-core is a separate process: the namespace is what covers it."""
    assert resumed.reached == []
    print(f"process A in a network namespace: {bool(resumed.namespace)}")


def test_a_store_that_cannot_be_written_fails(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    tracker = WandbTracker(WandbConfig(dir=blocker / "wandb"), run_dir=tmp_path)
    with pytest.raises(OSError):
        tracker.start(TrackedRun(run_id=RUN_ID, run_dir=tmp_path))
    tracker.close()
    with pytest.raises(RuntimeError):
        tracker.log([step(1, 0.1)])


def test_preflight(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert WandbTracker.preflight(WandbConfig()) == []
    lines = WandbTracker.preflight(WandbConfig(mode="online"))
    assert len(lines) == 1 and "WANDB_API_KEY" in lines[0] and "\n" not in lines[0]
    (tmp_path / "no-netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert WandbTracker.preflight(WandbConfig(mode="online")) == []
    (tmp_path / "file").write_text("")
    assert len(WandbTracker.preflight(WandbConfig(dir=tmp_path / "file"))) == 1


def test_wandb_ids():
    assert wandb_id(RUN_ID) == RUN_ID
    odd = wandb_id("my run/1")
    assert odd.startswith("my-run-1-") and odd != wandb_id("my run:1")


def test_the_plugin_registers_the_tracker_and_imports_no_wandb():
    registered = []
    plugin.register_trackers(registered.append)
    assert registered == [WandbTracker] and WandbTracker.name == "wandb"
    probe = ("import sys, aitrainsai_tracker_wandb.plugin, aitrainsai_tracker_wandb.tracker; "
             "print('wandb' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"


class TestWandbConformance(TrackerConformance):
    tracker = WandbTracker
    distribution = "aitrainsai-tracker-wandb"
    heavy_modules = ("wandb",)

    def read_back(self, run_dir, options):
        """Every value of every history row in the run's offline files, read with wandb's own reader."""
        out = []
        for path in sorted((run_dir / "trackers" / "wandb").rglob("*.wandb")):
            for row in _rows(path):
                for key, value in row.items():
                    if key.startswith("_") or key.endswith("/x"):
                        continue
                    parts = key.split("/")
                    axis = "/".join(parts[:2]) if parts[0] == "eval" else parts[0]
                    out.append((axis, key[len(axis) + 1:], row[f"{axis}/x"], value))
        return out
