"""``aitrainsai report RUN``: PNG plots and a markdown summary of a run, from its ledger alone."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

from pydantic import BaseModel

from aitrainsai.run.ledger import Run
from aitrainsai.run.record import (AgentPrompt, BaseChoice, EpisodeRow, Eval, GroupDropped, GroupRef, GroupSkipped,
                                   JobState, LeftOut, OuterStep, PolicyExport, Reward, Stopped)
from aitrainsai.trainers import EvalComparison
from aitrainsai.errors import AitrainsaiError


class JobLine(BaseModel):
    """One training episode as the report lists it: the outer step that trained on it (None: none did), its
    reward, its trained job's hidden-eval outcome (``shared_with``: the identical job whose outcome it took, not
    trained itself), and the choices it made (:func:`_jobs`)."""

    episode: str
    step: int | None
    family: str
    status: str
    reward: float
    train: EvalComparison | None
    shared_with: str | None = None
    chosen: dict[str, Any]


class OptionFigures(BaseModel):
    """One option of a choice that differed: how many jobs took it in the first and the last trained step, and
    their mean reward and uplift (None: none of them trained)."""

    value: Any
    first: int
    last: int
    reward: float
    uplift: float | None


class ChoiceTable(BaseModel):
    choice: str
    options: list[OptionFigures]


class Separation(BaseModel):
    """What separated the jobs of the first and the last trained step (:func:`_separation`)."""

    first: int
    last: int
    jobs_first: int
    jobs_last: int
    tables: list[ChoiceTable]


Change = tuple[float, float, tuple[float, float]]  # first, last, and the paired bootstrap interval of the change


class Comparison(BaseModel):
    """A held-out family under the first and the last policy, on the same eval seeds (:func:`_initial_vs_final`)."""

    family: str
    first: int
    last: int
    episodes: int
    reward: Change
    job_quality: Change


class VersionFigures(BaseModel):
    """The training episodes one policy version wrote: how many, their mean reward and components."""

    version: int
    episodes: int
    reward: float
    components: dict[str, float]


class ReportData(BaseModel):
    """Everything the report (and the viewer's run page) shows of a run, read from its ledger (:func:`collect`).
    The per-step lists run along ``steps``."""

    steps: list[int]
    reward: list[float]
    components: dict[str, list[float]]
    base_choice: list[float | None]  # the share of a step's jobs that trained the best untrained base
    choices: list[BaseChoice]  # the jobs whose trainer offered two bases or more
    uplift: dict[str, list[float]]  # trained training jobs' uplifts, by family
    evals: list[Eval]
    dead_rate: dict[int, float]
    episodes: int
    skipped: int
    dropped: int
    left_out: list[str]
    cost: list[dict[str, float] | None]  # the outer trainer's spending per step (None: it reports none)
    compute: list[dict[str, float]]
    jobs_usd: float
    export: PolicyExport | None
    prompts: list[AgentPrompt]
    stopped: list[str]
    step_uplift: list[tuple[int, float | None]]  # per step: jobs trained, their mean uplift
    comparison: list[Comparison]
    by_version: list[VersionFigures]
    jobs: list[JobLine]
    varied: list[str]  # the choices that differed between jobs
    separation: Separation | None


def collect(run: Run) -> ReportData:
    """Everything the report shows, typed."""
    steps = run.records(OuterStep)
    evals = run.records(Eval)
    episodes = run.episodes()
    evaluations = {ref.id for ref in run.groups().values() if ref.kind == "eval"}
    uplift: dict[str, list[float]] = defaultdict(list)
    for episode in episodes:
        train = episode.data.train
        if train and episode.group_id not in evaluations:
            uplift[episode.family or ""].append(train.uplift)
    dead_by_step: dict[int, list[bool]] = defaultdict(list)
    for episode in episodes:
        if episode.status in ("done", "dead") and episode.step is not None:
            dead_by_step[episode.step].append(episode.status == "dead")
    jobs = _jobs(episodes, steps, evaluations, _shared(run))
    varied = [k for k in dict.fromkeys(k for j in jobs for k in j.chosen) if _differs(jobs, k)]
    return ReportData(
        steps=[s.step for s in steps],
        reward=[s.mean_reward for s in steps],
        components={k: [s.components.get(k, 0.0) for s in steps]
                    for k in sorted({k for s in steps for k in s.components})},
        base_choice=[mean(c.picked_best for c in s.base_choices) if s.base_choices else None for s in steps],
        choices=[c for s in steps for c in s.base_choices if c.base and c.bases >= 2],
        uplift=dict(uplift),
        evals=evals,
        dead_rate={step: mean(flags) for step, flags in sorted(dead_by_step.items())},
        episodes=len(episodes),
        skipped=len(run.records(GroupSkipped)),
        dropped=len(run.records(GroupDropped)),
        left_out=sorted(e for r in run.records(LeftOut) for e in r.episodes),
        cost=[_cost(s.metrics) for s in steps],
        compute=[s.compute for s in steps],
        jobs_usd=run.jobs_cost(),
        export=next(reversed(run.records(PolicyExport)), None),
        prompts=list(run.agent_prompts().values()),
        stopped=[e.reason for e in run.records(Stopped) if e.resumable],
        step_uplift=_step_uplift(steps, episodes),
        comparison=_initial_vs_final(evals, episodes),
        by_version=_by_version(run.records(Reward), evaluations, {e.id: e.group_id for e in episodes}),
        jobs=jobs,
        varied=varied,
        separation=_separation(jobs, varied),
    )


def _shared(run: Run) -> dict[str, str]:
    """By episode: the job whose outcome its job took instead of training (``loop.share_identical_jobs``)."""
    return {job.episode_id: job.progress.shared_with for job in run.jobs()
            if job.episode_id and job.progress.shared_with and job.state is JobState.DONE}


def _jobs(episodes: list[EpisodeRow], steps: list[OuterStep], evaluations: set[str], shared: dict[str, str]
          ) -> list[JobLine]:
    """Every training episode (evaluations apart), oldest first: the choices its policy recorded in a turn's
    ``meta["chosen"]`` (the recipe policy does) or else what its accepted job chose
    (:func:`aitrainsai.jobs.job.job_design`: the rubric's functions and trainer.toml's values)."""
    trained_by = {group: step.step for step in steps for group in step.groups}
    rows = []
    for episode in episodes:
        if episode.group_id in evaluations or episode.reward is None:
            continue
        # an agent that records no choices (an LLM): what its accepted job chose
        chosen = episode.data.chosen() or episode.data.design or {}
        rows.append(JobLine(episode=episode.id, step=trained_by.get(episode.group_id or ""),
                            family=episode.family or "", status=episode.status, reward=episode.reward,
                            train=episode.data.train, shared_with=shared.get(episode.id),
                            chosen={str(k): v for k, v in chosen.items()}))
    return rows


def _step_uplift(steps: list[OuterStep], episodes: list[EpisodeRow]) -> list[tuple[int, float | None]]:
    """Per outer step: how many of its jobs trained, and their mean uplift."""
    by_group: dict[str | None, list[float]] = defaultdict(list)
    for episode in episodes:
        if episode.data.train is not None:
            by_group[episode.group_id].append(episode.data.train.uplift)
    out = []
    for step in steps:
        values = [u for g in step.groups for u in by_group.get(g, [])]
        out.append((len(values), mean(values) if values else None))
    return out


def _initial_vs_final(evals: list[Eval], episodes: list[EpisodeRow]) -> list[Comparison]:
    """Each held-out family evaluated at step 0 and later: the first and the last policy, episode by episode on the
    same eval seeds (the same episode index), with a paired bootstrap interval of the difference."""
    from aitrainsai.evaluation import paired_bootstrap

    rows = []
    for family in sorted({e.family for e in evals if e.held_out}):
        steps = sorted({e.step for e in evals if e.family == family})
        if len(steps) < 2 or steps[0] != 0:
            continue
        first, last = steps[0], steps[-1]

        def scores(step: int, family: str = family) -> dict[int, tuple[float, float]]:
            """By member: the same member plays the same eval seed at every step."""
            group = GroupRef.eval(step, family)
            rows = {e.id: e for e in episodes if e.group_id == group.id and e.reward is not None}
            members = {group.episode_id(i): i for i in range(len(episodes))}
            return {members[i]: (e.reward or 0.0, e.data.components.get("job_quality", 0.0))
                    for i, e in rows.items() if i in members}

        before, after = scores(first), scores(last)
        keys = sorted(set(before) & set(after), key=GroupRef.eval(first, family).episode_id)  # the ids' order
        if not keys:
            continue
        changes = []
        for k in (0, 1):
            a, b = [before[key][k] for key in keys], [after[key][k] for key in keys]
            changes.append((mean(a), mean(b), paired_bootstrap(a, b)))
        rows.append(Comparison(family=family, first=first, last=last, episodes=len(keys), reward=changes[0],
                               job_quality=changes[1]))
    return rows


def _comparison_lines(data: ReportData) -> list[str]:
    if not data.comparison:
        return []
    lines = ["", "## Held-out families: initial vs final policy", "",
             "The untrained policy (step 0) and the last one, on the same eval seeds; the interval is a paired "
             "bootstrap over episodes.", "",
             "| family | episodes | steps | reward first → last (95% CI of the change) | job quality first → last "
             "(95% CI) |", "|---|---|---|---|---|"]
    for row in data.comparison:
        cells = []
        for a, b, (low, high) in (row.reward, row.job_quality):
            cells.append(f"{a:+.3f} → {b:+.3f} ({b - a:+.3f}; {low:+.3f} .. {high:+.3f})")
        lines.append(f"| {row.family} | {row.episodes} | {row.first} → {row.last} | {cells[0]} | {cells[1]} |")
    return lines


def _by_version(rewards: list[Reward], evaluations: set[str], groups: dict[str, str | None]
                ) -> list[VersionFigures]:
    """The training episodes' rewards by the policy version that wrote them (an episode's ``step``): every episode,
    those of groups skipped for want of signal too, which an outer step's mean leaves out."""
    found: dict[int, list[Reward]] = defaultdict(list)
    for reward in rewards:
        if reward.step is not None and reward.total is not None and groups.get(reward.episode) not in evaluations:
            found[reward.step].append(reward)
    rows = []
    for version, items in sorted(found.items()):
        names = sorted({k for r in items for k in r.components})
        rows.append(VersionFigures(version=version, episodes=len(items), reward=mean(r.total or 0.0 for r in items),
                                   components={k: mean(r.components.get(k, 0.0) for r in items) for k in names}))
    return rows


