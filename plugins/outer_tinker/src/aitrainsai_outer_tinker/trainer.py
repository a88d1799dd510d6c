"""The ``tinker`` outer trainer: the agent is an LLM with a LoRA adapter on Tinker (by default
``Qwen/Qwen3.6-35B-A3B``), trained with GRPO through the ``tinker`` SDK (pinned 0.38.0), against the hosted service
or the local Tinker-compatible server.

``sample`` renders the conversation with the tools in the base model's own format (:mod:`.rendering`: Hermes JSON
calls, where a conversation it replied to continues from the exact tokens it saw and sampled; or Qwen3.5/3.6's XML
calls, rendered anew each turn), samples one reply from the current policy version's ``SamplingClient``, and keeps
the sampler's log-prob of every sampled token (and its sequence id).

``update`` centres the rewards of each group (``reward - group mean``, no division by the group's standard deviation:
the Tinker cookbook's choice; a group whose rewards are all equal teaches nothing and is skipped), turns each run of
turns whose prompts extend as token prefixes into one datum (the environment's tokens carry advantage 0:
:func:`aitrainsai.is_grpo.episode_datums`; with ``stable_reinforce`` each datum names where its tokens came from), and
submits ``forward_backward(data, loss)`` and ``optim_step(AdamParams(...))`` before awaiting either. The service's
losses are SUMS over tokens and datums, so any normalisation is folded into the advantages:
``advantage_normalisation = "tokens"`` (the default) divides every advantage by the number of sampled tokens in the
batch, which makes the loss a per-token mean whose size does not grow with the batch (Adam is nearly invariant to
that scale, gradient clipping and the reported loss are not); ``"none"`` sends the plain sum.

Every SDK call runs under a deadline (``call_timeout_s``) with ``retries`` retries and exponential backoff for what
is transient (429, 5xx, paused sampling, dropped connections, no answer); then :class:`aitrainsai.trainers.StopRun`
stops the run with its state saved. The training pair is never retried by the trainer (a timed-out step may still
land): its failure stops the run, and a resume trains the same groups again from the last saved state.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import importlib.util
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlsplit

from aitrainsai import (AgentTask, AgentTurn, ComponentConfig, Datum, Message, OuterTrainer, SampleMode, ScoredEpisode,
                        StopRun, TurnMeta, episode_datums, group_advantages, has_signal)
from pydantic import Field

from aitrainsai_outer_tinker import costs, local, rendering
from aitrainsai_outer_tinker.costs import CostMeter, Prices, Tokens
from aitrainsai_outer_tinker.state import STATE_FILE, SavedState, warm_start_summary

REFERENCE_MODEL = "Qwen/Qwen3.6-35B-A3B"
RETIRED = {  # Tinker's model deprecations page: base model -> (retired on, named replacement)
    "Qwen/Qwen3-30B-A3B": ("2026-06-12", REFERENCE_MODEL),
    "Qwen/Qwen3-30B-A3B-Instruct-2507": ("2026-06-12", REFERENCE_MODEL),
}
Loss = Literal["importance_sampling", "ppo", "cispo", "stable_reinforce"]
LOCAL = "local"
LOCAL_CALL_TIMEOUT_S = 7 * 24 * 3600.0
"""The deadline of one request to a server on this machine. Its requests take as long as the machine makes them
(a loaded one: many times the idle time; a 600 s deadline killed a 59-minute warm start), and a server that dies
fails its requests at once (the connection), so no deadline is needed to notice it: this one is only finite because
the SDK's thread waits refuse an infinite one. A hosted service keeps ``call_timeout_s``."""
KEY_PREFIXES = ("tml-", "eyJ")
MAX_CONTINUATIONS = 1024
SECTION = "outer_trainer.tinker"


