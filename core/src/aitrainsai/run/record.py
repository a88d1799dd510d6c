"""The run's typed records: every ledger event, the job row's state machine, a group's typed reference, and the
ledger's rows as read (run, episode, probe, baseline, stored event, agent prompt).

The loop, the episodes and the CLI write these models (:meth:`aitrainsai.run.ledger.Run.record`); resume, ``show``
and the report read them back as the same models (:meth:`~aitrainsai.run.ledger.Run.records`). The ledger stores an
event as its ``kind`` and its other fields as JSON, as it always has: a run recorded before these types existed
reads back through them (fields it lacks take their defaults, a ``reward`` event's flat components are gathered).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from aitrainsai.backends import JobHandle, JobPayload
from aitrainsai.evaluation import EngineSpec
from aitrainsai.errors import AitrainsaiError
from aitrainsai.rewards import EpisodeOutcome
from aitrainsai.trainers import AgentTurn, EvalComparison, TrainOutcome


class Record(BaseModel):
    """One ledger event. ``kind`` names it; the rest is its data."""

    model_config = ConfigDict(extra="forbid")
    KIND: ClassVar[str]  # the stored kind: the default of ``kind`` (a prefix for open kinds)
    kind: str

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        default = cls.model_fields["kind"].default
        if isinstance(default, str):
            cls.KIND = default

    def data(self) -> dict[str, Any]:
        """What the ledger stores beside the kind."""
        return self.model_dump(mode="json", exclude={"kind"})


# -- groups --------------------------------------------------------------------------------------------------------
class GroupRef(BaseModel):
    """A group of episodes: a training group (its launch number) or an evaluation group (the outer step whose policy
    it evaluates, and the family). Its ``id`` is made from these fields, never read back into them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["train", "eval"]
    family: str
    index: int | None = None  # train: the launch number (ids are never reused)
    step: int | None = None  # eval: the outer step evaluated

    @classmethod
    def train(cls, index: int, family: str) -> GroupRef:
        return cls(kind="train", family=family, index=index)

    @classmethod
    def eval(cls, step: int, family: str) -> GroupRef:
        return cls(kind="eval", family=family, step=step)

    @property
    def id(self) -> str:
        return f"g{self.index:04d}" if self.kind == "train" else f"eval{self.step}-{self.family}"

    def episode_id(self, member: int) -> str:
        return f"{self.id}-e{member}"

    def eval_key(self, member: int) -> str:
        """What an evaluation episode's sampling seed is made from: the same family and member at every step."""
        return f"{self.family}-e{member}"


_LEGACY_EVAL = re.compile(r"eval(\d+)-(.*)")
_LEGACY_TRAIN = re.compile(r"g(\d+)")


def legacy_group(group_id: str, family: str) -> GroupRef | None:
    """The group of a run recorded before groups had a :class:`GroupLaunched` record: read from its id, the one
    place an id is parsed, for old ledgers only. None: not a group the loop made."""
    if match := _LEGACY_EVAL.fullmatch(group_id):
        return GroupRef.eval(int(match.group(1)), match.group(2) or family)
    if match := _LEGACY_TRAIN.fullmatch(group_id):
        return GroupRef.train(int(match.group(1)), family)
    return None


class GroupLaunched(Record):
    """The loop started a group (written before its episodes)."""

    kind: Literal["group_launched"] = "group_launched"
    group: GroupRef


class GroupDropped(Record):
    """A group sampled too many policy updates ago: not trained on."""

    kind: Literal["group_dropped"] = "group_dropped"
    group: str
    lag: int


class GroupSkipped(Record):
    """A group whose rewards were all equal: no signal, not trained on."""

    kind: Literal["group_skipped"] = "group_skipped"
    group: str
    reward: float


