"""The ``aitrainsai`` command line."""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Sequence

import click

from aitrainsai.plugins import SELECTION_VARIABLE, PluginError, Plugins
from aitrainsai.run.record import ConfigChanged, PluginChange, PluginVersionsChanged, ProbeRow
from aitrainsai.errors import AitrainsaiError

if TYPE_CHECKING:
    from aitrainsai.config import ResolvedConfig
    from aitrainsai.run.ledger import Run

RUNS_DIR_VARIABLE = "AITRAINSAI_RUNS_DIR"


class CommandState:
    """What the commands share: the plugin selection, loaded on first use, and the runs directory (a plugin's
    command reads it with ``click.get_current_context().ensure_object(CommandState)``).

    Plugins load tolerantly: one that cannot be loaded is left out with a warning (on stderr) naming the way out,
    so that listings and help still work; a command that needs every plugin (a run) sets ``strict`` and refuses."""

    def __init__(self) -> None:
        self.selection: str | None = os.environ.get(SELECTION_VARIABLE)
        self.selection_given = False  # --plugins on the command line (a resume then uses it, not the recorded one)
        self.strict = False
        self.runs_dir = Path(os.environ.get(RUNS_DIR_VARIABLE, "runs"))
        self._plugins: Plugins | None = None
        self._warned: set[str] = set()

    @property
    def plugins(self) -> Plugins:
        if self._plugins is None:
            try:
                self._plugins = Plugins.load(self.selection, tolerant=True)
            except PluginError as exc:
                raise click.ClickException(str(exc)) from None
        if self.strict:
            try:
                self._plugins.check_loaded()
            except PluginError as exc:
                raise click.ClickException(str(exc)) from None
        self.warn_broken()
        return self._plugins

    def warn_broken(self) -> None:
        """Name each plugin left out because it cannot be loaded, once, on stderr."""
        if self._plugins is None:
            return
        for name, line in zip(self._plugins.broken, self._plugins.broken_warnings()):
            if name not in self._warned:
                self._warned.add(name)
                click.echo(f"Warning: {line}", err=True)

    def ledger(self, check: bool = False):
        """The runs directory's ledger; ``check`` reads it whole first (before a run starts on it)."""
        from aitrainsai.run.ledger import Ledger

        ledger = Ledger(self.runs_dir)
        if check:
            ledger.check()
        return ledger




def _state() -> CommandState:
    return click.get_current_context().ensure_object(CommandState)


def _set_selection(ctx: click.Context, _param: click.Parameter | None, value: str | None) -> None:
    if value is not None:
        state = ctx.ensure_object(CommandState)
        state.selection, state.selection_given = value, True


def needs_every_plugin(command):
    """For commands that run something (``run``, ``job run``): a selected plugin that cannot be loaded is an error
    (one line, with the way out), not a warning."""
    @functools.wraps(command)
    def strict(*args, **kwargs):
        _state().strict = True
        return command(*args, **kwargs)

    return strict


