"""The one place that pins the prime-rl stacks a job runs on: a ``Stack`` per job format, chosen by the run option
``prime_rl.stack`` (:func:`select_stack`; ``auto``: by the job's format).

Why v0.6.0 for classic jobs: it is the last prime-rl release that loads verifiers' classic environments natively
(``vf.load_environment(id, **args)`` in its orchestrator), which is the classic job format
(:mod:`aitrainsai.jobs.verifiers_env`); v0.7.0 and v0.8.0 load them only through a legacy bridge, and prime-rl main no
longer loads them at all.

Why main at ``559b447`` for verifiers-v1 jobs: prime-rl dropped classic environments on main (PR #3226,
2026-08-10) and loads only v1 tasksets (``[[orchestrator.train.source]]`` with ``env.taskset.id``); ``559b447``
(2026-08-21) is the newest commit the repository mirror holds. No v0.9 tag is in it (v0.9.0, 2026-08-24, came
after), so the pin is a commit of main (its only tag is the dev tag ``v0.8.1.dev67``, not relied on). It supports
dense Qwen3.5 (#2984, 2026-07-09), hence the two Qwen3.5 bases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

QWEN3_BASES = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B")  # the reference system's bases
QWEN3_5_BASES = ("Qwen/Qwen3.5-0.8B", "Qwen/Qwen3.5-2B")  # dense Qwen3.5: prime-rl main only


@dataclass(frozen=True)
class Stack:
    """A prime-rl release (or a commit of main) and what it brings."""

    tag: str  # the release tag; "" for a commit of main that no tag names
    commit: str
    verifiers: str  # the verifiers version its submodule builds as (what loads a job's environment)
    python: str  # the Python its uv project requires
    job_format: str  # the job format it loads (aitrainsai.jobs.format.JobFormat)
    bases: tuple[str, ...] = QWEN3_BASES  # the bases a job may train on it
    date: str = ""  # the commit's date

    @property
    def name(self) -> str:
        """What ``prime_rl.stack`` calls it, and its folder on a worker: the tag, else ``main-<commit[:7]>``."""
        return self.tag or f"main-{self.commit[:7]}"


V0_6_0 = Stack(tag="v0.6.0", commit="38494ccb4140897b1c9e7a9ba8da59dcd8940d47", verifiers="0.1.15.dev180",
               python="3.12", job_format="verifiers", date="2026-06-22")
MAIN_V1 = Stack(tag="", commit="559b44772e471d1538537b8805cc77f3824a5e64", verifiers="0.3.1.dev62",
                python="3.12", job_format="verifiers-v1", bases=QWEN3_BASES + QWEN3_5_BASES, date="2026-08-21")
STACK = V0_6_0  # the classic jobs' stack (and the default where no job is at hand)
STACKS = {stack.name: stack for stack in (V0_6_0, MAIN_V1)}
StackOption = Literal["auto", "v0.6.0", "main-559b447"]
assert set(get_args(StackOption)) == {"auto", *STACKS}

BASES = V0_6_0.bases
ALL_BASES = MAIN_V1.bases
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's valid max_lora_rank values (v0.6.0 does not round)
TOOL_PARSERS = {"Qwen/Qwen3-0.6B": "hermes", "Qwen/Qwen3-1.7B": "hermes",  # vLLM's tool-call parser per base
                "Qwen/Qwen3.5-0.8B": "qwen3_coder", "Qwen/Qwen3.5-2B": "qwen3_coder"}  # Qwen3.5 calls tools in XML
assert set(TOOL_PARSERS) == set(ALL_BASES)


class StackMismatch(ValueError):
    """A job whose format the chosen prime-rl cannot load; the message is one line."""


def select_stack(option: str, job_format: str) -> Stack:
    """The stack a job of ``job_format`` ("verifiers" or "verifiers-v1") trains on under the run option
    ``prime_rl.stack``: ``auto`` picks the stack of that format; a named stack must load the format."""
    if option == "auto":
        for candidate in STACKS.values():
            if candidate.job_format == job_format:
                return candidate
        raise StackMismatch(f"no pinned prime-rl loads jobs of the format {job_format!r}")
    stack = STACKS.get(option)
    if stack is None:
        raise StackMismatch(f"prime_rl.stack = {option!r} is not one of {sorted(STACKS)} or 'auto'")
    if stack.job_format != job_format:
        what = "classic verifiers environments (environment.py)" if job_format == "verifiers" else \
            "verifiers v1 tasksets (taskset.py)"
        raise StackMismatch(f"prime-rl {stack.name} (prime_rl.stack) cannot load {what}: it loads "
                            f"{stack.job_format} jobs only; write the job in that format or set prime_rl.stack = "
                            f"'auto'")
    return stack


def offered_bases(option: str) -> tuple[str, ...]:
    """The bases a run offers under ``prime_rl.stack``: a named stack's; ``auto`` the bases every stack trains (a
    job's format, which decides its stack, is not known when the task's constraints are made)."""
    if option == "auto":
        common = set.intersection(*(set(s.bases) for s in STACKS.values()))
        return tuple(base for base in ALL_BASES if base in common)
    return STACKS[option].bases