class LeftOut(Record):
    """A group's episodes whose jobs the infrastructure could not run (status ``infra``: a machine too slow for the
    budget, a backend that could not start them): no reward the agent earned or could steer toward, so left out of
    the group's signal; the group trains on the rest (when two or more are left, with a spread)."""

    kind: Literal["left_out"] = "left_out"
    group: str
    episodes: list[str]


# -- steps and evaluations -----------------------------------------------------------------------------------------
class BaseChoice(BaseModel):
    """Which base model an episode's job trained, and whether it had the better untrained score."""

    model_config = ConfigDict(extra="forbid")

    family: str
    base: str | None = None
    best_untrained: str | None = None
    bases: int = 0
    picked_best: bool = False


class OuterStep(Record):
    """One update of the agent's policy, on ``groups``."""

    kind: Literal["outer_step"] = "outer_step"
    step: int
    mean_reward: float
    groups: list[str] = Field(default_factory=list)
    components: dict[str, float] = Field(default_factory=dict)
    base_choices: list[BaseChoice] = Field(default_factory=list)
    compute: dict[str, float] = Field(default_factory=dict)  # jobs_usd and the backend's costs
    metrics: dict[str, Any] = Field(default_factory=dict)  # the outer trainer's
    policy_version: int = 0
    seconds: float = 0.0
    dropped: int = 0
    skipped: int = 0


class Eval(Record):
    """The policy of ``step`` evaluated on one family (no update)."""

    kind: Literal["eval"] = "eval"
    step: int
    family: str
    held_out: bool
    mean_reward: float
    pre: list[float] = Field(default_factory=list)
    post: list[float] = Field(default_factory=list)
    uplift: list[float] = Field(default_factory=list)
    base_choices: list[BaseChoice] = Field(default_factory=list)


class RewardSpecCopy(BaseModel):
    """The reward spec a policy was trained under, kept with its export."""

    model_config = ConfigDict(extra="forbid")

    name: str
    formula: str | None = None
    agent_text: str | None = None
    file: str | None = None


class PolicyExport(Record):
    """Where the trained policy went (the outer trainer's references)."""

    kind: Literal["policy_export"] = "policy_export"
    step: int
    refs: dict[str, Any]
    reward_spec: RewardSpecCopy | None = None


# -- episodes and jobs ---------------------------------------------------------------------------------------------
class Reward(Record):
    """An episode's reward and its components."""

    kind: Literal["reward"] = "reward"
    episode: str
    total: float | None = None
    family: str | None = None
    step: int | None = None
    components: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _flat_components(cls, value: Any) -> Any:
        """Events written before this type held the components as top-level fields."""
        if isinstance(value, dict):
            known = set(cls.model_fields)
            extra = {k: v for k, v in value.items() if k not in known}
            if extra:
                value = {k: v for k, v in value.items() if k in known}
                value["components"] = {**extra, **value.get("components", {})}
        return value


class EpisodeError(Record):
    """An episode's agent or job failed; the episode stays in its own record."""

    kind: Literal["episode_error"] = "episode_error"
    episode: str
    phase: Literal["agent", "job"]
    error: str


class JobRerun(Record):
    """The backend lost a payload; it was submitted again."""

    kind: Literal["job_rerun"] = "job_rerun"
    job: str
    reason: str
    rerun: int


class JobShared(Record):
    """A job identical to one of the run's (``loop.share_identical_jobs``) took that job's outcome (``shares``)
    instead of training."""

    kind: Literal["job_shared"] = "job_shared"
    job: str
    shares: str


class ProbeShared(Record):
    """A submission identical to a job two probes had accepted alike (``loop.share_identical_probes``) took that
    verdict and its frozen job (``shares``: the folder copied, under the run's) instead of running the job's code."""

    kind: Literal["probe_shared"] = "probe_shared"
    episode: str
    attempt: int
    shares: str


# -- the run's life ------------------------------------------------------------------------------------------------
class Resumed(Record):
    kind: Literal["resumed"] = "resumed"
    trained_steps: int
    groups_in_progress: int


