"""How fast this machine runs the trainer's kind of work now, against the machine its budgets are measured on.

A job's wall budget is seconds of the reference machine (:data:`REFERENCE`: 2 cores of an x86 server with AMX, the
machine the docs' numbers come from). Before the job's code first runs, the driver times a fixed workload
shaped like the trainer's (its matmuls and attention, in the job's dtype, on its device, at the trainer's own thread
count) and compares its wall time with the reference's: the ratio turns the trainer's wall time here into the
reference machine's seconds. Load and the threads' efficiency stretch the workload as they stretch the trainer, so
they cancel, and whatever the job's prompts make the trainer do is counted at its real cost, on a fast or a slow
machine (see :class:`aitrainsai_trainer_local.job.Clock`).
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

# wall seconds of one calibration() on the reference machine, quiet, at 1 thread, by compute dtype: measured with
# `python -m aitrainsai_trainer_local.speed` (the median of 9 runs)
REFERENCE = {"bfloat16": 0.060, "float32": 0.140}
REPEATS = 3
_warm: set[str] = set()  # (dtype, device) pairs calibrated once already in this process


class Measure(NamedTuple):
    """This machine now, as the trainer's own work sees it."""

    speed: float  # the reference machine's seconds of the trainer's work per wall second here (2.0: twice as fast),
    # at the trainer's threads and with the machine's load now
    stretch: float  # how much the load stretches wall time: wall over CPU time (1: quiet; at most MAX_STRETCH)


MAX_STRETCH = 8.0


class Timing(NamedTuple):
    cpu: float  # CPU seconds over threads (wall seconds on a GPU)
    wall: float


def calibration(dtype: torch.dtype, device: torch.device) -> Timing:
    """CPU seconds over threads (wall seconds on a GPU), and wall seconds, of a fixed workload shaped like a step of
    the local trainer: 256 positions through one block's MLP weights and attention of 128 queries over 512 slots,
    8 times."""
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
    return Timing((clock() - began) / threads, time.perf_counter() - wall)


def measure(dtype: torch.dtype, device: torch.device) -> Measure:
    """This machine's speed for the trainer's work now (in wall time, at the trainer's threads, load included), and
    how much its load stretches wall time: the medians of :data:`REPEATS` calibrations (after one to warm up, the
    first time in a process). Only what takes the CPU stretches them: processes that wait (which a job can start by
    the hundred) do not."""
    reference = REFERENCE["bfloat16" if str(dtype).endswith("bfloat16") else "float32"]
    if f"{dtype}/{device}" not in _warm:
        calibration(dtype, device)
        _warm.add(f"{dtype}/{device}")
    timings = [calibration(dtype, device) for _ in range(REPEATS)]
    cpu = max(statistics.median(t.cpu for t in timings), 1e-6)
    wall = max(statistics.median(t.wall for t in timings), 1e-6)
    return Measure(speed=reference / wall, stretch=min(MAX_STRETCH, max(1.0, wall / cpu)))


def main() -> None:
    import torch

    for name in ("bfloat16", "float32"):
        dtype = getattr(torch, name)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            calibration(dtype, torch.device("cpu"))
            times = [calibration(dtype, torch.device("cpu")).wall for _ in range(9)]
            print(f"{name} at {threads} thread(s): median {statistics.median(times):.4f} s, "
                  f"min {min(times):.4f}, max {max(times):.4f}")


if __name__ == "__main__":
    main()
