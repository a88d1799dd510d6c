"""The trainer's memory is bounded by what the job's shapes need, refused before it is taken (issue 51: a job with
long prompts took the trainer's memory in the backward pass, and the kernel killed it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aitrainsai_trainer_local import llama
from aitrainsai_trainer_local.grpo import policy_gradient_loss
from aitrainsai_trainer_local.rollout import Rollout

# Runs one training forward and backward of SmolLM2 in a fresh process; prints the activations it estimated and the
# resident memory they took (its peak over the level after a warm-up step: kernels and packed weights are not theirs)
MEASURE = """
import json, sys, threading, time
import torch
torch.set_num_threads(1)
from aitrainsai_trainer_local import llama
from aitrainsai_trainer_local.grpo import policy_gradient_loss
from aitrainsai_trainer_local.lora import LoraModel, LoraSettings
from test_memory import _rows as rows

def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096

policy = LoraModel.load(lora=LoraSettings(), dtype=sys.argv[1], seed=0)
policy_gradient_loss(policy, rows(1, 4, 2, 3), [1.0, -1.0]).backward()
kept, check = [], llama.FastLlama._check_activations
def spy(self, cache, *args):
    check(self, cache, *args)
    kept.append(cache.kept)
llama.FastLlama._check_activations = spy
batch = rows(1, 300, 8, 32)
base = peak = resident()
done = threading.Event()
def watch():
    global peak
    while not done.is_set():
        peak = max(peak, resident())
        time.sleep(0.002)
watcher = threading.Thread(target=watch)
watcher.start()
policy_gradient_loss(policy, batch, [1.0, -1.0] * 4).backward()
done.set()
watcher.join()
print(json.dumps({"estimated": max(kept), "taken": peak - base}))
"""


@pytest.mark.slow  # SmolLM2's real training step
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_estimate_bounds_what_a_training_step_takes(tokenizer, dtype):
    """SmolLM2's training forward and backward on a 300-token prompt and 8 rows: the activations the bound counts
    are at least the memory the step took, and not far over it (a bound far over would refuse honest jobs)."""
    out = subprocess.run([sys.executable, "-c", MEASURE, dtype], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    assert out.returncode == 0, out.stderr[-2000:]
    measured = json.loads(out.stdout.splitlines()[-1])
    assert measured["taken"] > 2**28, measured  # the step took memory worth bounding (about 0.8 GB)
    assert measured["taken"] <= measured["estimated"] <= 2 * measured["taken"], measured


def _rows(prompts: int, length: int, group: int, completion: int) -> list[Rollout]:
    return [Rollout([], [100 + (p * 7 + k * 13) % 40000 for k in range(length)],
                    [100 + (r * 11 + k * 3 + p) % 40000 for k in range(completion)], [1] * completion, [])
            for p in range(prompts) for r in range(group)]


def test_a_training_forward_over_the_bound_is_refused_before_it_runs(tiny_policy_fp32, monkeypatch):
    """The prompts' forward fits, the completions' would pass the bound: refused before it computes anything, with
    the size and the shape named."""
    fast = tiny_policy_fp32.fast
    batch = _rows(2, 40, 4, 16)
    advantages = [1.0, -1.0] * 4
    policy_gradient_loss(tiny_policy_fp32, batch, advantages)  # fits the real bound
    positions = fast.positions
    policy_gradient_loss(tiny_policy_fp32, _rows(2, 40, 1, 1), [1.0, -1.0])
    prompts_only = fast.positions - positions - 2  # the two one-token completions
    per_position = llama.KEPT_ELEMENTS_PER_POSITION * 4 * fast.position_width
    monkeypatch.setattr(llama, "MAX_ACTIVATION_BYTES", len(fast.blocks) * per_position * prompts_only * 2)
    positions = fast.positions
    with pytest.raises(llama.ActivationsTooLarge, match=r"training keeps [0-9.]+ GB of activations \(8 rows of 16 "
                                                        r"tokens after 40\), over the trainer's 0.00 GB"):
        policy_gradient_loss(tiny_policy_fp32, batch, advantages)
    assert fast.positions - positions == prompts_only  # the prompts ran; the completions' forward did not


def test_an_inference_forward_whose_scores_pass_the_bound_is_refused(tiny_policy_fp32, monkeypatch):
    """Generation keeps no graph, but a long prefill materialises its attention scores, one layer at a time."""
    import torch

    from aitrainsai_trainer_local.sampling import Sampler

    monkeypatch.setattr(llama, "MAX_ACTIVATION_BYTES", 2**16)
    model = tiny_policy_fp32.inference_model()
    sampler = Sampler(model, tiny_policy_fp32.stop_ids, tiny_policy_fp32.pad_id)
    forwards = model.forwards
    with pytest.raises(llama.ActivationsTooLarge, match=r"its attention scores need [0-9.]+ GB of activations "
                                                        r"\(2 rows of 200 tokens after 0\)"):
        sampler.generate([list(range(100, 300)), list(range(300, 500))], None, 4, 1.0, torch.Generator())
    assert model.forwards == forwards


def test_an_inference_forward_of_many_short_rows_counts_its_positions(tiny_policy_fp32, monkeypatch):
    """Review twelve: 1,024 rows of 100 tokens took 1.33 times what the scores and cache alone counted (each layer's
    norms and MLP, per position). Positions count in an inference forward too."""
    import torch

    from aitrainsai_trainer_local.sampling import Sampler

    fast = tiny_policy_fp32.fast
    per_position = llama.TRANSIENT_ELEMENTS_PER_POSITION * 4 * fast.position_width
    rows = [[100 + row, 200 + row, 300 + row, 400 + row, 500, 600, 700, 800] for row in range(64)]
    monkeypatch.setattr(llama, "MAX_ACTIVATION_BYTES", 64 * 8 * per_position // 2)  # the scores alone fit
    sampler = Sampler(tiny_policy_fp32.inference_model(), tiny_policy_fp32.stop_ids, tiny_policy_fp32.pad_id)
    with pytest.raises(llama.ActivationsTooLarge, match=r"\(64 rows of 8 tokens after 0\)"):
        sampler.generate(rows, None, 2, 1.0, torch.Generator())


def test_logits_recomputed_in_the_backward_pass_are_counted_twice():
    """Review twelve: past ``KEPT_LOGITS_BYTES`` the backward pass projects to the vocabulary again, which no fitted
    shape reached; a step's logit rows count that pass."""
    vocab = 49_152
    kept = llama.KEPT_LOGITS_BYTES // (4 * vocab)
    assert llama.logit_passes(kept, vocab) == 1 and llama.logit_passes(kept + 1, vocab) == 2
