"""How much the machine's load stretches wall time now, for the budgets of the job's own code.

The trainer's work is counted, never timed (:mod:`aitrainsai_trainer_local.work`); the job's own code (its sandbox's
start, its tools and rubric) can only be timed, and its budgets are stretched by the load: a fixed workload like the
trainer's is timed in wall and CPU time, and their ratio is the stretch. Only what takes the CPU stretches it:
processes that wait (which a job can start by the hundred) do not.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

REPEATS = 3
MAX_STRETCH = 8.0
_warm: set[str] = set()  # (dtype, device) pairs measured once already in this process


def _calibration(dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """CPU seconds over threads (wall seconds on a GPU) and wall seconds of a fixed workload shaped like a step of the
    local trainer: 256 positions through one block's MLP weights and attention of 128 queries over 512 slots, 8
    times."""
    import torch

    generator = torch.Generator().manual_seed(0)

    def tensor(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.05).to(device=device, dtype=dtype)

    x, up, down = tensor(256, 576), tensor(3072, 576), tensor(576, 1536)
    q, k, v = tensor(9, 128, 64), tensor(9, 512, 64), tensor(9, 512, 64)
    threads = max(1, torch.get_num_threads()) if device.type == "cpu" else 1
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    began, wall = clock(), time.perf_counter()
    with torch.no_grad():
        for _ in range(8):
            gate, value = (x @ up.T).chunk(2, -1)
            h = (torch.nn.functional.silu(gate) * value) @ down.T
            scores = (q @ k.transpose(1, 2)).float().softmax(-1).to(dtype)
            h = h + (scores @ v).transpose(0, 1).reshape(128, 576).repeat(2, 1)
            x = x + h * 1e-3
        if device.type == "cuda":
            torch.cuda.synchronize()
    return (clock() - began) / threads, time.perf_counter() - wall


def stretch(dtype: torch.dtype, device: torch.device) -> float:
    """Wall over CPU time of the workload (1: quiet; at most :data:`MAX_STRETCH`): the median of :data:`REPEATS`,
    after one to warm up the first time in a process."""
    if f"{dtype}/{device}" not in _warm:
        _calibration(dtype, device)
        _warm.add(f"{dtype}/{device}")
    timings = [_calibration(dtype, device) for _ in range(REPEATS)]
    cpu = max(statistics.median(t[0] for t in timings), 1e-6)
    wall = max(statistics.median(t[1] for t in timings), 1e-6)
    return min(MAX_STRETCH, max(1.0, wall / cpu))
