"""Old path of :mod:`aitrainsai.run.episode` (kept importable for one release), with the names it held that moved to
the episode's neighbours in :mod:`aitrainsai.run`."""

from aitrainsai.plugins import with_env
from aitrainsai.run.baseline import Baselines, EngineMismatch, compare
from aitrainsai.run.episode import Episode, EpisodeContext, EpisodeResult
from aitrainsai.run.job_phase import MAX_LOST_RERUNS
from aitrainsai.run.policy import Policy, SubmitFiles
from aitrainsai.run.prompt import AGENT_ROLE, AGENT_ROLE_COMPACT, TaskView
from aitrainsai.run.transcript import AGENT_ARGUMENT_CHARS, AGENT_RESULT_CHARS, MAX_STORED_MESSAGE, MAX_STORED_TEXT

__all__ = ["AGENT_ARGUMENT_CHARS", "AGENT_RESULT_CHARS", "AGENT_ROLE", "AGENT_ROLE_COMPACT", "MAX_LOST_RERUNS",
           "MAX_STORED_MESSAGE", "MAX_STORED_TEXT", "Baselines", "EngineMismatch", "Episode", "EpisodeContext",
           "EpisodeResult", "Policy", "SubmitFiles", "TaskView", "compare", "with_env"]