class TinkerConfig(ComponentConfig):
    base_model: str | None = Field(None, description=(
        f"the policy's base model; None: {REFERENCE_MODEL} (the reference system's), or the local server's model "
        "when base_url is 'local'. Checked at start against the service's supported models"))
    base_url: str | None = Field(None, description=(
        "None: $TINKER_BASE_URL, else the SDK's default (the hosted service); 'local': start the local "
        "Tinker-compatible server (SmolLM2-135M, CPU or one GPU) with its state beside the policy folder"))
    api_key_env: str = Field("TINKER_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description=(
        "the environment variable that holds the API key; the key itself is never in a config, a log or the ledger"))
    chat_format: Literal["auto", "hermes", "qwen3_5"] = Field("auto", description=(
        "the renderer: 'auto' chooses by the base model (Qwen3.5/3.6: qwen3_5; Qwen3 instruct and the local model: "
        "hermes); another value forces one (e.g. the local model speaking Qwen3.5's format, for tests)"))
    tokenizer: Literal["service", "tml-renderers"] = Field("service", description=(
        "'service': the training client's get_tokenizer() (Hugging Face Hub); 'tml-renderers': the copy embedded "
        "in Thinking Machines' tml-renderers package (offline; pip install "
        "'aitrainsai-outer-tinker[offline-tokenizer]' and torch), Qwen3/3.5/3.6 only"))
    loss: Loss = Field("importance_sampling", description=(
        "the service's loss: importance_sampling (the reference system's, with up to 2 steps off-policy), ppo, "
        "cispo, or stable_reinforce (samples with record_stability_info and tags every datum with its sequence "
        "ids; the cookbook's async default, alpha on the service)"))
    loss_config: dict[str, float] = Field(default_factory=dict, description=(
        "the loss's scalar settings (loss_fn_config), e.g. {clip_low_threshold = 0.8, clip_high_threshold = 1.2} "
        "for ppo; empty: the service's defaults"))
    lora_rank: int = Field(8, ge=1, le=256)
    train_unembed: bool = Field(True, description="LoRA on the unembedding too (the local model has none: ignored)")
    learning_rate: float = Field(4e-5, gt=0, description="Adam step size (the reference system's outer value)")
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0, description="global gradient-norm clip; 0 clips nothing")
    temperature: float = Field(1.0, gt=0, le=2, description="training samples (evaluation is greedy)")
    max_tokens: int = Field(1024, ge=1, le=32_768, description="sampled tokens per agent turn")
    max_prompt_tokens: int = Field(32_000, ge=256, description="a longer conversation gets no reply (a parse error)")
    advantage_normalisation: Literal["tokens", "none"] = Field("tokens", description=(
        "the service's loss is a sum over tokens and datums: 'tokens' divides every advantage by the number of "
        "sampled tokens in the batch (a per-token mean), 'none' sends the sum"))
    prices: Prices | None = Field(None, description=(
        "USD per million tokens; None: the plugin's dated rate table for the base model (costs.RATE_CARD)"))
    max_usd: float | None = Field(None, gt=0, json_schema_extra={"on_resume": True},
                                  description="stop the run (saved, resumable) once the outer side has cost this "
                                              "much; None: no cap; may be raised on resume")
    retries: int = Field(3, ge=0, le=20, description="retries of a transient failure, after the SDK's own")
    backoff_s: float = Field(2.0, ge=0, description="the first retry's wait; doubles with each retry")
    call_timeout_s: float = Field(600.0, gt=0, description=(
        "deadline of one SDK call, its own retries included; unset, a server on this machine (base_url 'local' or a "
        "loopback address) has none to speak of (LOCAL_CALL_TIMEOUT_S: its requests are as slow as the machine)"))
    ttl_seconds: int | None = Field(None, ge=60, description="lifetime of saved checkpoints; None: the service's")
    seed: int = Field(0, description="the adapter's initialisation")
    init_state: Path | None = Field(None, description=(
        "a warm start: a saved policy state (the folder `aitrainsai sft` wrote, or a run's policy/<step>), whose "
        "weights a new run's training client starts from, with fresh Adam moments; a resume loads its own state "
        "instead. Its base model must be this one; on the local server its checkpoint is copied into the run's "
        "server state"))

    @property
    def model(self) -> str:
        """The base model, defaults resolved."""
        if self.base_model:
            return self.base_model
        return rendering.LOCAL_BASE_MODEL if self.base_url == LOCAL else REFERENCE_MODEL

    @property
    def format(self) -> rendering.Format | None:
        """The chat format, defaults resolved (None: no renderer speaks this base model)."""
        return rendering.chat_format(self.model) if self.chat_format == "auto" else self.chat_format


