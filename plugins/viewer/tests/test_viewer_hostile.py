"""Hostile input to the viewer, over real HTTP on loopback (uvicorn in a thread): a foreign ``Host`` (a page whose
name was rebound to this machine) or ``Origin`` (another site's script), transcripts of deeply nested JSON, huge and
badly encoded text, damaged rows, a job at the workspace's caps, and rows that point the job view at another folder.
Every page still renders, bounded; nothing hidden is served; the ledger is never written."""

from __future__ import annotations

import http.client
import json
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest

from aitrainsai import EpisodeData, Ledger, OuterStep
from aitrainsai_viewer.app import create_app
from aitrainsai_viewer.serve import hosts_for, served

SECRET = "SECRET-51-hidden"  # in every folder the job view must not read
DEEP = 100_000  # levels of nesting
JOB_FILES, JOB_BYTES = 64, 10_000_000  # the workspace's caps on a job (aitrainsai.jobs.job MAX_JOB_FILES/BYTES)
HUGE = "<" * 3_000_000  # a message over what a page decodes (and 12 MB once escaped)
LONG = "y" * 400_000  # a message a page decodes, but shows only the start of
PAGE_BOUND = 3_000_000  # bytes: no page may be larger


@dataclass
class Runs:
    root: Path
    run: str  # the hostile run
    broken: str  # a run whose own row is damaged
    other: str  # a plain run beside them
    job: Path  # g0000-e0's frozen job, at the caps
    seqs: dict[str, int]  # the hostile messages' seqs, by name


