"""The jobs room: the job format (:mod:`~aitrainsai.jobs.job`), the validation probe (:mod:`~aitrainsai.jobs.probe`
and the child it runs in the sandbox, :mod:`~aitrainsai.jobs.probe_child`), and what crosses the wall with a job: the
environment server in the sandbox (:mod:`~aitrainsai.jobs.env_server`), the trusted side's handle on it
(:mod:`~aitrainsai.jobs.remote_env`, :mod:`~aitrainsai.jobs.sandboxed_env`), the verifiers compatibility layer
(:mod:`~aitrainsai.jobs.verifiers_env`) and the agent's workspace (:mod:`~aitrainsai.jobs.workspace`).

``aitrainsai.jobs`` was one module; its names stay importable from here for one release (loaded on first use, so
that a sandboxed child importing :mod:`aitrainsai.jobs.env_server` loads nothing else of the room)."""

import importlib

_OLD_NAMES = {
    "aitrainsai.jobs.job": ("REQUIRED_FILES", "DATASET_FILE", "FROZEN_DIR", "MAX_ROW_BYTES", "MAX_DATASET_BYTES",
                            "MAX_JOB_FILES", "MAX_JOB_BYTES", "job_template", "TrainingRow", "JobChanged",
                            "job_design", "freeze", "job_digest", "verify_job", "read_dataset"),
    "aitrainsai.jobs.probe": ("PROBLEMS_FILE", "SANDBOX_OUT", "CHANCE_DRAW_ROWS", "CHANCE_DRAW_SEED",
                              "CHANCE_CONFIDENCE", "CHANCE_REFUSAL", "SAMPLE_ROWS", "ProbeReport", "ChildProblem",
                              "probe_job", "OverlapCheck", "check_overlap", "chance_overlap", "chance_allowance"),
}
_WHERE = {name: module for module, names in _OLD_NAMES.items() for name in names}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
