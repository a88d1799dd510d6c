"""The viewer's pages through Starlette's TestClient, over a ledger written by hand with the core's public API:
every page renders, nothing hidden from the agent is served, and the ledger is never written."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from aitrainsai import EpisodeData, Ledger, OuterStep
from aitrainsai_viewer.app import create_app

SECRET = "SECRET-7f3a91"  # put wherever the agent must not look; never on a page
SECRET_SCORE = 0.123456789  # a per-item score


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("runs")
    ledger = Ledger(root)
    run = ledger.create_run({"families": {"train": ["calc_chain"]}, "inner_trainer": {"use": "not-installed"},
                             "eval_seed": SECRET}, [], name="hand-made")
    ledger.save_baseline("k", family="calc_chain", level=1, base_model="tiny", eval_seed=987654321, eval_size=3,
                         score=0.5, item_scores=[SECRET_SCORE, 1.0, 0.0])
    episode = run.dir / "episodes" / "g0000-e0"
    job = episode / "probe-1" / "job"
    job.mkdir(parents=True)
    (job / "rubric.py").write_text("def build_rubric():\n    return '<script>alert(1)</script>'\n")
    (episode / "eval").mkdir()
    (episode / "eval" / "scores.json").write_text(json.dumps({"items": [SECRET]}))
    outside = root / "secret.txt"
    outside.write_text(SECRET)
    (job / "linked.py").symlink_to(outside)  # a link out of the job: not followed
    train = {"base_model": "tiny", "pre": 0.25, "post": 0.75, "uplift": 0.5, "uplift_ci": [0.125, 0.875],
             "eval_size": 3, "train_seconds": 10.0, "metrics": {"post_item_scores": [SECRET_SCORE], "note": SECRET}}
    for k, reward in enumerate((0.8, 0.4)):
        run.upsert_episode(f"g0000-e{k}", status="done", step=0, family="calc_chain", level=1, group_id="g0000",
                           reward=reward, data=EpisodeData.model_validate({
                               "components": {"validation": 1.0, "job_quality": reward}, "train": train,
                               "frozen_job": str(job) if k == 0 else None, "design": {"rubric": f"r{k}"}}))
    run.add_message("g0000-e0", {"role": "user", "content": "<b>make a job</b>"})
    run.add_message("g0000-e0", {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "write_file", "arguments": json.dumps({"path": "rubric.py", "content": "x"})}}]})
    run.add_message("g0000-e0", {"role": "tool", "name": "write_file", "tool_call_id": "c1", "content": "wrote"})
    run.add_probe("g0000-e0", 1, False, ["rubric.py:12: build_rubric returns no rubric"], 0.5)
    run.record(OuterStep(step=1, mean_reward=0.6, groups=["g0000"], components={"validation": 1.0,
                                                                                 "job_quality": 0.6}))
    run.set_status("finished")
    ledger.close()
    return root, run.id


def client_of(runs_dir: Path) -> TestClient:
    """A client that names the viewer as a browser on loopback would (``Host: 127.0.0.1:8765``)."""
    return TestClient(create_app(runs_dir), base_url="http://127.0.0.1:8765", raise_server_exceptions=False)


def pages(run_id: str) -> list[str]:
    return ["/", f"/runs/{run_id}", f"/runs/{run_id}/steps/1", f"/runs/{run_id}/episodes/g0000-e0",
            f"/runs/{run_id}/episodes/g0000-e1", f"/runs/{run_id}/events"]


def test_pages_render_and_show_the_ledger(runs):
    root, run_id = runs
    client = client_of(root)
    for url in pages(run_id):
        assert client.get(url).status_code == 200, url
    run_page = client.get(f"/runs/{run_id}").text
    assert "+0.500 (+0.125 .. +0.875)" in run_page  # the job's uplift and interval
    assert "<svg" in run_page and 'id="chart-reward"' in run_page and "src=\"http" not in run_page
    assert 'data-stream' not in run_page  # a finished run opens no stream
    episode = client.get(f"/runs/{run_id}/episodes/g0000-e0").text
    assert "write_file" in episode and "build_rubric returns no rubric" in episode
    assert '<td class="file">rubric.py</td><td class="line">12</td>' in episode
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in episode and "<script>alert" not in episode  # escaped
    assert "&lt;b&gt;make a job&lt;/b&gt;" in episode
    assert "could not be rebuilt" in episode  # the trainer is not installed: files without a diff, and why


def test_hidden_data_is_never_served(runs):
    root, run_id = runs
    client = client_of(root)
    for url in [*pages(run_id), "/static/viewer.css", "/static/live.js", "/static/..%2Fsecret.txt",
                f"/runs/{run_id}/episodes/..%2F..%2Fsecret.txt"]:
        body = client.get(url).text
        assert SECRET not in body, url
        assert str(SECRET_SCORE) not in body and "987654321" not in body, url


def test_the_ledger_is_never_written(runs):
    root, run_id = runs
    ledger_file = root / "ledger.sqlite"
    before = (ledger_file.read_bytes(), os.stat(ledger_file).st_mtime_ns)
    listing = sorted(p.name for p in root.iterdir())
    client = client_of(root)
    for url in [*pages(run_id), "/runs/no-such-run", f"/runs/{run_id}/steps/7"]:
        client.get(url)
        assert (ledger_file.read_bytes(), os.stat(ledger_file).st_mtime_ns) == before, url
    assert not (root / "no-such-run").exists()
    assert {p for p in os.listdir(root)} - set(listing) <= {"ledger.sqlite-wal", "ledger.sqlite-shm"}


def test_bad_ids_and_a_missing_or_damaged_ledger_are_one_line_pages(runs, tmp_path):
    root, run_id = runs
    client = client_of(root)
    for url, status in [("/runs/nope", 404), (f"/runs/{run_id}/steps/99", 404),
                        (f"/runs/{run_id}/episodes/nope", 404), ("/runs/nope/events", 404)]:
        response = client.get(url)
        assert response.status_code == status and "Traceback" not in response.text, url
        assert re.search(r'id="error-line">[^<\n]+</p>', response.text), url
    empty = client_of(tmp_path / "nothing").get("/")
    assert empty.status_code == 500 and "no run ledger" in empty.text and not (tmp_path / "nothing").exists()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "ledger.sqlite").write_bytes(b"this is not a database" * 200)
    damaged = client_of(tmp_path / "bad").get("/")
    assert damaged.status_code == 500 and "Traceback" not in damaged.text
    assert "is damaged or is not a run ledger" in damaged.text
