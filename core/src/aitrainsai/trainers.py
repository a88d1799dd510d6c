"""Inner trainers (train the small model a job describes) and outer trainers (the agent's policy and its update)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, with_config
from typing_extensions import TypedDict  # pydantic validates only this TypedDict on Python 3.11

from aitrainsai.backends import JobPayload, JobResult
from aitrainsai.chat import Message
from aitrainsai.components import Component, ComponentConfig, shipped_by
from aitrainsai.evaluation import EngineSpec, EvalResult
from aitrainsai.families import Constraints, TaskFamily, TaskSpec
from aitrainsai.errors import AitrainsaiError


if TYPE_CHECKING:
    from aitrainsai.backends import GpuBackend
    from aitrainsai.jobs.format import JobFormat

TRAINER_FILE = "trainer.toml"


class JobConfigBase(ComponentConfig):
    """What every job's ``trainer.toml`` holds; an inner trainer's ``JobConfig`` adds its own keys."""

    base_model: str
    steps: int = Field(ge=1)


def line_of(text: str, key: str) -> int | None:
    """The first line of a TOML ``text`` that sets ``key`` (1-based), for a :class:`Problem`; None if none does."""
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith(key) and "=" in line:
            return number
    return None


class Problem(BaseModel):
    """One thing wrong with a job: where, and what to change."""

    model_config = ConfigDict(extra="forbid")

    file: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.message}"


class EvalComparison(BaseModel):
    """A trained job's checkpoint compared with its untrained base on the hidden eval: pre (the base) and post (the
    checkpoint), from the same evaluation code and settings, and the paired uplift interval. Composed by the core
    (:func:`aitrainsai.run.baseline.compare`) from a :class:`TrainOutcome`."""

    model_config = ConfigDict(extra="forbid")

    base_model: str
    pre: float
    post: float
    uplift: float
    uplift_ci: tuple[float, float]
    eval_size: int
    train_seconds: float
    train_work: float | None = None  # TrainOutcome.work
    metrics: dict[str, Any] = Field(default_factory=dict)


class InnerTrainerConfig(ComponentConfig):
    """The run options every inner trainer has (its ``Config`` extends them)."""

    eval_size: int = Field(200, ge=1, le=1_000, description="hidden-eval items scored pre and post (200: the full set)")


class InnerTrainer(Component, ABC):
    """Owns a job's trainer config schema (``Config``), its base models, its part of the probe, the payload, and
    reading the payload's outputs back."""

    Config: ClassVar[type[InnerTrainerConfig]] = InnerTrainerConfig
    base_models: tuple[str, ...] = ()  # the class's; an instance may offer others (by its run options)

    def __init__(self, config: InnerTrainerConfig | None = None):
        self.config: InnerTrainerConfig = config if config is not None else self.Config()

    def family_distribution(self, family: TaskFamily) -> str | None:
        """The installed distribution that ships ``family`` (what a worker installs, and loads with
        :func:`aitrainsai.plugins.load_family`): the one whose entry point's package holds the family's class. None
        for a family registered by hand in this process."""
        from importlib import metadata

        owner = shipped_by(type(family))
        if owner is None:
            return None
        try:
            metadata.version(owner)
        except metadata.PackageNotFoundError:
            return None
        return owner

    def constraints(self, defaults: Constraints, job_format: JobFormat = "verifiers") -> Constraints:
        """The family's constraints with the base models a job in ``job_format`` may train filled in, and the budget
        this trainer's run options set (``max_train_steps``, ``max_dataset_size``, ``max_wall_seconds``,
        ``max_train_tokens``, where its ``Config`` has them)."""
        update: dict[str, Any] = {"allowed_bases": list(self.bases_for(job_format))}
        for name in ("max_train_steps", "max_dataset_size", "max_wall_seconds", "max_train_tokens"):
            if name in type(self.config).model_fields:
                update[name] = getattr(self.config, name)
        return defaults.model_copy(update=update)

    def bases_for(self, job_format: JobFormat) -> tuple[str, ...]:
        """The base models a job in ``job_format`` may train on: :attr:`base_models`, unless the trainer's stack
        depends on the format (prime-rl: Qwen3.5 only where v1 jobs train)."""
        return self.base_models

    def config_template(self, spec: TaskSpec) -> str:
        """``trainer.toml`` as the job template shows it: the first allowed base and every default."""
        import tomli_w

        values = {"base_model": spec.constraints.allowed_bases[0] if spec.constraints.allowed_bases else "",
                  "steps": min(20, spec.constraints.max_train_steps)}
        for name, field_info in self.JobConfig.model_fields.items():
            if name not in values and not field_info.is_required() and field_info.default is not None:
                values[name] = field_info.default
        return tomli_w.dumps(values)

    JobConfig: type[JobConfigBase]  # the class's; an instance may choose another (by its run options)
    """The schema of a job's ``trainer.toml`` (the agent's choices); ``Config`` holds the run's options."""

    def job_config(self, job_dir: Path) -> JobConfigBase:
        """The job's parsed ``trainer.toml`` (call after the probe accepted it)."""
        import tomllib

        return self.JobConfig.model_validate(tomllib.loads((Path(job_dir) / TRAINER_FILE).read_text()))

    def job_base_model(self, job_dir: Path) -> str:
        return self.job_config(job_dir).base_model

    def eval_settings(self, base_model: str) -> dict[str, Any]:
        """Every setting of this trainer that changes a hidden-eval score of ``base_model`` (part of the baseline
        cache key, with the family's version and the eval size). The default is the whole config; a trainer that
        knows which of its options reach the evaluation names only those."""
        return {"base_model": base_model, **self.config.model_dump(mode="json")}

    def deterministic(self, backend: GpuBackend) -> bool:
        """Whether a job trained by this trainer on ``backend`` always gives the same checkpoint and the same scores
        given the same files, run settings, base model and seed. True lets a run train identical jobs once: the
        second episode takes the first one's outcome (``loop.share_identical_jobs``). Say True only where it holds
        (a CPU with a fixed thread count may; a GPU's kernels, whose reductions run in varying order, do not). The
        default, False: every job trains."""
        return False

    @property
    def eval_size(self) -> int:
        """How many hidden-eval items pre and post are scored on."""
        return self.config.eval_size

    def probe(self, job_dir: Path, spec: TaskSpec) -> list[Problem]:
        """This trainer's part of the probe: :meth:`check_config` against the task's constraints."""
        return self.check_config(job_dir, spec.constraints)

    def check_config(self, job_dir: Path, constraints: Constraints) -> list[Problem]:
        """The static checks of ``trainer.toml``: TOML syntax, the schema, the allowed base models and the step
        budget. Subclasses add their own checks. Empty means acceptable. The probe runs them on the frozen job, and a
        trainer runs them again before it trains."""
        import tomllib

        from pydantic import ValidationError

        text = (Path(job_dir) / TRAINER_FILE).read_text(errors="replace")
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            line = getattr(exc, "lineno", None)
            return [Problem(file=TRAINER_FILE, line=line, message=f"not valid TOML: {exc}")]
        except RecursionError:  # tomllib recurses into nested arrays and inline tables
            return [Problem(file=TRAINER_FILE, message="not valid TOML: arrays or tables nested too deeply")]
        try:
            config = self.JobConfig.model_validate(raw)
        except ValidationError as exc:
            problems = []
            for error in exc.errors():
                key = ".".join(str(part) for part in error["loc"])
                reason = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
                reason = reason.removeprefix("Value error, ")
                line = line_of(text, str(error["loc"][0])) if error["loc"] else None  # a rule across keys: no line
                problems.append(Problem(file=TRAINER_FILE, line=line, message=f"{key}: {reason}" if key else reason))
            return problems
        problems = []
        allowed = constraints.allowed_bases
        if allowed and config.base_model not in allowed:
            problems.append(Problem(file=TRAINER_FILE, line=line_of(text, "base_model"),
                                    message=f"base_model {config.base_model!r} is not allowed; use one of {allowed}"))
        if config.steps > constraints.max_train_steps:
            problems.append(Problem(file=TRAINER_FILE, line=line_of(text, "steps"), message=(
                f"steps = {config.steps} exceeds the training budget of {constraints.max_train_steps}")))
        return problems

    @abstractmethod
    def payload(self, job_dir: Path, spec: TaskSpec, job_id: str, family: TaskFamily) -> JobPayload:
        """The backend payload that trains the frozen job in ``job_dir`` into a checkpoint (an artifact). It runs the
        job's code only in a sandbox, and re-checks the job's hash and config before training. ``family`` is the
        run's instance of ``spec.family``."""

    @abstractmethod
    def result(self, outcome: JobResult) -> TrainOutcome:
        """Read a finished training payload's artifacts: the checkpoint's local path, training time and metrics."""

    def classify(self, outcome: JobResult) -> JobResult:
        """A finished payload's outcome as this trainer reads its end: a dead one whose cause was the infrastructure
        (the machine too slow for a budget the job kept), not the job, as reason ``infra``; such an episode is left
        out of its group's signal, never scored as the job's failure. The default changes nothing."""
        return outcome

    @abstractmethod
    def eval_payload(self, family: TaskFamily, level: int, base_model: str, checkpoint: Path | None,
                     workdir: Path, job_id: str) -> JobPayload:
        """A payload that scores ``checkpoint`` (None: the untrained ``base_model``) on the hidden eval of ``family``
        (the run's instance) with
        :func:`aitrainsai.evaluation.evaluate_family` through this trainer's chat engine, and brings the
        :class:`~aitrainsai.evaluation.EvalResult` back as the artifact ``scores`` (JSON). The same payload scores
        the baseline and the trained checkpoint, so pre and post share one code path and one set of settings."""

    def eval_result(self, outcome: JobResult, *, family: TaskFamily | None = None, level: int | None = None,
                    base_model: str | None = None) -> EvalResult:
        """The ``scores`` artifact of a finished evaluation payload, read as data (size-capped). The core passes
        the family, level and base model it asked for, so that a trainer whose workers bring back transcripts rather
        than scores scores them here, on the trusted side, with the family's own scorer."""
        from pydantic import ValidationError

        from aitrainsai.parsing import UntrustedInputError, read_json

        path = outcome.artifacts.get("scores")
        if path is None:
            raise ValueError("the evaluation brought back no 'scores' artifact")
        data = read_json(path, max_bytes=MAX_SCORES_BYTES, what="the evaluation's scores")
        try:
            return EvalResult.model_validate(data)
        except ValidationError as exc:  # one line: the first problem, where it is
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"]) or "the record"
            raise UntrustedInputError("the evaluation's scores", f"{where}: {error['msg']}") from None


