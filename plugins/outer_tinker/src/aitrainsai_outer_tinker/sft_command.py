"""``aitrainsai sft``: a supervised warm start of the tinker policy on a run's accepted episodes (imports nothing heavy
until it runs)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import click
from click.core import ParameterSource


@click.command("sft")
@click.option("--from", "sources", multiple=True, required=True, metavar="RUN",
              help="A run whose accepted episodes are the demonstrations (an id, a prefix, a name or latest; "
                   "repeatable).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The warm start's folder (tinker.json, sft.json); the same command again continues a killed or "
                   "stopped one from its last saved step.")
@click.option("--preset", help="The preset of the run that will continue from it (its outer_trainer.tinker options: "
                               "base model, service, LoRA rank, renderer).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), help="A TOML run config.")
@click.option("--set", "-s", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key, e.g. -s outer_trainer.tinker.base_url=local (repeatable).")
@click.option("--epochs", type=int, default=3, show_default=True)
@click.option("--learning-rate", type=float, default=1e-4, show_default=True, help="Adam step size.")
@click.option("--batch", "batch_size", type=int, default=8, show_default=True, help="Turns per optimizer step.")
@click.option("--held-out", type=float, default=0.2, show_default=True,
              help="The share of episodes kept out of training (each family and rubric its share); their loss is "
                   "reported per epoch.")
@click.option("--min-reward", type=float, default=None, help="Only episodes at or above this reward.")
@click.option("--include-dead", is_flag=True, help="Also episodes whose accepted job died in training.")
@click.option("--seed", type=int, default=0, show_default=True, help="The split and the batch order.")
@click.option("--save-every", "save_minutes", type=float, default=10.0, show_default=True, metavar="MINUTES",
              help="Save the state this often between epochs (and at the end of each): what a killed warm start "
                   "continues from; 0: after every step.")
@click.option("--check", type=int, default=0, show_default=True,
              help="Then play the agent side of this many fresh draws per training family (one at temperature 0), "
                   "cold (the base) and warm (the warm start), and table what they came to in sft.json and the "
                   "run's report; no job is trained.")
@click.option("--check-temperature", type=float, default=0.0, show_default=True, help="0: greedy.")
@click.option("--dry-run", is_flag=True, help="Only render the data and price it (offline: the local model, or "
                                              "-s outer_trainer.tinker.tokenizer=tml-renderers); creates nothing.")
def sft(sources: tuple[str, ...], out_dir: Path, preset: str | None, config_path: Path | None,
        overrides: tuple[str, ...], epochs: int, learning_rate: float, batch_size: int, held_out: float,
        min_reward: float | None, include_dead: bool, seed: int, save_minutes: float, check: int,
        check_temperature: float, dry_run: bool) -> None:
    """Warm-start the tinker policy: supervised training (cross_entropy) on the assistant turns of the accepted
    episodes of RUNs, rendered as the agent would have written them; then point a run at it with
    -s outer_trainer.tinker.init_state=OUT.

    \b
    Examples:
      aitrainsai sft --from latest --out warm --preset tinker-local
      aitrainsai sft --from demos --out warm --preset llm-quickstart --epochs 4 --min-reward 0.5 --check 1
      aitrainsai sft --from demos --out warm --preset tinker -s outer_trainer.tinker.tokenizer=tml-renderers --dry-run
      aitrainsai run --preset llm-quickstart -s outer_trainer.tinker.init_state=warm
    """
    from aitrainsai import CommandState, ConfigError, InputError, Interrupted, load_config, resolve, run_until_stopped
    from pydantic import ValidationError

    from aitrainsai_outer_tinker.state import SftSettings
    from aitrainsai_outer_tinker.trainer import SECTION, TinkerConfig, TinkerTrainer
    from aitrainsai_outer_tinker.warm_start import WarmStart, WarmStartError, WarmStartStopped

    state = click.get_current_context().ensure_object(CommandState)
    try:
        settings = SftSettings(epochs=epochs, learning_rate=learning_rate, batch_size=batch_size, held_out=held_out,
                               min_reward=min_reward, include_dead=include_dead, seed=seed)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise InputError(f"--{str(error['loc'][0]).replace('_', '-')}: {error['msg']}") from None
    try:
        resolved = resolve(load_config(config_path, overrides, preset, presets=state.plugins.presets),
                           state.plugins, str(config_path or "config"))
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    chosen = resolved.outer_trainer
    if chosen is None or chosen.use != TinkerTrainer.name:
        raise InputError(f"sft trains a tinker policy, and this config's outer trainer is "
                         f"{getattr(chosen, 'use', None)!r}: give a tinker preset or -s outer_trainer.use=tinker")
    config = chosen.config
    assert isinstance(config, TinkerConfig)  # the tinker trainer's options, validated by resolve()
    problems = TinkerTrainer.format_problems(config) if dry_run else TinkerTrainer.preflight(config)
    if problems:
        raise InputError(f"{SECTION}: " + "; ".join(problems))
    if check < 0 or check_temperature < 0 or save_minutes < 0:
        raise InputError("--check, --check-temperature and --save-every: at least 0")
    runs = [state.ledger().run(ref) for ref in sources]
    warm = WarmStart(config, out_dir, settings, say=lambda line: click.echo(line), save_every_s=save_minutes * 60)
    again = continuation(click.get_current_context(), [run.id for run in runs])

    def with_init(init: Path | None):
        extra = [] if init is None else [f"{SECTION}.init_state={json.dumps(str(init.resolve()))}"]
        extra += [f"{SECTION}.temperature={check_temperature}"] if check_temperature > 0 else []
        return resolve(load_config(config_path, [*overrides, *extra], preset, presets=state.plugins.presets),
                       state.plugins, str(config_path or "config"))

    families = list(resolved.families.train)
    try:
        run_until_stopped(lambda: warm.run(runs, dry_run=dry_run))
        if check and not dry_run:
            run_until_stopped(lambda: warm.check(with_init, state.plugins, families, draws=check,
                                                 temperature=check_temperature))
    except WarmStartStopped as exc:
        raise click.ClickException(f"{exc}; continue it with: {again}" if exc.resumable else str(exc)) from None
    except WarmStartError as exc:
        raise click.ClickException(str(exc)) from None
    except Interrupted as stop:
        click.echo(f"{stop.name}: the warm start stopped; continue it from its last saved step with: {again}",
                   err=True)
        raise SystemExit(stop.exit_code) from None


def continuation(ctx: click.Context, run_ids: list[str]) -> str:
    """The command that continues this warm start: this one as given, each ``--from`` run named by its id (a name
    or ``latest`` may name another run by then), with its ``--plugins`` and, where not the default, its runs
    directory."""
    from aitrainsai import CommandState

    state = ctx.ensure_object(CommandState)
    words = ["aitrainsai"]
    if state.selection_given and state.selection is not None:
        words += ["--plugins", state.selection]
    if state.runs_dir != Path(os.environ.get("AITRAINSAI_RUNS_DIR", "runs")):
        words += ["--runs-dir", str(state.runs_dir)]
    words.append(ctx.info_name or "sft")
    for param in ctx.command.params:
        if (not isinstance(param, click.Option) or param.name is None or param.name not in ctx.params
                or ctx.get_parameter_source(param.name) is not ParameterSource.COMMANDLINE):
            continue
        flag = next((o for o in param.opts if o.startswith("--")), param.opts[0])
        value = run_ids if param.name == "sources" else ctx.params[param.name]
        if param.is_flag:
            words += [flag] if value else []
        elif param.multiple:
            for item in value:
                words += [flag, str(item)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)