class TinkerTrainer(OuterTrainer):
    name = "tinker"
    description = "an LLM agent on Tinker (or the local Tinker-compatible server), trained with GRPO"
    Config = TinkerConfig

    def __init__(self, config: TinkerConfig, *, state_dir: Path):
        super().__init__(config, state_dir=state_dir)
        self.config: TinkerConfig = with_deadline(config)
        self.version = 0
        self.costs = CostMeter()
        try:
            self.prices = costs.prices_for(config.model, config.prices)
        except ValueError:  # no known price: start() refuses the run (after asking the service)
            self.prices = Prices(prefill=0, sampled=0, trained=0)
        self._service: Any = None  # tinker.ServiceClient
        self._training: Any = None  # tinker.TrainingClient
        self._sampler: tuple[int, Any] | None = None  # (policy version, tinker.SamplingClient)
        self._chat: rendering.Renderer | None = None
        self._stops: list[int] = []
        self._server: Any = None  # the local server this trainer started
        self._base_url: str | None = None
        self._key: str | None = None
        self._sessions: list[str] = []  # this run's service sessions, resumes included
        self._started_at: float | None = None
        self._continuations: dict[str, tuple[list[int], bool]] = {}  # the tokens up to each reply it sampled
        self._readying: tuple[Any, asyncio.Lock] | None = None  # (event loop, lock): one ready() at a time

    @property
    def policy_version(self) -> int:
        return self.version

    @property
    def server_dir(self) -> Path:
        """The local server's state (its checkpoints): beside the policy folder, not in it, since the loop reads
        every entry of that folder as a policy state; it outlives the server, so a resumed run's new server loads
        the saved states."""
        return self.state_dir.parent / f"{self.state_dir.name}-tinker-server"

    @property
    def run_id(self) -> str:
        """The run this trainer belongs to (its policy folder's parent: ``<runs>/<run id>/policy``)."""
        return self.state_dir.parent.name

    # -- lifecycle -------------------------------------------------------------------------------------------------
    @staticmethod
    def format_problems(config: TinkerConfig) -> list[str]:
        """Whether the base model's chat can be rendered as ``config`` asks (a known format, a tokenizer that has the
        model): what a dry run, offline and without a key, needs too."""
        model = config.model
        if config.format is None:
            return [f"no chat format known for base model {model!r}; supported: {rendering.SUPPORTED}"]
        if config.tokenizer == "tml-renderers":
            if config.format == "hermes" and model == rendering.LOCAL_BASE_MODEL:
                return ["tokenizer = 'tml-renderers' has Qwen's tokenizers only, not the local model's"]
            if importlib.util.find_spec("tml_renderers") is None:
                return ["tokenizer = 'tml-renderers' needs that package: pip install "
                        "'aitrainsai-outer-tinker[offline-tokenizer]' (and torch)"]
        return []

    @classmethod
    def preflight(cls, config: ComponentConfig) -> list[str]:
        """What must hold before anything starts, checked without the network: a key of the right shape in
        ``api_key_env`` (unless the trainer starts its own local server), a base model whose chat format and price
        are known, the local server's model where asked, a readable ``init_state`` of this base model. The lines
        name the variable, never the key."""
        assert isinstance(config, TinkerConfig)
        problems = cls.format_problems(config)
        if config.init_state is not None:
            problems += init_problems(config)
        if config.base_url == LOCAL:
            if not local.installed():
                problems.append(f"base_url = 'local' needs the local Tinker server: {local.INSTALL}")
            return problems
        key = os.environ.get(config.api_key_env, "").strip()
        if not key:
            problems.append(f"${config.api_key_env} is not set: export your Tinker API key there (or "
                            f"train on the local server: -s {SECTION}.base_url=local)")
        elif not key.startswith(KEY_PREFIXES):
            problems.append(f"${config.api_key_env} does not hold a Tinker API key (one starts with "
                            "'tml-', or 'eyJ' for a token)")
        return problems

    @classmethod
    def service_problems(cls, config: ComponentConfig) -> list[str]:
        """Before a run exists: ask the service whether it is one, takes the key and offers the base model
        (:func:`ask_service`); nothing for ``base_url = 'local'`` (its server starts with the run)."""
        assert isinstance(config, TinkerConfig)
        if config.base_url == LOCAL:
            return []
        try:
            ask_service(config, config.base_url, os.environ.get(config.api_key_env, "").strip())
        except StopRun as exc:  # the caller names the section
            return [str(exc).removeprefix(f"{SECTION}: ")]
        problem = costs.price_problem(config.model, config.prices)
        return [problem] if problem else []

    async def start(self) -> None:
        """Check the key, start the local server where asked, ask the service whether it is one, takes the key and
        offers the base model (:func:`ask_service`: each refusal is one line), and open a session tagged with the
        run. The training client, the tokenizer and the first sampler come with the first call that needs them, or
        from the saved state on a resume (:meth:`load_state`): a resume creates nothing it throws away."""
        if self._service is not None:
            return
        c = self.config
        problems = self.preflight(c)
        if problems:
            raise StopRun(f"{SECTION}: " + "; ".join(problems))
        import tinker

        _quiet_polling()
        base_url = c.base_url
        if base_url == LOCAL:
            start_local_server = local.server().start_local_server

            self._key = "tml-local-" + secrets.token_hex(16)  # this server's only key, never stored
            self._server = await asyncio.to_thread(start_local_server, self.server_dir,
                                                   api_key=self._key)
            base_url = self._server.base_url
        else:
            self._key = os.environ[c.api_key_env].strip()
        key = self._key
        try:
            await asyncio.wait_for(_resolve(lambda: ask_service(c, base_url, key)), _asking_s(c))
        except TimeoutError:
            await self.close()
            raise StopRun(f"{SECTION}: the Tinker service at {_url(base_url)} did not answer within "
                          f"{c.call_timeout_s:g} s") from None
        except BaseException:
            await self.close()
            raise
        problem = costs.price_problem(c.model, c.prices)  # after the service: a base it does not offer says so first
        if problem:
            await self.close()
            raise StopRun(f"{SECTION}: {problem}", resumable=False)
        self._base_url = base_url
        self._service = tinker.ServiceClient(base_url=base_url, api_key=key, display_name="aitrainsai",
                                             user_metadata=self._metadata())
        if self._started_at is None:
            self._started_at = time.time()

    def _metadata(self, **more: Any) -> dict[str, str]:
        """What every session, training client and checkpoint carries: the run, the policy version (= outer steps
        trained), and what else the call names (an episode)."""
        return costs.session_metadata(self.run_id, outer_step=self.version, **more)

    async def ready(self, *, sampler: bool = True) -> rendering.Renderer:
        """A training client (fresh, or from ``init_state``: a new run), the tokenizer and (``sampler``) a sampler of
        the current weights, made where missing; the renderer the policy speaks with."""
        if self._service is None:
            raise RuntimeError("the tinker trainer is not started (await trainer.start() first)")
        loop = asyncio.get_running_loop()
        if self._readying is None or self._readying[0] is not loop:
            self._readying = (loop, asyncio.Lock())
        async with self._readying[1]:  # episodes side by side: one training client, one import, one sampler
            await self._make_ready(sampler=sampler)
        assert self._chat is not None
        return self._chat

    async def _make_ready(self, *, sampler: bool) -> None:
        if self._training is None:
            if self.config.init_state is not None:
                self._training = await self._warm_started()
            else:
                self._training = await self._call("create_lora_training_client", self._new_training_client)
            self._record_session()
        if self._chat is None:
            c = self.config
            chat_format = c.format
            assert chat_format is not None  # start() refused a base model without one (preflight)
            chat = await asyncio.to_thread(rendering.policy_renderer, c.model, chat_format, c.tokenizer,
                                           self._training)
            self._chat = chat
            self._stops = rendering.stop_tokens(chat)
        if self._sampler is None and sampler:
            self._sampler = await self._new_sampler()

    def _session(self) -> str | None:
        """The current service session's id (None where the SDK does not say)."""
        try:
            return str(self._service.holder.get_session_id())
        except Exception:  # noqa: BLE001 - an SDK without it: sequences are then not checked per session
            return None

    def _record_session(self) -> None:
        """Note the service session (for the billing check at the end)."""
        session = self._session()
        if session and session not in self._sessions:
            self._sessions.append(session)

    async def _warm_started(self) -> Any:
        """A training client with the weights of ``init_state`` (its Adam state left behind: GRPO starts its own)."""
        init_state = self.config.init_state
        assert init_state is not None  # called for a new run with one
        state = SavedState.model_validate_json((init_state / STATE_FILE).read_text())
        if self._server is not None:
            await asyncio.to_thread(_import_checkpoint, state, self.server_dir)
        service = self._service
        return await self._call("create_training_client_from_state", lambda: service.create_training_client_from_state(
            state.tinker_path, user_metadata=self._metadata(warm_start=state.tinker_path)))

    def _new_training_client(self) -> Any:
        c = self.config
        local = c.model == rendering.LOCAL_BASE_MODEL
        return self._service.create_lora_training_client(
            base_model=c.model, rank=c.lora_rank, seed=c.seed, train_unembed=c.train_unembed and not local,
            user_metadata=self._metadata())

    async def _new_sampler(self) -> tuple[int, Any]:
        """A sampler of the current weights (one per policy version); it records stability info where the loss
        needs it."""
        training = self._training
        stability = self.config.loss == "stable_reinforce"
        client = await self._call("save_weights_and_get_sampling_client",
                                  lambda: training.save_weights_and_get_sampling_client(
                                      record_stability_info=stability))
        return self.version, client

    async def close(self) -> None:
        """End the service session and stop the local server this trainer started; never raises, and takes at most
        about 20 s (a run's stop is bounded: ``aitrainsai.stopping.STOP_TIMEOUT_S``)."""
        service, self._service, self._training, self._sampler = self._service, None, None, None
        if service is not None:
            with contextlib.suppress(Exception):  # a session that cannot be ended expires on the service
                await asyncio.wait_for(_resolve(lambda: service.close("success")), 10)
        server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(server.stop)

    # -- acting ----------------------------------------------------------------------------------------------------
    async def sample(self, messages: list[Message], tools: list[dict], task: AgentTask, *,
                     mode: SampleMode = "train") -> AgentTurn:
        """One reply from the current policy version's sampler. ``mode="train"`` samples at ``temperature`` and
        records the tokens and the sampler's log-probs; ``mode="eval"`` is greedy and records nothing to learn from."""
        import tinker

        chat = await self.ready()
        self._check_budget()
        c = self.config
        assert self._sampler is not None  # ready() made it
        version, sampler = self._sampler
        prompt = self._prompt(messages, tools)
        if len(prompt) > c.max_prompt_tokens:
            return AgentTurn(message={"role": "assistant", "content": ""}, policy_version=version,
                             parse_error=f"the conversation is {len(prompt)} tokens, over the agent's limit of "
                                         f"{c.max_prompt_tokens}", end=True)
        params = tinker.SamplingParams(max_tokens=c.max_tokens, stop=self._stops,
                                       temperature=c.temperature if mode == "train" else 0.0)
        model_input = tinker.ModelInput.from_ints(prompt)
        response = await self._call("sample", lambda: sampler.sample(model_input, 1, params))
        sequence = response.sequences[0]
        completion = [int(t) for t in sequence.tokens]
        cached = min(len(prompt), max(0, int(getattr(response, "prompt_cache_hit_tokens", None) or 0)))
        used = Tokens.sampling(len(prompt), len(completion), cache_hits=cached)
        self.costs.add(used, self.prices)
        parsed = chat.parse(completion)
        message = parsed.message()
        if parsed.calls:
            message["content"] = parsed.content.strip()
        if chat.continues:
            self._remember(messages + [message], tools, prompt + completion, completion)
        meta: TinkerTurnMeta = {"tokens": used.model_dump()}
        if mode == "eval":
            return AgentTurn(message=message, policy_version=version, parse_error=parsed.error, meta=meta)
        logprobs = [float(x) for x in sequence.logprobs or []]
        if len(logprobs) != len(completion):
            raise RuntimeError(f"the sampler returned {len(logprobs)} log-probs for {len(completion)} tokens")
        if getattr(sequence, "sequence_id", None):
            meta["sequence_id"] = str(sequence.sequence_id)
            meta["session"] = self._session()
        return AgentTurn(message=message, prompt_tokens=prompt, completion_tokens=completion, logprobs=logprobs,
                         policy_version=version, parse_error=parsed.error, meta=meta)

    def _prompt(self, messages: list[Message], tools: list[dict]) -> list[int]:
        """The prompt's tokens. In a format whose history is one token prefix (Hermes), where the conversation
        continues one this trainer replied to (the same messages up to its reply), the earlier tokens are those it
        saw and sampled, then the format's tokens for what came after: the prompt extends the last one and the
        episode trains as one datum. Otherwise (Qwen3.5's format, a conversation it has not seen, or one edited
        since) the whole conversation is rendered anew, and the turn trains as a datum of its own."""
        chat = self._chat
        assert chat is not None  # after ready()
        if chat.continues:
            assert isinstance(chat, rendering.HermesRenderer)  # the renderer whose replies continue (its bridge)
            for end in range(len(messages), 0, -1):
                if messages[end - 1].get("role") != "assistant":
                    continue
                known = self._continuations.get(_fingerprint(messages[:end], tools))
                if known is not None:
                    tokens, ended = known
                    return tokens + chat.bridge(messages[end:], ended)
                break  # only the last reply can continue: earlier ones were continued already, or never will be
        return chat.prompt(messages, tools)

    def _remember(self, messages: list[Message], tools: list[dict], tokens: list[int],
                  completion: list[int]) -> None:
        assert self._chat is not None  # after ready()
        ended = bool(completion) and completion[-1] == self._chat.end_of_turn_id
        self._continuations[_fingerprint(messages, tools)] = (tokens, ended)
        while len(self._continuations) > MAX_CONTINUATIONS:  # oldest first: finished episodes' replies
            del self._continuations[next(iter(self._continuations))]

    async def logprobs(self, tokens: list[int]) -> list[float | None]:
        """The current sampler's log-prob of each of ``tokens`` after the ones before it (None for the first)."""
        import tinker

        await self.ready()
        assert self._sampler is not None  # ready() made it
        _, sampler = self._sampler
        model_input = tinker.ModelInput.from_ints(list(tokens))
        return list(await self._call("compute_logprobs", lambda: sampler.compute_logprobs(model_input)))

    # -- learning --------------------------------------------------------------------------------------------------
    def datums(self, groups: list[list[ScoredEpisode]]) -> list[Datum]:
        """The batch an update sends: one datum per episode with signal where its prompts extend as token
        prefixes, else one per turn; advantages centred per group and normalised as configured."""
        return [datum for datum, _, _ in self._batch(groups)]

    def _batch(self, groups: list[list[ScoredEpisode]]) -> list[tuple[Datum, list[Segment], str]]:
        """Each datum with the segments that tile its tokens (:func:`segments`) and its episode's id."""
        batch: list[tuple[Datum, list[Segment], str]] = []
        for group in groups:
            rewards = [episode.reward for episode in group]
            if not has_signal(rewards):
                continue
            for episode, advantage in zip(group, group_advantages(rewards, scale_by_std=False)):
                if advantage != 0.0 and self._trainable(episode):
                    datums = episode_datums(episode.turns, advantage)
                    tiles = segments(episode.turns)
                    if len(tiles) != len(datums):
                        raise RuntimeError("the datums and their provenance disagree")  # a bug, not data
                    batch += [(d, t, episode.id) for d, t in zip(datums, tiles)]
        acted = sum(1 for d, _, _ in batch for a in d.advantages if a != 0.0)
        if self.config.advantage_normalisation == "tokens" and acted:
            batch = [(Datum(d.model_input, d.target_tokens, d.logprobs, [a / acted for a in d.advantages]), t, e)
                     for d, t, e in batch]
        return batch

    def _trainable(self, episode: ScoredEpisode) -> bool:
        """Whether the service can train ``episode`` with the configured loss: stable_reinforce only trains on
        sequences this session recorded (an episode sampled before a resume, in another session, is skipped)."""
        if self.config.loss != "stable_reinforce":
            return True
        current = self._session()
        return all(_meta(turn).get("session") == current for turn in episode.turns if turn.completion_tokens)

    async def update(self, groups: list[list[ScoredEpisode]]) -> dict[str, float]:
        """One step of ``loss`` on every episode of every group with signal, then a sampler of the new weights.
        The metrics end the outer step's cost account (``cost_usd``, ``cost_usd_total``, ``tokens_*``)."""
        batch = self._batch(groups)
        for group in groups:  # what each episode's turns cost to sample, into its account
            for episode in group:
                for turn in episode.turns:
                    spent = _meta(turn).get("tokens")
                    if isinstance(spent, dict):
                        with contextlib.suppress(ValueError, TypeError):
                            self.costs.charge(episode.id, Tokens.model_validate(spent), self.prices)
        if not batch:
            return {"datums": 0.0, **self.costs.close_step()}
        c = self.config
        trained = sum(len(d.model_input) for d, _, _ in batch)
        self._check_budget(Tokens(trained=trained))
        await self.ready()
        import tinker

        data = [self._datum(d, tiles) for d, tiles, _ in batch]
        adam = tinker.AdamParams(learning_rate=c.learning_rate, beta1=c.beta1, beta2=c.beta2, eps=c.eps,
                                 weight_decay=c.weight_decay, grad_clip_norm=c.grad_clip_norm)
        training, loss, config = self._training, c.loss, dict(c.loss_config) or None

        def submit() -> tuple[Any, Any]:  # both submitted before either is awaited: one clock cycle on the service
            return training.forward_backward(data, loss, loss_fn_config=config), training.optim_step(adam)

        output, optimised = await self._call("forward_backward and optim_step", submit, retry=False)
        self.costs.add(Tokens(trained=trained), self.prices)
        for d, _, episode_id in batch:
            self.costs.charge(episode_id, Tokens(trained=len(d.model_input)), self.prices)
        self.version += 1
        self._sampler = await self._new_sampler()
        metrics = {"datums": float(len(batch)), "loss": float(output.metrics.get("loss:sum", math.nan)),
                   "acted_tokens": float(sum(1 for d, _, _ in batch for a in d.advantages if a != 0.0))}
        steps = (getattr(optimised, "metrics", None) or {}).get("step:max")
        if isinstance(steps, (int, float)):
            metrics["optimizer_steps"] = float(steps)
        ratios = _ratios([d for d, _, _ in batch], output.loss_fn_outputs)
        if ratios:
            metrics |= {"mean_ratio": sum(ratios) / len(ratios), "max_ratio": max(ratios)}
        return metrics | self.costs.close_step()

    def _datum(self, d: Datum, tiles: list[Segment]) -> Any:
        """The SDK's datum; with ``stable_reinforce``, tagged with where each position came from."""
        import tinker

        datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(d.model_input), loss_fn_inputs={
            "target_tokens": tinker.TensorData(data=d.target_tokens, dtype="int64", shape=[len(d.target_tokens)]),
            "logprobs": tinker.TensorData(data=d.logprobs, dtype="float32", shape=[len(d.logprobs)]),
            "advantages": tinker.TensorData(data=d.advantages, dtype="float32", shape=[len(d.advantages)])})
        if self.config.loss != "stable_reinforce":
            return datum
        if any(seq is None for _, seq, _, _ in tiles):
            raise StopRun(f"{SECTION}: loss = 'stable_reinforce' needs every sampled turn's sequence id, and the "
                          "service returned none (a sampler made without record_stability_info?)", resumable=False)
        return datum.with_provenance(model_input=_spans(tiles[:-1] + [_shorter(tiles[-1], end=True)]),
                                     loss_fn_inputs=_spans([_shorter(tiles[0], end=False)] + tiles[1:]))

    def _check_budget(self, upcoming: Tokens | None = None) -> None:
        """:class:`StopRun` once the outer side has cost ``max_usd`` (counting ``upcoming``, not yet spent)."""
        cap = self.config.max_usd
        if cap is None:
            return
        projected = self.costs.usd_total + (upcoming.usd(self.prices) if upcoming else 0.0)
        if projected >= cap:
            raise StopRun(f"the tinker trainer reached its cost cap: ${projected:.4f} of max_usd ${cap:g} "
                          f"(at {self.version} updates); the run is saved: go on with aitrainsai run --resume RUN "
                          f"-s {SECTION}.max_usd=<higher>")

    # -- state -----------------------------------------------------------------------------------------------------
    async def save_state(self, path: Path) -> None:
        """The service saves the weights and Adam state (``tinker://...``); ``path`` gets a pointer to them, the
        policy version, the cost account and the run's sessions."""
        await self.ready()
        training = self._training
        name = f"aitrainsai-v{self.version:05d}-{secrets.token_hex(4)}"
        saved = await self._call("save_state", lambda: training.save_state(
            name, ttl_seconds=self.config.ttl_seconds, user_metadata=self._metadata()))
        state = SavedState(tinker_path=saved.path, policy_version=self.version, base_model=self.config.model,
                           costs=self.costs, sessions=self._sessions, started_at=self._started_at,
                           server_dir=str(self.server_dir.resolve()) if self._server is not None else None)
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / STATE_FILE).write_text(state.model_dump_json(indent=2))

    async def load_state(self, path: Path) -> None:
        """A training client from the saved weights and Adam state (no fresh client is made first), and a sampler
        of them."""
        if self._service is None:
            raise RuntimeError("the tinker trainer is not started (await trainer.start() first)")
        state = SavedState.model_validate_json((Path(path) / STATE_FILE).read_text())
        if state.base_model != self.config.model:
            raise ValueError(f"the saved policy was trained on {state.base_model!r}, not {self.config.model!r}")
        service = self._service
        self.version = state.policy_version
        self.costs = state.costs
        self._sessions = list(dict.fromkeys(state.sessions + self._sessions))
        self._started_at = state.started_at or self._started_at
        self._training = await self._call("create_training_client_from_state_with_optimizer",
                                          lambda: service.create_training_client_from_state_with_optimizer(
                                              state.tinker_path, user_metadata=self._metadata()))
        self._record_session()
        self._continuations.clear()
        self._sampler = None
        await self.ready()

    async def export(self) -> dict[str, str]:
        """The final adapter in the service's external format (``save_weights_external``), and the run's cost:
        the estimate and, where the key may read billing, what the service billed its sessions
        (:func:`aitrainsai_outer_tinker.costs.check_billing`)."""
        await self.ready()
        training = self._training
        name = f"aitrainsai-final-v{self.version:05d}-{secrets.token_hex(4)}"
        saved = await self._call("save_weights_external",
                                 lambda: training.save_weights_external(name, ttl_seconds=self.config.ttl_seconds))
        refs = {"adapter": str(saved.path), "cost_estimate_usd": f"{self.costs.usd_total:.4f}"}
        started = dt.datetime.fromtimestamp(self._started_at or time.time(), dt.UTC)
        check = await costs.check_billing(base_url=self._base_url, api_key=self._key, started_at=started,
                                          estimate=self.costs.total, estimate_usd=self.costs.usd_total,
                                          session_ids=self._sessions, run_id=self.run_id,
                                          deadline_s=min(60.0, self.config.call_timeout_s))
        refs |= {"billing": check.line()}
        if self.config.init_state is not None:
            refs["warm_start"] = warm_start_summary(self.config.init_state)
        return refs

    # -- faults ----------------------------------------------------------------------------------------------------
    async def _call(self, what: str, submit: Callable[[], Any], *, retry: bool = True) -> Any:
        """``submit()`` (an SDK call) and what it returns awaited, within ``call_timeout_s``. A transient failure
        is tried again ``retries`` times (``retry``) with exponential backoff; then :class:`StopRun`."""
        c = self.config
        attempts = 1 + (c.retries if retry else 0)
        reason = ""
        for attempt in range(attempts):
            try:
                return await asyncio.wait_for(_resolve(submit), c.call_timeout_s)
            except TimeoutError:
                reason = f"no answer within {c.call_timeout_s:g} s"
            except Exception as exc:
                if not transient(exc):
                    raise
                reason = _describe(exc)
            if attempt + 1 < attempts:
                await asyncio.sleep(c.backoff_s * 2 ** attempt)
        tries = f"after {attempts} attempts" if attempts > 1 else "(not retried: a training step may have landed)"
        raise StopRun(f"the Tinker service failed on {what} {tries}: {reason}; the run stopped with its last "
                      "outer step saved (aitrainsai run --resume continues it)")