MAX_SCORES_BYTES = 8 * 2**20


class TrainOutcome(BaseModel):
    """What a finished training payload left: its checkpoint (a local path, fetched) and how training went."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: Path
    train_seconds: float
    metrics: dict[str, Any] = Field(default_factory=dict)
    work: float | None = Field(None, ge=0, allow_inf_nan=False, description=(
        "the training's work in the unit of the task's max_train_tokens (tokens sampled), where the trainer counts "
        "it: the same for the same job and seed on any machine, so the train-speed term is read from it, not from "
        "seconds"))
    reproducible: bool | None = Field(None, description=(
        "whether the job's own code (tools, rubric) gave the same results when rollouts were replayed in a fresh "
        "sandbox (None: not checked); identical jobs share only a reproducible outcome"))
    checkpoint_digest: str | None = Field(None, description=(
        "the checkpoint's content hash, taken by the core when the training payload's outcome is read: two trainings "
        "of one job agree only where these are equal"))


class Baseline(BaseModel):
    """The untrained hidden-eval score of one base model, with its per-item scores."""

    model_config = ConfigDict(extra="forbid")

    family: str
    level: int
    base_model: str
    eval_seed: int
    eval_size: int
    score: float
    item_scores: list[float]
    engine: EngineSpec | None = Field(None, description="the engine settings that scored it (the core's evaluation)")


@with_config(ConfigDict(extra="allow"))
class TurnMeta(TypedDict, total=False):
    """The keys of ``AgentTurn.meta`` the core reads. An outer trainer declares its own extras in a subclass
    (``class RecipeTurnMeta(TurnMeta, total=False)``); the turn keeps them as they are."""

    chosen: dict[str, Any]  # the job's decisions the policy drew in this turn, by name: the report lists them


class AgentTurn(BaseModel):
    """One sampled agent message and what the trainer needs to learn from it."""

    model_config = ConfigDict(extra="forbid")

    message: Message
    prompt_tokens: list[int] = Field(default_factory=list)
    completion_tokens: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list, description="the sampler's log-prob of each completion token")
    policy_version: int = 0
    parse_error: str | None = Field(None, description="why the sampled text is not a well-formed message")
    end: bool = Field(False, description="no later turn of this conversation can be sampled (it is over the agent's "
                                         "context): the episode's agent phase ends here")
    meta: TurnMeta = Field(default_factory=TurnMeta, description="what the policy needs to learn from this turn, "
                                                                 "and the keys the core reads (TurnMeta)")


class AgentOutcome(BaseModel):
    """The agent side of one episode alone (:meth:`aitrainsai.run.episode.Episode.play_agent`): what its turns and
    submissions came to, with no job trained."""

    model_config = ConfigDict(extra="forbid")

    family: str
    episode: str
    turns: int
    parsed_turns: int = Field(description="turns whose text parsed as a message")
    call_turns: int = Field(description="turns with at least one tool call")
    submitted: bool = Field(description="a parseable submit_job call")
    first_accepted: bool = Field(description="the first submission passed validation")
    accepted: bool = Field(description="a submission passed validation")
    reward: float = Field(description="the reward spec's reward with the job untrained: the validation part, or the "
                                      "penalty for no parseable submission")
    seconds: float
    failed_turns: int | None = Field(None, description="turns that did not parse or a call of which failed (an "
                                                       "error result); None: not counted")
    recovered: int | None = Field(None, description="failed turns whose next turn made calls that all succeeded")


class AgentTask(BaseModel):
    """What an episode asks of the agent, in structured form (LLM agents read the same in their messages)."""

    model_config = ConfigDict(extra="forbid")

    family: str
    level: int
    levels: list[int]
    held_out: bool
    template: dict[str, str] = Field(description="the job template files, by name")
    family_module: str = Field("", description="the family's public module a job imports (TOOLS, generate)")
    allowed_bases: list[str]
    max_train_steps: int
    max_dataset_size: int
    eval_seed: int | None = Field(None, description="in an evaluation episode, a seed that depends only on the "
                                  "family and the episode's index: the initial and the final policy are compared on "
                                  "the same draws (a policy may use it for its sampling); None in training")


SampleMode = Literal["train", "eval"]


class StopRun(AitrainsaiError):
    """Raised by an outer trainer (from ``start``, ``sample``, ``update`` or ``save_state``) to stop the run cleanly:
    a spending cap reached, a service still unavailable after bounded retries. The loop cancels what is in flight,
    records the message, marks the run ``stopped`` and exits; every finished episode and the last saved policy state
    stay in the ledger, so ``aitrainsai run --resume`` continues the run. The message is shown to the user as is.

    ``resumable=False``: a refusal that a resume cannot change, since it follows from the run's recorded config (a
    base model the service does not offer, a base URL that is no such service): the run is recorded as refused, and
    the way on is a new run with another setting, not ``--resume``."""

    def __init__(self, message: str, *, resumable: bool = True):
        super().__init__(message)
        self.resumable = resumable


class OuterTrainer(Component, ABC):
    """The agent's policy. ``__init__(self, config, *, state_dir)``.

    Lifecycle: the loop awaits :meth:`start` before the first sample and :meth:`close` at the end (default no-ops:
    open a remote session, a client, a model there). Every method that may wait on I/O is async, state included: a
    remote trainer's state is a path on its service, and saving it must not block the event loop (run local file or
    GPU work in a thread, or accept that it is short)."""

    Config: ClassVar[type[ComponentConfig]] = ComponentConfig

    def __init__(self, config: ComponentConfig, *, state_dir: Path):
        self.config = config
        self.state_dir = Path(state_dir)

    @classmethod
    def preflight(cls, config: ComponentConfig) -> list[str]:
        """What this trainer would refuse before a run exists, one line each (a missing or malformed API key, a
        setting the environment cannot meet). Checked by ``Session.check`` for new and resumed runs; must not
        contact a service or print a secret. Default: nothing."""
        return []

    @classmethod
    def service_problems(cls, config: ComponentConfig) -> list[str]:
        """What the trainer's service would refuse, asked before a new run exists (a base model it does not offer, an
        address that is no such service), one line each. Called only when :meth:`preflight` found nothing; may send
        one or two short requests (bounded in time); must not print a secret. Default: nothing."""
        return []

    async def start(self) -> None:
        """Acquire what sampling and updates need (a remote session, a client). Default: nothing."""

    async def close(self) -> None:
        """Release what :meth:`start` acquired. Default: nothing."""

    @property
    @abstractmethod
    def policy_version(self) -> int:
        """Increases by one with every update."""

    @abstractmethod
    async def sample(self, messages: list[Message], tools: list[dict], task: AgentTask, *,
                     mode: SampleMode = "train") -> AgentTurn:
        """The next agent message (text and/or OpenAI tool calls) for a conversation about ``task``.

        ``mode="train"``: a turn to learn from (tokens and the sampler's log-probs recorded). ``mode="eval"``: an
        evaluation episode that no update will see: record no learning data, and act as the trainer's evaluation
        policy says (greedy for a token sampler); the loop plays held-out and periodic evaluations in this mode."""

    @abstractmethod
    async def update(self, groups: list[list[ScoredEpisode]]) -> dict[str, float]:
        """One update on groups of scored episodes; returns metrics. Each turn carries the policy version and
        log-probs it was sampled with, for the importance-sampling correction."""

    @abstractmethod
    async def save_state(self, path: Path) -> None:
        """Write everything needed to resume (a remote trainer may write a pointer to its service's state)."""

    @abstractmethod
    async def load_state(self, path: Path) -> None:
        """Restore what :meth:`save_state` wrote."""

    async def export(self) -> dict[str, str]:
        """Called once when a run finishes: publish the trained policy (an adapter's path on a service, a local
        folder) and return named references to it. The loop records them in the ledger and the report prints them
        beside the reward spec and the agent's prompt they were trained against. Default: nothing to export."""
        return {}


class ScoredEpisode(BaseModel):
    """One finished episode as an update receives it: its id (unique in the run), its agent turns in order, its
    reward. A group is a list of these, played on the same task."""

    model_config = ConfigDict(extra="forbid")

    id: str
    turns: list[AgentTurn]
    reward: float
