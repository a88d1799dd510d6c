"""The one place that pins the prime-rl stack a job runs on. A later job format (verifiers v1 tasksets on prime-rl
after v0.8) is a second ``Stack`` beside this one, chosen by the job format, not a change to this one.

Why v0.6.0: it is the last prime-rl release that loads verifiers' classic environments natively
(``vf.load_environment(id, **args)`` in its orchestrator), which is the job format agents write today
(:mod:`aitrainsai.jobs.verifiers_env`); v0.7.0 and v0.8.0 load them only through a legacy bridge, and prime-rl main no
longer loads them at all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stack:
    """A prime-rl release and what it brings."""

    tag: str
    commit: str
    verifiers: str  # the verifiers version its submodule builds as (what loads a job's environment)
    python: str  # the Python its uv project requires
    job_format: str


V0_6_0 = Stack(tag="v0.6.0", commit="38494ccb4140897b1c9e7a9ba8da59dcd8940d47", verifiers="0.1.15.dev180",
               python="3.12", job_format="verifiers-classic")
STACK = V0_6_0

BASES = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B")
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's valid max_lora_rank values (prime-rl does not round)
