"""The viewer's web app (Starlette): pages over a runs directory, read-only, and a change stream for a live run.

What is shown is chosen field by field (never a record dumped whole), so nothing the agent could not see reaches a
page: no eval seeds, no hidden items or per-item scores (``baselines``, a job's ``metrics``), no ``eval/`` folder,
no payload environment; and a file only from the episode's own frozen job folder.

Every page is bounded: agent text is cut (with a note and a link to the whole), a transcript, the runs and a run's
jobs come a page at a time, a job's files are shown up to a budget and linked whole. A row that cannot be read is
shown as damaged in its place (:mod:`aitrainsai_viewer.store`). A request is answered only when its ``Host`` names
this server (:class:`Hosts`), and never to another origin.
"""

from __future__ import annotations

import asyncio
import difflib
import ipaddress
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any
from urllib.parse import quote, urlsplit

import anyio
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from aitrainsai import (EpisodeRow, EvalComparison, FrozenJobError, LedgerError, OuterStep, ReportData,
                        UntrustedInputError, collect, content_text, frozen_job_folder, load_json, run_is_live)
from aitrainsai_viewer.charts import line_chart
from aitrainsai_viewer.store import (MESSAGE_CHARS, RAW_FILE_BYTES, CheckedRun, Damaged, ProbeRow, RowError,
                                     RunInfo, RunNotFound, StoredMessage, find_run, fingerprint, list_job, one_line,
                                     open_ledger, read_job_file, run_count, run_rows, starting_files)

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
STATIC = {"viewer.css": "text/css", "live.js": "text/javascript"}  # the only files served from disk by name
POLL_S = 1.0
# nothing loads from anywhere but this server; scripts only from /static
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
RAW_HEADERS = {"Content-Security-Policy": "sandbox; default-src 'none'", "X-Content-Type-Options": "nosniff",
               "Cache-Control": "no-store"}
PROBLEM = re.compile(r"^(?P<file>[^\s:]+?)(?::(?P<line>\d+))?: (?P<message>.*)$", re.DOTALL)
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})

# what one page shows at most
RUNS_PER_PAGE = 100
JOBS_PER_PAGE = 100
IN_FLIGHT_SHOWN = 200
MESSAGES_PER_PAGE = 50
MESSAGE_SHOWN = 20_000  # characters of one message's text (content and call arguments together)
MAX_CALLS = 32  # tool calls shown per message
MAX_ARGUMENTS = 64  # arguments shown per call
MAX_PROBLEMS = 100  # problems shown per probe attempt
PROBLEM_CHARS = 2_000
FILE_CHARS = 64_000  # of one job file
FILE_LINES = 1_500
JOB_CHARS = 400_000  # of all of a job's files together
JOB_LINES = 6_000
DIFF_LINES = 4_000  # a longer file (or starting file) is shown, not diffed


def _signed(value: Any) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:+.3f}"


def _num(value: Any, digits: int = 3) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:.{digits}f}"


def _when(value: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
    except (TypeError, ValueError, OverflowError, OSError):
        return "-"


def _clip(value: Any, limit: int = 200) -> str:
    """A value from a row, as one bounded piece of text (its start, and "…" where cut)."""
    text = value if isinstance(value, str) else "-" if value is None else str(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _environment() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters.update(signed=_signed, num=_num, when=_when, clip=_clip)
    return env


# -- which requests are answered -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hosts:
    """The names a request's ``Host`` may give (with the port it reached): any other is a page of another site
    whose name was rebound to this machine (DNS rebinding), refused. ``any_address``: every address literal too (a
    server bound to all of the machine's addresses; an address cannot be rebound)."""

    names: frozenset[str] = LOOPBACK_NAMES
    any_address: bool = False

    def allows(self, name: str) -> bool:
        if name in self.names:
            return True
        if not self.any_address:
            return False
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\[\]:@/\s]+)(?::(\d{1,5}))?")


def _host_and_port(value: str, default_port: int) -> tuple[str, int] | None:
    match = _HOST.fullmatch(value)
    if match is None:
        return None
    return match[1].strip("[]").lower(), int(match[2]) if match[2] else default_port