def init_problems(config: TinkerConfig) -> list[str]:
    """What is wrong with ``config.init_state`` (a missing or unreadable state, another base model, a local state
    for the hosted service or the other way round), one line each."""
    where = config.init_state
    if where is None:
        return []
    file = where / STATE_FILE
    try:
        state = SavedState.model_validate_json(file.read_bytes()[:1_000_000])
    except OSError as exc:
        return [f"init_state: no saved policy state at {file} ({exc.strerror or exc}); give the folder "
                f"`aitrainsai sft` wrote"]
    except ValueError:
        return [f"init_state: {file} is not a saved tinker policy state"]
    problems = []
    if state.base_model != config.model:
        problems.append(f"init_state: {where} was trained on {state.base_model!r}, not {config.model!r}")
    saved_on, runs_on = ("the hosted service" if state.server_dir is None else "a local server",
                         "the local server" if config.base_url == LOCAL else "the hosted service")
    if (state.server_dir is None) == (config.base_url == LOCAL):
        problems.append(f"init_state: {where} was saved on {saved_on}, and this run trains on {runs_on}")
    return problems


def _import_checkpoint(state: SavedState, server_dir: Path) -> None:
    """Copy a local server's checkpoint into this run's server state (a server reads only its own)."""
    parts = state.tinker_path.removeprefix("tinker://").split("/")
    if len(parts) != 3 or not all(re.fullmatch(r"[A-Za-z0-9._:-]+", part) for part in parts) or ".." in parts:
        raise StopRun(f"{SECTION}: init_state holds no tinker path of a local server: {state.tinker_path!r}",
                      resumable=False)
    source = Path(state.server_dir or "") / "checkpoints" / Path(*parts)
    target = server_dir / "checkpoints" / Path(*parts)
    if target.exists():
        return
    if not source.is_dir():
        raise StopRun(f"{SECTION}: init_state's checkpoint {state.tinker_path} is not in {state.server_dir}",
                      resumable=False)
    work = target.with_name(target.name + ".importing")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(source, work)
    work.rename(target)


