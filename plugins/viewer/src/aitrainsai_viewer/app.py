"""The viewer's web app (Starlette): pages over a runs directory, read-only, and a change stream for a live run.

What is shown is chosen field by field (never a record dumped whole), so nothing the agent could not see reaches a
page: no eval seeds, no hidden items or per-item scores (``baselines``, a job's ``metrics``), no ``eval/`` folder,
no payload environment; and no file by a path from the request, only an accepted job's own files.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from statistics import mean
from typing import Any

import anyio
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Route

from aitrainsai import LedgerError, OuterStep, collect, content_text, run_is_live
from aitrainsai_viewer.charts import line_chart
from aitrainsai_viewer.store import (RunNotFound, find_run, fingerprint, frozen_files, open_ledger,
                                     starting_files)

HERE = Path(__file__).resolve().parent
STATIC = {"viewer.css": "text/css", "live.js": "text/javascript"}  # the only files served from disk by name
POLL_S = 1.0
# nothing loads from anywhere but this server; scripts only from /static
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PROBLEM = re.compile(r"^(?P<file>[^\s:]+?)(?::(?P<line>\d+))?: (?P<message>.*)$", re.DOTALL)
TRAIN_FIELDS = ("base_model", "pre", "post", "uplift", "uplift_ci", "eval_size", "train_seconds")  # never metrics


def _signed(value: Any) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:+.3f}"


def _num(value: Any, digits: int = 3) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:.{digits}f}"


def _when(value: Any) -> str:
    return "-" if not isinstance(value, (int, float)) else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))


def _environment() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters.update(signed=_signed, num=_num, when=_when)
    return env


class Viewer:
    """The pages of one runs directory. ``plugins`` (called on first need) rebuilds a workspace's starting files."""

    def __init__(self, runs_dir: Path, plugins: Callable[[], Any] | None = None):
        self.runs_dir = Path(runs_dir)
        self._plugins = plugins
        self._loaded: Any = None
        self.env = _environment()
        self._templates: dict[tuple[str, str, int], dict[str, str] | str] = {}

    def plugins(self) -> Any:
        if self._loaded is None:
            if self._plugins is not None:
                self._loaded = self._plugins()
            else:
                from aitrainsai import Plugins

                self._loaded = Plugins.load(tolerant=True)
        return self._loaded

    def page(self, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        html = self.env.get_template(name).render(**context)
        return HTMLResponse(html, status_code=status, headers={"Content-Security-Policy": CSP,
                                                               "X-Content-Type-Options": "nosniff",
                                                               "Cache-Control": "no-store"})

    # -- pages ------------------------------------------------------------------------------------------------------
    def index(self, request: Request) -> Response:
        with open_ledger(self.runs_dir) as ledger:
            rows = []
            for summary in reversed(ledger.summaries()):
                steps = (find_run(ledger, summary.id).records(OuterStep)
                         if (self.runs_dir / summary.id).is_dir() else [])
                rows.append({"id": summary.id, "name": summary.name, "status": summary.status,
                             "created": summary.created_at, "steps": len(steps), "episodes": summary.episodes,
                             "last_reward": steps[-1].mean_reward if steps else None})
        return self.page("index.html", runs=rows, runs_dir=str(self.runs_dir))

    def run_page(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        with open_ledger(self.runs_dir) as ledger:
            run = find_run(ledger, run_id)
            info, data, episodes = run.info(), collect(run), run.episodes()
            evaluations = {ref.id for ref in run.groups().values() if ref.kind == "eval"}
            stepped = {group for step in run.records(OuterStep) for group in step.groups}
            stamp = fingerprint(ledger, run_id)
        steps = data["steps"]
        charts = [line_chart("Mean episode reward", steps, {"reward": data["reward"]}, chart_id="chart-reward")]
        charts += [line_chart(name, steps, {name: values}, chart_id=f"chart-{name}")
                   for name, values in data["components"].items()]
        varied = data["varied"]
        jobs = [{**job, "train": _train(job["train"]),
                 "picks": ", ".join(f"{k}={job['chosen'][k]}" for k in varied if k in job["chosen"]) or "-"}
                for job in data["jobs"]]
        step_rows = [{"step": s, "reward": data["reward"][i],
                      "components": {k: v[i] for k, v in data["components"].items()},
                      "trained": data["step_uplift"][i][0], "uplift": data["step_uplift"][i][1],
                      "jobs_usd": (data["compute"][i] or {}).get("jobs_usd"),
                      "agent_usd": (data["cost"][i] or {}).get("cost_usd_total") if data["cost"][i] else None}
                     for i, s in enumerate(steps)]
        # episodes of groups no outer step has trained on yet (a live run's work in progress)
        in_flight = [_episode_row(e) for e in episodes if e["group_id"] not in stepped | evaluations]
        return self.page("run.html", info=info, data=data, charts=charts, steps=step_rows, jobs=jobs,
                         separation=data["separation"], components=list(data["components"]),
                         evals=[_eval_row(e) for e in data["evals"]], in_flight=in_flight,
                         live=info["status"] == "running", stamp=stamp)

    def step_page(self, request: Request) -> Response:
        run_id, number = request.path_params["run_id"], request.path_params["step"]
        with open_ledger(self.runs_dir) as ledger:
            run = find_run(ledger, run_id)
            info = run.info()
            step = next((s for s in run.records(OuterStep) if s.step == number), None)
            if step is None:
                raise HTTPException(404, f"run {run_id} has no outer step {number}")
            groups = [(group, [_episode_row(e) for e in run.episodes(group)]) for group in step.groups]
            stamp = fingerprint(ledger, run_id)
        return self.page("step.html", info=info, step=step, groups=groups, live=info["status"] == "running",
                         stamp=stamp)

    def episode_page(self, request: Request) -> Response:
        run_id, episode_id = request.path_params["run_id"], request.path_params["episode_id"]
        with open_ledger(self.runs_dir) as ledger:
            run = find_run(ledger, run_id)
            info = run.info()
            episode = run.episode(episode_id)
            if episode is None:
                raise HTTPException(404, f"run {run_id} has no episode {episode_id!r}")
            transcript = [_message(m) for m in run.transcript(episode_id)]
            attempts = sorted(run.probes(episode_id), key=lambda p: p["attempt"])
            probes = [{"attempt": p["attempt"], "ok": bool(p["ok"]), "seconds": p["seconds"],
                       "problems": [_problem(text) for text in p["problems"] or []]} for p in attempts]
            stamp = fingerprint(ledger, run_id)
        data = episode["data"] or {}
        files = self._job_files(run, info, episode)
        components = data.get("components") or {}
        return self.page("episode.html", info=info, episode=_episode_row(episode), transcript=transcript,
                         probes=probes, files=files, components=components, train=_train(data.get("train")),
                         live=info["status"] == "running", stamp=stamp)

    def _job_files(self, run: Any, info: dict[str, Any], episode: dict[str, Any]) -> dict[str, Any]:
        """The accepted job's files as a unified diff against the workspace's starting files, where those can be
        rebuilt; else the files alone, with the reason."""
        frozen = (episode["data"] or {}).get("frozen_job")
        if not frozen:
            return {"diffs": [], "notes": ["no job was accepted in this episode"], "why_no_diff": None}
        files, notes = frozen_files(Path(frozen), run.dir / "episodes" / episode["id"])
        key = (info["id"], episode["family"] or "", int(episode["level"] or 0))
        if key not in self._templates:
            try:
                self._templates[key] = starting_files(self.plugins(), info["config"], key[1], key[2])
            except Exception as exc:  # any missing part (a plugin not installed here): say so, show the files
                self._templates[key] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        start = self._templates[key]
        why = None
        if isinstance(start, str):
            why, start = f"the starting files could not be rebuilt ({start}); the job's files are shown whole", {}
        diffs = []
        for name in sorted(set(files) | set(start if why is None else {})):
            before, after = start.get(name), files.get(name)
            if after is None:
                continue  # a starting file the frozen job does not hold: not part of the job
            if why is not None:
                diffs.append({"name": name, "kind": "file", "lines": after.splitlines(), "big": len(after) > 20_000})
                continue
            lines = list(difflib.unified_diff((before or "").splitlines(), after.splitlines(),
                                              f"a/{name}" if before is not None else "/dev/null", f"b/{name}",
                                              lineterm=""))
            diffs.append({"name": name, "kind": "new" if before is None else ("same" if not lines else "changed"),
                          "lines": lines, "big": len(after) > 20_000})
        return {"diffs": diffs, "notes": notes, "why_no_diff": why}

    # -- the change stream ------------------------------------------------------------------------------------------
    async def stream(self, request: Request) -> Response:
        """Server-sent events for a live run: ``change`` (data: the new fingerprint) whenever the ledger records
        something for it, ``end`` once no process runs it; a finished run's stream ends at once."""
        run_id = request.path_params["run_id"]
        since = request.query_params.get("since", "")

        def look() -> tuple[str, bool]:
            with open_ledger(self.runs_dir) as ledger:
                find_run(ledger, run_id)
                return fingerprint(ledger, run_id), run_is_live(self.runs_dir / run_id)

        await anyio.to_thread.run_sync(look)  # a bad run is a 404 before the stream starts

        async def events() -> AsyncIterator[str]:
            last = since
            yield "retry: 2000\n\n"
            while not await request.is_disconnected():
                try:
                    stamp, live = await anyio.to_thread.run_sync(look)
                except (LedgerError, RunNotFound) as exc:
                    yield f"event: failed\ndata: {json.dumps(str(exc))}\n\n"
                    return
                if stamp != last:
                    last = stamp
                    yield f"event: change\ndata: {json.dumps(stamp)}\n\n"
                if not live:
                    yield "event: end\ndata: \"\"\n\n"
                    return
                await asyncio.sleep(POLL_S)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            raise HTTPException(404, "no such file")
        return Response((HERE / "static" / name).read_bytes(), media_type=STATIC[name],
                        headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})

    # -- errors: one line, never a traceback -------------------------------------------------------------------------
    def error(self, request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            status, line = exc.status_code, str(exc.detail)
        elif isinstance(exc, RunNotFound):
            status, line = 404, str(exc)
        elif isinstance(exc, LedgerError):
            status, line = 500, str(exc)
        else:
            status, line = 500, f"the viewer failed on this page ({type(exc).__name__}); see the server's log"
        return self.page("error.html", status=status, status_code=status, line=line)


def _train(train: Any) -> dict[str, Any] | None:
    """A trained job's hidden-eval outcome: the aggregate numbers only (its ``metrics`` hold per-item scores)."""
    if not isinstance(train, dict):
        return None
    return {k: train.get(k) for k in TRAIN_FIELDS}


def _eval_row(e: dict[str, Any]) -> dict[str, Any]:
    return {"step": e.get("step"), "family": e.get("family"), "held_out": e.get("held_out"),
            "reward": e.get("mean_reward"), "pre": mean(e["pre"]) if e.get("pre") else None,
            "post": mean(e["post"]) if e.get("post") else None}


def _episode_row(e: dict[str, Any]) -> dict[str, Any]:
    data = e["data"] or {}
    return {"id": e["id"], "family": e["family"], "level": e["level"], "group": e["group_id"], "step": e["step"],
            "status": e["status"], "reward": e["reward"], "components": data.get("components") or {},
            "train": _train(data.get("train")), "created": e["created_at"]}


def _message(m: dict[str, Any]) -> dict[str, Any]:
    calls = []
    for call in m.get("tool_calls") or []:
        function = (call or {}).get("function") or {}
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = None
        calls.append({"id": call.get("id"), "name": function.get("name"),
                      "arguments": parsed if isinstance(parsed, dict) else None,
                      "raw": arguments if not isinstance(parsed, dict) else None})
    return {"role": m.get("role", "?"), "name": m.get("name"), "content": content_text(m.get("content")),
            "calls": calls, "call_id": m.get("tool_call_id")}


def _problem(text: Any) -> dict[str, Any]:
    """A probe problem as ``file:line: message`` splits into its parts (the way :class:`aitrainsai.Problem` prints)."""
    match = PROBLEM.match(str(text))
    if match is None:
        return {"file": None, "line": None, "message": str(text)}
    return {"file": match["file"], "line": int(match["line"]) if match["line"] else None,
            "message": match["message"]}


def create_app(runs_dir: Path | str, plugins: Callable[[], Any] | None = None) -> Starlette:
    """The viewer over ``runs_dir``; ``plugins`` returns the plugin set that rebuilds starting files (default: the
    installed plugins, loaded tolerantly on first need)."""
    viewer = Viewer(Path(runs_dir), plugins)
    routes = [
        Route("/", viewer.index),
        Route("/runs/{run_id}", viewer.run_page),
        Route("/runs/{run_id}/steps/{step:int}", viewer.step_page),
        Route("/runs/{run_id}/episodes/{episode_id}", viewer.episode_page),
        Route("/runs/{run_id}/events", viewer.stream),
        Route("/static/{name}", viewer.static),
    ]
    # the expected failures are answered by the exception middleware; anything else is a bug: a one-line page too,
    # and the server logs its traceback
    handlers: dict[Any, Any] = {HTTPException: viewer.error, RunNotFound: viewer.error, LedgerError: viewer.error,
                                Exception: viewer.error}
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.viewer = viewer
    return app