class Guard:
    """Answers a request only when its ``Host`` is one of :class:`Hosts`' names with the port the request reached
    (else 421), and never another origin's script: a request with another ``Origin``, or a fetch another site
    started (``Sec-Fetch-Site``; a link followed from it is still a navigation), is refused (403). On every route,
    the event stream included."""

    def __init__(self, app: ASGIApp, hosts: Hosts):
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self.refusal(scope) if scope["type"] == "http" else None
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> Response | None:
        headers = Headers(scope=scope)
        given = headers.getlist("host")
        server = scope.get("server")
        host = _host_and_port(given[0], 80) if len(given) == 1 else None
        if host is None or server is None or host[1] != server[1] or not self.hosts.allows(host[0]):
            named = _clip(", ".join(given) or "none", 100)
            return PlainTextResponse(f"421: this viewer does not answer to the host {named}; open it by the address "
                                     "it printed", status_code=421, headers=RAW_HEADERS)
        origin = headers.get("origin")
        if origin is not None:
            parts = urlsplit(origin)
            try:
                theirs = (parts.scheme, (parts.hostname or "").lower(), parts.port or 80)
            except ValueError:  # a port that is not a number
                theirs = None
            if theirs != ("http", *host):
                return PlainTextResponse("403: this viewer does not answer another site's pages", status_code=403,
                                         headers=RAW_HEADERS)
        if (headers.get("sec-fetch-site") not in (None, "same-origin", "none")
                and headers.get("sec-fetch-mode") != "navigate"):
            return PlainTextResponse("403: this viewer does not answer another site's pages", status_code=403,
                                     headers=RAW_HEADERS)
        return None


# -- a page's parts, and what they show --------------------------------------------------------------------------------
@dataclass
class Part:
    """A part of a page that a live page fetches again only when its ``stamp`` changed."""

    name: str
    stamp: str
    render: Callable[[], str]

    def section(self) -> Markup:
        return Markup('<section class="part" data-part="{}" data-stamp="{}">{}</section>').format(
            self.name, self.stamp, Markup(self.render()))


@dataclass
class Pager:
    page: int
    pages: int
    total: int
    base: str  # the page's path

    def url(self, page: int) -> str:
        return f"{self.base}?page={page}"


@dataclass(frozen=True)
class StepView:
    """An outer step in the run page's table."""

    step: int
    reward: float
    components: dict[str, float]
    trained: int  # jobs of its groups that trained
    uplift: float | None  # their mean uplift
    jobs_usd: float | None


@dataclass(frozen=True)
class JobView:
    """A training episode in the run page's job table (:class:`aitrainsai.cli.report.JobLine`, clipped)."""

    episode: str
    step: int | None
    family: str
    status: str
    reward: float
    train: EvalComparison | None  # the pages show its aggregate numbers, never its per-item metrics
    picks: str  # the choices that differed between the run's jobs, as ``key=value, ...``


@dataclass(frozen=True)
class EvalView:
    """A family evaluated with no update, in the run page's table."""

    step: int
    family: str
    held_out: bool
    reward: float
    pre: float | None
    post: float | None


@dataclass(frozen=True)
class EpisodeView:
    """An episode in a step's groups, or in flight on the run page."""

    id: str
    family: str | None
    level: int | None
    group: str | None
    step: int | None
    status: str
    reward: float | None
    components: dict[str, float]
    train: EvalComparison | None  # the pages show its aggregate numbers, never its per-item metrics
    created: float


@dataclass(frozen=True)
class ProblemView:
    """A probe problem split into its parts (``file:line: message``, the way :class:`aitrainsai.Problem` prints)."""

    file: str | None
    line: int | None
    message: str


@dataclass(frozen=True)
class ProbeView:
    """A probe attempt on the episode page: its first :data:`MAX_PROBLEMS` problems, and how many more it named."""

    attempt: int
    ok: bool
    seconds: float | None
    problems: list[ProblemView]
    more: int


@dataclass(frozen=True)
class JobFilesView:
    """An accepted job's files on the episode page: each file's view, notes on what was left out, and why no diff
    is shown (None: each file is a diff against its starting file)."""

    diffs: list[FileView]
    notes: list[str]
    why_no_diff: str | None = None


@dataclass
class CallView:
    id: str | None
    name: str
    arguments: list[tuple[str, str]] | None
    raw: str | None
    note: str | None = None


