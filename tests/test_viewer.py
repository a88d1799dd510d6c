"""`aitrainsai view` as a person uses it: a real headless Chromium (Debian's, driven by Playwright) clicks through a
recorded run (given-numbers trainer, recipe agent) served on loopback, and watches a live run progress."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aitrainsai.run.ledger import Ledger, LedgerError, run_is_live
from aitrainsai.run.loop import run_loop
from aitrainsai.cli.report import collect
from episode_helpers import orchestrator_script, plugins_with_given_numbers, resolved_config, session_of

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    if os.environ.get("AITRAINSAI_REQUIRE_CHROMIUM") == "1":
        raise RuntimeError(f"{CHROMIUM} is missing and AITRAINSAI_REQUIRE_CHROMIUM=1 (apt-get install chromium)")
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)", allow_module_level=True)
playwright = pytest.importorskip("playwright.sync_api")

SMALL = ("loop.steps=2", "loop.group_size=2", "loop.groups_per_step=1", "families.train=['calc_chain']",
         "loop.final_eval=false", "inner_trainer.given-numbers.spread=0.3")
PROBLEM = "rubric.py:7: build_rubric() returned None; return a vf.Rubric"


@contextlib.contextmanager
def served(runs: Path, plugins=None) -> Iterator[str]:
    """The viewer over ``runs`` on 127.0.0.1 at a free port, in a thread; stopped (and joined) on exit."""
    from aitrainsai_viewer.app import create_app
    from aitrainsai_viewer.serve import served as serving

    with serving(create_app(runs, plugins)) as url:
        yield url


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, str]:
    """One finished run, 2 outer steps of one group of 2; with one refused probe attempt added to an episode (the
    recipe's jobs pass the probe at once, and the transcript page shows a refusal's problems)."""
    root = tmp_path_factory.mktemp("runs")
    plugins = plugins_with_given_numbers()
    run = Ledger(root).create_run(resolved_config(plugins, *SMALL).snapshot(), [], name="recorded")
    run_loop(session_of(run, plugins))
    episode = collect(run)
    run.add_probe("g0000-e0", 0, False, [PROBLEM], 0.1)
    assert episode.steps == [1, 2]
    return root, run.id


@pytest.fixture(scope="module")
def site(runs) -> Iterator[str]:
    with served(runs[0], plugins_with_given_numbers) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        # names under .test resolve to loopback, as an attacker's DNS rebinds its own name to this machine
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                     args=["--host-resolver-rules=MAP *.test 127.0.0.1"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, request):
    """A page that records console errors and page errors; the test fails on any."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.problems = problems  # type: ignore[attr-defined]  # a test that expects some removes them
    yield page
    context.close()
    assert problems == []


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("AITRAINSAI_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_click_through_run_step_job_and_transcript(runs, site, page, shots):
    root, run_id = runs
    ledger = Ledger(root)
    run = ledger.run(run_id)
    data = collect(run)
    page.goto(site + "/")
    row = page.locator(f'#runs tr[data-run="{run_id}"]')
    assert row.locator(".steps").inner_text() == "2"
    assert row.locator(".reward").inner_text() == f"{data.reward[-1]:+.3f}"
    page.screenshot(path=str(shots / "viewer-index.png"), full_page=True)

    row.get_by_role("link", name=run_id).click()
    page.wait_for_url(f"**/runs/{run_id}")
    shown = [page.locator(f'#steps tr[data-step="{s}"] .reward').inner_text() for s in data.steps]
    assert shown == [f"{r:+.3f}" for r in data.reward]
    dots = page.locator("#chart-reward circle")
    assert dots.count() == 2 and [float(dots.nth(i).get_attribute("data-value")) for i in range(2)] == pytest.approx(
        data.reward, abs=1e-5)
    for name in ("validation", "job_quality", "train_speed"):
        assert page.locator(f"#chart-{name} circle").count() == 2
    assert page.locator("body[data-stream]").count() == 0  # a finished run opens no stream
    page.screenshot(path=str(shots / "viewer-run.png"), full_page=True)

    page.locator('#steps tr[data-step="1"] a').click()
    page.wait_for_url(f"**/runs/{run_id}/steps/1")
    step = next(e.data for e in run.events("outer_step") if e.data["step"] == 1)
    assert page.locator("#step-reward").inner_text() == f"{step['mean_reward']:+.3f}"
    for group in step["groups"]:
        for episode in run.episodes(group):
            cell = page.locator(f'tr[data-episode="{episode.id}"] .reward')
            assert cell.inner_text() == f"{episode.reward:+.3f}"
    page.screenshot(path=str(shots / "viewer-step.png"), full_page=True)

    page.goto(f"{site}/runs/{run_id}")  # back to the jobs table: the job of g0000-e0
    job = page.locator('#jobs tr[data-episode="g0000-e0"]')
    train = next(e for e in run.episodes() if e.id == "g0000-e0").data.train
    assert train is not None
    low, high = train.uplift_ci
    assert job.locator(".uplift").inner_text() == f"{train.uplift:+.3f} ({low:+.3f} .. {high:+.3f})"
    job.get_by_role("link", name="g0000-e0").click()
    page.wait_for_url(f"**/runs/{run_id}/episodes/g0000-e0")

    message = next(m for m in run.transcript("g0000-e0") if m.get("tool_calls"))
    name = message["tool_calls"][0]["function"]["name"]
    assert page.locator("#transcript .call .tool", has_text=name).count() >= 1
    problem = page.locator('.probe[data-attempt="0"] .problems tr', has_text="build_rubric() returned None")
    assert problem.locator(".file").inner_text() == "rubric.py" and problem.locator(".line").inner_text() == "7"
    assert page.locator("#reward .uplift").inner_text() == f"{train.uplift:+.3f} ({low:+.3f} .. {high:+.3f})"
    assert page.locator("#no-diff").count() == 0  # the starting files were rebuilt: a diff
    assert page.locator('#job-files details[data-file="rubric.py"] .diff .add').count() > 0
    page.screenshot(path=str(shots / "viewer-transcript.png"), full_page=True)
    ledger.close()


def test_a_live_run_updates_its_page(tmp_path, browser, page, shots):
    """A run started after the viewer: its page, opened before any outer step finished, shows the steps and the
    reward figure as they come, without a reload, and closes its stream when the run ends."""
    Ledger(tmp_path).close()  # an empty ledger: the viewer never creates one
    script = orchestrator_script(tmp_path, "live", *SMALL, "inner_trainer.given-numbers.job_seconds=1.0")
    with served(tmp_path, plugins_with_given_numbers) as site:
        process = subprocess.Popen([sys.executable, "-c", script, "new"], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            run_id = None
            deadline = time.monotonic() + 60
            while run_id is None and time.monotonic() < deadline and process.poll() is None:
                with contextlib.suppress(LedgerError):
                    ledger = Ledger(tmp_path)
                    found = ledger.run("live")
                    run_id = found.id if run_is_live(found.dir) else None
                    ledger.close()
                time.sleep(0.2)
            assert run_id is not None, process.communicate()
            page.goto(f"{site}/runs/{run_id}")
            assert page.locator("body[data-stream]").count() == 1
            assert page.locator("#no-steps").count() == 1, "the run finished a step before the page opened"
            page.wait_for_selector('#steps tr[data-step="1"]', timeout=90_000)
            assert page.locator("#chart-reward circle").count() >= 1
            page.wait_for_selector('#steps tr[data-step="2"]', timeout=90_000)
            page.wait_for_selector("#run-status.status-finished", timeout=60_000)
            page.screenshot(path=str(shots / "viewer-live.png"), full_page=True)
            assert process.wait(timeout=60) == 0, process.communicate()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_a_bad_run_id_and_a_damaged_ledger_get_a_clear_page(runs, site, page, tmp_path):
    response = page.goto(site + "/runs/no-such-run")
    assert response is not None and response.status == 404
    assert "no run 'no-such-run'" in page.locator("#error-line").inner_text()
    assert "Traceback" not in page.content()
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    shutil.copy(runs[0] / "ledger.sqlite", damaged / "ledger.sqlite")
    with open(damaged / "ledger.sqlite", "r+b") as handle:
        handle.write(os.urandom(4096))  # the header and the first page
    with served(damaged) as bad:
        response = page.goto(bad + "/")
        assert response is not None and response.status == 500
        line = page.locator("#error-line").inner_text()
        assert "is damaged or is not a run ledger" in line and "\n" not in line
        assert "Traceback" not in page.content()
    # Chromium reports each error status as a console error: those two, and nothing else
    assert [p for p in page.problems if "status of 404" not in p and "status of 500" not in p] == []
    page.problems.clear()


ATTACK = """<!doctype html><meta charset="utf-8"><title>another site</title><body><script>
(async () => {
  const target = TARGET, run = RUN, result = {};
  try {
    const response = await fetch(target + "/runs/" + run);
    result.page = response.status + " " + (await response.text()).slice(0, 3000);
  } catch (error) { result.page = "blocked: " + error; }
  try {  // opaque: never readable; only the browser (and this test) sees how the viewer answered
    result.opaque = (await fetch(target + "/runs/" + run + "/events", {mode: "no-cors"})).type;
  } catch (error) { result.opaque = "blocked: " + error; }
  result.stream = await new Promise(resolve => {
    const source = new EventSource(target + "/runs/" + run + "/events");
    source.addEventListener("change", event => { source.close(); resolve("read: " + event.data); });
    source.onerror = () => { source.close(); resolve("error"); };
  });
  document.body.dataset.result = JSON.stringify(result);
})();
</script></body>"""


@contextlib.contextmanager
def another_site(html: str) -> Iterator[str]:
    """A second loopback server (another origin: another port) that serves ``html`` at /attack.html."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=15)


def _attack(browser, url: str, route: tuple[str, str] | None = None) -> tuple[dict, list[tuple[str, int]]]:
    """What the page at ``url`` could read of the viewer (``route``: that address fetched from the other, as the
    attacker's server answers it before its name is rebound), and the viewer's answers the browser received."""
    context = browser.new_context()
    page = context.new_page()
    answers: list[tuple[str, int]] = []
    page.on("response", lambda r: answers.append((r.url, r.status)))
    if route is not None:  # the page's address, answered by the other site's server
        page.route(route[0], lambda r: r.continue_(url=route[1]))
    try:
        page.goto(url)
        page.wait_for_selector("body[data-result]", state="attached", timeout=30_000)
        return json.loads(page.locator("body").get_attribute("data-result")), answers
    finally:
        context.close()


def test_a_page_of_another_site_cannot_read_the_viewer(runs, site, browser):
    """DNS rebinding: a page loaded from http://rebound.test:PORT, the viewer's port, whose name then resolves to
    127.0.0.1 (the browser's host rules play the attacker's DNS) reads "its own" origin, which is now the viewer: the
    viewer refuses its Host. And a page of another origin (a second loopback server) that fetches the viewer's page
    and opens its event stream: the browser lets it read neither, and the viewer refuses to answer it at all."""
    root, run_id = runs
    port = site.rsplit(":", 1)[1]
    rebound = f"http://rebound.test:{port}"
    with another_site(ATTACK.replace("TARGET", '""').replace("RUN", json.dumps(run_id))) as other:
        result, answers = _attack(browser, f"{rebound}/attack.html", (f"{rebound}/attack.html",
                                                                       f"{other}/attack.html"))
    assert result["page"].startswith("421 ") and run_id not in result["page"], result["page"][:300]
    assert result["stream"] == "error", result
    assert (f"{rebound}/runs/{run_id}", 421) in answers and (f"{rebound}/runs/{run_id}/events", 421) in answers

    html = ATTACK.replace("TARGET", json.dumps(site)).replace("RUN", json.dumps(run_id))
    with another_site(html) as other:
        result, answers = _attack(browser, f"{other}/attack.html")
    assert result["page"].startswith("blocked: ") and result["stream"] == "error", result
    assert (f"{site}/runs/{run_id}/events", 403) in answers, answers