def _version_lines(data: ReportData) -> list[str]:
    """The mean reward of every training episode by the policy that wrote it, where a later policy's groups were
    skipped (no reward spread: nothing to train on) and so appear in no outer step."""
    rows = data.by_version
    if len(rows) < 2 or not (data.skipped or len(rows) > len(data.steps)):
        return []
    lines = ["", "## Reward by the policy that wrote the episodes", "",
             "Every training episode, by the policy version it was written with (0: before any update), groups "
             "skipped for want of reward spread included.", "",
             "| policy | episodes | mean reward | " + " | ".join(rows[-1].components) + " |",
             "|---|---|---|" + "---|" * len(rows[-1].components)]
    for row in rows:
        lines.append(f"| v{row.version} | {row.episodes} | {row.reward:+.3f} | "
                     + " | ".join(f"{row.components.get(k, 0.0):.3f}" for k in rows[-1].components) + " |")
    first, last = rows[0], rows[-1]
    named = _moved({k: (first.components.get(k, 0.0), v) for k, v in last.components.items()})
    change = last.reward - first.reward
    lines += ["", f"Mean reward, policy v{first.version} → v{last.version}: {change:+.3f}; its components "
                  f"moved {named} (unweighted, largest first)."]
    return lines


def _moved(components: dict[str, tuple[float, float]]) -> str:
    """Each component's change from first to last, largest first: ``"job_quality +0.230, ..."``."""
    moves = sorted(((k, last - first) for k, (first, last) in components.items()), key=lambda kv: -abs(kv[1]))
    return ", ".join(f"{k} {v:+.3f}" for k, v in moves) or "-"


