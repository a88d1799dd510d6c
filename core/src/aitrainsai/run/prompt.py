"""What the agent reads first: the system and user messages of an episode's opening, in the run's task view
(``loop.task_view``): ``full``, the whole spec, the template's files and the trainer.toml schema; ``compact``, about a
quarter of that size from the same spec and template."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from aitrainsai.chat import Message
    from aitrainsai.families import TaskSpec
    from aitrainsai.reward_spec import RewardSpec
    from aitrainsai.trainers import InnerTrainer

AGENT_ROLE = """You are an ML engineer. You write training jobs that teach a small language model a task with
reinforcement learning (GRPO). A job is four files in your workspace: environment.py (a verifiers environment with the
task's eval interface), rubric.py (the reward functions GRPO maximises), dataset.py (the training rows) and
trainer.toml (the trainer config). Your workspace starts with a working job; use the tools to improve it, then call
submit_job: a probe validates the job and tells you what to fix; an accepted job trains the model, which is then
scored on a hidden eval you never see."""

AGENT_ROLE_V1 = """You are an ML engineer. You write training jobs that teach a small language model a task with
reinforcement learning (GRPO). A job is four files in your workspace, in the verifiers v1 format: taskset.py (a
verifiers 0.4.0 taskset whose task has the eval's interface), rubric.py (the @vf.reward methods GRPO maximises),
dataset.py (the training rows) and trainer.toml (the trainer config). Your workspace starts with a working job; use the
tools to improve it, then call submit_job: a probe validates the job and tells you what to fix; an accepted job trains
the model, which is then scored on a hidden eval you never see."""

AGENT_ROLE_COMPACT = """You are an ML engineer. Your workspace holds a working job that trains a small model on a task
with GRPO. Improve it, then call submit_job: a probe checks the job; an accepted job trains the model, then a hidden
eval scores it."""

TaskView = Literal["full", "compact"]


def opening(view: TaskView, spec: TaskSpec, template: dict[str, str], trainer: InnerTrainer,
            reward: RewardSpec) -> list[Message]:
    """The opening messages in ``view``: :func:`full_opening` or :func:`compact_opening`."""
    return (compact_opening if view == "compact" else full_opening)(spec, template, trainer, reward)


def full_opening(spec: TaskSpec, template: dict[str, str], trainer: InnerTrainer,
                 reward: RewardSpec) -> list[Message]:
    """The whole spec, the template's files and the trainer.toml schema."""
    files = "\n\n".join(f"### {name}\n```\n{text}```" for name, text in template.items())
    role = AGENT_ROLE_V1 if spec.job_format == "verifiers-v1" else AGENT_ROLE
    system = f"{role}\n\n{reward.agent_text()}"
    user = (f"{spec.render()}\n## Job template (a working job; improve it)\n\n{files}\n\n"
            f"The trainer config schema (trainer.toml): {json.dumps(_schema_summary(trainer))}\n\n"
            "Your workspace already holds these four files. Improve them with edit_file or write_file, "
            "then call submit_job.")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def compact_opening(spec: TaskSpec, template: dict[str, str], trainer: InnerTrainer,
                    reward: RewardSpec) -> list[Message]:
    """The spec in brief (:meth:`TaskSpec.render_compact`), the workspace's files by name with their purpose and the
    names they define (``read_file`` gives the text), and trainer.toml's keys, each with its value and what it may
    be."""
    files = "\n".join(f"- {name}: {_file_summary(name, text)}" for name, text in template.items())
    keys = "\n".join(_config_lines(trainer, template.get("trainer.toml", "")))
    system = f"{AGENT_ROLE_COMPACT}\n\n{compact_reward_text(reward)}"
    user = (f"{spec.render_compact()}\nYour workspace holds a working job (read_file gives a file's text):\n"
            f"{files}\n\ntrainer.toml now (allowed; meaning):\n{keys}\n\n"
            "Improve the job with edit_file (write_file for a whole file), then call submit_job.")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def compact_reward_text(spec: RewardSpec) -> str:
    """The reward in brief: the formula, a component's ``description`` where it has one, the rule for no submission
    and the attempts allowed (:meth:`RewardSpec.agent_text` explains every component in full)."""
    lines = [f"How you are rewarded: {spec.formula()}."]
    lines += [f"{term.component}: {type(component).description}" for term, component in spec.components
              if type(component).description]
    lines.append(f"With no submit_job call that parses, the reward is {spec.data.no_submission:g}. You have "
                 f"{spec.max_attempts} submit_job attempts; the first accepted one ends the episode.")
    return "\n".join(lines)


def _schema_summary(trainer: InnerTrainer) -> dict[str, Any]:
    schema = trainer.JobConfig.model_json_schema()
    return {name: {k: v for k, v in prop.items() if k in ("type", "default", "minimum", "maximum", "description")}
            for name, prop in schema.get("properties", {}).items()}


_SHOWN_VALUE_CHARS = 40  # a template constant whose value is longer is named without it
_KINDS = {"integer": "int", "number": "float", "string": "str", "boolean": "bool"}


def _file_summary(name: str, text: str) -> str:
    """One line on a template file: its purpose (its docstring's first line, to the first colon) and what it sets:
    its constants (the short ones with their values), else its functions. trainer.toml: a pointer to its keys."""
    import ast

    if name.endswith(".toml"):
        return "the trainer config; its keys are below."
    try:
        tree = ast.parse(text) if name.endswith(".py") else None
    except SyntaxError:
        tree = None
    if tree is None:
        return f"{len(text.splitlines())} lines."
    constants, functions = [], []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.append(f"{node.name}()")
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
              and node.targets[0].id.isupper()
              and isinstance(node.value, (ast.Constant, ast.Dict, ast.List, ast.Tuple, ast.Set))):
            value = ast.get_source_segment(text, node.value) or ""
            short = len(value) <= _SHOWN_VALUE_CHARS and "\n" not in value
            constants.append(f"{node.targets[0].id} = {value}" if short else node.targets[0].id)
    docstring = (ast.get_docstring(tree) or "").strip().splitlines()
    purpose = docstring[0].split(": ")[0].rstrip(".") + "." if docstring else ""  # "Training rows: build() ..."
    sets = f"Sets {', '.join(constants)}." if constants else f"Defines {', '.join(functions)}." if functions else ""
    return " ".join(part for part in (purpose, sets) if part)


def _config_lines(trainer: InnerTrainer, toml_text: str) -> list[str]:
    """trainer.toml's keys, one line each: the template's value, then what the trainer's schema allows (base_model:
    a base the hard constraints list) and what the key means."""
    import tomllib

    try:
        values = tomllib.loads(toml_text)
    except tomllib.TOMLDecodeError:
        values = {}
    lines = []
    for name, prop in trainer.JobConfig.model_json_schema().get("properties", {}).items():
        value = values.get(name, prop.get("default"))
        allowed = "an allowed base model" if name == "base_model" else _allowed(prop)
        about = str(prop.get("description") or "").split(";")[0].strip()
        lines.append(f"{name} = {json.dumps(value)} ({allowed}{'; ' + about if about else ''})")
    return lines


def _allowed(prop: dict[str, Any]) -> str:
    """What a JSON schema property allows, in a few words: the choices, or the type and its bounds."""
    if "enum" in prop:
        return "one of " + ", ".join(json.dumps(v) for v in prop["enum"])
    kinds = [prop["type"]] if "type" in prop else [p.get("type", "?") for p in prop.get("anyOf", [])]
    kind = "/".join(_KINDS.get(str(k), str(k)) for k in kinds) or "any"
    if "minimum" in prop and "maximum" in prop:
        return f"{kind} {_number(prop['minimum'])}..{_number(prop['maximum'])}"
    bounds = [f"{sign}{_number(prop[key])}" for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                             ("maximum", "<="), ("exclusiveMaximum", "<"))
              if key in prop]
    return " ".join([kind, *bounds])


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
