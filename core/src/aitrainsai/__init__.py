"""aitrainsai: an outer agent is RL-trained to write training jobs that really train small language models.

The public API is this module: everything a plugin, a task family or a script needs is importable from here, and
the conformance kits and fakes from :mod:`aitrainsai.testing`. Every other module is private and may move; a test
fails when a plugin or family imports one. Names load on first use (``import aitrainsai`` stays light, and the
sandboxed processes that import the package never load the rest of the core).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aitrainsai.hookspecs import hookimpl

if TYPE_CHECKING:  # the same names, for type checkers (``X as X``: an explicit re-export)
    from aitrainsai.backends import (
        PYTHON as PYTHON,
        BackendUnavailable as BackendUnavailable,
        DeadReason as DeadReason,
        GpuBackend as GpuBackend,
        JobHandle as JobHandle,
        JobPayload as JobPayload,
        JobResult as JobResult,
        MissingArtifacts as MissingArtifacts,
        Runtime as Runtime,
        TaskPerJob as TaskPerJob,
        append_journal as append_journal,
        blank_secrets as blank_secrets,
        place_artifact as place_artifact,
        read_journal as read_journal,
        relative_path as relative_path,
    )
    from aitrainsai.builtin.local_backend import (
        LocalBackend as LocalBackend,
        LocalBackendConfig as LocalBackendConfig,
    )
    from aitrainsai.chat import (
        ChatML as ChatML,
        ChatMessage as ChatMessage,
        ChatTokens as ChatTokens,
        FunctionCall as FunctionCall,
        Message as Message,
        ParsedReply as ParsedReply,
        content_text as content_text,
        format_tool_call as format_tool_call,
        openai_message as openai_message,
        parse_reply as parse_reply,
        parse_tool_calls as parse_tool_calls,
        ToolCall as ToolCall,
        ToolFunction as ToolFunction,
    )
    from aitrainsai.cli.command import CommandState as CommandState, InputError as InputError
    from aitrainsai.cli.report import (
        ReportData as ReportData,
        collect as collect,
        write_report as write_report,
    )
    from aitrainsai.cli.scaffold import (
        new_family as new_family,
    )
    from aitrainsai.components import (
        ComponentConfig as ComponentConfig,
    )
    from aitrainsai.config import (
        ConfigError as ConfigError,
        load_config as load_config,
        resolve as resolve,
        resume_overrides as resume_overrides,
    )
    from aitrainsai.errors import AitrainsaiError as AitrainsaiError
    from aitrainsai.evaluation import (
        ChatRequest as ChatRequest,
        EngineSpec as EngineSpec,
        EvalResult as EvalResult,
        converse as converse,
        evaluate_family as evaluate_family,
        evaluate_items as evaluate_items,
        paired_bootstrap as paired_bootstrap,
    )
    from aitrainsai.families import (
        Constraints as Constraints,
        DevExample as DevExample,
        EvalInterface as EvalInterface,
        Item as Item,
        TaskFamily as TaskFamily,
        TaskSpec as TaskSpec,
        ToolSession as ToolSession,
        extract_answer as extract_answer,
        final_reply as final_reply,
        last_text as last_text,
    )
    from aitrainsai.is_grpo import (
        Datum as Datum,
        build_datum as build_datum,
        episode_datums as episode_datums,
        group_advantages as group_advantages,
        has_signal as has_signal,
        importance_sampling_loss as importance_sampling_loss,
    )
    from aitrainsai.isolation import Limits as Limits
    from aitrainsai.jobs.format import (JobFormat as JobFormat, job_format as job_format,
                                        verifiers_v1_path as verifiers_v1_path)
    from aitrainsai.jobs.job import (DATASET_FILE as DATASET_FILE, FrozenRows as FrozenRows, JobChanged as JobChanged,
                                     frozen_rows as frozen_rows, job_digest as job_digest, job_template as job_template,
                                     verify_job as verify_job, write_frozen_rows as write_frozen_rows)
    from aitrainsai.jobs.probe import wall_net as wall_net
    from aitrainsai.jobs.remote_env import (
        JobEnvironmentError as JobEnvironmentError,
        RemoteEnvironment as RemoteEnvironment,
        RowsChanged as RowsChanged,
        RubricChanged as RubricChanged,
    )
    from aitrainsai.jobs.sandboxed_env import SandboxedEnv as SandboxedEnv
    from aitrainsai.jobs.workspace import (
        Workspace as Workspace,
    )
    from aitrainsai.parsing import (
        SpecError as SpecError,
        UntrustedInputError as UntrustedInputError,
        load_json as load_json,
        lora_adapter_config as lora_adapter_config,
        printable as printable,
        read_json as read_json,
        read_spec as read_spec,
    )
    from aitrainsai.plugins import (
        PluginError as PluginError,
        Plugins as Plugins,
        load_family as load_family,
    )
    from aitrainsai.rewards import (
        EpisodeOutcome as EpisodeOutcome,
        ProbeAttempt as ProbeAttempt,
        RewardComponent as RewardComponent,
    )
    from aitrainsai.run.baseline import (
        EngineMismatch as EngineMismatch,
        compare as compare,
    )
    from aitrainsai.run.ledger import (
        RUN_ID as RUN_ID,
        FrozenJobError as FrozenJobError,
        Ledger as Ledger,
        LedgerError as LedgerError,
        Run as Run,
        frozen_job_folder as frozen_job_folder,
        run_is_live as run_is_live,
    )
    from aitrainsai.run.record import (
        AgentPrompt as AgentPrompt,
        BackendEvent as BackendEvent,
        EpisodeData as EpisodeData,
        EpisodeRow as EpisodeRow,
        Eval as Eval,
        GroupRef as GroupRef,
        Job as Job,
        JobState as JobState,
        JobStateError as JobStateError,
        OuterStep as OuterStep,
        PolicyExport as PolicyExport,
        Stopped as Stopped,
    )
    from aitrainsai.run.session import (
        Session as Session,
    )
    from aitrainsai.stopping import (
        Interrupted as Interrupted,
        run_until_stopped as run_until_stopped,
    )
    from aitrainsai.trackers import (
        AnyPoint as AnyPoint,
        EpisodePoint as EpisodePoint,
        EvalPoint as EvalPoint,
        JobPoint as JobPoint,
        RunEnd as RunEnd,
        StepPoint as StepPoint,
        TrackedRun as TrackedRun,
        Tracker as Tracker,
    )
    from aitrainsai.tools import (
        bind as bind,
        call_tool as call_tool,
        takes_world as takes_world,
    )
    from aitrainsai.trainers import (
        AgentOutcome as AgentOutcome,
        AgentTask as AgentTask,
        AgentTurn as AgentTurn,
        Baseline as Baseline,
        EvalComparison as EvalComparison,
        InnerTrainer as InnerTrainer,
        InnerTrainerConfig as InnerTrainerConfig,
        JobConfigBase as JobConfigBase,
        OuterTrainer as OuterTrainer,
        Problem as Problem,
        SampleMode as SampleMode,
        ScoredEpisode as ScoredEpisode,
        StopRun as StopRun,
        TrainOutcome as TrainOutcome,
        TurnMeta as TurnMeta,
        line_of as line_of,
    )
    from aitrainsai.scheduler import JobQueue as JobQueue
    from aitrainsai.wheels import (
        WheelCache as WheelCache,
        WheelError as WheelError,
        build_local_wheels as build_local_wheels,
    )

# the public names by kind: section -> module that defines them -> names (docs/api.md is generated from this; the
# TYPE_CHECKING imports above say the same, and a test holds the two equal)
_SECTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "Every kind: options, errors": {
        "aitrainsai.components": ("ComponentConfig",),
        "aitrainsai.errors": ("AitrainsaiError",),
    },
    "Task family": {
        "aitrainsai.families": ("Constraints", "DevExample", "EvalInterface", "Item", "TaskFamily", "TaskSpec",
                                "ToolSession", "extract_answer", "final_reply", "last_text"),
        "aitrainsai.chat": ("Message", "ToolCall", "ToolFunction"),
        "aitrainsai.tools": ("bind", "call_tool", "takes_world"),
    },
    "Reward component": {
        "aitrainsai.rewards": ("EpisodeOutcome", "ProbeAttempt", "RewardComponent"),
    },
    "GPU backend": {
        "aitrainsai.backends": ("PYTHON", "BackendUnavailable", "DeadReason", "GpuBackend", "JobHandle", "JobPayload",
                                "JobResult", "MissingArtifacts", "Runtime", "TaskPerJob", "append_journal",
                                "blank_secrets", "place_artifact", "read_journal", "relative_path"),
        "aitrainsai.scheduler": ("JobQueue",),
        "aitrainsai.builtin.local_backend": ("LocalBackend", "LocalBackendConfig"),
        "aitrainsai.wheels": ("WheelCache", "WheelError", "build_local_wheels"),
    },
    "Tracker": {
        "aitrainsai.trackers": ("AnyPoint", "EpisodePoint", "EvalPoint", "JobPoint", "RunEnd", "StepPoint",
                                "TrackedRun", "Tracker"),
    },
    "Inner trainer: the job it trains, the hidden eval its checkpoint is scored on": {
        "aitrainsai.trainers": ("AgentOutcome", "AgentTask", "AgentTurn", "Baseline", "EvalComparison", "InnerTrainer",
                                "InnerTrainerConfig", "JobConfigBase", "OuterTrainer", "Problem", "SampleMode",
                                "ScoredEpisode", "StopRun", "TrainOutcome", "TurnMeta", "line_of"),
        "aitrainsai.jobs.job": ("DATASET_FILE", "FrozenRows", "JobChanged", "frozen_rows", "job_digest",
                                "job_template", "verify_job", "write_frozen_rows"),
        "aitrainsai.jobs.format": ("JobFormat", "job_format", "verifiers_v1_path"),
        "aitrainsai.jobs.remote_env": ("JobEnvironmentError", "RemoteEnvironment", "RowsChanged", "RubricChanged"),
        "aitrainsai.jobs.probe": ("wall_net",),
        "aitrainsai.jobs.sandboxed_env": ("SandboxedEnv",),
        "aitrainsai.isolation": ("Limits",),
        "aitrainsai.evaluation": ("ChatRequest", "EngineSpec", "EvalResult", "converse", "evaluate_family",
                                  "evaluate_items", "paired_bootstrap"),
        "aitrainsai.run.baseline": ("EngineMismatch", "compare"),
        "aitrainsai.parsing": ("SpecError", "UntrustedInputError", "load_json", "lora_adapter_config", "printable",
                               "read_json", "read_spec"),
    },
    "Outer trainer: chat rendering and GRPO": {
        "aitrainsai.chat": ("ChatMessage", "ChatML", "ChatTokens", "FunctionCall", "ParsedReply", "content_text",
                            "format_tool_call", "openai_message", "parse_reply", "parse_tool_calls"),
        "aitrainsai.is_grpo": ("Datum", "build_datum", "episode_datums", "group_advantages", "has_signal",
                               "importance_sampling_loss"),
        "aitrainsai.jobs.workspace": ("Workspace",),
    },
    "Commands a plugin adds, and scripts: runs, config, plugins, stopping": {
        "aitrainsai.cli.command": ("CommandState", "InputError"),
        "aitrainsai.config": ("ConfigError", "load_config", "resolve", "resume_overrides"),
        "aitrainsai.run.ledger": ("RUN_ID", "FrozenJobError", "Ledger", "LedgerError", "Run", "frozen_job_folder",
                                  "run_is_live"),
        "aitrainsai.run.record": ("AgentPrompt", "BackendEvent", "EpisodeData", "EpisodeRow", "Eval", "GroupRef", "Job",
                                  "JobState", "JobStateError", "OuterStep", "PolicyExport", "Stopped"),
        "aitrainsai.plugins": ("PluginError", "Plugins", "load_family"),
        "aitrainsai.cli.report": ("ReportData", "collect", "write_report"),
        "aitrainsai.run.session": ("Session",),
        "aitrainsai.stopping": ("Interrupted", "run_until_stopped"),
        "aitrainsai.cli.scaffold": ("new_family",),
    },
}
_EXPORTS: dict[str, str] = {name: module for modules in _SECTIONS.values() for module, names in modules.items()
                            for name in names}  # name -> the module that defines it

__all__ = ["hookimpl", *sorted(_EXPORTS)]

# modules that need an extra of the aitrainsai distribution: module -> (extra, the distribution the extra installs)
_EXTRAS: dict[str, tuple[str, str]] = {"aitrainsai.jobs.sandboxed_env": ("jobs", "verifiers")}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aitrainsai' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        extra = _EXTRAS.get(module)
        if extra is None or exc.name != extra[1]:
            raise
        raise ImportError(f"aitrainsai.{name} needs {extra[1]}: pip install 'aitrainsai[{extra[0]}]'",
                          name=extra[1]) from None
    value = getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
