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

The transcripts come from the ledger as recorded, each message read bounded (:func:`aitrainsai.load_json`: its
size, depth and encoding, then its shape, then each tool call's arguments): an episode with a damaged message keeps
only its turns before the damage (cut), or none (skipped), and the count of each, by reason, is said.

Training: Tinker's ``cross_entropy`` through the SDK, weights divided by the batch's reply tokens (a per-token mean),
``optim_step`` with Adam; after each epoch the held-out loss (forward only, nats per reply token) and a saved state
(``tinker.json``: what ``outer_trainer.tinker.init_state`` points a run at), and a saved state every ``save_every_s``
in between. ``sft.json`` records the settings, the split, every epoch and the last saved state; a warm start killed
or stopped, run again with the same ``--out``, continues from its last saved step, in the same batch order, to the
same number of steps.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aitrainsai import ChatMessage, Message, StopRun, UntrustedInputError, load_json
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from aitrainsai_outer_tinker import rendering
from aitrainsai_outer_tinker.agent_check import AgentCheck, check_agents, table
from aitrainsai_outer_tinker.costs import Tokens
from aitrainsai_outer_tinker.state import (PROGRESS_FILE, STATE_FILE, EpochPartial, EpochRecord, SavedState,
                                           SftProgress, SftSettings)
from aitrainsai_outer_tinker.trainer import SECTION, TinkerConfig, TinkerTrainer

PARSE_ERROR = "error: your reply could not be parsed"  # the core's reply to a turn it could not parse
TOOL_ERROR = "error: "  # how the core's tools begin a failed call's result
# the job was accepted and trained, or accepted in a validation-only run (loop.train_jobs = false); "dead":
# accepted, then died (with include_dead)
ACCEPTED = {"done", "validated"}
ROLES = {"system", "user", "assistant", "tool"}
BYTES_PER_TOKEN = 32
"""What a transcript may hold per token of the agent's limit (``max_prompt_tokens + max_tokens``), as recorded JSON:
more than a token's text is, even escaped (``\\uXXXX``); a conversation longer than that up to a turn could not
have fit, so reading stops there."""
SAVE_EVERY_S = 600.0
"""How often a warm start saves its state between epochs (``--save-every``)."""
class WarmStartError(Exception):
    """A warm start that cannot be made as asked: one line for the user."""


class WarmStartStopped(WarmStartError):
    """The service failed (after its retries) or refused mid-way: one line saying where the warm start stands;
    ``resumable``: the same command continues it from its last saved step."""

    def __init__(self, message: str, *, resumable: bool = True):
        super().__init__(message)
        self.resumable = resumable


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


class Demonstration(BaseModel):
    """An accepted episode's conversation, as the run recorded it."""

    model_config = ConfigDict(extra="forbid")

    run: str
    episode: str
    family: str
    reward: float
    messages: list[Message]
    tools: list[dict[str, Any]]
    rubric: str = ""  # the job's rubric as the trusted side parsed it: with the family, the held-out split's stratum


class Found(BaseModel):
    """What :func:`demonstrations` found in a run."""

    model_config = ConfigDict(extra="forbid")

    demonstrations: list[Demonstration]
    statuses: dict[str, int] = Field(description="the run's episodes by status")
    skipped: dict[str, int] = Field(default_factory=dict, description="episodes left out for a damaged transcript, "
                                                                      "by what was wrong with its first bad message")
    cut: dict[str, int] = Field(default_factory=dict, description="episodes whose turns before such a message are "
                                                                  "kept, by the same")

    def damage(self) -> list[str]:
        """One line each for the skipped and the cut episodes, counted by reason (none where there are none)."""
        lines = []
        for counts, what in ((self.skipped, "skipped (a damaged transcript, no turn before the damage)"),
                             (self.cut, "cut at the first damaged message (the turns before it kept)")):
            if counts:
                reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items(), key=lambda x: -x[1]))
                lines.append(f"{sum(counts.values())} episode{'s' if sum(counts.values()) > 1 else ''} {what}: "
                             f"{reasons}")
        return lines


