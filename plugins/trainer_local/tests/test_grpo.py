import torch

from aitrainsai_trainer_local.grpo import Example, GRPOConfig, GRPOTrainer, group_advantages, policy_gradient_loss
from aitrainsai_trainer_local.rollout import Conversation, Rollout


def test_advantages_are_group_normalised():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 3.0]])
    advantages, flat = group_advantages(rewards, eps=1e-4)
    assert flat == 1
    assert torch.equal(advantages[1], torch.zeros(4))  # zero spread: exactly zero, not 0/eps noise
    for row in (0, 2):
        r = rewards[row]
        expected = (r - r.mean()) / (r.std() + 1e-4)
        assert torch.allclose(advantages[row], expected)
        assert abs(float(advantages[row].sum())) < 1e-5


def test_all_flat_groups_give_no_loss():
    r = Rollout(messages=[], prompt_ids=[1, 2], completion_ids=[3, 4], completion_mask=[1, 1], turn_ids=[[3, 4]])
    assert policy_gradient_loss(None, [r, r], [0.0, 0.0]) is None


def test_training_changes_the_adapter(tiny_policy_fp32, tmp_path):
    policy_fp32 = tiny_policy_fp32  # the mechanics of a step and of the checkpoint, not learning
    # A reward with spread in every group (the reply's length), so every step has a gradient.
    example = Example.fixed(Conversation([{"role": "user", "content": "Say something."}]),
                      lambda transcript: len(transcript[-1]["content"]) / 10)
    config = GRPOConfig(steps=2, prompts_per_step=1, group_size=3, max_new_tokens=6, learning_rate=1e-2,
                        lora_rank=4, lora_alpha=8, dtype="float32")
    before = {n: p.detach().clone() for n, p in policy_fp32.model.named_parameters() if p.requires_grad}
    trainer = GRPOTrainer(config, [example], policy=policy_fp32)
    history = trainer.train()
    assert [m.step for m in history] == [1, 2]
    for m in history:
        assert m.tokens_generated > 0 and m.trained_rollouts > 0
        assert m.seconds_total >= m.seconds_generation + m.seconds_forward_backward
    after = {n: p.detach() for n, p in policy_fp32.model.named_parameters() if p.requires_grad}
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert any("lora_B" in n for n in changed) and any("lora_A" in n for n in changed)
    # the checkpoint is a peft adapter that reloads to the same weights
    path = trainer.save(tmp_path / "adapter")
    assert (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()
    from safetensors.torch import load_file

    saved = load_file(path / "adapter_model.safetensors")
    assert len(saved) == len(after)
    for name, tensor in saved.items():
        match = [n for n in after if n.replace(".default", "") == name]
        assert match and torch.equal(after[match[0]].cpu(), tensor)