@dataclass
class MessageView:
    seq: Any
    role: str
    name: str | None = None
    call_id: str | None = None
    content: str = ""
    calls: list[CallView] = field(default_factory=list)
    cut: int = 0  # characters of its text not shown here
    note: str | None = None  # why it is not shown as a message (damaged, too long to read here)


@dataclass
class FileView:
    name: str
    size: int | None
    kind: str  # new, same, changed, file (as accepted, no diff), left (not shown here)
    lines: list[str] = field(default_factory=list)
    note: str | None = None
    raw: str | None = None  # the whole file's address


class Budget:
    """Characters (and lines) left to show; each piece taken is cut to what is left, and the rest counted."""

    def __init__(self, chars: int, lines: int = 0):
        self.chars = chars
        self.lines = lines
        self.cut = 0

    def take(self, text: str) -> str:
        shown = text[:max(self.chars, 0)]
        self.chars -= len(shown)
        self.cut += len(text) - len(shown)
        return shown

    def take_lines(self, lines: list[str]) -> tuple[list[str], int]:
        """As many of ``lines`` as the budget holds, each cut to what is left; and how many were left out."""
        shown = []
        for line in lines:
            if self.lines <= 0 or self.chars <= 0:
                break
            shown.append(self.take(line))
            self.lines -= 1
        return shown, len(lines) - len(shown)


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (ValueError, RecursionError):  # a row's values nest at most store.MAX_DEPTH deep: not expected
        return repr(type(value))


def _text(content: Any) -> str:
    return content_text(content) if content is None or isinstance(content, (str, list)) else _json(content)


def _message(stored: StoredMessage) -> MessageView:
    """One stored message as the page shows it: its text up to :data:`MESSAGE_SHOWN` characters (the rest counted),
    its calls' arguments parsed as the agent's tools parse them (bounded: a deep or bad one is shown as text)."""
    budget = Budget(MESSAGE_SHOWN)
    if stored.preview is not None:
        shown = budget.take(stored.preview)
        return MessageView(stored.seq, "?", content=shown, cut=stored.chars - len(shown),
                           note=f"{stored.chars} characters stored, more than a page reads ({MESSAGE_CHARS}): the "
                                "start of the stored text is shown")
    value = stored.value
    if isinstance(value, Damaged):
        return MessageView(stored.seq, "?", note=f"damaged: {value.why}")
    if not isinstance(value, dict):
        return MessageView(stored.seq, "?", content=budget.take(_json(value)), cut=budget.cut,
                           note=f"damaged: a JSON {type(value).__name__}, not a message")
    view = MessageView(stored.seq, _clip(value.get("role"), 40) if value.get("role") is not None else "?",
                       name=_clip(value["name"]) if value.get("name") is not None else None,
                       call_id=_clip(value["tool_call_id"]) if value.get("tool_call_id") else None,
                       content=budget.take(_text(value.get("content"))))
    calls = value.get("tool_calls") or []
    if not isinstance(calls, list):
        view.note, calls = f"its tool_calls are a JSON {type(calls).__name__}, not a list", [calls]
    for call in calls[:MAX_CALLS]:
        view.calls.append(_call(call, budget))
    if len(calls) > MAX_CALLS:
        view.note = f"{len(calls) - MAX_CALLS} more tool calls not shown"
    view.cut = budget.cut
    return view