def _reason_lines(data: ReportData) -> list[str]:
    """What moved the mean reward between the first and the last outer step, component by component."""
    if len(data.steps) < 2:
        return []
    change = data.reward[-1] - data.reward[0]
    named = _moved({k: (v[0], v[-1]) for k, v in data.components.items()})
    return ["", f"Mean reward, step {data.steps[0]} → {data.steps[-1]}: {change:+.3f}; its components moved "
                f"{named} (unweighted, largest first)."]


def _job_lines(data: ReportData) -> list[str]:
    """One row per training episode, with the choices that differed between the run's jobs."""
    jobs, varied = data.jobs, data.varied
    if not jobs:
        return []
    lines = ["", "## Jobs (training episodes)", "",
             "Step: the outer step that trained on the job's group (-: none did).", "",
             "| step | family | status | reward | pre → post | uplift (95% CI) | choices that differed |",
             "|---|---|---|---|---|---|---|"]
    for job in jobs:
        train = job.train
        outcome = ("-", "-") if not train else (
            f"{train.pre:.3f} → {train.post:.3f}",
            f"{train.uplift:+.3f} ({train.uplift_ci[0]:+.3f} .. {train.uplift_ci[1]:+.3f})")
        picks = ", ".join(f"{k}={job.chosen[k]}" for k in varied if k in job.chosen) or "-"
        step = "-" if job.step is None else job.step
        status = job.status + (f" (shared with {job.shared_with})" if job.shared_with else "")
        lines.append(f"| {step} | {job.family} | {status} | {job.reward:+.3f} | {outcome[0]} | "
                     f"{outcome[1]} | {picks} |")
    above = sum(1 for j in jobs if j.train and j.train.uplift_ci[0] > 0)
    trained = sum(1 for j in jobs if j.train)
    lines += ["", f"{above} of {trained} trained jobs have an uplift interval above 0."]
    shared = sum(1 for j in jobs if j.shared_with)
    if shared:
        lines[-1] += (f" {shared} of them did not train: each was identical to a job of the run and took its outcome "
                      f"(shared, at no cost; loop.share_identical_jobs).")
    return lines + _separation_lines(data.separation)


