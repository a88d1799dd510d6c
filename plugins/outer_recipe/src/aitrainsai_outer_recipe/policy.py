"""A stochastic policy over job-design decisions, trained with importance-sampling GRPO.

Each decision is a categorical choice with logits ``shared[d] + per_family[f][d]``. An episode samples every decision
once, writes the job from them (:func:`write_job`) as ``edit_file`` calls on the template's files (:func:`job_calls`)
and calls ``submit_job``, in a single turn whose ``completion_tokens`` are the chosen options and whose ``logprobs``
are their log-probabilities (with ``read_first``, after a turn of ``read_file`` calls that draws nothing).
The update is the IS-GRPO step of :mod:`aitrainsai.is_grpo`: loss ``-sum exp(logp - logp_sampler) * advantage`` over
decisions, its exact gradient for softmax logits, and a plain gradient step. Advantages are centred, not divided by
the group's spread, and the step is not normalised (no Adam): a reward gap of 0.001 (train-speed jitter) moves the
logits a thousand times less than a refused job does, instead of as much.
"""

from __future__ import annotations

import json
import math
import random
import tomllib
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any, NamedTuple, cast

import tomli_w
from pydantic import Field, field_validator

from aitrainsai import (AgentTask, AgentTurn, ComponentConfig, JobFormat, Message, OuterTrainer, SampleMode,
                        ScoredEpisode, ToolCall, TurnMeta, build_datum, group_advantages, has_signal,
                        importance_sampling_loss, job_format)

RUBRICS = {
    "exact": ("correct_answer", "1.0 for the right final answer", []),
    "shaped": ("correct_answer", "1.0 for the right answer, 0.3 for naming it anywhere in the reply, 0.2 for "
                                 "<answer> tags, 0.1 for a short reply: signal before the model is often right", []),
    "exact+format": ("correct_answer", "1.0 for the right answer, 0.2 for answering in <answer> tags", ["format"]),
    "exact+tools": ("correct_answer", "1.0 for the right answer, 0.1 for using a tool", ["tools"]),
    "length": ("length", "longer replies score higher (rewards nothing useful)", []),
    "constant": ("constant", "every reply scores 1 (the probe refuses it)", []),
}
TAGS = " End your reply with <answer>...</answer>."
# (text appended to a question, on every n-th row): "tags-half" hints every other row, as the reference jobs do,
# so half the rows look like the eval's
SUFFIXES = {"none": ("", 1), "tags": (TAGS, 1), "tools": (" Use the tools, then answer.", 1), "tags-half": (TAGS, 2)}
TRAINER_CHOICES: dict[str, list[Any]] = {
    "learning_rate": [1e-4, 3e-4, 1e-3],
    "steps": [],  # from the task's step budget: step_options()
    "group_size": [4, 8],
    "lora_rank": [8, 16],
    "temperature": [0.7, 1.0],
    "max_turns": [2, 4],
}


CORE_CHOICES = {"rubric": list(RUBRICS), "prompt_suffix": list(SUFFIXES), "level_mix": ["task", "task+harder"]}
JOB_DECISIONS = (*CORE_CHOICES, "dataset_size")  # written into dataset.py and rubric.py, not trainer.toml
READ_FIRST = ("dataset.py", "rubric.py", "trainer.toml")  # the files write_job rewrites