def ask_service(config: TinkerConfig, base_url: str | None, key: str) -> None:
    """Whether the service at ``base_url`` is a Tinker service that takes ``key`` and offers ``config.model``; else
    :class:`StopRun` with one line naming the address and what it answered. Blocking; bounded in time.

    First a plain ``GET /api/v1/get_server_capabilities`` without the key: a wrong address fails there at once (no
    connection, 404, a redirect) instead of after the SDK's five minutes of retries of a connection; a server error or
    no connection is tried again ``retries`` times (backoff ``backoff_s``, doubling). Then the SDK asks the same with
    the key. A refusal that follows from the run's recorded config (an address given in ``base_url`` that is no such
    service, a base model not offered) is ``resumable=False``: a resume would meet it again."""
    import time

    import httpx
    import tinker

    url = _url(base_url)
    configured = base_url is not None  # recorded in the run; else $TINKER_BASE_URL or the SDK's default
    path = "/api/v1/get_server_capabilities"
    for attempt in range(1 + config.retries):
        problem = ""
        try:
            answer = httpx.get(url + path, timeout=min(config.call_timeout_s, 15.0), follow_redirects=False)
        except httpx.HTTPError as exc:
            problem = f"cannot reach the Tinker service at {url}: {_describe_transport(exc)}"
        else:
            code = answer.status_code
            if 300 <= code < 400 or code in (404, 405, 410):
                raise StopRun(f"{SECTION}: {url} answered {code} {answer.reason_phrase} to GET {path}: it is not a "
                              f"Tinker service (check {'base_url' if configured else '$TINKER_BASE_URL'})",
                              resumable=not configured)
            if code in (408, 429) or code >= 500:
                problem = f"the Tinker service at {url} answered {code} {answer.reason_phrase}"
        if not problem:
            break
        if attempt == config.retries:
            raise StopRun(f"{SECTION}: {problem}")
        time.sleep(config.backoff_s * 2 ** attempt)
    try:
        capabilities = tinker.RestClient(base_url=base_url, api_key=key).get_server_capabilities().result(
            timeout=config.call_timeout_s)
    except (tinker.AuthenticationError, tinker.PermissionDeniedError) as exc:
        raise StopRun(f"{SECTION}: the Tinker service refused the key in ${config.api_key_env} "
                      f"({exc.status_code})") from None
    except tinker.APIStatusError as exc:
        refused = 400 <= exc.status_code < 500 and exc.status_code not in (408, 429)
        raise StopRun(f"{SECTION}: the Tinker service at {url} answered {exc.status_code} to "
                      f"get_server_capabilities: {_describe(exc)[:200]}", resumable=not (refused and configured)
                      ) from None
    except (tinker.APIConnectionError, TimeoutError, ConnectionError) as exc:
        raise StopRun(f"{SECTION}: the Tinker service at {url} did not answer get_server_capabilities: "
                      f"{_describe(exc)}") from None
    models = [m.model_name for m in capabilities.supported_models if m.model_name and m.trainable is not False]
    if config.model not in models:
        retired = RETIRED.get(config.model)
        why = (f"was retired by Tinker on {retired[0]}; its replacement is {retired[1]!r}" if retired
               else "is not offered by the service")
        raise StopRun(f"{SECTION}: base model {config.model!r} {why}; the service offers: "
                      f"{', '.join(models) or 'none'} (at {url}; choose one with -s {SECTION}.base_model=NAME)",
                      resumable=False)