def _differs(jobs: list[JobLine], key: str) -> bool:
    """Two jobs that chose ``key`` chose it differently (a job without a design, never submitted, chose nothing)."""
    return len({repr(j.chosen[key]) for j in jobs if key in j.chosen}) > 1


def _separation(jobs: list[JobLine], varied: list[str]) -> Separation | None:
    """Per choice that differed: each option's jobs in the first and the last trained step, mean reward and mean
    uplift. Decisions whose options' mean rewards differ most come first: what the policy's update had to go on.
    None: fewer than two trained steps."""
    jobs = [j for j in jobs if j.step is not None]  # what some update trained on
    varied = [k for k in varied if _differs(jobs, k)]
    steps = sorted({j.step for j in jobs if j.step is not None})
    if not varied or len(steps) < 2:
        return None
    first, last = steps[0], steps[-1]
    tables: list[tuple[float, ChoiceTable]] = []
    for key in varied:
        rows: list[OptionFigures] = []
        for option in dict.fromkeys(repr(j.chosen.get(key)) for j in jobs if key in j.chosen):
            picked = [j for j in jobs if repr(j.chosen.get(key)) == option]
            uplifts = [j.train.uplift for j in picked if j.train]
            rows.append(OptionFigures(value=picked[0].chosen[key], first=sum(j.step == first for j in picked),
                                      last=sum(j.step == last for j in picked), reward=mean(j.reward for j in picked),
                                      uplift=mean(uplifts) if uplifts else None))
        spread = max(r.reward for r in rows) - min(r.reward for r in rows)
        tables.append((spread, ChoiceTable(choice=key, options=sorted(rows, key=lambda r: -r.reward))))
    return Separation(first=first, last=last, jobs_first=sum(j.step == first for j in jobs),
                      jobs_last=sum(j.step == last for j in jobs),
                      tables=[table for _, table in sorted(tables, key=lambda t: -t[0])])