class RecipeConfig(ComponentConfig):
    learning_rate: float = Field(2.0, gt=0, description="gradient step size on the decision logits")
    seed: int = 0
    dataset_seed: int | None = Field(
        None, ge=0, description="the SEED every job's dataset.py draws its rows from: jobs then differ only in "
                                "their decisions (a controlled comparison); unset, each job draws a new seed")
    read_first: bool = Field(
        False, description="write the job in two turns: read_file on the files it rewrites (dataset.py, rubric.py, "
                           "trainer.toml), then the edits and submit_job, so that every edit's old text is in the "
                           "conversation (a demonstration a small LLM can copy from, with the compact task view)")
    one_call_per_turn: bool = Field(
        False, description="every tool call in a turn of its own (each read_file, each edit, then submit_job), each "
                           "after the result of the one before: what the next call is always follows from what the "
                           "conversation shows (the decisions are drawn in the turn of the first edit)")
    slips: float = Field(
        0.0, ge=0.0, le=1.0, description="with one_call_per_turn: the chance that a call after the first edit is "
                                         "made wrong first (a misspelt tool name, an edit whose old text is not in "
                                         "the file, the edit just made again, or an edit without its new text) "
                                         "and right the turn after its error: demonstrations of "
                                         "recovering (sft learns the fix, not the slip)")
    choices: dict[str, list[str | int | float | bool]] = Field(
        default_factory=dict,
        description="replace a decision's options, e.g. {steps = [1, 2], rubric = ['exact']}; a key of the "
                    "template's trainer.toml that is no decision becomes one, e.g. {max_new_tokens = [8]} (a "
                    "single option fixes it); keys the template's trainer.toml lacks are not written")

    @field_validator("choices")
    @classmethod
    def _known_options(cls, value: dict[str, list]) -> dict[str, list]:
        for key, options in value.items():
            if not options:
                raise ValueError(f"choices.{key} is empty: give at least one option")
            if len(set(map(repr, options))) != len(options):
                raise ValueError(f"choices.{key} repeats an option")
            allowed = CORE_CHOICES.get(key)
            if allowed is not None and not set(options) <= set(allowed):
                raise ValueError(f"choices.{key}: {sorted(set(options) - set(allowed))} are not among "
                                 f"{', '.join(allowed)}")
            if key in ("dataset_size", "steps", "group_size") and not all(
                    isinstance(o, int) and not isinstance(o, bool) and o > 0 for o in options):
                raise ValueError(f"choices.{key}: options must be positive integers")
        return value


class RecipeTurnMeta(TurnMeta, total=False):
    """What a trained turn keeps beside the core's ``chosen``: the family whose distribution drew it ("" held out),
    the decisions drawn, in order, and how many values each had (the turn's completion tokens are the indices)."""

    family: str
    decisions: list[str]
    sizes: list[int]