def demonstrations(run: Any, settings: SftSettings, *, max_bytes: int) -> Found:
    """The episodes of ``run`` (a ledger run) to imitate, each transcript read bounded (:func:`transcript`: at most
    ``max_bytes`` of recorded JSON), and a count of the run's episodes by status."""
    config = run.info().config
    held_families = set((config.get("families") or {}).get("held_out") or [])
    accepted = ACCEPTED | ({"dead"} if settings.include_dead else set())
    found = Found(demonstrations=[], statuses={})
    prompts = run.agent_prompts()
    tools: dict[str, list[dict[str, Any]]] = {}
    for row in run.episodes():
        status, family, reward, episode = row.status, row.family, row.reward, row.id
        found.statuses[status] = found.statuses.get(status, 0) + 1
        if (status not in accepted or episode.startswith("eval") or family is None or family in held_families
                or reward is None or not math.isfinite(reward)
                or (settings.min_reward is not None and reward < settings.min_reward)):
            continue
        if family not in tools:
            prompt = prompts.get(family)
            tools[family] = prompt.tools if prompt is not None else []
        if not tools[family]:
            continue
        messages, damage = transcript(run, episode, max_bytes)
        if damage is not None:
            counts = found.cut if any(m.get("role") == "assistant" for m in messages) else found.skipped
            counts[damage] = counts.get(damage, 0) + 1
        if not any(m.get("role") == "assistant" for m in messages):
            continue
        rubric = (row.data.design or {}).get("rubric")
        found.demonstrations.append(Demonstration(run=run.id, episode=episode, family=family, reward=float(reward),
                                                  messages=messages, tools=tools[family],
                                                  rubric=rubric if isinstance(rubric, str) else ""))
    return found


def transcript(run: Any, episode: str, max_bytes: int) -> tuple[list[Message], str | None]:
    """The episode's messages as recorded, each read bounded (:func:`message`), and what stopped the reading: None
    (the whole transcript), what was wrong with the first damaged message, or the length (more than ``max_bytes``
    of JSON up to there: no later turn fits the agent's limit). What stops it stops it before the last assistant
    turn ahead of it, whose results are not all known (a failed call is never learned as a good one)."""
    messages: list[Message] = []
    total = 0
    for record in run.transcript_lines(episode, max_bytes=max_bytes):
        total += len(record)
        if total > max_bytes:
            return _before_last_reply(messages), f"over the agent's limit of {max_bytes} bytes as JSON"
        try:
            messages.append(message(record, max_bytes))
        except UntrustedInputError as exc:
            return _before_last_reply(messages), exc.reason.split(" (")[0]
    return messages, None


def message(record: bytes, max_bytes: int) -> Message:
    """One recorded message checked (:func:`aitrainsai.load_json`: size, encoding, depth, JSON; then a chat message of
    a known role whose tool calls' arguments are as bounded) and as the renderers read it; else
    :class:`aitrainsai.UntrustedInputError`, whose reason says what is wrong."""
    value = load_json(record, what="a message", max_bytes=max_bytes)
    if not isinstance(value, dict) or value.get("role") not in ROLES:
        raise UntrustedInputError("a message", "not a chat message (no known role)")
    try:
        typed = ChatMessage.model_validate(value)
    except ValidationError:
        raise UntrustedInputError("a message", "not a chat message (a field of the wrong type)") from None
    for call in typed.tool_calls or []:
        try:
            load_json(call.function.arguments or "{}", what="arguments", max_bytes=max_bytes, finite=False)
        except UntrustedInputError as exc:
            # arguments cut by the core (or not JSON) were answered with an error, and render as text: a failed
            # turn, context only; what the renderers would recurse into, or cannot encode, is damage
            if not exc.reason.startswith("not valid JSON"):
                raise UntrustedInputError("a message", f"a tool call's arguments {exc.reason}") from None
    return typed.to_dict()


def _before_last_reply(messages: list[Message]) -> list[Message]:
    last = max((k for k, m in enumerate(messages) if m.get("role") == "assistant"), default=0)
    return messages[:last]


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
            following = messages[index + 1] if index + 1 < len(messages) else None
            if (following is not None and following.get("role") == "user"
                    and str(following.get("content", "")).startswith(PARSE_ERROR)):
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
            turn = Reply(message=index, start=len(prompt), end=len(prompt) + len(reply))
            if current is not None and prompt[:len(current.tokens)] == current.tokens:  # it extends the datum
                current.tokens = prompt + reply
                current.replies.append(turn)
                continue
            current = Example(id=f"{demo.run}/{demo.episode}/{index}", family=demo.family, tokens=prompt + reply,
                              replies=[turn], rubric=demo.rubric)
            out.append(current)
    return out, long, unparsed, failed