def _asking_s(config: TinkerConfig) -> float:
    """The longest :func:`ask_service` takes: its plain requests and their backoff, then the SDK's call."""
    tries = 1 + config.retries
    return tries * min(config.call_timeout_s, 15.0) + config.backoff_s * (2 ** config.retries - 1) + \
        config.call_timeout_s + 10.0


def on_this_machine(config: TinkerConfig) -> bool:
    """Whether the service is a server on this machine: the one the trainer starts (``base_url = 'local'``), or one
    at a loopback address (``aitrainsai tinker-serve``)."""
    if config.base_url == LOCAL:
        return True
    host = urlsplit(_url(config.base_url)).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def with_deadline(config: TinkerConfig) -> TinkerConfig:
    """``config`` with the request deadline a trainer uses, in a run or a warm start: :data:`LOCAL_CALL_TIMEOUT_S` on a
    server on this machine, unless ``call_timeout_s`` is set; ``call_timeout_s`` on a hosted service."""
    if "call_timeout_s" in config.model_fields_set or not on_this_machine(config):
        return config
    return config.model_copy(update={"call_timeout_s": LOCAL_CALL_TIMEOUT_S})


def _url(base_url: str | None) -> str:
    """The address the SDK talks to: ``base_url``, else $TINKER_BASE_URL, else the hosted service."""
    from tinker.lib.base_url import resolve_base_url

    return resolve_base_url(base_url)