def _separation_lines(separation: Separation | None) -> list[str]:
    if separation is None:
        return []
    first, last = separation.first, separation.last
    lines = ["", "## What separated the jobs", "",
             f"Each choice that differed between jobs, by option: how many jobs took it in the first and the last "
             f"outer step (of {separation.jobs_first} and {separation.jobs_last}), their mean reward and mean "
             f"uplift; the choices whose options' rewards differ most first.", "",
             f"| choice | option | jobs, step {first} → {last} | mean reward | mean uplift |",
             "|---|---|---|---|---|"]
    for table in separation.tables:
        for row in table.options:
            uplift = "-" if row.uplift is None else f"{row.uplift:+.3f}"
            lines.append(f"| {table.choice} | {row.value} | {row.first} → {row.last} | {row.reward:+.3f} | {uplift} |")
    return lines


COST_KEYS = ("cost_usd", "cost_usd_total", "tokens_prefill", "tokens_sampled", "tokens_trained")


def _cost(metrics: dict[str, Any]) -> dict[str, float] | None:
    """The outer trainer's spending in one step's metrics, where it reports it (a priced service)."""
    if not isinstance(metrics.get("cost_usd_total"), (int, float)):
        return None
    return {k: float(metrics[k]) for k in COST_KEYS if isinstance(metrics.get(k), (int, float))}


def _compute_lines(data: ReportData) -> list[str]:
    """What the backend charged: the jobs of each outer step, all jobs (evaluations and baselines too), and the
    backend's own figures at the last step (a pool's idle time), where it bills anything."""
    if not data.jobs_usd and not any(any(c.values()) for c in data.compute):
        return []
    lines = ["", "## Compute cost", "", "| step | jobs $ |", "|---|---|"]
    lines += [f"| {step} | {c.get('jobs_usd', 0.0):.2f} |" for step, c in zip(data.steps, data.compute)]
    last = data.compute[-1] if data.compute else {}
    rest = ", ".join(f"{k.removesuffix('_usd')} ${v:.2f}" for k, v in last.items() if k != "jobs_usd")
    lines += ["", f"All jobs of the run: ${data.jobs_usd:.2f}" + (f"; the backend at the last step: {rest}."
                                                                      if rest else ".")]
    return lines


def _base_choice_lines(data: ReportData) -> list[str]:
    """How often the agent's job trained the base whose untrained score was the better one (jobs of trained outer
    steps where the trainer offers two bases or more): the reference system's "meta-ML" signal."""
    choices = data.choices
    if not choices:
        return []
    picked = sum(1 for c in choices if c.picked_best)
    by_base = ", ".join(f"{base} {n}" for base, n in sorted(Counter(c.base for c in choices).items()))
    return ["", "## Base choice", "",
            f"The agent picked the base with the better untrained score in {picked} of {len(choices)} jobs "
            f"({picked / len(choices):.0%}); jobs per base: {by_base}."]


