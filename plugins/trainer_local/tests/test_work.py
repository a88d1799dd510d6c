"""A job's training work is counted from what the trainer computed: the same on any machine and under any load."""

import multiprocessing

import pytest

from aitrainsai_trainer_local.grpo import Example, GRPOConfig, GRPOTrainer, StepMetrics
from aitrainsai_trainer_local.model import BASE_MODEL, TINY_BASE
from aitrainsai_trainer_local.rollout import Conversation
from aitrainsai_trainer_local.work import RATES, PhaseRates, Rates, UnknownRates, _nonnegative_fit, fit, rates_for, \
    step_work


@pytest.mark.parametrize("base", [BASE_MODEL, TINY_BASE])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_base_the_trainer_offers_has_rates_in_every_dtype(base, dtype):
    rates = rates_for(base, f"torch.{dtype}")
    assert rates is RATES[(base, dtype)]
    assert all(rate >= 0 for phase in rates for rate in phase) and rates.generation.logit_row > 0


def test_a_base_without_rates_is_named():
    with pytest.raises(UnknownRates, match="no work rates for other-base in bfloat16: fit them with "):
        rates_for("other-base", "bfloat16")


def test_the_fit_recovers_the_rates_that_made_the_times():
    """Steps timed as the rates say (a count that costs nothing included) give those rates back, none below 0."""
    truth = PhaseRates(Rates(2e-5, 3e-4, 1e-7, 9e-7, 4e-3, 0.0, 2e-6), Rates(0.0, 6e-4, 2e-7, 0.0, 1e-2, 5e-3))
    steps = []
    for index, (positions, rows, attended, forwards) in enumerate(
            [(84, 16, 5_936, 8), (491, 384, 42_269, 49), (1_197, 1_024, 98_537, 33), (742, 128, 460_540, 32),
             (4_712, 16, 22_137_032, 8), (2_627, 256, 3_131_089, 65), (913, 256, 168_601, 17)]):
        step = StepMetrics(step=index, reward_mean=0, reward_std=0, loss=0, grad_norm=0, tokens_generated=0,
                           zero_spread_groups=0, trained_rollouts=0, seconds_generation=0, seconds_scoring=0,
                           seconds_forward_backward=0, seconds_total=0,
                           positions_generation=positions, logit_rows_generation=rows, attended_generation=attended,
                           forwards_generation=forwards, decode_attended_generation=attended // (index + 2),
                           decode_far_generation=attended // (index + 2) // (index % 3 + 2) * (index % 2),
                           positions_training=positions + index,
                           logit_rows_training=rows // 2, attended_training=attended + 7 * index,
                           forwards_training=index % 3 + 1)
        generation = PhaseRates(truth.generation, Rates(0, 0, 0, 0, 0, 0, 0))
        training = PhaseRates(Rates(0, 0, 0, 0, 0, 0, 0), truth.training)
        step.seconds_generation, step.seconds_forward_backward = step_work(step, generation), step_work(step, training)
        steps.append(step)
    fitted = fit(steps)
    for got, want in zip([*fitted.generation, *fitted.training], [*truth.generation, *truth.training]):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert _nonnegative_fit([(1.0, 1.0), (2.0, 1.0), (3.0, 1.0)], [1.0, 0.5, 0.0]) == (0.0, pytest.approx(0.5))


def _burn(stop) -> None:
    """Takes a core until ``stop`` is set."""
    while not stop.is_set():
        sum(range(10_000))


def _steps(policy) -> list[StepMetrics]:
    def reward(transcript) -> float:
        return float(len(str(transcript[-1].get("content", ""))) % 2)

    examples = [Example.fixed(Conversation([{"role": "user", "content": f"Count to {n}, slowly."}]), reward)
                for n in (3, 5)]
    config = GRPOConfig(steps=2, prompts_per_step=2, group_size=4, max_new_tokens=12, seed=3, dtype="float32")
    return GRPOTrainer(config, examples, policy=policy).train()


def test_a_neighbours_load_changes_no_steps_work(tiny_policy_fp32):
    """The same steps, run quiet and beside two processes that take both cores, count the same work to the unit."""
    from aitrainsai_trainer_local.lora import LoraModel, LoraSettings

    quiet = _steps(tiny_policy_fp32)
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=_burn, args=(stop,), daemon=True) for _ in range(2)]
    for burner in burners:
        burner.start()
    try:  # the fixture's policy afresh: the same seed
        loaded = _steps(LoraModel.load(lora=LoraSettings(rank=4, alpha=8), dtype="float32", seed=0))
    finally:
        stop.set()
        for burner in burners:
            burner.join()
    rates = rates_for(TINY_BASE, "float32")
    assert [step_work(s, rates) for s in loaded] == [step_work(s, rates) for s in quiet]
    assert all(step_work(s, rates) > 0 for s in quiet)
    assert [s.seconds_total for s in loaded] != [s.seconds_total for s in quiet]  # the load was there


def test_the_cache_a_group_copies_is_counted(tiny_policy_fp32):
    """Review eleven: a group's rows repeat their prompt's key/value cache, and room is made for each turn; no other
    count saw those copies (256 rows of a long prompt copied 2.65 GB a step). They are counted, in bytes, and priced
    at ``COPY_S_PER_GB``."""
    import dataclasses

    from aitrainsai_trainer_local.work import COPY_S_PER_GB

    step = _steps(tiny_policy_fp32)[0]
    fast = tiny_policy_fp32.fast
    per_slot = 2 * len(fast.blocks) * fast.kv_heads * fast.head_dim * 4  # keys and values, every layer, float32
    assert step.copied_generation >= 8 * per_slot and step.copied_training >= 8 * per_slot
    rates = rates_for(TINY_BASE, "float32")
    uncopied = dataclasses.replace(step, copied_generation=0, copied_training=0)
    assert step_work(step, rates) - step_work(uncopied, rates) == pytest.approx(
        (step.copied_generation + step.copied_training) / 2**30 * COPY_S_PER_GB)


def test_decode_pairs_past_a_long_caches_first_slots_are_counted_again(tiny_policy_fp32):
    """Review fourteen: decodes over a long cache (many turns of long tool results) cost more a pair than over a short
    one (bfloat16, 4,700 slots: twice). A decode step's pairs past a row's first ``FAR_SLOTS`` slots are counted
    apart and priced again; a short cache has none."""
    import dataclasses

    from aitrainsai_trainer_local.llama import FAR_SLOTS

    def step(words: int) -> StepMetrics:
        prompt = " ".join(f"word{k % 97}" for k in range(words))
        examples = [Example.fixed(Conversation([{"role": "user", "content": prompt}]), lambda transcript: 0.0)]
        config = GRPOConfig(steps=1, prompts_per_step=1, group_size=2, max_new_tokens=4, seed=0, dtype="float32")
        return GRPOTrainer(config, examples, policy=tiny_policy_fp32).train()[0]

    short, long = step(50), step(FAR_SLOTS // 2)  # about 3 tokens a word
    assert short.decode_attended_generation > 0 and short.decode_far_generation == 0
    assert 0 < long.decode_far_generation < long.decode_attended_generation
    rates = PhaseRates(Rates(0, 0, 0, 0, 0, 0, 1e-6), Rates(0, 0, 0, 0, 0, 0, 0))
    near = dataclasses.replace(long, decode_far_generation=0)
    assert step_work(long, rates) - step_work(near, rates) == pytest.approx(long.decode_far_generation * 1e-6)