def _describe_transport(exc: BaseException) -> str:
    """A connection failure in words: the innermost cause (``[Errno 111] Connection refused``), one line."""
    while (inner := exc.__cause__ or exc.__context__) is not None:
        exc = inner
    text = " ".join(str(exc).split())
    return text[:200] or type(exc).__name__


_RETRYABLE_STATUS = re.compile(r"status:? (408|409|429|5\d\d)\b")


def transient(exc: BaseException) -> bool:
    """Whether a failure that surfaced from the SDK (after its own retries) is worth trying again: rate limits,
    server errors, paused sampling, dropped connections, timeouts."""
    import tinker

    if isinstance(exc, (TimeoutError, ConnectionError, tinker.APIConnectionError)):
        return True
    if isinstance(exc, tinker.APIStatusError):
        return exc.status_code in (408, 409, 429) or exc.status_code >= 500
    if type(exc).__name__ == "RetryableException":
        return True
    text = str(exc).lower()
    return bool(_RETRYABLE_STATUS.search(text)) or any(
        word in text for word in ("paused", "rate limit", "try again", "temporarily unavailable", "overloaded"))


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def _ratios(datums: list[Datum], outputs: list[dict[str, Any]]) -> list[float]:
    """exp(trainer log-prob - sampler log-prob) of every trained token, where the output holds the log-probs."""
    ratios: list[float] = []
    for datum, output in zip(datums, outputs):
        current = output.get("logprobs") if isinstance(output, dict) else None
        if current is None:
            return []
        values = current.tolist() if hasattr(current, "tolist") else list(current)
        ratios += [math.exp(new - old) for new, old, advantage in zip(values, datum.logprobs, datum.advantages)
                   if advantage != 0.0]
    return ratios