def _policy_lines(data: ReportData, out: Path) -> list[str]:
    """The trained policy's references, with the reward spec and the exact agent prompt it was trained against."""
    export = data.export
    if export is None:
        return []
    lines = ["", "## Trained policy", "", f"Exported after outer step {export.step}:", ""]
    blocks = []
    for name, ref in sorted(export.refs.items()):
        first, _, rest = str(ref).partition("\n")  # a reference with more to say: its first line, then the rest
        lines.append(f"- {name}: `{first}`")
        if rest.strip():
            blocks += ["", rest.strip("\n")]
    lines += blocks
    spec = export.reward_spec
    name, formula = (spec.name, spec.formula or "") if spec else ("?", "")
    lines += ["", f"Trained against the reward spec `{name}`: {formula}", ""]
    if spec and spec.file:
        lines += ["```toml", spec.file.rstrip(), "```"]
    if data.prompts:
        parts = []
        for prompt in data.prompts:
            parts += [f"# {prompt.family} (level {prompt.level}, episode {prompt.episode})", ""]
            for message in prompt.messages:
                parts += [f"## {message['role']}", "", str(message.get("content") or ""), ""]
            parts += ["## tools", "", "```json", json.dumps(prompt.tools, indent=2), "```", ""]
        (out / "agent_prompt.md").write_text("\n".join(parts))
        lines += ["", ("The agent's prompt, exactly as it saw it (opening messages and tool schemas, per family): "
                       "[agent_prompt.md](agent_prompt.md).")]
    return lines


class ReportUnavailable(RuntimeError, AitrainsaiError):
    """The report's optional dependencies are not installed."""