class RecipePolicy(OuterTrainer):
    name = "recipe"
    description = "a stochastic policy over job-design decisions, updated with IS-GRPO (CPU, milliseconds)"
    Config = RecipeConfig

    def __init__(self, config: RecipeConfig, *, state_dir: Path):
        super().__init__(config, state_dir=state_dir)
        self.config: RecipeConfig = config
        self.rng = random.Random(config.seed)
        self.version = 0
        self.shared: dict[str, list[float]] = {}
        self.per_family: dict[str, dict[str, list[float]]] = {}
        self._plans: dict[str, list[ToolCall]] = {}  # with one_call_per_turn: the calls an episode has still to make
        self._slipped: set[str] = set()  # planned calls made wrong once already (slips)
        self._planned = 0

    @property
    def policy_version(self) -> int:
        return self.version

    # -- acting ----------------------------------------------------------------------------------------------------
    def decisions(self, task: AgentTask) -> dict[str, list[Any]]:
        """The decision space for a task: option lists by decision name, in a fixed order."""
        config = tomllib.loads(task.template.get("trainer.toml", ""))
        space: dict[str, list[Any]] = {
            "base_model": list(task.allowed_bases) or [config.get("base_model", "")],
        }
        if task.family_module:  # the dataset is written from these; without the module it is the template's
            space["dataset_size"] = [32, 128, 512]
            space["level_mix"] = ["task", "task+harder"] if task.level < max(task.levels) else ["task"]
        space["rubric"] = list(RUBRICS)
        if task.family_module:
            space["prompt_suffix"] = list(SUFFIXES)
        for key, options in TRAINER_CHOICES.items():
            if key in config:
                space[key] = step_options(task.max_train_steps) if key == "steps" else list(options)
        for key, options in self.config.choices.items():
            if key in space or key in config:
                space[key] = list(options)
        return space

    def distribution(self, family: str, decision: str, size: int) -> list[float]:
        shared = self.shared.setdefault(decision, [0.0] * size)
        local = self.per_family.get(family, {}).get(decision, [0.0] * size)
        logits = [a + b for a, b in zip(shared, local)]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        total = sum(weights)
        return [w / total for w in weights]

    async def sample(self, messages: list[Message], tools: list[dict], task: AgentTask, *,
                     mode: SampleMode = "train") -> AgentTurn:
        """One turn that writes and submits the job. In ``mode="eval"`` the turn records nothing to learn from, and
        the decisions are drawn from the task's ``eval_seed`` where it has one (else from the policy's stream)."""
        single = self.config.one_call_per_turn
        if _submitted(messages, by_call=self.config.read_first or single):  # nothing more to do
            return AgentTurn(message={"role": "assistant", "content": "Submitted."}, policy_version=self.version)
        if single and (plan := self._plans.get(key := _plan_of(messages))):  # the episode's next planned call
            call = plan[0]
            if (self.config.slips and call["id"] not in self._slipped and self.rng.random() < self.config.slips
                    and (wrong := slip(call, tools, [*task.template.values(), *_written(messages, plan)],
                                       self.rng, last=_last_edit(messages))) is not None):
                self._slipped.add(call["id"])
                return AgentTurn(message={"role": "assistant", "content": "", "tool_calls": [wrong]},
                                 policy_version=self.version)
            self._slipped.discard(call["id"])
            plan.pop(0)
            if not plan:
                del self._plans[key]
            return AgentTurn(message={"role": "assistant", "content": "", "tool_calls": [call]},
                             policy_version=self.version)
        reads = [name for name in READ_FIRST if name in task.template] if self.config.read_first else []
        done = sum(m.get("role") == "tool" for m in messages)
        if done < (len(reads) if single else min(1, len(reads))):  # the read turn, or (single) the next read
            calls = [_call(f"r{i}", "read_file", {"path": name}) for i, name in enumerate(reads)]
            if single:
                calls = calls[done:done + 1]
            text = "First the files the job's decisions change." if not done else ""
            return AgentTurn(message={"role": "assistant", "content": text, "tool_calls": calls},
                             policy_version=self.version)
        space = self.decisions(task)
        # an evaluation episode with a seed draws from it: the initial and the final policy on the same draws
        rng = random.Random(task.eval_seed) if mode == "eval" and task.eval_seed is not None else self.rng
        chosen: dict[str, Any] = {}
        options: list[int] = []
        logprobs: list[float] = []
        for decision, values in space.items():
            probs = self.distribution("" if task.held_out else task.family, decision, len(values))
            index = rng.choices(range(len(values)), weights=probs)[0]
            chosen[decision] = values[index]
            options.append(index)
            logprobs.append(math.log(probs[index]))
        drawn = rng.randrange(10**6, 10**7)  # drawn either way: a fixed dataset seed leaves the stream as it was
        files = write_job(task, chosen, seed=drawn if self.config.dataset_seed is None else self.config.dataset_seed)
        calls = job_calls(task.template, files)
        calls.append(_call("submit", "submit_job", {}))
        if single:  # the first call now, the rest one a turn (their ids name the plan)
            self._planned += 1
            calls = [{**c, "id": f"p{self._planned}-{c['id']}"} for c in calls]
            if len(calls) > 1:
                self._plans[f"p{self._planned}"] = calls[1:]
            calls = calls[:1]
        summary = ", ".join(f"{k}={v}" for k, v in chosen.items())
        message: Message = {"role": "assistant", "content": f"Recipe: {summary}", "tool_calls": calls}
        if mode == "eval":
            return AgentTurn(message=message, policy_version=self.version, meta={"chosen": chosen})
        meta: RecipeTurnMeta = {"family": "" if task.held_out else task.family, "decisions": list(space),
                                "sizes": [len(v) for v in space.values()], "chosen": chosen}
        return AgentTurn(message=message, completion_tokens=options, logprobs=logprobs, policy_version=self.version,
                         meta=meta)

    # -- learning --------------------------------------------------------------------------------------------------
    async def update(self, groups: list[list[ScoredEpisode]]) -> dict[str, float]:
        grads: dict[tuple[str, str], list[float]] = {}
        datums, current_logprobs, ratios = [], [], []
        used = 0
        for group in groups:
            rewards = [episode.reward for episode in group]
            if not has_signal(rewards):
                continue
            used += 1
            for episode, advantage in zip(group, group_advantages(rewards, scale_by_std=False)):
                for turn in episode.turns:
                    if not turn.completion_tokens:
                        continue
                    meta = cast(RecipeTurnMeta, turn.meta)
                    now = []
                    for decision, size, index, old in zip(meta["decisions"], meta["sizes"], turn.completion_tokens,
                                                          turn.logprobs):
                        probs = self.distribution(meta["family"], decision, size)
                        new = math.log(probs[index])
                        now.append(new)
                        ratio = math.exp(new - old)
                        ratios.append(ratio)
                        # d/dlogits of -ratio * A  =  -A * ratio * (onehot - p)
                        grad = [-advantage * ratio * ((1.0 if k == index else 0.0) - p) for k, p in enumerate(probs)]
                        keys = (("", decision), (meta["family"], decision)) if meta["family"] else (("", decision),)
                        for key in keys:
                            acc = grads.setdefault(key, [0.0] * size)
                            for k, g in enumerate(grad):
                                acc[k] += g
                    datums.append(build_datum([0], turn.completion_tokens, turn.logprobs, advantage))
                    current_logprobs.append(now)
        if not grads:
            return {"groups_used": 0.0}
        loss = importance_sampling_loss(datums, current_logprobs)
        for (family, decision), grad in grads.items():
            table = self.shared if not family else self.per_family.setdefault(family, {})
            logits = table.setdefault(decision, [0.0] * len(grad))
            for k, g in enumerate(grad):
                logits[k] -= self.config.learning_rate * g / used
        self.version += 1
        return {"loss": loss, "groups_used": float(used), "mean_ratio": sum(ratios) / len(ratios),
                "entropy": self.mean_entropy()}

    def mean_entropy(self) -> float:
        values = []
        for decision, logits in self.shared.items():
            probs = self.distribution("", decision, len(logits))
            values.append(-sum(p * math.log(p) for p in probs if p > 0))
        return sum(values) / len(values) if values else 0.0

    def probabilities(self, family: str = "") -> dict[str, list[float]]:
        return {d: self.distribution(family, d, len(logits)) for d, logits in self.shared.items()}

    # -- state -----------------------------------------------------------------------------------------------------
    async def save_state(self, path: Path) -> None:
        """A small JSON file, written atomically (milliseconds: no thread needed)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {"version": self.version, "shared": self.shared, "per_family": self.per_family,
                 "rng": _rng_state(self.rng)}
        temporary = path / "recipe.json.partial"
        temporary.write_text(json.dumps(state))
        temporary.replace(path / "recipe.json")

    async def load_state(self, path: Path) -> None:
        state = json.loads((Path(path) / "recipe.json").read_text())
        self.version = state["version"]
        self.shared = state["shared"]
        self.per_family = state["per_family"]
        self.rng.setstate(_rng_restore(state["rng"]))


# the template's docstrings, kept: the edits change what the decisions change, nothing else
DATASET = '''"""Training rows: build() returns them; the probe runs it once and saves dataset.jsonl.

