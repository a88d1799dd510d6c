"""A supervised warm start of the Tinker policy on recorded episodes (``aitrainsai sft``).

The data: the assistant turns of a run's accepted episodes (the probe accepted the job and it trained; optionally
only those at or above a reward), on training families only (a held-out family's episodes never train the agent) and
never an evaluation episode. Each turn is the conversation before it rendered as the agent's prompt, then the reply
as the format samples it (:meth:`aitrainsai_outer_tinker.rendering.Renderer.reply`: text, tool calls in the base's
own syntax, end of turn); only the reply's tokens carry weight. An episode's turns share one datum where each turn's
prompt extends the sequence before it (one forward over the conversation, not one per turn); where it does not (a
chat format that rewrites earlier turns), the turn starts a datum of its own. A turn the agent could not parse is
context, never a target. Episodes, not turns, are split between training and held out, by a seeded hash, each
family and rubric in proportion.

Training: Tinker's ``cross_entropy`` through the SDK, weights divided by the batch's reply tokens (a per-token mean),
``optim_step`` with Adam; after each epoch the held-out loss (forward only, nats per reply token) and a saved state
(``tinker.json``: what ``outer_trainer.tinker.init_state`` points a run at). ``sft.json`` records the settings, the
split and every epoch; a killed warm start run again with the same ``--out`` continues from its last epoch.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from aitrainsai_outer_tinker import rendering
from aitrainsai_outer_tinker.agent_check import AgentCheck, check_agents, table
from aitrainsai_outer_tinker.costs import Tokens
from aitrainsai_outer_tinker.trainer import SECTION, STATE_FILE, TinkerConfig, TinkerTrainer

PROGRESS_FILE = "sft.json"
PARSE_ERROR = "error: your reply could not be parsed"  # the core's reply to a turn it could not parse
TOOL_ERROR = "error: "  # how the core's tools begin a failed call's result
# the job was accepted and trained, or accepted in a validation-only run (loop.train_jobs = false); "dead":
# accepted, then died (with include_dead)
ACCEPTED = {"done", "validated"}


class WarmStartError(Exception):
    """A warm start that cannot be made as asked: one line for the user."""


class SftSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epochs: int = Field(3, ge=1, le=1000)
    learning_rate: float = Field(1e-4, gt=0, le=1)
    batch_size: int = Field(8, ge=1, le=4096, description="datums (an episode's turns, one sequence) per optimizer "
                                                          "step")
    held_out: float = Field(0.2, ge=0, lt=1, description="the share of episodes kept out of training")
    min_reward: float | None = Field(None, description="only episodes at or above this reward")
    include_dead: bool = Field(False, description="also episodes whose accepted job died in training")
    seed: int = 0


class Reply(BaseModel):
    """One assistant turn inside a datum: message ``message`` of the episode is ``tokens[start:end]``."""

    model_config = ConfigDict(extra="forbid")

    message: int
    start: int
    end: int


class Example(BaseModel):
    """Assistant turns as one supervised datum: ``tokens`` = the conversation up to its last reply, each of
    ``replies`` preceded by exactly the agent's prompt at that turn (``tokens[:reply.start]``)."""

    model_config = ConfigDict(extra="forbid")

    id: str  # "<run>/<episode>/<message index of its first reply>"
    family: str
    tokens: list[int]
    replies: list[Reply]
    rubric: str = ""  # the episode's job's, as recorded (Demonstration.rubric)

    @property
    def episode(self) -> str:
        return self.id.rsplit("/", 1)[0]

    @property
    def stratum(self) -> tuple[str, str]:
        """What the held-out split keeps the share of."""
        return self.family, self.rubric

    @property
    def reply_tokens(self) -> int:
        return sum(r.end - r.start for r in self.replies)

    @property
    def sent_tokens(self) -> int:
        """The datum's model input: what a forward (or forward_backward) is billed for."""
        return len(self.tokens) - 1

    def weights(self, scale: float = 1.0) -> list[float]:
        """Per target position (``tokens[1:]``): ``scale`` where the target is a reply token, else 0."""
        out = [0.0] * (len(self.tokens) - 1)
        for r in self.replies:
            out[r.start - 1:r.end - 1] = [scale] * (r.end - r.start)
        return out


class EpochRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epoch: int
    steps: int
    train_loss: float = Field(description="nats per reply token, averaged over the epoch's batches as trained")
    held_out_loss: float | None = Field(None, description="nats per reply token after the epoch; None: no split")
    train_tokens: int
    seconds: float
    tinker_path: str


class SftProgress(BaseModel):
    """``sft.json``: what the warm start is (a resume must ask for the same) and what it has done."""

    model_config = ConfigDict(extra="forbid")

    sources: list[str]
    base_model: str
    chat_format: str
    settings: SftSettings
    train: list[str]
    held_out: list[str]
    before_held_out_loss: float | None = None
    epochs: list[EpochRecord] = Field(default_factory=list)
    tokens: Tokens = Field(default_factory=Tokens)
    usd: float = 0.0
    checks: list[AgentCheck] = Field(default_factory=list, description="cold and warm on fresh draws (--check)")

    def same_start(self, other: SftProgress) -> bool:
        """The same data, model and settings (the number of epochs may grow: a finished warm start trains on)."""
        keys = ("sources", "base_model", "chat_format", "train", "held_out")
        return (all(getattr(self, k) == getattr(other, k) for k in keys)
                and self.settings.model_copy(update={"epochs": 0}) == other.settings.model_copy(update={"epochs": 0}))


class Demonstration(BaseModel):
    """An accepted episode's conversation, as the run recorded it."""

    model_config = ConfigDict(extra="forbid")

    run: str
    episode: str
    family: str
    reward: float
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    rubric: str = ""  # the job's rubric as the trusted side parsed it: with the family, the held-out split's stratum


def demonstrations(run: Any, settings: SftSettings) -> tuple[list[Demonstration], dict[str, int]]:
    """The episodes of ``run`` (a ledger run) to imitate, and a count of the run's episodes by status."""
    config = run.info()["config"]
    held_families = set((config.get("families") or {}).get("held_out") or [])
    accepted = ACCEPTED | ({"dead"} if settings.include_dead else set())
    statuses: dict[str, int] = {}
    found: list[Demonstration] = []
    prompts = run.agent_prompts()
    tools: dict[str, list[dict[str, Any]]] = {}
    for row in run.episodes():
        statuses[row["status"]] = statuses.get(row["status"], 0) + 1
        family, reward = row.get("family") or "", row.get("reward")
        if (row["status"] not in accepted or row["id"].startswith("eval") or family in held_families
                or reward is None or (settings.min_reward is not None and reward < settings.min_reward)):
            continue
        if family not in tools:
            schemas = prompts.get(family, {}).get("tools")
            tools[family] = schemas if isinstance(schemas, list) else []
        messages = run.transcript(row["id"])
        if not tools[family] or not any(m.get("role") == "assistant" for m in messages):
            continue
        design = (row.get("data") or {}).get("design")
        rubric = design.get("rubric") if isinstance(design, dict) else None
        found.append(Demonstration(run=run.id, episode=row["id"], family=family, reward=float(reward),
                                   messages=messages, tools=tools[family],
                                   rubric=rubric if isinstance(rubric, str) else ""))
    return found, statuses


def examples(demos: Sequence[Demonstration], renderer: Any, max_tokens: int
             ) -> tuple[list[Example], int, int, int]:
    """The assistant turns of ``demos`` as :class:`Example` datums (rendered with ``renderer``; an episode's turns in
    one where each prompt extends the sequence before it), and the turns left out: longer than ``max_tokens``, not
    parsed by the agent's side, and those a call of which failed (a slip: what the agent did next is learned, the
    slip is not)."""
    out: list[Example] = []
    long = unparsed = failed = 0
    for demo in demos:
        messages = demo.messages
        current: Example | None = None
        for index, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            following = messages[index + 1] if index + 1 < len(messages) else {}
            if following.get("role") == "user" and str(following.get("content", "")).startswith(PARSE_ERROR):
                unparsed += 1  # context for the turns after it (their prompts hold it), never a target
                continue
            if _failed(messages, index):
                failed += 1  # context too: the error result and the call that fixed it are what is learned
                continue
            prompt = renderer.prompt(messages[:index], demo.tools)
            reply = renderer.reply(message)
            if len(prompt) + len(reply) > max_tokens:
                long += 1
                continue
            extends = current is not None and prompt[:len(current.tokens)] == current.tokens
            turn = Reply(message=index, start=len(prompt), end=len(prompt) + len(reply))
            if extends:
                current.tokens = prompt + reply
                current.replies.append(turn)
                continue
            current = Example(id=f"{demo.run}/{demo.episode}/{index}", family=demo.family, tokens=prompt + reply,
                              replies=[turn], rubric=demo.rubric)
            out.append(current)
    return out, long, unparsed, failed


