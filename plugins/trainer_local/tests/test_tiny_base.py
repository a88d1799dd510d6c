"""The tiny base for tests of mechanics: SmolLM2-135M's tokenizer and the trainer's own architecture at two narrow
layers, drawn from a seed; loaded and offered only where ``AITRAINSAI_LOCAL_BASE`` names it, and named to every
worker by its payload."""

import pytest
import torch

from aitrainsai_trainer_local.model import BASE_MODEL, BASE_VARIABLE, TINY_BASE, base_name


def test_the_real_base_is_loaded_and_offered_unless_the_variable_names_the_tiny_one(monkeypatch):
    from aitrainsai import Constraints
    from aitrainsai_trainer_local.inner import LocalTrainer

    monkeypatch.delenv(BASE_VARIABLE, raising=False)
    assert base_name() == BASE_MODEL and LocalTrainer.base_models == (BASE_MODEL,)
    assert LocalTrainer().constraints(Constraints()).allowed_bases == [BASE_MODEL]
    monkeypatch.setenv(BASE_VARIABLE, TINY_BASE)
    assert base_name() == TINY_BASE and LocalTrainer().base_models == (TINY_BASE,)
    assert LocalTrainer().constraints(Constraints()).allowed_bases == [TINY_BASE]
    monkeypatch.setenv(BASE_VARIABLE, "gpt-9")
    with pytest.raises(ValueError, match="names no local base"):
        base_name()


def test_each_payload_names_its_base_to_the_worker(tmp_path, tiny_base, calc_chain):
    from aitrainsai import Constraints, job_template
    from aitrainsai_trainer_local.inner import LocalTrainer

    trainer = LocalTrainer()
    spec = calc_chain.task_spec(1, trainer.constraints(Constraints()))
    job = tmp_path / "episode" / "job"
    job.mkdir(parents=True)
    for name, text in job_template(spec, trainer.config_template(spec)).items():
        (job / name).write_text(text)
    assert trainer.payload(job, spec, "j", calc_chain).env == {BASE_VARIABLE: tiny_base}  # trainer.toml chose it
    assert trainer.eval_payload(calc_chain, 1, BASE_MODEL, None, tmp_path / "eval", "e").env == {
        BASE_VARIABLE: BASE_MODEL}


def test_the_tiny_base_is_the_same_in_every_load_and_runs_on_the_trainers_forward(tiny_policy_fp32, tokenizer):
    from aitrainsai_trainer_local.model import load_base

    policy = tiny_policy_fp32
    config = policy.model.get_base_model().config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (2, 64, len(tokenizer))
    assert policy.tokenizer.get_vocab() == tokenizer.get_vocab() and policy.stop_ids == [tokenizer.eos_token_id]
    torch.manual_seed(123)  # the caller's random state neither changes the weights nor is changed
    state = torch.random.get_rng_state()
    (first, _), (second, _) = load_base("cpu", base=TINY_BASE), load_base("cpu", base=TINY_BASE)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert first.state_dict().keys() == second.state_dict().keys()
    assert all(torch.equal(value, second.state_dict()[name]) for name, value in first.state_dict().items())
    assert sum(p.numel() for p in first.parameters()) < 4_000_000  # SmolLM2-135M: 134,515,008
    # the trainer's fast forward over it agrees with transformers' own
    ids = torch.tensor([tokenizer.encode("The tiny base has the trainer's own architecture.")])
    fast = policy.fast
    hidden = fast.forward(ids, torch.ones_like(ids, dtype=torch.bool), fast.new_cache(1, inplace=False))
    with torch.no_grad():
        expected = policy.model(input_ids=ids).logits
    assert torch.allclose(fast.logits(hidden[0]), expected[0], atol=1e-4)