def _message_rows(db: sqlite3.Connection, run_id: str, episode: str, texts: list[str | bytes]) -> list[int]:
    seqs = []
    for text in texts:
        seq = db.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM messages WHERE run_id = ? AND episode_id = ?",
                         (run_id, episode)).fetchone()[0]
        # bytes: text that is not UTF-8, stored as TEXT (as a damaged file could hold it)
        value = "CAST(? AS TEXT)" if isinstance(text, bytes) else "?"
        db.execute(f"INSERT INTO messages VALUES (?, ?, ?, {value}, ?)", (run_id, episode, seq, text, time.time()))
        seqs.append(seq)
    return seqs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("hostile")
    ledger = Ledger(root)
    other = ledger.create_run({"inner_trainer": {"use": "not-installed"}}, [], name="other")
    other_job = other.dir / "episodes" / "g0000-e0" / "probe-1" / "job"
    other_job.mkdir(parents=True)
    (other_job / "secret.txt").write_text(SECRET)
    other.record(OuterStep(step=1, mean_reward=0.25, groups=["g0000"], components={}))
    other.set_status("finished")
    broken = ledger.create_run({"inner_trainer": {"use": "not-installed"}}, [], name="broken")
    broken.set_status("finished")
    run = ledger.create_run({"inner_trainer": {"use": "not-installed"}}, [], name="hostile")
    episodes = run.dir / "episodes"

    # g0000-e0: a job at the workspace's caps; its transcript and probes hostile
    job = episodes / "g0000-e0" / "probe-1" / "job"
    job.mkdir(parents=True)
    (job / "f00.py").write_text("<" * (JOB_BYTES // JOB_FILES))  # one line
    (job / "f01.bin").write_bytes(b"\x00\x01" * (JOB_BYTES // JOB_FILES // 2))
    line = 'x = "<b>" * 3  # one of many lines\n'
    for n in range(2, JOB_FILES):
        (job / f"f{n:02d}.py").write_text(line * (JOB_BYTES // JOB_FILES // len(line)))
    (episodes / "g0000-e0" / "eval").mkdir()
    (episodes / "g0000-e0" / "eval" / "scores.json").write_text(json.dumps({"items": [SECRET]}))
    train = {"base_model": "tiny", "pre": 0.25, "post": 0.75, "uplift": 0.5, "uplift_ci": [0.125, 0.875],
             "eval_size": 3, "train_seconds": 10.0, "metrics": {"note": SECRET}}
    run.upsert_episode("g0000-e0", status="done", step=0, family="calc_chain", level=1, group_id="g0000",
                       reward=0.5, data=EpisodeData.model_validate({"components": {"job_quality": 0.5}, "train": train,
                                                                    "frozen_job": str(job)}))
    for k in (1, 2, 3):  # rows damaged below
        run.upsert_episode(f"g0000-e{k}", status="done", step=0, family="calc_chain", level=1, group_id="g0000",
                           reward=0.1 * k)
    # g0001-e*: rows that point the job view at folders that are not their frozen job
    tampered = {}
    for k in range(5):
        folder = episodes / f"g0001-e{k}"
        (folder / "eval" / "job").mkdir(parents=True)
        (folder / "eval" / "secret.txt").write_text(SECRET)
        (folder / "eval" / "job" / "secret.txt").write_text(SECRET)
        tampered[k] = folder
    (tampered[1] / "probe-1" / "job").mkdir(parents=True)  # so that probe-1/job/../../eval resolves to eval/
    (tampered[2] / "probe-1").symlink_to(tampered[2] / "eval")  # probe-1/job is eval/job
    frozen = {0: tampered[0] / "eval",
              1: tampered[1] / "probe-1" / "job" / ".." / ".." / "eval",
              2: tampered[2] / "probe-1" / "job",
              3: other_job,
              4: Path("/")}
    for k, path in frozen.items():
        run.upsert_episode(f"g0001-e{k}", status="done", step=0, family="calc_chain", level=1, group_id="g0001",
                           reward=0.2, data=EpisodeData(frozen_job=str(path)))
    run.add_probe("g0000-e0", 1, True, ["rubric.py:3: fine"], 1.0)
    run.upsert_job("g0000-e0-job", status="done", episode_id="g0000-e0", cost_usd=0.5)
    run.record(OuterStep(step=1, mean_reward=0.5, groups=["g0000"], components={"job_quality": 0.5}))
    run.add_message("g0000-e0", {"role": "user", "content": "make a job"})
    run.set_status("finished")
    ledger.close()

    db = sqlite3.connect(root / "ledger.sqlite", isolation_level=None)
    nested_array = "[" * DEEP + "]" * DEEP
    nested_object = '{"a":' * 70 + "1" + "}" * 70  # deeper than a row may be, shallow enough to parse
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": nested_array}}]}
    hostile = {
        "deep arguments": json.dumps(call),
        "deep content": '{"role": "tool", "content": ' + nested_array + "}",
        "deep argument value": ('{"role": "assistant", "tool_calls": [{"id": "c2", "function": {"name": "f", '
                                '"arguments": ' + nested_array + "}}]}"),
        "deep object": '{"role": "tool", "content": ' + nested_object + "}",
        "huge": json.dumps({"role": "tool", "content": HUGE}),
        "long": json.dumps({"role": "tool", "content": LONG}),
        "surrogate": json.dumps({"role": "user", "content": "a lone \udc80 surrogate"}),
        "bad utf-8": b'{"role": "user", "content": "bad \xff\xfe bytes"}',
        "unparseable": '{"role": "assistant", "content": "unterminated',
        "not an object": "[1, 2, 3]",
        "calls not a list": json.dumps({"role": "assistant", "tool_calls": "nope"}),
        "calls of odd types": json.dumps({"role": "assistant", "tool_calls": ["x", {"function": [1]}, None]}),
    }
    names = list(hostile)
    seqs = dict(zip(names, _message_rows(db, run.id, "g0000-e0", [hostile[name] for name in names])))
    for n in range(120):  # three pages of transcript
        _message_rows(db, run.id, "g0000-e0", [json.dumps({"role": "assistant", "content": f"turn {n}"})])
    now = time.time()
    db.execute("INSERT INTO probes VALUES (?, 'g0000-e0', 2, 0, '[\"unterminated', 0.1, ?)", (run.id, now))
    db.execute("INSERT INTO probes VALUES (?, 'g0000-e0', 3, 0, '5', 0.1, ?)", (run.id, now))
    db.execute("UPDATE episodes SET data = '{\"components\": ' WHERE run_id = ? AND id = 'g0000-e1'", (run.id,))
    db.execute("UPDATE episodes SET data = ? WHERE run_id = ? AND id = 'g0000-e2'",
               (json.dumps({"train": {"uplift": "high"}, "components": [1, 2]}), run.id))
    db.execute("UPDATE episodes SET data = ? WHERE run_id = ? AND id = 'g0000-e3'",
               ('{"design": ' + nested_array + "}", run.id))
    db.execute("INSERT INTO jobs VALUES (?, 'g0000-e1-job', 'g0000-e1', 'done', NULL, NULL, 0.1, 1.0, '{\"pre\": ', "
               "?, ?)", (run.id, now, now))
    db.execute("INSERT INTO jobs VALUES (?, 'g0000-e2-job', 'g0000-e2', 'exploded', NULL, NULL, 0.1, 1.0, '{}', ?, ?)",
               (run.id, now, now))
    db.execute("INSERT INTO events (run_id, kind, data, created_at) VALUES (?, 'outer_step', '{\"step\": 2, ', ?)",
               (run.id, now))
    db.execute("UPDATE runs SET config = '{\"families\": ', created_at = 'yesterday', name = ? WHERE id = ?",
               ("n" * 100_000, broken.id))
    db.execute("INSERT INTO runs VALUES (X'2e2e', 'blob id', 'finished', ?, ?, '{}', '[]', NULL)", (now, now))
    db.close()
    return Runs(root, run.id, broken.id, other.id, job, seqs)


@pytest.fixture(scope="module")
def site(runs) -> Iterator[str]:
    with served(create_app(runs.root)) as url:
        yield url


def get(site: str, path: str, host: str | None = None, headers: dict[str, str] | None = None,
        hosts: list[str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One GET to the viewer on loopback, with exactly the Host header(s) given (default: the viewer's own)."""
    address = urlsplit(site)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    try:
        connection.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        for value in hosts if hosts is not None else [host if host is not None else address.netloc]:
            connection.putheader("Host", value)
        for key, value in (headers or {}).items():
            connection.putheader(key, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def routes(runs: Runs) -> list[str]:
    base = f"/runs/{runs.run}"
    return ["/", base, f"{base}/steps/1", f"{base}/episodes/g0000-e0", f"{base}/episodes/g0000-e0/messages/0",
            f"{base}/episodes/g0000-e0/files/f02.py", f"{base}/events", "/static/live.js"]


def test_a_foreign_host_is_refused_on_every_route(runs, site):
    port = urlsplit(site).port
    for path in routes(runs):
        assert get(site, path)[0] == 200, path  # as the browser names it
        assert get(site, path, host=f"localhost:{port}")[0] == 200, path
        for host in [f"evil.test:{port}", "evil.test", f"127.0.0.1:{port + 1}", "127.0.0.1", f"localhost:{port}0",
                     f"127.0.0.1.evil.test:{port}", f"[::2]:{port}", f"evil.test:{port}@127.0.0.1:{port}"]:
            status, headers, body = get(site, path, host=host)
            assert status == 421, (path, host, status)
            assert b"write_file" not in body and b"make a job" not in body and b"EventSource" not in body
        assert get(site, path, hosts=[f"127.0.0.1:{port}", f"evil.test:{port}"])[0] in (400, 421), path
        assert get(site, path, hosts=[])[0] in (400, 421), path  # none at all


def test_another_origin_cannot_read_the_event_stream_or_the_pages(runs, site):
    port = urlsplit(site).port
    for path in [f"/runs/{runs.run}/events", f"/runs/{runs.run}", f"/runs/{runs.run}/episodes/g0000-e0"]:
        for origin in [f"http://evil.test:{port}", f"http://127.0.0.1:{port + 1}", "null",
                       f"https://127.0.0.1:{port}", f"http://localhost:{port}", f"http://127.0.0.1:{port}x"]:
            status, _, body = get(site, path, headers={"Origin": origin})
            assert status == 403, (path, origin, status)
            assert b"event: change" not in body and b"make a job" not in body
        status, _, _ = get(site, path, headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"})
        assert status == 403, path
        status, _, _ = get(site, path, headers={"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors"})
        assert status == 403, path
        # its own pages' requests, and a link followed from another site, are answered
        assert get(site, path, headers={"Origin": f"http://127.0.0.1:{port}"})[0] == 200, path
        assert get(site, path, headers={"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"})[0] == 200, path
        assert get(site, path, headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"})[0] == 200
    status, _, body = get(site, f"/runs/{runs.run}/events")
    assert status == 200 and b"event: end" in body  # a finished run's stream ends at once


def test_a_public_viewer_answers_to_its_names_and_addresses_only(runs):
    hosts = hosts_for("0.0.0.0", public=True, allowed=["viewer.example"])
    with served(create_app(runs.root, hosts=hosts)) as site:
        port = urlsplit(site).port
        for host in [f"viewer.example:{port}", f"10.1.2.3:{port}", f"[fe80::1]:{port}", f"127.0.0.1:{port}"]:
            assert get(site, "/", host=host)[0] == 200, host
        for host in [f"evil.test:{port}", f"viewer.example.evil.test:{port}", f"10.1.2.3:{port + 1}"]:
            assert get(site, "/", host=host)[0] == 421, host
    loopback = hosts_for("127.0.0.1", allowed=["box.local"])
    assert loopback.allows("box.local") and loopback.allows("localhost") and not loopback.allows("10.1.2.3")


def test_a_hostile_transcript_renders_bounded_and_paginated(runs, site):
    base = f"/runs/{runs.run}/episodes/g0000-e0"
    status, headers, body = get(site, base)
    assert status == 200 and len(body) < PAGE_BOUND, (status, len(body))
    page = body.decode()
    for name, seq in runs.seqs.items():
        assert re.search(rf'data-seq="{seq}"', page), name  # every message in its place
    shown = {name: page.split(f'data-seq="{seq}"', 1)[1].split('class="message', 1)[0]
             for name, seq in runs.seqs.items()}
    assert "nested more than 32 deep" in shown["deep arguments"] and "write_file" in shown["deep arguments"]
    assert "damaged: nested more than 64 deep" in shown["deep content"]
    assert "damaged: nested more than 64 deep" in shown["deep argument value"]
    assert "damaged: nested more than 64 deep" in shown["deep object"]
    assert "more than a page reads" in shown["huge"] and "whole message" in shown["huge"]
    assert "more characters not shown here" in shown["long"] and LONG[:20_000] in shown["long"]
    assert LONG[:20_001] not in page
    assert "a lone \\udc80 surrogate" in shown["surrogate"]
    assert "bad \ufffd\ufffd bytes" in shown["bad utf-8"]
    assert "damaged: not valid JSON" in shown["unparseable"]
    assert "damaged: a JSON list, not a message" in shown["not an object"]
    assert "not a list" in shown["calls not a list"]
    assert "not a tool call" in shown["calls of odd types"]
    assert 'data-pages="3"' in page and "Traceback" not in page
    for number, last in [(2, b"turn 60<"), (3, b"turn 119<"), (99, b"turn 119<")]:  # past the end: the last page
        status, _, more = get(site, f"{base}?page={number}")
        assert status == 200 and len(more) < PAGE_BOUND and last in more, number
    status, _, line = get(site, f"{base}?page=x")
    assert status == 400 and b"is not a page number" in line
    # the whole of a cut message, as stored, as plain text that no browser runs
    status, headers, whole = get(site, f"{base}/messages/{runs.seqs['long']}")
    assert status == 200 and LONG.encode() in whole and headers["content-type"].startswith("text/plain")
    assert "sandbox" in headers["content-security-policy"] and headers["x-content-type-options"] == "nosniff"
    status, _, whole = get(site, f"{base}/messages/{runs.seqs['huge']}")
    assert status == 200 and len(whole) > len(HUGE)
    # the probe attempts: the damaged ones in their place
    assert "probe attempt 2</b>: damaged: not valid JSON" in page and "probe attempt 3</b>: damaged:" in page
    assert '<td class="file">rubric.py</td><td class="line">3</td>' in page


def test_damaged_rows_show_in_their_place(runs, site):
    ledger_file = runs.root / "ledger.sqlite"
    before = (ledger_file.read_bytes(), os.stat(ledger_file).st_mtime_ns)
    status, _, index = get(site, "/")
    assert status == 200, index[-500:]
    text = index.decode()
    assert f'data-run="{runs.other}"' in text and f'data-run="{runs.broken}"' in text
    assert re.search(rf'<tr class="damaged-why" data-run="{runs.run}"><td colspan="7">damaged: its last outer step '
                     r'\(event \d+\): not valid JSON', text)
    assert "damaged: its id is not a run&#39;s id" in text  # the row whose id is bytes
    assert "its created_at is &#39;yesterday&#39;" in text and "n" * 201 not in text

    status, _, page = get(site, f"/runs/{runs.run}")
    assert status == 200, page[-500:]
    text = page.decode()
    for what in ["episode g0000-e1</b>: not valid JSON", "episode g0000-e2</b>: data.",
                 "episode g0000-e3</b>: nested more than 64 deep", "job g0000-e1-job</b>:", "job g0000-e2-job</b>:",
                 "outer_step event"]:
        assert what in text, what
    assert 'data-episode="g0000-e0"' in text and 'id="chart-reward"' in text
    # in the jobs table, in their place, linked to their pages
    assert re.findall(r'<tr class="damaged" data-episode="(g0000-e[123])"><td><a href="[^"]+/episodes/g0000-e[123]">',
                      text) == ["g0000-e1", "g0000-e2", "g0000-e3"]

    status, _, step = get(site, f"/runs/{runs.run}/steps/1")
    assert status == 200 and b'tr data-episode="g0000-e0"' in step and step.count(b'<tr class="damaged"') == 3
    for k in (1, 2, 3):
        status, _, episode = get(site, f"/runs/{runs.run}/episodes/g0000-e{k}")
        assert status == 200 and b'<p class="error" id="episode-damaged">This episode\'s row is damaged' in episode, k
    status, _, page = get(site, f"/runs/{runs.broken}")
    assert status == 200 and b"the run&#39;s config</b>: not valid JSON" in page
    assert (ledger_file.read_bytes(), os.stat(ledger_file).st_mtime_ns) == before


def _stamps(page: str) -> dict[str, str]:
    import html

    return {name: html.unescape(stamp) for name, stamp in
            re.findall(r'<section class="part" data-part="([a-z]+)" data-stamp="([^"]*)">', page)}


def test_a_job_at_the_caps_is_bounded_and_its_files_are_linked(runs, site):
    base = f"/runs/{runs.run}/episodes/g0000-e0"
    status, _, body = get(site, base)
    assert status == 200
    stamps = _stamps(body.decode())
    assert set(stamps) == {"episode", "transcript", "job"}
    # the job's part alone, as a live page fetches it when only it changed
    asked = {name: stamp for name, stamp in stamps.items() if name != "job"}
    status, _, part = get(site, f"{base}?parts={quote(json.dumps(asked))}")
    assert status == 200 and part.count(b'data-part="') == 1 and b'data-part="job"' in part
    assert len(part) < 1_000_000, len(part)
    text = part.decode()
    names = sorted(p.name for p in runs.job.iterdir())
    assert len(names) == 64
    for name in names:
        size = (runs.job / name).stat().st_size
        assert re.search(rf'data-file="{name}"( open)?><summary>{name} <span class="note">\([a-z ]+, {size} '
                         rf'bytes\)</span> <a href="{base}/files/{name}" class="raw">whole file</a>', text), name
    assert "binary: not shown" in text and "only its first" in text
    assert SECRET not in text
    for name in ("f00.py", "f01.bin", "f63.py"):
        status, headers, whole = get(site, f"{base}/files/{name}")
        assert status == 200 and whole == (runs.job / name).read_bytes(), name
        assert headers["content-type"].startswith("text/plain") and "sandbox" in headers["content-security-policy"]
    for name in ("../eval/scores.json", "..%2Feval%2Fscores.json", "nothere.py", "", "f02.py/x", ".%2E/.%2E/x"):
        status, _, body = get(site, f"{base}/files/{name}")
        assert status == 404 and SECRET.encode() not in body, name


def test_a_live_page_fetches_only_its_parts_that_changed(runs, site):
    for path in [f"/runs/{runs.run}/episodes/g0000-e0", f"/runs/{runs.run}", f"/runs/{runs.run}/steps/1"]:
        status, _, body = get(site, path)
        stamps = _stamps(body.decode())
        assert status == 200 and stamps, path
        status, _, nothing = get(site, f"{path}?parts={quote(json.dumps(stamps))}")
        assert status == 204 and nothing == b"", path
    path = f"/runs/{runs.run}/episodes/g0000-e0"
    stale = {**_stamps(get(site, path)[2].decode()), "transcript": "an older one"}
    status, _, part = get(site, f"{path}?parts={quote(json.dumps(stale))}")
    assert status == 200 and re.findall(rb'data-part="([a-z]+)"', part) == [b"transcript"]
    status, _, line = get(site, f"{path}?parts=%7Bbad")
    assert status == 400 and b"not valid JSON" in line


def test_job_files_are_read_only_from_the_episodes_frozen_job(runs, site):
    for k in range(5):
        base = f"/runs/{runs.run}/episodes/g0001-e{k}"
        status, _, body = get(site, base)
        assert status == 200, k
        assert SECRET.encode() not in body and b'class="raw"' not in body, k
        assert b"not read" in body or b"is gone" in body, k
        for name in ("secret.txt", "job/secret.txt", "scores.json"):
            status, _, body = get(site, f"{base}/files/{name}")
            assert status == 404 and SECRET.encode() not in body, (k, name)