def _failed(messages: list[dict[str, Any]], index: int) -> bool:
    """Whether a tool result of the assistant turn at ``index`` is an error (the core's tools answer "error: ...")."""
    for message in messages[index + 1:]:
        if message.get("role") != "tool":
            return False
        if str(message.get("content", "")).startswith(TOOL_ERROR):
            return True
    return False


def split(items: list[Example], share: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Held out: ``round(share x episodes)`` episodes (at least one where ``share > 0`` and there are two), spread
    over the strata (family and rubric) in proportion to their size, the largest remainders taking what is left, so
    the training side keeps the demonstrations' mix of options; within a stratum chosen by a seeded hash of their
    ids (stable across resumes)."""
    def rank(key: str) -> str:
        return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()

    strata: dict[tuple[str, str], list[str]] = {}
    for e in items:
        members = strata.setdefault(e.stratum, [])
        if e.episode not in members:
            members.append(e.episode)
    total = sum(len(m) for m in strata.values())
    count = round(share * total)
    if share > 0 and total >= 2:
        count = min(max(count, 1), total - 1)
    quota = {k: int(share * len(m)) for k, m in strata.items()}
    # what is left is at most the strata with a fraction, each below its size
    order = sorted(strata, key=lambda k: (quota[k] - share * len(strata[k]), rank("|".join(k))))
    for k in order[:max(0, count - sum(quota.values()))]:
        quota[k] += 1
    held = {ep for k, m in strata.items() for ep in sorted(m, key=rank)[:quota[k]]}
    return [e for e in items if e.episode not in held], [e for e in items if e.episode in held]


def datum(example: Example, scale: float) -> Any:
    import tinker

    tokens = example.tokens
    weights = example.weights(scale)
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tinker.TensorData(data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]),
        "weights": tinker.TensorData(data=weights, dtype="float32", shape=[len(weights)])})


def reply_nll(examples_: Sequence[Example], outputs: Sequence[Any]) -> tuple[float, int]:
    """Summed negative log-likelihood of the reply tokens, from the service's per-position log-probs."""
    total, count = 0.0, 0
    for example, output in zip(examples_, outputs):
        values = output.get("logprobs") if isinstance(output, dict) else None
        if values is None:
            raise WarmStartError("the service returned no log-probs for a cross_entropy datum")
        logprobs = values.tolist() if hasattr(values, "tolist") else list(values)
        for r in example.replies:
            total -= sum(float(x) for x in logprobs[r.start - 1:r.end - 1])
            count += r.end - r.start
    return total, count


class WarmStart:
    """One ``aitrainsai sft``: ``prepare`` (the data; nothing is created before it exists), then ``train``."""

    def __init__(self, config: TinkerConfig, out: Path, settings: SftSettings,
                 say: Callable[[str], None] = print):
        self.config = config
        self.out = Path(out)
        self.settings = settings
        self.say = say
        self.trainer = TinkerTrainer(config, state_dir=self.out / "policy")
        self._examples: dict[str, Example] = {}

    @property
    def progress_file(self) -> Path:
        return self.out / PROGRESS_FILE

    def saved(self) -> SftProgress | None:
        try:
            return SftProgress.model_validate_json(self.progress_file.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            raise WarmStartError(f"{self.progress_file} is not a warm start's record; choose another --out") from None

    async def run(self, runs: Sequence[Any], *, dry_run: bool = False) -> SftProgress:
        """The warm start of ``runs`` (ledger runs); a saved one with the same start continues. ``dry_run``: the
        data and its price only, with no service (the tokenizer must be offline: the local model's, or
        ``tokenizer = 'tml-renderers'``)."""
        demos: list[Demonstration] = []
        for run in runs:
            found, statuses = demonstrations(run, self.settings)
            if not found:
                seen = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())) or "none"
                raise WarmStartError(f"run {run.id} has no accepted episode of a training family to learn from "
                                     f"(episodes: {seen})" + (f" at or above reward {self.settings.min_reward:g}"
                                                              if self.settings.min_reward is not None else ""))
            demos += found
        if dry_run:
            offline = self.config.tokenizer != "service" or self.config.model == rendering.LOCAL_BASE_MODEL
            if not offline:
                raise WarmStartError(f"--dry-run renders offline: -s {SECTION}.tokenizer=tml-renderers")
            return self._plan(runs, demos, await asyncio.to_thread(self.trainer._load_chat))
        saved = self.saved()
        if saved is not None:
            asked = saved.model_copy(update={"sources": [r.id for r in runs], "settings": self.settings})
            if not saved.same_start(asked):
                raise WarmStartError(f"{self.out} holds another warm start (other runs or settings); choose another "
                                     f"--out")
            if len(saved.epochs) >= self.settings.epochs:
                self.say(f"the warm start in {self.out} is finished ({len(saved.epochs)} epochs): "
                         f"-s {SECTION}.init_state={self.out}")
                return saved
        await self.trainer.start()
        try:
            if saved is not None and saved.epochs:  # the last epoch's weights and Adam state
                await self.trainer.load_state(self.out)
            else:
                await self.trainer._ready(sampler=False)
            progress = self._plan(runs, demos, self.trainer._chat)
            if saved is not None:
                if not saved.same_start(progress):
                    raise WarmStartError(f"{self.out} holds another warm start (its runs have other episodes now); "
                                         f"choose another --out")
                progress = saved.model_copy(update={"settings": self.settings})
                self.say(f"continuing the warm start in {self.out} after epoch {len(saved.epochs)}")
            return await self._train(progress)
        finally:
            await self.trainer.close()

    def _plan(self, runs: Sequence[Any], demos: list[Demonstration], renderer: Any) -> SftProgress:
        """The examples, their split and their price (said), as a fresh record."""
        c, s = self.config, self.settings
        items, long, unparsed, failed = examples(demos, renderer, c.max_prompt_tokens + c.max_tokens)
        train, held = split(items, s.held_out, s.seed)
        if not train:
            raise WarmStartError(f"no assistant turn to train on ({long} over the agent's limit of "
                                 f"{c.max_prompt_tokens + c.max_tokens} tokens, {unparsed} unparsed, {failed} failed)")
        self._examples = {e.id: e for e in items}
        reply = sum(e.reply_tokens for e in train)
        turns = sum(len(e.replies) for e in train)
        self.say(f"{turns} turns ({reply} reply tokens) in {len(train)} datums from {len({e.episode for e in train})} "
                 f"episodes to train on, {sum(len(e.replies) for e in held)} held out; {long} over the length limit"
                 f", {unparsed} unparsed and {failed} with a failed call left out")
        per_epoch = Tokens(trained=sum(e.sent_tokens for e in train), prefill=sum(e.sent_tokens for e in held))
        self.say(f"per epoch: {per_epoch.trained} trained and {per_epoch.prefill} forward tokens; {s.epochs} epochs "
                 f"at {c.model}'s prices: ${per_epoch.usd(self.trainer.prices) * s.epochs:.4f}")
        return SftProgress(sources=[r.id for r in runs], base_model=c.model, chat_format=str(c.format),
                           settings=s, train=[e.id for e in train], held_out=[e.id for e in held])

    async def _train(self, progress: SftProgress) -> SftProgress:
        import tinker

        trainer, c, s = self.trainer, self.config, self.settings
        train = [self._examples[i] for i in progress.train]
        held = [self._examples[i] for i in progress.held_out]
        if held and progress.before_held_out_loss is None:
            progress.before_held_out_loss = await self._held_out_loss(held, progress)
            self.say(f"held-out loss before: {progress.before_held_out_loss:.4f} nats per reply token")
            self._save(progress)
        adam = tinker.AdamParams(learning_rate=s.learning_rate, beta1=c.beta1, beta2=c.beta2, eps=c.eps,
                                 weight_decay=c.weight_decay, grad_clip_norm=c.grad_clip_norm)
        for epoch in range(len(progress.epochs), s.epochs):
            began = time.monotonic()
            order = list(train)
            random.Random(f"{s.seed}:{epoch}").shuffle(order)
            nll = tokens = steps = 0
            for start in range(0, len(order), s.batch_size):
                batch = order[start:start + s.batch_size]
                count = sum(e.reply_tokens for e in batch)
                data = [datum(e, 1.0 / count) for e in batch]
                training = trainer._training

                def submit() -> tuple[Any, Any]:
                    return training.forward_backward(data, "cross_entropy"), training.optim_step(adam)

                output, _ = await trainer._call("forward_backward and optim_step", submit, retry=False)
                total, counted = reply_nll(batch, output.loss_fn_outputs)
                nll, tokens, steps = nll + total, tokens + counted, steps + 1
                used = Tokens(trained=sum(e.sent_tokens for e in batch))
                progress.tokens, progress.usd = progress.tokens + used, progress.usd + used.usd(trainer.prices)
                trainer.version += 1
            held_loss = await self._held_out_loss(held, progress) if held else None
            await trainer.save_state(self.out)
            state = json.loads((self.out / STATE_FILE).read_text())
            record = EpochRecord(epoch=epoch + 1, steps=steps, train_loss=nll / max(tokens, 1),
                                 held_out_loss=held_loss, train_tokens=tokens,
                                 seconds=round(time.monotonic() - began, 1), tinker_path=state["tinker_path"])
            progress.epochs.append(record)
            self._save(progress)
            self.say(f"epoch {record.epoch}/{s.epochs}: train loss {record.train_loss:.4f}, held-out loss "
                     + ("-" if held_loss is None else f"{held_loss:.4f}") + f" (nats per reply token), "
                     f"{steps} steps, {record.seconds:.0f} s")
        self.say(f"warm start saved: -s {SECTION}.init_state={self.out}")
        return progress

    async def _held_out_loss(self, held: list[Example], progress: SftProgress) -> float:
        trainer = self.trainer
        training = trainer._training
        nll = count = 0.0
        for start in range(0, len(held), self.settings.batch_size):
            batch = held[start:start + self.settings.batch_size]
            data = [datum(e, 1.0) for e in batch]
            output = await trainer._call("forward", lambda: training.forward(data, "cross_entropy"))
            total, counted = reply_nll(batch, output.loss_fn_outputs)
            nll, count = nll + total, count + counted
            used = Tokens(prefill=sum(e.sent_tokens for e in batch))
            progress.tokens, progress.usd = progress.tokens + used, progress.usd + used.usd(trainer.prices)
        return nll / max(count, 1)

    async def check(self, resolve: Callable[[Path | None], Any], plugins: Any, families: Sequence[str], *,
                    draws: int, temperature: float) -> list[AgentCheck]:
        """Cold and warm on fresh draws (:func:`aitrainsai_outer_tinker.agent_check.check_agents`), saved in
        ``sft.json``; a finished warm start's check asked again is played again."""
        progress = self.saved()
        if progress is None or not progress.epochs:
            raise WarmStartError(f"{self.out} holds no trained warm start to check")
        self.say(f"checking: cold and warm, {draws if temperature else 1} draw(s) of {', '.join(families)} at "
                 f"temperature {temperature:g}")
        checks = await check_agents(resolve, plugins, self.out / "check", init_state=self.out, families=families,
                                    draws=draws, temperature=temperature, say=self.say)
        self._save(progress.model_copy(update={"checks": checks}))
        self.say(table(checks))
        return checks

    def _save(self, progress: SftProgress) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        scratch = self.progress_file.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(progress.model_dump_json(indent=1))
        os.replace(scratch, self.progress_file)


def summary(where: Path) -> str:
    """One line on the warm start in ``where`` (for the run's report): its data, epochs and held-out losses."""
    try:
        progress = SftProgress.model_validate_json((Path(where) / PROGRESS_FILE).read_bytes()[:10_000_000])
    except (OSError, ValueError):
        return f"from {where} (no sft.json: a saved policy state)"
    losses = [progress.before_held_out_loss] + [e.held_out_loss for e in progress.epochs]
    shown = " -> ".join("-" if x is None else f"{x:.3f}" for x in losses)
    line = (f"from {where}: {len(progress.train)} datums of {', '.join(progress.sources)}, {len(progress.epochs)} "
            f"epochs at lr {progress.settings.learning_rate:g}; held-out loss {shown} nats per reply token")
    if not progress.checks:
        return line
    return (f"{line}\n\nBefore and after the warm start, on fresh draws (the agent side alone, no job trained; "
            f"temperature {progress.checks[0].temperature:g}):\n\n{table(progress.checks)}")