def write_report(run: Run, out_dir: Path | None = None) -> Path:
    """Write ``report.md`` and its PNG plots into ``out_dir`` (default: the run's ``report/``); return the markdown."""
    data = collect(run)  # the ledger first: a damaged one is reported as such
    try:
        import matplotlib
    except ImportError:
        raise ReportUnavailable("the report needs matplotlib: pip install 'aitrainsai[report]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = Path(out_dir or run.dir / "report")
    out.mkdir(parents=True, exist_ok=True)
    figures = []

    def save(fig, name: str, title: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        figures.append((title, name))

    def steps_axis(ax) -> None:
        ax.set_xlabel("outer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    def legend_or_note(ax, note: str) -> None:
        """A legend when something was drawn, else ``note`` in the middle of the empty panel (a legend of nothing
        is a matplotlib warning)."""
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="grey")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if data.steps:
        ax.plot(data.steps, data.reward, marker="o", linewidth=2, label="reward")
        for name, values in data.components.items():
            ax.plot(data.steps, values, marker=".", linestyle="--", label=name)
    steps_axis(ax)
    ax.set_ylabel("mean episode reward")
    legend_or_note(ax, "no outer step finished in this run")
    ax.grid(alpha=0.3)
    save(fig, "reward.png", "Episode reward per outer step, with its components")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    families = sorted(data.uplift)
    if families:
        means = [mean(data.uplift[f]) for f in families]
        ax.bar(families, means, color="tab:green")
        for i, f in enumerate(families):
            ax.scatter([i] * len(data.uplift[f]), data.uplift[f], color="black", s=8, zorder=3)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_ylabel("uplift (post - pre)")
    ax.tick_params(axis="x", rotation=30)
    save(fig, "uplift.png", "Per-family uplift of trained jobs (bars: mean; dots: jobs)")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    held = [e for e in data.evals if e.held_out]
    train = [e for e in data.evals if not e.held_out]
    if held:
        ax.plot([e.step for e in held], [e.mean_reward for e in held], marker="o", label="held out")
    if train:
        by_step: dict[int, list[float]] = defaultdict(list)
        for e in train:
            by_step[e.step].append(e.mean_reward)
        ax.plot(sorted(by_step), [mean(by_step[s]) for s in sorted(by_step)], marker="s", label="training families")
    steps_axis(ax)
    ax.set_ylabel("eval episode reward")
    legend_or_note(ax, "no evaluation step in this run\n(see loop.eval_every and loop.final_eval)")
    ax.grid(alpha=0.3)
    save(fig, "heldout.png", "Evaluation with no update: held-out family vs training families")

    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    rates = [(s, r) for s, r in zip(data.steps, data.base_choice) if r is not None]
    if rates:
        left.plot(*zip(*rates), marker="o")
    left.set_ylim(-0.05, 1.05)
    left.set_title("base-choice rate (picked the best untrained base)", fontsize=9)
    steps_axis(left)
    if data.dead_rate:
        right.bar(list(data.dead_rate), list(data.dead_rate.values()), color="tab:red")
    right.set_ylim(0, 1.05)
    right.set_title("dead-job rate", fontsize=9)
    steps_axis(right)
    save(fig, "rates.png", "Base-choice rate and dead-job rate")

    info = run.info()
    lines = [f"# Run {info.id}" + (f" ({info.name})" if info.name else ""), "",
             f"Status: {info.status}. Episodes: {data.episodes}. Groups skipped (no signal): {data.skipped}; "
             f"dropped (too stale): {data.dropped}."
             + (f" Episodes left out of their group's signal (their jobs died of the infrastructure, not of the "
                f"agent's job): {', '.join(data.left_out)}." if data.left_out else ""),
             "", "## Outer steps", "",
             "| step | mean reward | " + " | ".join(data.components) + " | jobs trained | mean uplift |",
             "|---|---|" + "---|" * len(data.components) + "---|---|"]
    for i, step in enumerate(data.steps):
        parts = " | ".join(f"{data.components[k][i]:.3f}" for k in data.components)
        trained, uplift = data.step_uplift[i]
        lines.append(f"| {step} | {data.reward[i]:+.3f} | {parts} | {trained} | "
                     f"{'-' if uplift is None else f'{uplift:+.3f}'} |")
    lines += _reason_lines(data)
    lines += _version_lines(data)
    lines += _job_lines(data)
    lines += ["", "## Evaluations (no update)", ""]
    lines += (["| step | family | held out | reward | pre | post |", "|---|---|---|---|---|---|"] if data.evals
              else ["No evaluation step in this run: the held-out plot below is empty."])
    for e in data.evals:
        pre = f"{mean(e.pre):.3f}" if e.pre else "-"
        post = f"{mean(e.post):.3f}" if e.post else "-"
        lines.append(f"| {e.step} | {e.family} | {'yes' if e.held_out else 'no'} | {e.mean_reward:+.3f} | "
                     f"{pre} | {post} |")
    lines += _comparison_lines(data)
    costs = [c for c in data.cost if c]
    if costs:
        last = costs[-1]
        tokens = ", ".join(f"{k.removeprefix('tokens_')} {int(sum(c.get(k, 0) for c in costs)):,}"
                           for k in COST_KEYS[2:] if any(k in c for c in costs))
        lines += ["", "## Agent cost", "",
                  (f"${last['cost_usd_total']:.2f} over {len(costs)} outer steps "
                   f"(${last['cost_usd_total'] / len(costs):.2f} per step); tokens: {tokens or '-'}.")]
    lines += _compute_lines(data)
    if data.stopped:
        lines += ["", (f"Stopped before the end: {data.stopped[-1]} (continue with `aitrainsai run --resume "
                       f"{info.id}`).")]
    lines += _policy_lines(data, out)
    lines += _base_choice_lines(data)
    lines += ["", "## Uplift by family (training episodes)", ""]
    for family in sorted(data.uplift):
        values = data.uplift[family]
        lines.append(f"- {family}: mean {mean(values):+.3f} over {len(values)} jobs")
    for title, name in figures:
        lines += ["", f"## {title}", "", f"![{title}]({name})"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