def _call(call: Any, budget: Budget) -> CallView:
    if not isinstance(call, dict):
        kind = "null" if call is None else type(call).__name__
        return CallView(None, "?", None, budget.take(_json(call)), f"a JSON {kind}, not a tool call")
    function = call["function"] if isinstance(call.get("function"), dict) else {}
    view = CallView(_clip(call["id"]) if call.get("id") is not None else None, _clip(function.get("name"), 200),
                    None, None)
    arguments = function.get("arguments")
    parsed = arguments
    if isinstance(arguments, str):
        try:  # as the agent's tools parse them: bounded, at most 32 deep
            parsed = load_json(arguments, what="arguments", max_bytes=MESSAGE_CHARS, finite=False)
        except UntrustedInputError as exc:
            parsed, view.note = None, f"arguments {exc.reason}: shown as text"
    if isinstance(parsed, dict):
        items = list(parsed.items())
        view.arguments = [(budget.take(_clip(k)), budget.take(v if isinstance(v, str) else _json(v)))
                          for k, v in items[:MAX_ARGUMENTS]]
        if len(items) > MAX_ARGUMENTS:
            view.note = f"{len(items) - MAX_ARGUMENTS} more arguments not shown"
    else:
        view.raw = budget.take(arguments if isinstance(arguments, str) else _json(arguments))
    return view


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

    def render(self, name: str, **context: Any) -> str:
        return self.env.get_template(name).render(**context)

    def page(self, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        # a lone surrogate in agent text is written as its escape, never failing the page
        html = self.render(name, **context).encode("utf-8", errors="backslashreplace")
        return HTMLResponse(html, status_code=status, headers={"Content-Security-Policy": CSP,
                                                               "X-Content-Type-Options": "nosniff",
                                                               "Cache-Control": "no-store"})

    def respond(self, request: Request, name: str, parts: list[Part], **context: Any) -> Response:
        """The page, or (``?parts=``, a live page's JSON of its parts' stamps) only the parts whose stamp changed:
        no content when none did."""
        asked = request.query_params.get("parts")
        if asked is None:
            return self.page(name, sections=[part.section() for part in parts], **context)
        try:
            stamps = load_json(asked, what="parts", max_bytes=4_000, max_depth=1)
        except UntrustedInputError as exc:
            raise HTTPException(400, str(exc)) from None
        if not isinstance(stamps, dict):
            raise HTTPException(400, "parts: not a JSON object of the parts' stamps")
        changed = [part.section() for part in parts if stamps.get(part.name) != part.stamp]
        if not changed:
            return Response(status_code=204, headers={"Cache-Control": "no-store"})
        return HTMLResponse("".join(changed).encode("utf-8", errors="backslashreplace"),
                            headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                                     "Cache-Control": "no-store"})

    # -- pages ------------------------------------------------------------------------------------------------------
    def index(self, request: Request) -> Response:
        number = _page_number(request)
        with open_ledger(self.runs_dir) as ledger:
            pager = _pager(number, run_count(ledger), RUNS_PER_PAGE, "/")
            rows = run_rows(ledger, (pager.page - 1) * RUNS_PER_PAGE, RUNS_PER_PAGE)
        return self.page("index.html", runs=rows, runs_dir=str(self.runs_dir), pager=pager)

    def run_page(self, request: Request) -> Response:
        run_id, number = request.path_params["run_id"], _page_number(request)
        with open_ledger(self.runs_dir) as ledger:
            run = find_run(ledger, run_id)
            info = run.checked_info()
            stamp = fingerprint(ledger, run_id)
            part = Part("run", f"{stamp}|{number}", lambda: self._run_part(run, info, number))
            return self.respond(request, "run.html", [part], info=info, live=info.status == "running", stamp=stamp)

    def _run_part(self, run: CheckedRun, info: RunInfo, number: int) -> str:
        rows = run.episode_rows()
        data: ReportData | None
        try:
            data = collect(run)
            problem = None
        except Exception as exc:  # the rows are checked: a bug; the page still lists the episodes
            log.exception("collect() failed on run %s", run.id)
            data, problem = None, f"the run's figures could not be computed ({type(exc).__name__}: {one_line(exc)})"
        evaluations = {ref.id for ref in run.groups().values() if ref.kind == "eval"}
        stepped = {group for step in run.records(OuterStep) for group in step.groups}
        context: dict[str, Any] = {"info": info, "data": data, "problem": problem}
        jobs = {job.episode: job for job in data.jobs} if data else {}
        varied = data.varied if data else []
        table: list[JobView | Damaged] = []
        for row in rows:  # the jobs in the order of their episodes, a damaged episode in its place
            if isinstance(row, Damaged):
                table.append(row)
            elif row.id in jobs:
                job = jobs[row.id]
                picks = ", ".join(f"{_clip(k, 60)}={_clip(job.chosen[k], 60)}" for k in varied if k in job.chosen)
                table.append(JobView(episode=job.episode, step=job.step, family=job.family, status=job.status,
                                     reward=job.reward, train=job.train, picks=_clip(picks or "-", 400)))
        pager = _pager(number, len(table), JOBS_PER_PAGE, f"/runs/{run.id}")
        context.update(jobs=table[(pager.page - 1) * JOBS_PER_PAGE:pager.page * JOBS_PER_PAGE], pager=pager)
        in_flight = [_episode_row(e) for e in rows if isinstance(e, EpisodeRow)
                     and e.group_id not in stepped | evaluations]
        context.update(in_flight=in_flight[:IN_FLIGHT_SHOWN], in_flight_left=max(0, len(in_flight) - IN_FLIGHT_SHOWN))
        if data is not None:
            steps = data.steps
            charts = [line_chart("Mean episode reward", steps, {"reward": data.reward}, chart_id="chart-reward")]
            charts += [line_chart(_clip(name, 60), steps, {_clip(name, 60): values}, chart_id=f"chart-{name}")
                       for name, values in list(data.components.items())[:20]]
            context.update(
                charts=charts, components=list(data.components), separation=data.separation,
                evals=[EvalView(step=e.step, family=e.family, held_out=e.held_out, reward=e.mean_reward,
                                pre=mean(e.pre) if e.pre else None, post=mean(e.post) if e.post else None)
                       for e in data.evals],
                steps=[StepView(step=s, reward=data.reward[i], components={k: v[i] for k, v in data.components.items()},
                                trained=data.step_uplift[i][0], uplift=data.step_uplift[i][1],
                                jobs_usd=data.compute[i].get("jobs_usd")) for i, s in enumerate(steps)])
        context["damaged"] = sorted(run.damaged.items())  # read last: every read above has noted its rows
        return self.render("run_part.html", **context)

    def step_page(self, request: Request) -> Response:
        run_id, number = request.path_params["run_id"], request.path_params["step"]
        with open_ledger(self.runs_dir) as ledger:
            run = find_run(ledger, run_id)
            info = run.checked_info()
            step = next((s for s in run.records(OuterStep) if s.step == number), None)
            if step is None:
                raise HTTPException(404, f"run {run_id} has no outer step {number}")
            stamp = fingerprint(ledger, run_id)

            def render() -> str:
                groups = [(group, [_episode_row(e) if isinstance(e, EpisodeRow) else e
                                   for e in run.episode_rows(group)]) for group in step.groups]
                return self.render("step_part.html", info=info, step=step, groups=groups)

            return self.respond(request, "step.html", [Part("step", stamp, render)], info=info, step=step,
                                live=info.status == "running", stamp=stamp)

    def episode_page(self, request: Request) -> Response:
        run_id, episode_id, number = (request.path_params["run_id"], request.path_params["episode_id"],
                                      _page_number(request))
        with open_ledger(self.runs_dir) as ledger:
            run = find_run(ledger, run_id)
            info = run.checked_info()
            episode = run.episode_row(episode_id)
            if episode is None:
                raise HTTPException(404, f"run {run_id} has no episode {_clip(episode_id)!r}")
            probes = run.probe_rows(episode_id)
            count, last = run.message_count(episode_id)
            pager = _pager(number, count, MESSAGES_PER_PAGE, f"/runs/{run_id}/episodes/{quote(episode_id)}")
            shown = episode.why if isinstance(episode, Damaged) else f"{episode.updated_at}|{episode.status}"
            frozen = None if isinstance(episode, Damaged) else episode.data.frozen_job

            def summary() -> str:
                return self.render("episode_part.html", info=info, episode=episode, probes=[_probe(p) for p in probes])

            def transcript() -> str:
                stored = run.messages(episode_id, (pager.page - 1) * MESSAGES_PER_PAGE, MESSAGES_PER_PAGE)
                return self.render("transcript_part.html", transcript=[_message(m) for m in stored], pager=pager,
                                   base=pager.base)

            def job() -> str:
                return self.render("job_part.html", files=self._job_files(run, info, episode))

            parts = [Part("episode", f"{shown}|{len(probes)}|{info.status}", summary),
                     Part("transcript", f"{count}|{last}|{pager.page}", transcript),
                     Part("job", f"{frozen}", job)]
            return self.respond(request, "episode.html", parts, info=info, episode_id=episode_id,
                                live=info.status == "running", stamp=fingerprint(ledger, run_id))

    def _job_files(self, run: CheckedRun, info: RunInfo, episode: EpisodeRow | Damaged) -> JobFilesView:
        """The accepted job's files, read only from the episode's frozen job folder: each as a unified diff against
        the workspace's starting file where those can be rebuilt (else as accepted), up to :data:`FILE_CHARS` a file
        and :data:`JOB_CHARS` in all; every file linked whole, with its size."""
        if isinstance(episode, Damaged):
            return JobFilesView([], ["the episode's row is damaged: its job is not shown"])
        try:
            folder = frozen_job_folder(run.dir, episode.id, episode.data.frozen_job)
        except FrozenJobError as exc:
            return JobFilesView([], [str(exc)])
        listing, notes = list_job(folder)
        start = self._starting(info, episode)
        why = None
        if isinstance(start, str):
            why, start = f"the starting files could not be rebuilt ({start}); the job's files are shown as accepted", {}
        budget = Budget(JOB_CHARS, JOB_LINES)
        views = []
        for n, listed in enumerate(listing):
            raw = f"/runs/{run.id}/episodes/{quote(episode.id)}/files/{quote(listed.name)}"
            if listed.size is None:
                views.append(FileView(listed.name, None, "left", note=f"{listed.problem}: not shown"))
                continue
            left = len(listing) - n  # each file its share of what is left: every file shows its start
            share = Budget(min(FILE_CHARS, budget.chars // left), min(FILE_LINES, budget.lines // left))
            chars, lines = share.chars, share.lines
            views.append(_file_view(folder, listed.name, listed.size, None if why else start, share, raw))
            budget.chars -= chars - share.chars
            budget.lines -= lines - share.lines
        return JobFilesView(views, notes, why)

    def _starting(self, info: RunInfo, episode: EpisodeRow) -> dict[str, str] | str:
        key = (info.id, episode.family or "", int(episode.level or 0))
        if key not in self._templates:
            try:
                self._templates[key] = starting_files(self.plugins(), info.config, key[1], key[2])
            except Exception as exc:  # any missing part (a plugin not installed here): say so, show the files
                self._templates[key] = f"{type(exc).__name__}: {one_line(exc)}"
        return self._templates[key]

    # -- whole texts, as plain text ----------------------------------------------------------------------------------
    def job_file(self, request: Request) -> Response:
        """One of the accepted job's files, whole (up to :data:`RAW_FILE_BYTES`): only a name the frozen job folder
        lists, opened from that folder without following a link."""
        run_id, episode_id, name = (request.path_params[k] for k in ("run_id", "episode_id", "name"))
        with open_ledger(self.runs_dir) as ledger:
            episode = find_run(ledger, run_id).episode_row(episode_id)
            run_dir = ledger.runs_dir / run_id
        if not isinstance(episode, EpisodeRow):
            raise HTTPException(404, f"run {run_id} has no readable episode {_clip(episode_id)!r}")
        try:
            folder = frozen_job_folder(run_dir, episode.id, episode.data.frozen_job)
        except FrozenJobError as exc:
            raise HTTPException(404, str(exc)) from None
        if name not in {f.name for f in list_job(folder)[0] if f.size is not None}:
            raise HTTPException(404, f"the accepted job has no file {_clip(name)!r}")
        try:
            data = read_job_file(folder, name, RAW_FILE_BYTES + 1)
        except OSError as exc:
            raise HTTPException(404, f"{_clip(name)}: {one_line(exc)}") from None
        more = b"\n[more not served]" if len(data) > RAW_FILE_BYTES else b""
        return Response(data[:RAW_FILE_BYTES] + more, media_type="text/plain; charset=utf-8", headers=RAW_HEADERS)

    def message_text(self, request: Request) -> Response:
        """One message of a transcript as the ledger stores it (JSON)."""
        run_id, episode_id, seq = (request.path_params[k] for k in ("run_id", "episode_id", "seq"))
        with open_ledger(self.runs_dir) as ledger:
            text = find_run(ledger, run_id).message_text(episode_id, seq)
        if text is None:
            raise HTTPException(404, f"episode {_clip(episode_id)!r} has no message {seq}")
        return Response(text.encode("utf-8", errors="backslashreplace"), media_type="text/plain; charset=utf-8",
                        headers=RAW_HEADERS)

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


def _page_number(request: Request) -> int:
    value = request.query_params.get("page", "1")
    if not value.isascii() or not value.isdigit() or len(value) > 7 or int(value) < 1:
        raise HTTPException(400, f"page {_clip(value, 40)!r} is not a page number")
    return int(value)


def _pager(page: int, total: int, per_page: int, base: str) -> Pager:
    pages = max(1, math.ceil(total / per_page))
    return Pager(min(page, pages), pages, total, base)


def _file_view(folder: Path, name: str, size: int, start: dict[str, str] | None, budget: Budget,
               raw: str) -> FileView:
    """One job file as the page shows it: a diff against its starting file (``start``; None: no diff) when the
    file is short enough to read whole and diff, else its start; cut to ``budget``, its share of the page."""
    if budget.chars <= 0 or budget.lines <= 0:
        return FileView(name, size, "left", note=f"{size} bytes, not shown: a page shows {JOB_CHARS} characters "
                                                 f"and {JOB_LINES} lines of a job in all", raw=raw)
    try:
        data = read_job_file(folder, name, FILE_CHARS + 1)
    except OSError as exc:
        return FileView(name, size, "left", note=f"unreadable ({one_line(exc)}): not shown")
    if b"\x00" in data:
        return FileView(name, size, "left", note=f"{size} bytes, binary: not shown", raw=raw)
    whole = len(data) <= FILE_CHARS
    text = data[:FILE_CHARS].decode("utf-8", errors="replace")
    lines, kind = text.splitlines(), "file"
    if start is not None and whole:
        before = start.get(name)
        if max(len(lines), len((before or "").splitlines())) <= DIFF_LINES:
            lines = list(difflib.unified_diff((before or "").splitlines(), lines,
                                              f"a/{name}" if before is not None else "/dev/null", f"b/{name}",
                                              lineterm=""))
            kind = "new" if before is None else ("same" if not lines else "changed")
    shown, left = budget.take_lines(lines)
    note = None
    if not whole or left or budget.cut:
        note = f"{size} bytes: only its first {len(shown)} lines{' (cut)' if budget.cut else ''} are shown here"
    return FileView(name, size, kind, shown, note, raw)


def _probe(p: ProbeRow | Damaged) -> ProbeView | Damaged:
    if isinstance(p, Damaged):
        return p
    return ProbeView(attempt=p.attempt, ok=p.ok, seconds=p.seconds,
                     problems=[_problem(_clip(text, PROBLEM_CHARS)) for text in p.problems[:MAX_PROBLEMS]],
                     more=max(0, len(p.problems) - MAX_PROBLEMS))


def _episode_row(e: EpisodeRow) -> EpisodeView:
    return EpisodeView(id=e.id, family=e.family, level=e.level, group=e.group_id, step=e.step, status=e.status,
                       reward=e.reward, components=e.data.components, train=e.data.train,
                       created=e.created_at)


def _problem(text: str) -> ProblemView:
    match = PROBLEM.match(text)
    if match is None:
        return ProblemView(None, None, text)
    return ProblemView(match["file"], int(match["line"]) if match["line"] else None, match["message"])


def create_app(runs_dir: Path | str, plugins: Callable[[], Any] | None = None, *,
               hosts: Hosts = Hosts()) -> Starlette:
    """The viewer over ``runs_dir``; ``plugins`` returns the plugin set that rebuilds starting files (default: the
    installed plugins, loaded tolerantly on first need); ``hosts``: the names it answers to (default: loopback's)."""
    viewer = Viewer(Path(runs_dir), plugins)
    routes = [
        Route("/", viewer.index),
        Route("/runs/{run_id}", viewer.run_page),
        Route("/runs/{run_id}/steps/{step:int}", viewer.step_page),
        Route("/runs/{run_id}/episodes/{episode_id}", viewer.episode_page),
        Route("/runs/{run_id}/episodes/{episode_id}/messages/{seq:int}", viewer.message_text),
        Route("/runs/{run_id}/episodes/{episode_id}/files/{name:path}", viewer.job_file),
        Route("/runs/{run_id}/events", viewer.stream),
        Route("/static/{name}", viewer.static),
    ]
    # the expected failures are answered by the exception middleware; anything else is a bug: a one-line page too,
    # and the server logs its traceback
    handlers: dict[Any, Any] = {HTTPException: viewer.error, RunNotFound: viewer.error, LedgerError: viewer.error,
                                RowError: viewer.error, Exception: viewer.error}
    app = Starlette(routes=routes, exception_handlers=handlers, middleware=[Middleware(Guard, hosts=hosts)])
    app.state.viewer = viewer
    return app