class Stopped(Record):
    """The run stopped before its steps were done (``resumable``: resuming it may help; None: not said)."""

    kind: Literal["stopped"] = "stopped"
    reason: str
    resumable: bool | None = None
    steps: int | None = None


class Finished(Record):
    kind: Literal["finished"] = "finished"
    steps: int
    dropped: int
    skipped: int
    launched: int


class StopSignal(Record):
    """A stop signal came (written as it comes): the ``interrupted`` event."""

    kind: Literal["interrupted"] = "interrupted"
    signal: str
    stop_timeout_s: float


class ConfigChanged(Record):
    """A resume changed the recorded config (``--set`` overrides)."""

    kind: Literal["config_changed"] = "config_changed"
    overrides: list[str]


class PluginChange(BaseModel):
    """A plugin whose installed version was not the recorded one (``installed`` None: not installed)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    recorded: str
    installed: str | None


class PluginVersionsChanged(Record):
    """A resume accepted other plugin versions, and continues with ``selection``."""

    kind: Literal["plugin_versions_changed"] = "plugin_versions_changed"
    changes: list[PluginChange]
    selection: str | None = None


class BackendEvent(Record):
    """What a GPU backend records about itself (``backend_pod``, ``backend_head``, ...): the backend's own fields,
    read through ``fields``. Its kind is ``backend_`` and the backend's word."""

    model_config = ConfigDict(extra="allow")
    KIND: ClassVar[str] = "backend_"
    kind: Annotated[str, Field(pattern=r"^backend_\w+$")]

    @classmethod
    def of(cls, what: str, **fields: Any) -> BackendEvent:
        return cls(kind=f"backend_{what}", **fields)

    @property
    def fields(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


# every event kind the loop, the episodes and the CLI write (backend events apart: their kinds are open)
Event = Annotated[GroupLaunched | GroupDropped | GroupSkipped | LeftOut | OuterStep | Eval | PolicyExport | Reward
                  | EpisodeError | JobRerun | JobShared | ProbeShared | Resumed | Stopped | Finished | StopSignal
                  | ConfigChanged | PluginVersionsChanged, Field(discriminator="kind")]
_EVENT = TypeAdapter(Event)
KINDS: dict[str, type[Record]] = {t.KIND: t for t in get_args(get_args(Event)[0])}


def parse_record(kind: str, data: dict[str, Any]) -> Record:
    """A stored event (its kind and JSON data) as its model; ValueError (pydantic's) if it does not fit."""
    if kind.startswith(BackendEvent.KIND):
        return BackendEvent(kind=kind, **data)
    return _EVENT.validate_python({**data, "kind": kind})


# -- jobs ----------------------------------------------------------------------------------------------------------
class JobState(StrEnum):
    """A job row's state. A job is queued, runs, is evaluated, and ends done or dead."""

    QUEUED = "queued"
    RUNNING = "running"
    EVALUATING = "evaluating"
    DONE = "done"
    DEAD = "dead"


Q, R, E, DONE, DEAD = JobState.QUEUED, JobState.RUNNING, JobState.EVALUATING, JobState.DONE, JobState.DEAD
# Where each state may go. None: no row yet (a job run elsewhere may be recorded running or finished at once).
# A state may be written again (a resubmitted payload, the evaluation's payload and handle). A finished job moves
# again only when a resumed episode finishes it once more (the run was killed between the job's record and the
# episode's): its phase is waited on again, and rerun if the backend lost it.
JOB_MOVES: dict[JobState | None, frozenset[JobState]] = {
    None: frozenset({Q, R, DONE, DEAD}),
    Q: frozenset({Q, R, DEAD}),
    R: frozenset({Q, R, E, DONE, DEAD}),  # back to queued: the backend lost it and it is submitted again
    E: frozenset({E, DONE, DEAD}),
    DONE: frozenset({DONE, E, DEAD}),
    DEAD: frozenset({DEAD, Q, E, DONE}),
}


class JobStateError(ValueError, AitrainsaiError):
    """A job moved where its state machine does not allow (a bug in the writer, not a damaged ledger)."""


def check_job_move(job_id: str, old: JobState | str | None, new: JobState | str, *, shared: bool = False
                   ) -> JobState:
    """``new`` as a :class:`JobState`, if a job in ``old`` may move there; else :class:`JobStateError`. A job that
    takes an identical job's outcome (``shared``) also goes from queued, where it waited for it, to done: it never
    ran."""
    try:
        target = JobState(new)
        source = None if old is None else JobState(old)
    except ValueError as exc:
        raise JobStateError(f"job {job_id}: {exc}") from None
    if target not in JOB_MOVES[source] and not (shared and source is Q and target is DONE):
        raise JobStateError(f"job {job_id} cannot move from {source.value if source else 'nothing'} to "
                            f"{target.value}")
    return target


class JobProgress(BaseModel):
    """What a job row knows so far, phase by phase: the training payload as submitted; once trained, its outcome and
    log; the evaluation's payload and handle; at the end the scores (done) or why it died (dead). A write names the
    fields its phase adds (:meth:`aitrainsai.run.ledger.Run.upsert_job`), and the ledger stores the whole, checked."""

    model_config = ConfigDict(extra="forbid")

    payload: JobPayload | None = None
    train: TrainOutcome | None = None
    log_tail: str | None = None
    eval_payload: JobPayload | None = None
    eval_handle: JobHandle | None = None
    eval_log_tail: str | None = None
    # done: the hidden eval's outcome (aitrainsai.trainers.EvalComparison's fields); reason ""
    base_model: str | None = None
    pre: float | None = None
    post: float | None = None
    uplift: float | None = None
    uplift_ci: tuple[float, float] | None = None
    eval_size: int | None = None
    train_seconds: float | None = None
    train_work: float | None = None
    metrics: dict[str, Any] | None = None
    # dead: why, in one line, and the backend's reason word (aitrainsai.backends.DeadReason) where it gave one
    reason: str | None = None
    dead_reason: str | None = None
    # identical jobs (aitrainsai.run.job_phase.share_key): what makes this job the same as another; the job whose
    # outcome it takes instead of training (queued: waiting for that job; done: its outcome is that job's)
    share_key: str | None = None
    shared_with: str | None = None

    def stored(self) -> dict[str, Any]:
        """The JSON the ledger keeps: the fields known so far."""
        return self.model_dump(mode="json", exclude_none=True)

    def adding(self, new: JobProgress) -> JobProgress:
        """This progress with the fields ``new`` sets."""
        return JobProgress.model_validate({**self.stored(), **new.model_dump(mode="json", exclude_unset=True)})

    def outcome(self) -> EvalComparison | None:
        """A done job's hidden-eval outcome, as the episode that trained it recorded it; None before it has one."""
        if (self.base_model is None or self.pre is None or self.post is None or self.uplift is None
                or self.uplift_ci is None or self.eval_size is None or self.train_seconds is None):
            return None
        return EvalComparison(base_model=self.base_model, pre=self.pre, post=self.post, uplift=self.uplift,
                           uplift_ci=self.uplift_ci, eval_size=self.eval_size, train_seconds=self.train_seconds,
                           train_work=self.train_work, metrics=self.metrics or {})

    def shareable(self) -> bool:
        """A done job's outcome may stand for identical jobs: its training found the job's code reproducible."""
        return self.outcome() is not None and self.train is not None and self.train.reproducible is True

    def same_outcome(self, other: JobProgress) -> bool:
        """Two trainings came out the same: the same checkpoint, byte for byte, and the same hidden-eval scores."""
        mine, theirs = self.outcome(), other.outcome()
        return (mine is not None and theirs is not None and self.train is not None and other.train is not None
                and self.train.checkpoint_digest is not None
                and self.train.checkpoint_digest == other.train.checkpoint_digest and mine.post == theirs.post
                and mine.metrics.get("post_item_scores") == theirs.metrics.get("post_item_scores"))


class Job(BaseModel):
    """A job's row: its state, where it runs, what it cost, and its progress so far."""

    model_config = ConfigDict(extra="forbid")

    id: str
    state: JobState
    episode_id: str | None = None
    backend: str | None = None
    handle: dict[str, Any] | None = None
    cost_usd: float | None = None
    wall_s: float | None = None
    progress: JobProgress = Field(default_factory=JobProgress)
    created_at: float
    updated_at: float


# -- the ledger's rows, as read ------------------------------------------------------------------------------------
class RunInfo(BaseModel):
    """A run's row: its status (``running`` only while a process runs it), its resolved config, its loaded plugins
    and their selection as one ``--plugins`` string."""

    model_config = ConfigDict(extra="forbid")

    id: str
    name: str | None = None
    status: str
    created_at: float
    updated_at: float
    config: dict[str, Any]
    plugins: list[dict[str, Any]] = Field(default_factory=list)
    selection: str | None = None


class EpisodeData(BaseModel):
    """What an episode's row holds beside its columns: while its job trains, the turns and the frozen job (for
    resume); once finished, the reward's components, the episode's outcome the reward was computed from, and the
    trained job's comparison. Keys older writers kept (``payload``, ``agent_seconds``) are ignored; ``record`` is the
    outcome's key in rows written before it had its name."""

    model_config = ConfigDict(extra="ignore")

    components: dict[str, float] = Field(default_factory=dict)
    outcome: EpisodeOutcome | None = Field(None, validation_alias=AliasChoices("outcome", "record"))
    turns: list[AgentTurn] = Field(default_factory=list)
    train: EvalComparison | None = None
    frozen_job: str | None = None  # the accepted job's frozen folder
    frozen_digest: str | None = None
    design: dict[str, Any] | None = None  # what the accepted job chose (aitrainsai.jobs.job.job_design)

    def chosen(self) -> dict[str, Any] | None:
        """The choices the policy recorded in a turn's ``meta["chosen"]`` (the first turn that has them)."""
        return next((turn.meta["chosen"] for turn in self.turns if isinstance(turn.meta.get("chosen"), dict)), None)


class EpisodeRow(BaseModel):
    """An episode's row: where it stands (``status``), its group and step, its reward, and its :class:`EpisodeData`."""

    model_config = ConfigDict(extra="forbid")

    id: str
    step: int | None = None
    family: str | None = None
    level: int | None = None
    group_id: str | None = None
    status: str
    reward: float | None = None
    data: EpisodeData = Field(default_factory=EpisodeData)
    created_at: float
    updated_at: float


class ProbeRow(BaseModel):
    """One submission of an episode's job to the probe: accepted (``ok``) or the problems it named."""

    model_config = ConfigDict(extra="forbid")

    episode_id: str
    attempt: int
    ok: bool
    problems: list[str] = Field(default_factory=list)
    seconds: float | None = None
    created_at: float


class BaselineRow(BaseModel):
    """A cached untrained score: the mean, each item's, and the engine settings that scored it (None: not recorded)."""

    model_config = ConfigDict(extra="forbid")

    score: float
    item_scores: list[float]
    engine: EngineSpec | None = None


class EventRow(BaseModel):
    """An event as stored (:meth:`aitrainsai.run.ledger.Run.events`): its sequence number, kind and data, unparsed."""

    model_config = ConfigDict(extra="forbid")

    seq: int
    kind: str
    data: dict[str, Any]
    created_at: float


class AgentPrompt(BaseModel):
    """The exact prompt the agent saw in one family: its opening messages and tool schemas
    (:meth:`aitrainsai.run.ledger.Run.record_agent_prompt`)."""

    model_config = ConfigDict(extra="ignore")

    family: str
    level: int | None = None
    episode: str | None = None  # the episode that first saw it
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = Field(default_factory=list)