Each row is {{"question": str, "answer": str, "world": dict}}. The family's public generator makes rows like the
eval's; rows that are hidden-eval items are dropped (more than chance: refused).
"""

from {module} import generate

SEED = {seed}
ITEMS_PER_LEVEL = {per_level!r}
QUESTION_SUFFIX = {suffix!r}
SUFFIX_EVERY = {every}  # rows that get the suffix: every one (1) or every other one (2)


def build() -> list[dict]:
    rows = []
    for level, count in ITEMS_PER_LEVEL.items():
        for item in generate(SEED + level, level, count):
            suffix = QUESTION_SUFFIX if len(rows) % SUFFIX_EVERY == 0 else ""
            rows.append({{"question": item.question + suffix, "answer": item.answer, "world": item.world}})
    return rows
'''


def write_job(task: AgentTask, chosen: dict[str, Any], seed: int) -> dict[str, str]:
    """The job files, from structure: ``trainer.toml`` is the template's config (parsed) with the chosen values,
    dumped as TOML; ``dataset.py`` and ``rubric.py`` are written from the decisions; ``environment.py`` is the
    template's as given. Without the family's module name the template's ``dataset.py`` stays as given too."""
    files = dict(task.template)
    config = tomllib.loads(files["trainer.toml"])
    config["base_model"] = chosen["base_model"]
    for key, value in chosen.items():
        if key in config and key not in JOB_DECISIONS:
            config[key] = value
    files["trainer.toml"] = tomli_w.dumps(config)
    if task.family_module:
        levels = [task.level] if chosen["level_mix"] == "task" else [task.level, task.level + 1]
        size = min(chosen["dataset_size"], task.max_dataset_size)
        per_level = {level: max(1, size // len(levels)) for level in levels}
        suffix, every = SUFFIXES[chosen["prompt_suffix"]]
        files["dataset.py"] = DATASET.format(module=task.family_module, seed=seed, per_level=per_level,
                                             suffix=suffix, every=every)
    files["rubric.py"] = rubric_source(chosen["rubric"], job_format(files))
    return files


def step_options(budget: int) -> list[int]:
    """GRPO steps a job may ask for: the task's budget and its half, quarter and eighth."""
    return sorted({max(1, budget // d) for d in (8, 4, 2, 1)})


def rubric_source(kind: str, form: JobFormat = "verifiers") -> str:
    """``rubric.py`` for one of :data:`RUBRICS`, in the job's format (v1: ``@vf.reward`` methods of a mixin)."""
    if form == "verifiers-v1":
        return rubric_source_v1(kind)
    head = ('"""Reward functions for the inner GRPO: what the small model is trained to maximise."""\n\n'
            'import verifiers as vf\n\n'
            'from aitrainsai import extract_answer\n\n\n')
    correct = READ_LIKE_THE_EVAL + (
        'def correct_answer(completion, answer, **kwargs) -> float:\n'
        '    """The final answer read as the hidden eval reads it: the last <answer> tags, else the last line; case,\n'
        '    surrounding quotes and a final period ignored."""\n'
        '    return float(_norm(extract_answer(_last_reply(completion))) == _norm(answer))\n\n\n')
    if kind == "length":
        return head + ('def length(completion, **kwargs) -> float:\n'
                       '    text = " ".join(str(getattr(m, "content", "") or "") for m in completion)\n'
                       '    return min(1.0, len(text) / 200)\n\n\n'
                       'def build_rubric(parser):\n'
                       '    return vf.Rubric(funcs=[length], weights=[1.0], parser=parser)\n')
    if kind == "constant":
        return head + ('def constant(completion, **kwargs) -> float:\n    return 1.0\n\n\n'
                       'def build_rubric(parser):\n'
                       '    return vf.Rubric(funcs=[constant], weights=[1.0], parser=parser)\n')
    extra_funcs, weights, source = ["correct_answer"], [1.0], head + correct
    if kind == "shaped":
        source += SHAPED_TERMS
        extra_funcs += ["names_answer", "answer_tag", "short_reply"]
        weights += [0.3, 0.2, 0.1]
    if kind == "exact+format":
        source += ('def answer_tag(completion, **kwargs) -> float:\n'
                   '    last = completion[-1] if completion else None\n'
                   '    return float("<answer>" in str(getattr(last, "content", "") or ""))\n\n\n')
        extra_funcs.append("answer_tag")
        weights.append(0.2)
    if kind == "exact+tools":
        source += ('def used_tools(completion, **kwargs) -> float:\n'
                   '    return float(any(getattr(m, "tool_calls", None) for m in completion))\n\n\n')
        extra_funcs.append("used_tools")
        weights.append(0.1)
    return source + (f"def build_rubric(parser):\n    return vf.Rubric(funcs=[{', '.join(extra_funcs)}], "
                     f"weights={weights!r}, parser=parser)\n")


# No backslash in a demonstration's code: in a JSON tool call each doubles (`\"` in the code is `\\\"` in the call),
# a run of escapes a small agent imitating the calls must copy exactly.
def rubric_source_v1(kind: str) -> str:
    """The same rewards as :func:`rubric_source`, each an ``@vf.reward`` method reading the rollout's trace the way
    the classic term reads its completion (the reply: the last assistant message with text, as the hidden eval reads
    it; the format tag: the last message; the length: every message)."""
    terms: dict[str, list[tuple[str, float, str]]] = {
        "length": [("length", 1.0, "min(1.0, len(' '.join(str(m.content or '') for m in [*trace.assistant_messages, "
                               "*trace.tool_messages])) / 200)")],
        "constant": [("constant", 1.0, "1.0")],
    }
    correct = ("correct_answer", 1.0, "float(_norm(extract_answer(_reply(trace))) == _norm(self.data.answer))")
    reply = "_reply(trace)"
    terms.update({
        "exact": [correct],
        "shaped": [correct, ("names_answer", 0.3, f"float(bool(_norm(self.data.answer)) and _norm(self.data.answer) "
                                                   f"in _norm({reply}))"),
                   ("answer_tag", 0.2, f'float("<answer>" in {reply} and "</answer>" in {reply})'),
                   ("short_reply", 0.1, f"float(len({reply}) <= 160)")],
        "exact+format": [correct, ("answer_tag", 0.2, 'float("<answer>" in str(trace.last_message.content or ""))')],
        "exact+tools": [correct, ("used_tools", 0.1, "float(any(m.tool_calls for m in trace.assistant_messages))")],
    })
    methods = "".join(f"    @vf.reward(weight={weight!r})\n    async def {name}(self, trace: vf.Trace) -> float:\n"
                      f"        return {body}\n\n" for name, weight, body in terms[kind])
    return ('"""Reward functions for the inner GRPO: what the small model is trained to maximise (verifiers v1: '
            '@vf.reward\nmethods of the task, reading its trace; the task\'s reward is their weighted sum)."""\n\n'
            "import verifiers.v1 as vf\n\nfrom aitrainsai import extract_answer, final_reply\n\n\n"
            "def _reply(trace) -> str:\n"
            '    """The last reply that has text, as the hidden eval reads it (a final tool call has none)."""\n'
            "    return final_reply(trace.assistant_messages)\n\n\n"
            "def _norm(text) -> str:\n"
            "    return \" \".join(str(text).strip().strip(\"'\" + '\"').rstrip(\".\").split()).casefold()\n\n\n"
            f"class Rubric:\n{methods}".rstrip() + "\n")


READ_LIKE_THE_EVAL = '''def _last_reply(completion) -> str:
    for message in reversed(completion):
        if getattr(message, "role", "") == "assistant" and getattr(message, "content", None):
            return str(message.content)
    return ""


def _norm(text) -> str:
    return " ".join(str(text).strip().strip("'" + '"').rstrip(".").split()).casefold()


'''
SHAPED_TERMS = '''def names_answer(completion, answer, **kwargs) -> float:
    return float(bool(_norm(answer)) and _norm(answer) in _norm(_last_reply(completion)))


def answer_tag(completion, **kwargs) -> float:
    reply = _last_reply(completion)
    return float("<answer>" in reply and "</answer>" in reply)


def short_reply(completion, **kwargs) -> float:
    return float(len(_last_reply(completion)) <= 160)


'''


class Edit(NamedTuple):
    """One ``edit_file``: ``old`` occurs exactly once in the file when the edit comes."""

    old: str
    new: str


def job_calls(template: dict[str, str], files: dict[str, str]) -> list[ToolCall]:
    """The tool calls that turn a workspace holding ``template`` into ``files``: ``edit_file`` for each changed run
    of lines of a file (:func:`line_edits`), ``write_file`` for a file the template lacks or one no line of which
    stays; files equal to the template's get no call."""
    calls: list[ToolCall] = []
    for name, text in files.items():
        before = template.get(name)
        if before == text:
            continue
        edits = None if before is None else line_edits(before, text)
        if edits is None:
            calls.append(_call(f"w{len(calls)}", "write_file", {"path": name, "content": text}))
        else:
            for edit in edits:
                calls.append(_call(f"e{len(calls)}", "edit_file", {"path": name, "old": edit.old, "new": edit.new}))
    return calls


def line_edits(before: str, after: str) -> list[Edit] | None:
    """Edits that, applied in order with ``edit_file``'s rule (``old`` must occur exactly once), turn ``before`` into
    ``after``: one per changed line where a run of lines is replaced by as many (``learning_rate = 0.0002`` ->
    ``learning_rate = 0.001``), else one per changed run, runs apart only by blank lines joined. An ``old`` that is
    empty or occurs more than once (overlapping occurrences too, which ``str.count`` misses) is widened by the
    unchanged lines around it. None where no line of ``before`` would stay, or no widening makes an ``old`` unique:
    the file is then written whole."""
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    hunks: list[list[int]] = []  # [i1, i2, j1, j2]: a[i1:i2] becomes b[j1:j2]
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag == "replace" and i2 - i1 == j2 - j1:
            hunks.extend([i, i + 1, j1 + (i - i1), j1 + (i - i1) + 1] for i in range(i1, i2))
        elif hunks and hunks[-1][1] < i1 and not "".join(a[hunks[-1][1]:i1]).strip():
            hunks[-1][1], hunks[-1][3] = i2, j2
        else:
            hunks.append([i1, i2, j1, j2])
    edits = []
    for i1, i2, j1, j2 in hunks:
        lines = b[:j1] + a[i1:]  # the text once the edits before this one are made: the hunk is lines[j1:j1 + n]
        n = i2 - i1
        start, end = j1, j1 + n  # the lines the edit's old text spans, widened by unchanged ones where needed
        text = "".join(lines)
        while True:
            old = "".join(lines[start:end])
            new = "".join(lines[start:j1] + b[j1:j2] + lines[j1 + n:end])
            if old.endswith("\n") and new.endswith("\n"):
                old, new = old[:-1], new[:-1]
            at = len("".join(lines[:start]))
            if old and text.find(old) == at and text.find(old, at + 1) == -1:  # once, overlapping ones counted
                break
            if start > 0:
                start -= 1
            elif end < len(lines):
                end += 1
            else:
                return None
        if start == 0 and end == len(lines):
            return None
        edits.append(Edit(old, new))
    return edits


def slip(call: ToolCall, tools: list[dict], texts: list[str], rng: random.Random, *, last: ToolCall | None = None
         ) -> ToolCall | None:
    """``call`` made wrong, as small agents get it wrong, one of: the edit just made made again (``last``, where its
    new text does not hold its old one, so that it cannot apply twice; the workspace answers that it is made), an
    edit's old text with a character left out (one in none of ``texts``: the template's files and every text the
    episode's calls write, so in no version of the file), an edit's ``new`` left out (the call closed after its old
    text; the workspace answers that an argument is missing), or the tool's name with a character left out (a name
    no tool has). None where none can be."""
    function = call["function"]
    arguments = json.loads(function["arguments"])
    old = arguments.get("old") if function["name"] == "edit_file" else None
    kinds = ["name"] + (["old", "new"] if isinstance(old, str) and "new" in arguments else [])
    if last is not None:
        made = json.loads(last["function"]["arguments"])
        if str(made.get("new")) and str(made.get("old")) not in str(made.get("new")):
            kinds.append("repeat")
    kind = rng.choice(kinds)
    if kind == "repeat":
        assert last is not None  # "repeat" is drawn only after a last edit
        return {**call, "id": f"{call['id']}s", "function": last["function"].copy()}
    if kind == "new":
        short = {key: value for key, value in arguments.items() if key != "new"}
        return {**call, "id": f"{call['id']}s", "function": {**function, "arguments": json.dumps(short)}}
    if kind == "old":
        assert isinstance(old, str)  # "old" is drawn only for an edit with an old text
        letters = [i for i, ch in enumerate(old) if ch.isalnum()]
        rng.shuffle(letters)
        for at in letters[:8]:
            wrong = old[:at] + old[at + 1:]
            if all(wrong not in text for text in texts):
                return {**call, "id": f"{call['id']}s", "function": {
                    **function, "arguments": json.dumps({**arguments, "old": wrong})}}
    names = {str((t.get("function") or {}).get("name")) for t in tools}
    name = function["name"]
    for at in rng.sample(range(len(name)), len(name)):
        wrong = name[:at] + name[at + 1:]
        if wrong and wrong not in names:
            return {**call, "id": f"{call['id']}s", "function": {**function, "name": wrong}}
    return None


def _last_edit(messages: list[Message]) -> ToolCall | None:
    """The conversation's last call where it is an edit_file that succeeded (its answer no error), else None."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "assistant":
            calls = messages[index].get("tool_calls") or []
            answers = [m for m in messages[index + 1:] if m.get("role") == "tool"]
            if (calls and calls[-1].get("function", {}).get("name") == "edit_file" and answers
                    and not str(answers[-1].get("content", "")).startswith("error: ")):
                return calls[-1]
            return None
    return None


def _written(messages: list[Message], plan: list[ToolCall]) -> list[str]:
    """The texts the conversation's calls and the plan's write (edit_file's new, write_file's content)."""
    calls = [c for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []] + plan
    texts = []
    for c in calls:
        try:
            arguments = json.loads((c.get("function") or {}).get("arguments") or "{}")
        except ValueError:
            continue
        if isinstance(arguments, dict):
            texts += [str(arguments[k]) for k in ("new", "content") if k in arguments]
    return texts


def _submitted(messages: list[Message], *, by_call: bool) -> bool:
    """The job went to submit_job (one try: a refused job ends the episode): any tool result, or with ``by_call``
    (the job takes more than one turn) an earlier turn that called submit_job."""
    if not by_call:
        return any(m.get("role") == "tool" for m in messages)
    return any((call.get("function") or {}).get("name") == "submit_job"
               for m in messages if m.get("role") == "assistant" for call in m.get("tool_calls") or [])


def _plan_of(messages: list[Message]) -> str:
    """The plan the conversation's last call belongs to ("p3" of call id "p3-e1"), or ""."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            calls = m.get("tool_calls") or []
            head, _, rest = str(calls[-1].get("id", "") if calls else "").partition("-")
            return head if rest and head.startswith("p") else ""
    return ""


def _call(call_id: str, name: str, arguments: dict) -> ToolCall:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _rng_state(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _rng_restore(state: list) -> tuple:
    return (state[0], tuple(state[1]), state[2])