def _failed(messages: list[Message], index: int) -> bool:
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
    """One ``aitrainsai sft``: the data (nothing is created before it exists), then the training, its state saved at
    the end of every epoch and every ``save_every_s`` in between."""

    def __init__(self, config: TinkerConfig, out: Path, settings: SftSettings,
                 say: Callable[[str], None] = print, *, save_every_s: float = SAVE_EVERY_S):
        self.config = config
        self.out = Path(out)
        self.settings = settings
        self.say = say
        self.save_every_s = save_every_s
        self.trainer = TinkerTrainer(config, state_dir=self.out / "policy")
        self._examples: dict[str, Example] = {}
        self._progress: SftProgress | None = None  # the one being trained: where a stop leaves it

    @property
    def progress_file(self) -> Path:
        return self.out / PROGRESS_FILE

    def saved(self) -> SftProgress | None:
        try:
            return SftProgress.model_validate_json(self.progress_file.read_bytes()[:100_000_000])
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            raise WarmStartError(f"{self.progress_file} is not a warm start's record; choose another --out") from None

    async def run(self, runs: Sequence[Any], *, dry_run: bool = False) -> SftProgress:
        """The warm start of ``runs`` (ledger runs); a saved one with the same start continues. ``dry_run``: the
        data and its price only, with no service (the tokenizer must be offline: the local model's, or
        ``tokenizer = 'tml-renderers'``). A service that fails (after its retries) or refuses is
        :class:`WarmStartStopped`."""
        c = self.config
        demos: list[Demonstration] = []
        for run in runs:
            found = demonstrations(run, self.settings, max_bytes=BYTES_PER_TOKEN * (c.max_prompt_tokens + c.max_tokens))
            for line in found.damage():
                self.say(f"run {run.id}: {line}")
            if not found.demonstrations:
                seen = ", ".join(f"{n} {s}" for s, n in sorted(found.statuses.items())) or "none"
                raise WarmStartError(f"run {run.id} has no accepted episode of a training family to learn from "
                                     f"(episodes: {seen})" + (f" at or above reward {self.settings.min_reward:g}"
                                                              if self.settings.min_reward is not None else ""))
            demos += found.demonstrations
        if dry_run:
            offline = c.tokenizer != "service" or c.model == rendering.LOCAL_BASE_MODEL
            if not offline:
                raise WarmStartError(f"--dry-run renders offline: -s {SECTION}.tokenizer=tml-renderers")
            if c.format is None:  # the command checks it first (TinkerTrainer.format_problems)
                raise WarmStartError(f"no chat format known for base model {c.model!r}; supported: "
                                     f"{rendering.SUPPORTED}")
            chat_format: rendering.Format = c.format
            return self._plan(runs, demos, await asyncio.to_thread(rendering.policy_renderer, c.model, chat_format,
                                                                   c.tokenizer))
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
        import tinker

        try:
            return await self._start_and_train(runs, demos, saved)
        except StopRun as exc:
            raise WarmStartStopped(f"{_without_run_advice(exc)}; {self._standing()}", resumable=exc.resumable
                                   ) from None
        except tinker.TinkerError as exc:  # refused, not transient: one line all the same
            raise WarmStartStopped(f"the Tinker service refused: {_described(exc)}; {self._standing()}") from None

    async def _start_and_train(self, runs: Sequence[Any], demos: list[Demonstration], saved: SftProgress | None
                               ) -> SftProgress:
        self._progress = saved
        await self.trainer.start()
        try:
            if saved is not None and (saved.state is not None or saved.epochs):  # weights and Adam state as saved
                if saved.state is not None:  # what sft.json names (tinker.json may hold a later save it never did)
                    self._write_state(saved.state)
                await self.trainer.load_state(self.out)
            progress = self._plan(runs, demos, await self.trainer.ready(sampler=False))  # loaded, or made
            if saved is not None:
                if not saved.same_start(progress):
                    raise WarmStartError(f"{self.out} holds another warm start (its runs have other episodes now); "
                                         f"choose another --out")
                progress = saved.model_copy(update={"settings": self.settings})
                if progress.state is not None or progress.epochs:
                    where = (f"epoch {progress.partial.epoch}, after its step {progress.partial.steps}"
                             if progress.partial is not None else f"after epoch {len(progress.epochs)}")
                    self.say(f"continuing the warm start in {self.out} from step {self._saved_steps(progress)} of "
                             f"{self._total_steps(progress)} ({where})")
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
        """The epochs not yet done, each in its seeded batch order; an epoch saved mid-way goes on after its saved
        steps."""
        import tinker

        trainer, c, s = self.trainer, self.config, self.settings
        self._progress = progress
        train = [self._examples[i] for i in progress.train]
        held = [self._examples[i] for i in progress.held_out]
        if held and progress.before_held_out_loss is None:
            progress.before_held_out_loss = await self._held_out_loss(held, progress)
            self.say(f"held-out loss before: {progress.before_held_out_loss:.4f} nats per reply token")
            self._save(progress)
        adam = tinker.AdamParams(learning_rate=s.learning_rate, beta1=c.beta1, beta2=c.beta2, eps=c.eps,
                                 weight_decay=c.weight_decay, grad_clip_norm=c.grad_clip_norm)
        saved_at = time.monotonic()
        for epoch in range(len(progress.epochs), s.epochs):
            order = list(train)
            random.Random(f"{s.seed}:{epoch}").shuffle(order)
            batches = [order[k:k + s.batch_size] for k in range(0, len(order), s.batch_size)]
            if progress.partial is None or progress.partial.epoch != epoch + 1:
                progress.partial = EpochPartial(epoch=epoch + 1)
            partial = progress.partial
            began = time.monotonic() - partial.seconds
            optimizer_steps = None
            for batch in batches[partial.steps:]:
                count = sum(e.reply_tokens for e in batch)
                data = [datum(e, 1.0 / count) for e in batch]

                def submit(training: Any = trainer._training, data: list[Any] = data) -> tuple[Any, Any]:
                    return training.forward_backward(data, "cross_entropy"), training.optim_step(adam)

                output, optimised = await trainer._call("forward_backward and optim_step", submit, retry=False)
                total, counted = reply_nll(batch, output.loss_fn_outputs)
                partial.steps, partial.nll, partial.tokens = (partial.steps + 1, partial.nll + total,
                                                              partial.tokens + counted)
                used = Tokens(trained=sum(e.sent_tokens for e in batch))
                progress.tokens, progress.usd = progress.tokens + used, progress.usd + used.usd(trainer.prices)
                trainer.version += 1
                steps = (getattr(optimised, "metrics", None) or {}).get("step:max")
                optimizer_steps = int(steps) if isinstance(steps, (int, float)) else None
                if partial.steps < len(batches) and time.monotonic() - saved_at >= self.save_every_s:
                    partial.seconds = round(time.monotonic() - began, 1)
                    progress.state = await self._save_state()
                    self._save(progress)
                    saved_at = time.monotonic()
            held_loss = await self._held_out_loss(held, progress) if held else None
            progress.state = await self._save_state()
            record = EpochRecord(epoch=epoch + 1, steps=partial.steps, train_loss=partial.nll / max(partial.tokens, 1),
                                 held_out_loss=held_loss, train_tokens=partial.tokens,
                                 seconds=round(time.monotonic() - began, 1), tinker_path=progress.state.tinker_path,
                                 optimizer_steps=optimizer_steps)
            progress.epochs.append(record)
            progress.partial = None
            self._save(progress)
            saved_at = time.monotonic()
            self.say(f"epoch {record.epoch}/{s.epochs}: train loss {record.train_loss:.4f}, held-out loss "
                     + ("-" if held_loss is None else f"{held_loss:.4f}") + f" (nats per reply token), "
                     f"{record.steps} steps, {record.seconds:.0f} s")
        self.say(f"warm start saved: -s {SECTION}.init_state={self.out}")
        return progress

    async def _save_state(self) -> SavedState:
        """The policy's weights and Adam state saved on the service, and ``tinker.json`` pointing at them; what
        ``sft.json`` then records (a kill between the two leaves ``sft.json`` at the save before, which a resume
        loads)."""
        await self.trainer.save_state(self.out)
        return SavedState.model_validate_json((self.out / STATE_FILE).read_text())

    def _write_state(self, state: SavedState) -> None:
        scratch = (self.out / STATE_FILE).with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(state.model_dump_json(indent=2))
        os.replace(scratch, self.out / STATE_FILE)

    def _total_steps(self, progress: SftProgress) -> int:
        return self.settings.epochs * math.ceil(len(progress.train) / self.settings.batch_size)

    @staticmethod
    def _saved_steps(progress: SftProgress) -> int:
        return progress.state.policy_version if progress.state is not None else sum(e.steps for e in progress.epochs)

    def _standing(self) -> str:
        """Where a stopped warm start stands: the steps it trained and the last it saved."""
        progress = self._progress
        if progress is None:
            return f"the warm start in {self.out} stopped before it trained"
        saved = self._saved_steps(progress)
        return (f"the warm start in {self.out} stopped after {max(self.trainer.version, saved)} of "
                f"{self._total_steps(progress)} steps, " + (f"its state saved after step {saved}" if saved
                                                            else "none of them saved"))

    async def _held_out_loss(self, held: list[Example], progress: SftProgress) -> float:
        trainer = self.trainer
        training = trainer._training
        nll = count = 0.0
        for start in range(0, len(held), self.settings.batch_size):
            batch = held[start:start + self.settings.batch_size]
            data = [datum(e, 1.0) for e in batch]

            def forward(data: list[Any] = data) -> Any:
                return training.forward(data, "cross_entropy")

            output = await trainer._call("forward", forward)
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


def _without_run_advice(stop: StopRun) -> str:
    """A trainer's stop in words, without the way on it names for a run (``aitrainsai run --resume``): a warm start
    names its own."""
    return str(stop).split("; the run stopped", 1)[0].split("; the run is saved", 1)[0]


def _described(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