def _set_runs_dir(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.ensure_object(CommandState).runs_dir = Path(value)


def _common_params() -> list[click.Option]:
    return [
        click.Option(["--plugins"], metavar="A,B", expose_value=False, callback=_set_selection, is_eager=True,
                     help=f"Load only these plugin distributions, as `aitrainsai plugins` names them ('' for none "
                          f"but the core's), or every installed one but no:NAME (no:A,no:B). Default: all "
                          f"installed, or ${SELECTION_VARIABLE}."),
        click.Option(["--runs-dir"], metavar="DIR", expose_value=False, callback=_set_runs_dir, is_eager=True,
                     help=f"Where runs are recorded. Default: ./runs, or ${RUNS_DIR_VARIABLE}."),
    ]


def common_options(command):
    """``--plugins`` and ``--runs-dir``, accepted by every command (plugin commands, and the commands of a plugin's
    group, get them too)."""
    params = getattr(command, "params", None)
    if params is None:
        command.__click_params__ = getattr(command, "__click_params__", []) + _common_params()[::-1]
    elif not any(p.name == "plugins" for p in params):
        params.extend(_common_params())
    for sub in getattr(command, "commands", {}).values():
        common_options(sub)
    return command


class InputError(click.ClickException, AitrainsaiError):
    """Bad arguments or config: one ``Error:`` line and exit code 2, like click's usage errors without the usage."""

    exit_code = 2


class AitrainsaiGroup(click.Group):
    """Adds the commands that plugins register, after reading ``--plugins`` wherever it appears; a ledger that cannot
    be used (damaged, read-only, a run not found) ends any command with one line, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        from aitrainsai.run.ledger import LedgerError

        try:
            return super().invoke(ctx)
        except LedgerError as exc:
            raise click.ClickException(str(exc)) from None
        except click.UsageError as exc:  # bad input: one line, naming where help is
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            raise InputError(f"{exc.format_message()}{hint}") from None

    def _plugin_commands(self, ctx: click.Context) -> dict[str, click.Command]:
        state = ctx.ensure_object(CommandState)
        extra = click.Group()
        state.plugins.register_commands(extra)
        state.warn_broken()
        return {name: common_options(cmd) for name, cmd in extra.commands.items() if name not in self.commands}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._plugin_commands(ctx)))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return super().get_command(ctx, name) or self._plugin_commands(ctx).get(name)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        for index, arg in enumerate(args):
            if arg == "--":
                break
            if arg == "--plugins" and index + 1 < len(args):
                _set_selection(ctx, None, args[index + 1])
            elif arg.startswith("--plugins="):
                _set_selection(ctx, None, arg.split("=", 1)[1])
        return super().resolve_command(ctx, args)


@click.group(cls=AitrainsaiGroup)
@common_options
@click.version_option(package_name="aitrainsai")
def cli() -> None:
    """aitrainsai: an outer agent is RL-trained to write training jobs that really train small language models.

    \b
    Examples:
      aitrainsai run                       # the small nested loop on CPU
      aitrainsai plugins --json            # what is installed
      aitrainsai show latest               # the last run
    """


@cli.command("plugins")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plugins_command(as_json: bool) -> None:
    """List plugin distributions, their versions and the components they provide per kind; a plugin that cannot be
    loaded is listed with the reason (and left out of every command; a run refuses it).

    \b
    Example:
      aitrainsai plugins --json
      aitrainsai plugins --plugins aitrainsai-family-ledger
      aitrainsai plugins --plugins no:aitrainsai-outer-openai
    """
    plugins = _state().plugins
    infos = sorted(plugins.plugin_list() + list(plugins.broken.values()), key=lambda info: info.name)
    if as_json:
        click.echo(json.dumps([info.to_dict() for info in infos], indent=2))
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table("plugin", "version", "provides")
    for info in infos:
        provides = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(info.components.items()))
        if info.error:
            provides = f"[red]cannot be loaded, left out[/]: {escape(info.error)}"
        table.add_row(info.name + (" (built in)" if info.builtin else ""), info.version, provides or "-")
    _console().print(table)


@cli.command("families")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def families_command(as_json: bool) -> None:
    """List installed task families: what each teaches (its ``description``), levels, default level, hidden-eval
    size, held-out flag.

    \b
    Example:
      aitrainsai families
    """
    plugins = _state().plugins
    registry = plugins.task_families
    rows: list[dict[str, Any]] = []
    for name in registry.names():
        family = registry.get(name)
        rows.append({"name": name, "plugin": registry.owner(name), "description": family.description,
                     "levels": list(family.levels),
                     "default_level": family.default_level, "eval_size": family.eval_size,
                     "held_out": family.held_out, "tools": len(family.tool_functions)})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table("family", "description", "levels", "default", "eval size", "held out", "tools", "plugin")
    for row in rows:
        levels = f"{min(row['levels'])}-{max(row['levels'])}"
        table.add_row(row["name"], row["description"] or "-", levels, str(row["default_level"]),
                      str(row["eval_size"]), "yes" if row["held_out"] else "no", str(row["tools"]), row["plugin"])
    _console().print(table if rows else "no task families installed (pip install aitrainsai-family-...)")


@cli.command("run")
@common_options
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="A TOML run config; see CONTRIBUTING.md for its sections.")
@click.option("--set", "-s", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override any config key, e.g. -s loop.steps=5 -s gpu_backend.local.workers=2 (repeatable).")
@click.option("--preset", help="Start from a preset an installed distribution ships (list them: aitrainsai "
                               "presets), e.g. cpu-long. Every run starts from the preset named default; --preset, "
                               "then --config, then --set apply on top.")
@click.option("--resume", "resume_ref", metavar="RUN", help="Continue a killed or stopped run from its ledger, with "
                                                            "the plugin selection it recorded unless --plugins is "
                                                            "given; --set may only raise options marked adjustable on "
                                                            "resume (a spending cap).")
@click.option("--allow-version-change", is_flag=True, help="With --resume: continue even though installed plugin "
                                                          "versions differ from the recorded ones (recorded as an "
                                                          "event).")
@click.option("--report/--no-report", default=True, show_default=True, help="Write the report when the run ends.")
@needs_every_plugin
def run_command(config_path: Path | None, overrides: tuple[str, ...], preset: str | None, resume_ref: str | None,
                report: bool, allow_version_change: bool = False) -> None:
    """Run the nested loop: outer steps of episodes whose jobs really train a model.

    With no arguments it runs the small default on CPU: the recipe policy, the local backend and the local inner
    trainer on the five training families, with the held-out family evaluated before the first update and after the
    last (the report compares the two), then the report. Every step is
    recorded as it happens; a killed run continues with --resume, rerunning no finished job. A run its outer trainer
    stopped (a spending cap reached, a service unavailable) exits with status 3 and continues the same way.

    \b
    Examples:
      aitrainsai run
      aitrainsai run --config run.toml -s loop.steps=10
      aitrainsai run --preset cpu-long
      aitrainsai run --preset one-gpu
      aitrainsai run --resume latest
      aitrainsai run --plugins no:aitrainsai-outer-openai
    """
    from aitrainsai.cli.progress import LoopProgress
    from aitrainsai.config import ConfigError, resolve_snapshot, resume_overrides
    from aitrainsai.reward_spec import RewardSpecError
    from aitrainsai.run.loop import run_loop
    from aitrainsai.run.session import Session

    state = _state()
    console = _console()
    if resume_ref:
        if config_path or preset:
            raise click.UsageError("--resume continues a run with its recorded config; drop --config and --preset")
        run = state.ledger(check=True).run(resume_ref)
        _resume_plugins(state, run, allow_version_change)
        try:
            record = run.info().config
            changed = resume_overrides(record, overrides, state.plugins) if overrides else record
            resolved = resolve_snapshot(changed, state.plugins)
            Session.check(resolved, state.plugins)
        except (ConfigError, RewardSpecError) as exc:
            raise click.UsageError(str(exc)) from None
        if overrides:  # budgets raised to continue: recorded, with what changed
            run.set_config(changed)
            run.record(ConfigChanged(overrides=list(overrides)))
        _require_sandbox()
        console.print(f"resuming run [bold]{run.id}[/]")
    else:
        run, resolved = create_run(state, overrides, config_path=config_path, preset=preset)
        console.print(f"run [bold]{run.id}[/] recorded in {state.ledger().path}")
    from aitrainsai.backends import BackendUnavailable
    from aitrainsai.stopping import Interrupted

    try:
        summary = run_loop(Session(resolved, state.plugins, run), display=LoopProgress(console, resolved.loop.steps),
                           resume=bool(resume_ref))
    except BackendUnavailable as exc:  # not a bug: one line, and the run resumes once the backend can start
        raise click.ClickException(f"the GPU backend cannot start: {exc} (the run is recorded; continue with: "
                                   f"aitrainsai run --resume {run.id})") from None
    except Interrupted as stop:  # SIGINT or SIGTERM: what the run started is closed; nothing finished is lost
        _stopped(stop, f"run {run.id} interrupted; continue with: aitrainsai run --resume {run.id}")
    if summary.stopped is not None and summary.resumable is False:  # refused for a setting: a resume cannot help
        raise click.ClickException(f"run {run.id} refused: {summary.stopped}; start a new run with another setting")
    if summary.stopped is not None:  # the outer trainer stopped the run cleanly: nothing lost, resumable
        console.print(f"stopped after {summary.steps} outer steps: {summary.stopped}", highlight=False)
        console.print(f"continue with: aitrainsai run --resume {run.id}", highlight=False)
        raise SystemExit(3)
    console.print(f"finished: {summary.steps} outer steps, {summary.launched} groups "
                  f"({summary.skipped} without signal, {summary.dropped} too stale)")
    if report:
        from aitrainsai.cli.report import ReportUnavailable, write_report

        try:
            console.print(f"report: {write_report(run)}")
        except ReportUnavailable as exc:
            console.print(f"no report: {exc}")


def create_run(state: CommandState, overrides: Sequence[str], *, config_path: Path | None = None,
               preset: str | None = None, name: str | None = None, outer: bool = True) -> tuple[Run, ResolvedConfig]:
    """The one way a command creates a run: the config loaded and resolved against the loaded plugins, the session's
    parts checked, the sandbox checked, and only then the run recorded (a refused command leaves nothing behind).
    ``outer=False``: no agent is trained, so the outer trainer's section is neither needed nor checked."""
    from aitrainsai.config import ConfigError, load_config, resolve
    from aitrainsai.reward_spec import RewardSpecError
    from aitrainsai.run.session import Session

    plugins = state.plugins
    try:
        config = load_config(config_path, overrides, preset, presets=plugins.presets)
        resolved = resolve(config, plugins, str(config_path or "config"), outer=outer)
        Session.check(resolved, plugins)
    except (ConfigError, RewardSpecError) as exc:
        raise click.UsageError(str(exc)) from None
    _require_sandbox()
    run = state.ledger(check=True).create_run(resolved.snapshot(), [info.to_dict() for info in plugins.plugin_list()],
                                              name=name or config.name, selection=plugins.selection_string())
    return run, resolved


@cli.command("presets")
@common_options
def presets_command() -> None:
    """List the run-config presets the installed distributions ship (``default`` is where every run starts).

    \b
    Example:
      aitrainsai presets
    """
    import tomllib

    found = _state().plugins.presets
    if not found:
        click.echo("no presets installed: every section of the run config must name its component")
    for name, path in sorted(found.items()):
        try:
            about = tomllib.loads(path.read_text()).get("about", "")
        except (OSError, tomllib.TOMLDecodeError) as exc:
            about = f"(unreadable: {exc})"
        click.echo(f"{name}: {about}  [{path}]")


@cli.group("job")
def job_group() -> None:
    """Single inner jobs, outside the outer loop."""


@job_group.command("run")
@common_options
@click.option("--family", required=True, help="The task family to teach.")
@click.option("--level", type=int, help="Difficulty level (default: the family's).")
@click.option("--dir", "job_dir", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="A directory of job files; missing files come from the task's template.")
@click.option("--set", "-s", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override run config keys, e.g. -s inner_trainer.local.eval_size=32.")
@needs_every_plugin
def job_run_command(family: str, level: int | None, job_dir: Path | None, overrides: tuple[str, ...]) -> None:
    """Run one job end to end: task spec, job files, probe, training, hidden-eval pre and post, uplift, reward.

    \b
    Examples:
      aitrainsai job run --family calc_chain
      aitrainsai job run --family ledger --dir plugins/trainer_local/reference_jobs/ledger
    """
    from aitrainsai.run.policy import SubmitFiles
    from aitrainsai.run.session import Session

    state = _state()
    console = _console()
    plugins = state.plugins
    # every argument is checked before anything is created: a refused job leaves no run behind
    if family not in plugins.task_families:
        raise click.UsageError(plugins.explain_missing(plugins.task_families, family) or f"no task family named "
                               f"{family!r} (installed: {', '.join(plugins.task_families.names())})")
    family_class = plugins.task_families.get(family)
    level = family_class.default_level if level is None else level
    if level not in family_class.levels:
        raise click.BadParameter(f"{family} has levels {', '.join(map(str, family_class.levels))}, not {level}",
                                 param_hint="--level")
    files = _job_files(job_dir) if job_dir else {}
    # a single job trains no agent: the outer trainer's section is neither needed nor checked
    run, resolved = create_run(state, ["families.train=[]", "families.held_out=[]", *overrides], outer=False,
                               name=f"job-{family}")
    session = Session(resolved, plugins, run)
    episode = session.episode(family, level, "job", step=0, group_id="job")
    trainer = session.inner_trainer
    console.print(f"run [bold]{run.id}[/]: one {trainer.name} job on {family} level {episode.level}, "
                  f"eval on {trainer.eval_size} hidden items (the full set is {family_class.eval_size})")

    async def play():
        async with session:
            return await episode.play(SubmitFiles(files))

    from aitrainsai.stopping import Interrupted, run_until_stopped

    started = datetime.now()
    try:
        with run.hold(), console.status("probe, baselines, training, evaluation ..."):
            result = run_until_stopped(play)
    except Interrupted as stop:  # the backend was closed: no payload of this job is left running
        run.set_status("interrupted")
        _stopped(stop, f"job run {run.id} interrupted")
    run.set_status("finished")
    for probe in run.probes("job"):
        console.print(f"probe: {'accepted' if probe.ok else 'rejected'} in {probe.seconds or 0.0:.1f} s"
                      + ("" if probe.ok else ": " + "; ".join(probe.problems)))
    if result.train:
        t = result.train
        console.print(f"pre {t.pre:.3f} -> post {t.post:.3f}: uplift {t.uplift:+.3f} "
                      f"(95% CI {t.uplift_ci[0]:+.3f} .. {t.uplift_ci[1]:+.3f}, n={t.eval_size}), "
                      f"training {t.train_seconds:.0f} s")
    elif result.status == "dead":
        died = run.jobs()[0].progress
        console.print(f"[red]the job died[/]: {died.reason}\n{(died.log_tail or '')[-2000:]}")
    parts = ", ".join(f"{k} {v:.3f}" for k, v in result.components.items())
    console.print(f"reward {result.reward:+.3f} ({parts}); {(datetime.now() - started).total_seconds():.0f} s in all")


@cli.command("runs")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def runs_command(as_json: bool) -> None:
    """List recorded runs, newest last.

    \b
    Example:
      aitrainsai runs --runs-dir runs
    """
    summaries = _state().ledger().summaries()
    if as_json:
        click.echo(json.dumps([s.__dict__ for s in summaries], indent=2))
        return
    from rich.table import Table

    table = Table("run", "name", "status", "started", "episodes", "jobs done", "jobs dead", "mean reward", "jobs $",
                  "agent $")
    for s in summaries:
        reward = "-" if s.mean_reward is None else f"{s.mean_reward:.3f}"
        agent = "-" if s.agent_cost_usd is None else f"{s.agent_cost_usd:.2f}"
        table.add_row(s.id, s.name or "", s.status, _when(s.created_at), str(s.episodes), str(s.jobs_done),
                      str(s.jobs_dead), reward, f"{s.cost_usd:.2f}", agent)
    _console().print(table if summaries else f"no runs in {_state().runs_dir}")


@cli.command("show")
@common_options
@click.argument("run_ref", metavar="RUN")
@click.option("--episode", "episode_id", metavar="ID", help="Print this episode's transcript.")
@click.option("--json", "as_json", is_flag=True, help="Print the run's records as JSON.")
def show_command(run_ref: str, episode_id: str | None, as_json: bool) -> None:
    """Summarise one run: its config, plugins, episodes, jobs and events. RUN is an id, a prefix, a name or latest.

    \b
    Examples:
      aitrainsai show latest
      aitrainsai show 20261129-1402 --episode s0-calc_chain-g0-e1
    """
    run = _state().ledger().run(run_ref)
    console = _console()
    if episode_id:
        transcript = run.transcript(episode_id)
        if not transcript:
            raise click.ClickException(f"run {run.id} has no episode {episode_id!r} with messages")
        if as_json:
            click.echo(json.dumps(transcript, indent=2))
            return
        _print_transcript(console, transcript, run.probes(episode_id))
        return
    info = run.info()
    episodes, jobs = run.episodes(), run.jobs()
    events: dict[str, int] = {}
    for event in run.events():
        events[event.kind] = events.get(event.kind, 0) + 1
    if as_json:
        click.echo(json.dumps({"run": info.model_dump(mode="json"),
                               "episodes": [e.model_dump(mode="json") for e in episodes],
                               "jobs": [j.model_dump(mode="json") for j in jobs], "events": events}, indent=2))
        return
    from rich.table import Table

    console.print(f"[bold]run {info.id}[/] {info.name or ''} — {info.status}, started {_when(info.created_at)}")
    selection = info.selection
    console.print("plugins: " + ", ".join(f"{p['name']} {p['version']}" for p in info.plugins)
                  + ("" if selection is None else f" (selection: {selection!r})"))
    config = info.config
    console.print("config: " + json.dumps({k: config[k] for k in config if k != "families"}, sort_keys=True))
    console.print(f"families: train {', '.join(config['families']['train'])}; "
                  f"held out {', '.join(config['families']['held_out'])}")
    if episodes:
        table = Table("episode", "step", "family", "status", "reward")
        for e in episodes:
            table.add_row(e.id, str(e.step), e.family or "", e.status, "-" if e.reward is None else f"{e.reward:.3f}")
        console.print(table)
    if jobs:
        table = Table("job", "episode", "status", "wall s", "cost $", "pre", "post")
        for job in jobs:
            table.add_row(job.id, job.episode_id or "", job.state.value, _num(job.wall_s, 1), _num(job.cost_usd, 2),
                          _num(job.progress.pre, 3), _num(job.progress.post, 3))
        console.print(table)
    console.print("events: " + (", ".join(f"{k} {v}" for k, v in sorted(events.items())) or "none"))


@cli.command("report")
@common_options
@click.argument("run_ref", metavar="RUN")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where to write it (default: the run's report/ directory).")
def report_command(run_ref: str, out_dir: Path | None) -> None:
    """Write PNG plots (reward and its components per step, per-family uplift, held-out score, base-choice and
    dead-job rates) and a markdown summary of a run.

    \b
    Example:
      aitrainsai report latest
    """
    from aitrainsai.cli.report import ReportUnavailable, write_report

    run = _state().ledger().run(run_ref)
    try:
        path = write_report(run, out_dir)
    except ReportUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write the report to {out_dir or run.dir / 'report'}: "
                                   f"{exc.strerror or exc}") from None
    click.echo(f"report: {path}")


@cli.command("export")
@common_options
@click.argument("run_ref", metavar="RUN")
@click.argument("episode_id", metavar="EPISODE")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where to write the package (default: the run's export/<name>/).")
def export_command(run_ref: str, episode_id: str, out_dir: Path | None) -> None:
    """Write an episode's accepted v1 job as an installable environment package (a verifiers 0.4.0 taskset) that
    verifiers' own tooling loads and evaluates.

    \b
    Example:
      aitrainsai export latest g0000-e0 && pip install runs/<run>/export/<name>
    """
    from aitrainsai.jobs.export import ExportError, export_job, package_name
    from aitrainsai.jobs.job import JobChanged
    from aitrainsai.parsing import printable
    from aitrainsai.run.ledger import FrozenJobError, frozen_job_folder

    def shown(value: Any) -> str:  # what the ledger says, on one line
        return repr(printable(str(value))[:100])

    run = _state().ledger().run(run_ref)  # its id is one plain name (Run), as the package's default folder needs
    row = next((e for e in run.episodes() if e.id == episode_id), None)
    if row is None:
        raise click.ClickException(f"run {run.id} has no episode {shown(episode_id)}")
    frozen, digest = row.data.frozen_job, row.data.frozen_digest
    if not frozen:
        raise click.ClickException(f"episode {shown(episode_id)} has no accepted job (its status is "
                                   f"{shown(row.status)})")
    family = row.family or ""
    plugins = _state().plugins
    if family not in plugins.task_families:
        raise click.ClickException(f"the task family {shown(family)} of episode {shown(episode_id)} is not installed")
    try:  # only this run's own frozen job folder: a damaged or foreign ledger could name any folder
        folder = frozen_job_folder(run.dir, episode_id, frozen)
    except FrozenJobError as exc:
        raise click.ClickException(f"{exc}; nothing exported") from None
    name = package_name(family, episode_id)
    out = out_dir or run.dir / "export" / name
    try:
        export_job(folder, digest, out, name=name,
                   family_distribution=plugins.task_families.owner(family),
                   about=f" for {family} (run {run.id}, episode {episode_id})")
    except (ExportError, JobChanged) as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write the package to {out}: {exc.strerror or exc}") from None
    click.echo(f"package: {out} (pip install {out}; verifiers id {name})")


@cli.group("reward")
def reward_group() -> None:
    """Reward specs: how an episode's reward is computed, and what the agent is told about it."""


@reward_group.command("show")
@common_options
@click.argument("spec", default="default")
def reward_show_command(spec: str) -> None:
    """Print a reward spec's formula, its weights and options, and exactly what the agent is told.

    SPEC is a name found in reward_specs/ (default: default) or a path to a .toml file.

    \b
    Example:
      aitrainsai reward show default
    """
    from aitrainsai.reward_spec import RewardSpecError, load_reward_spec

    try:
        loaded = load_reward_spec(spec, _state().plugins)
    except RewardSpecError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"spec: {loaded.name} ({loaded.source})")
    if loaded.data.description:
        click.echo(loaded.data.description)
    click.echo(f"\n{loaded.formula()}")
    for term, component in loaded.components:
        options = component.config.model_dump()
        click.echo(f"  {term.component}: weight {term.weight:g}" + (f", options {options}" if options else ""))
    click.echo(f"  no parseable submission: {loaded.data.no_submission:g}; attempts: {loaded.data.max_attempts}")
    click.echo("\nWhat the agent is told:\n" + loaded.agent_text())


@cli.group("new")
def new_group() -> None:
    """Create a new plugin distribution from a template."""


@new_group.command("family")
@common_options
@click.argument("name")
@click.option("--dir", "destination", default="task_families", show_default=True, metavar="PARENT",
              type=click.Path(file_okay=False, path_type=Path),
              help="The folder to create the family's folder in: the family is written to PARENT/NAME.")
def new_family_command(name: str, destination: Path) -> None:
    """Scaffold a task-family distribution that installs and passes the conformance kit as generated. It is written
    to PARENT/NAME (--dir gives PARENT, the folder that holds families; NAME/ must not exist yet).

    \b
    Examples:
      aitrainsai new family tide_tables && pip install -e task_families/tide_tables
      aitrainsai new family tide_tables --dir ~/src    # writes ~/src/tide_tables
    """
    from aitrainsai.cli.scaffold import new_family

    try:
        root = new_family(name, destination)
    except (ValueError, FileExistsError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"created {root}\nnext: pip install -e {root} && pytest {root}/tests")


def _job_files(job_dir: Path) -> dict[str, str]:
    """The files of ``--dir``, held to the same rules as the agent's workspace (text, sizes, count)."""
    import tempfile

    from aitrainsai.jobs.workspace import Workspace, WorkspaceError

    files: dict[str, str] = {}
    path = job_dir
    with tempfile.TemporaryDirectory() as scratch:
        workspace = Workspace(Path(scratch))
        try:
            for path in sorted(job_dir.iterdir()):
                if path.is_file():
                    files[path.name] = path.read_text(encoding="utf-8")
                    workspace.write_file(path.name, files[path.name])
        except (OSError, UnicodeDecodeError, WorkspaceError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise click.BadParameter(f"{path}: {reason}", param_hint="--dir") from None
    return files


def _print_transcript(console, transcript: list[dict[str, Any]], probes: list[ProbeRow]) -> None:
    from rich.markup import escape

    colours = {"system": "dim", "user": "cyan", "assistant": "green", "tool": "yellow"}
    for message in transcript:
        role = message.get("role", "?")
        console.print(f"[bold {colours.get(role, 'white')}]{role}[/]")
        if message.get("content"):
            console.print(escape(str(message["content"])))
        for call in message.get("tool_calls") or []:
            fn = call.get("function", {})
            console.print(f"  -> {escape(str(fn.get('name')))}({escape(str(fn.get('arguments'))[:500])})")
    for probe in probes:
        verdict = "accepted" if probe.ok else "rejected: " + "; ".join(probe.problems)
        console.print(f"probe attempt {probe.attempt}: {escape(verdict)}")


def _resume_plugins(state: CommandState, run, allow_version_change: bool) -> None:
    """Before a resume loads any plugin: take the run's recorded plugin selection (unless --plugins was given) and
    refuse, in one line, when an installed plugin version differs from the recorded one, unless
    ``allow_version_change``: then a ``plugin_versions_changed`` event records the versions and the selection the
    run continues with (a plugin no longer installed is dropped from it), and later resumes start from those."""
    from aitrainsai.plugins import CORE_DISTRIBUTION, PluginVersion, Selection, version_changes

    info = run.info()
    recorded = {p["name"]: p["version"] for p in info.plugins}
    selection = info.selection
    if selection is None:  # a run recorded before selections were: the plugins it loaded
        selection = ",".join(sorted(p["name"] for p in info.plugins if not p.get("builtin")
                                    and p["name"] != CORE_DISTRIBUTION))
    for event in run.records(PluginVersionsChanged):  # what a resume accepted before
        for change in event.changes:
            if change.installed is None:
                recorded.pop(change.name, None)
            else:
                recorded[change.name] = change.installed
        selection = event.selection if "selection" in event.model_fields_set else selection
    if not state.selection_given:
        state.selection = selection
    try:
        chosen = Selection.parse(state.selection)
    except PluginError as exc:
        raise InputError(str(exc)) from None
    changes = version_changes([PluginVersion(name=n, version=v) for n, v in sorted(recorded.items())], chosen)
    if not changes:
        return
    listed = ", ".join(change.text() for change in changes)
    if not allow_version_change:
        raise click.ClickException(f"run {run.id} recorded other plugin versions than are installed: "
                                   f"recorded {listed}; "
                                   f"install the recorded versions, or continue with --allow-version-change")
    gone = {change.name for change in changes if change.installed is None}
    if gone and chosen.only is not None:
        state.selection = ",".join(name for name in chosen.only if name not in gone)
    run.record(PluginVersionsChanged(changes=[PluginChange(**change.model_dump()) for change in changes],
                                     selection=state.selection))
    click.echo(f"Warning: continuing run {run.id} with other plugin versions than it recorded: {listed}", err=True)


def _stopped(stop, line: str) -> None:
    """End a command that a signal stopped: one line on stderr, exit status 128 + the signal (130, 143)."""
    click.echo(f"{stop.name}: {line}", err=True)
    raise SystemExit(stop.exit_code)


def _require_sandbox() -> None:
    """Agent code runs only in the sandbox: refuse to start a run where it cannot be built."""
    from aitrainsai.isolation import sandbox_problem

    problem = sandbox_problem()
    if problem:
        raise click.ClickException(f"this machine cannot build the sandbox agent code runs in: {problem}")


def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


def _when(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def _num(value: Any, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    cli(prog_name="aitrainsai")


if __name__ == "__main__":
    main()