async def _resolve(submit: Callable[[], Any]) -> Any:
    """Run ``submit`` in a daemon thread (the SDK's first call in a process blocks while it opens its session, and
    a thread stuck on a dead server must not keep the process alive), then await the future(s) it returns."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = submit(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="tinker-call", daemon=True).start()
    submitted = await done
    if isinstance(submitted, tuple):
        return tuple([await future for future in submitted])
    return await submitted if hasattr(submitted, "__await__") else submitted


def _fingerprint(messages: list[Message], tools: list[dict]) -> str:
    text = json.dumps([tools, messages], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


Segment = tuple[str, "str | None", int, int]
"""Where a run of a datum's tokens came from: ``("prompt" | "sampled", sequence id, offset, length)``."""


class TinkerTurnMeta(TurnMeta, total=False):
    """What a sampled turn keeps beside the core's keys: what sampling it cost (:class:`Tokens`, dumped), and, where
    the sampler names its sequences, the sequence's id and the session that sampled it (stable_reinforce trains only
    on its own session's sequences)."""

    tokens: dict[str, int]
    sequence_id: str
    session: str | None


def _meta(turn: AgentTurn) -> TinkerTurnMeta:
    return cast(TinkerTurnMeta, turn.meta)


def segments(turns: Sequence[AgentTurn]) -> list[list[Segment]]:
    """Per datum of :func:`aitrainsai.is_grpo.episode_datums` (same turns, same splits), the segments that tile its
    whole token sequence: each turn's new prompt tokens (positions ``offset...`` of that request's prompt) and its
    sampled tokens, named by the turn's sequence id (``meta["sequence_id"]``, None where the sampler gave none)."""
    out: list[list[Segment]] = []
    tokens: list[int] = []
    tiles: list[Segment] = []
    for turn in turns:
        prompt, completion = list(turn.prompt_tokens), list(turn.completion_tokens)
        if not prompt or not completion:
            continue
        sequence = _meta(turn).get("sequence_id")
        if tokens and prompt[:len(tokens)] == tokens:
            new, offset = prompt[len(tokens):], len(tokens)
        else:
            if len(tokens) > 1:
                out.append(tiles)
            tokens, tiles, new, offset = [], [], prompt, 0
        if new:
            tiles.append(("prompt", sequence, offset, len(new)))
        tiles.append(("sampled", sequence, 0, len(completion)))
        tokens += new + completion
    if len(tokens) > 1:
        out.append(tiles)
    return out


def _shorter(tile: Segment, *, end: bool) -> Segment:
    """``tile`` without its last (``end``) or its first position."""
    kind, sequence, offset, length = tile
    return (kind, sequence, offset, length - 1) if end else (kind, sequence, offset + 1, length - 1)


def _spans(tiles: list[Segment]) -> list[Any]:
    import tinker

    kinds = {"prompt": tinker.PromptProvenanceSpan, "sampled": tinker.SampledProvenanceSpan}
    spans = []
    for kind, sequence, offset, length in tiles:
        if length > 0:
            assert sequence is not None  # _datum refuses tiles without a sequence id
            spans.append(kinds[kind](sequence_id=sequence, offset=offset, length=length))
    return spans


def _as_debug(record: logging.LogRecord) -> bool:
    """The SDK warns at every poll of a future not done yet ("Retrying request ... because of try_again", each 25 s
    of a long update or a queue on the service): said at debug level instead, where a user who asks still sees it."""
    if "because of try_again" not in str(record.msg):
        return True
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def _quiet_polling() -> None:
    sdk = logging.getLogger("tinker.lib.api_future_impl")
    if _as_debug not in sdk.filters:
        sdk.addFilter(_as_debug)
