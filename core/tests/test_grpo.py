import math

import pytest

from aitrainsai.is_grpo import build_datum, group_advantages, has_signal, importance_sampling_loss


def test_group_advantages_by_hand():
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5
    assert group_advantages([1, 0, 0, 1], eps=0) == [1.0, -1.0, -1.0, 1.0]
    assert group_advantages([0.2, 0.4], scale_by_std=False) == pytest.approx([-0.1, 0.1])
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    assert not has_signal([0.3, 0.3, 0.3]) and has_signal([0.3, 0.31])


def test_datum_masks_the_prompt():
    datum = build_datum([11, 12, 13], [21, 22], [-0.5, -1.5], advantage=2.0)
    assert datum.model_input == [11, 12, 13, 21]
    assert datum.target_tokens == [12, 13, 21, 22]
    assert datum.logprobs == [0.0, 0.0, -0.5, -1.5]
    assert datum.advantages == [0.0, 0.0, 2.0, 2.0]
    with pytest.raises(ValueError):
        build_datum([1], [2, 3], [-0.1], 1.0)


def test_loss_on_policy_is_minus_the_summed_advantage():
    datum = build_datum([1, 2], [3, 4], [-0.7, -0.2], advantage=0.5)
    # trainer == sampler on completion tokens: ratio 1; prompt positions contribute nothing whatever their log-prob
    loss = importance_sampling_loss([datum], [[-9.0, -0.7, -0.2]])
    assert loss == pytest.approx(-(0.5 + 0.5))


def test_loss_with_off_policy_ratios_by_hand():
    datum = build_datum([5], [6, 7], [-1.0, -2.0], advantage=-1.5)
    trainer = [-0.5, -2.5]  # ratios e^0.5 and e^-0.5
    expected = -(math.exp(0.5) * -1.5 + math.exp(-0.5) * -1.5)
    assert importance_sampling_loss([datum], [trainer]) == pytest.approx(expected)
    other = build_datum([1, 2, 3], [4], [-0.1], advantage=1.0)
    both = importance_sampling_loss([datum, other], [trainer, [0.0, 0.0, -0.3]])
    assert both == pytest.approx(expected - math.exp(-0.2))  # a sum over datums, not a mean


def _turn(prompt, completion, logprobs=None):
    from aitrainsai.trainers import AgentTurn

    return AgentTurn(message={"role": "assistant", "content": ""}, prompt_tokens=prompt, completion_tokens=completion,
                     logprobs=logprobs if logprobs is not None else [-0.5] * len(completion))


def test_an_episode_that_extends_as_a_prefix_is_one_sequence_with_the_environment_masked():
    from aitrainsai.is_grpo import episode_datums

    turns = [_turn([1, 2], [3, 4], [-0.1, -0.2]),
             _turn([1, 2, 3, 4, 9, 9], [5], [-0.3]),  # the tool result (9, 9) came between the replies
             _turn([1, 2, 3, 4, 9, 9, 5, 8], [6, 7], [-0.4, -0.5])]
    (datum,) = episode_datums(turns, 2.0)
    assert datum.model_input == [1, 2, 3, 4, 9, 9, 5, 8, 6]
    assert datum.target_tokens == [2, 3, 4, 9, 9, 5, 8, 6, 7]
    assert datum.advantages == [0, 2, 2, 0, 0, 2, 0, 2, 2]
    assert datum.logprobs == [0, -0.1, -0.2, 0, 0, -0.3, 0, -0.4, -0.5]


def test_a_prompt_that_does_not_extend_starts_the_fewest_new_sequences():
    from aitrainsai.is_grpo import episode_datums

    turns = [_turn([1, 2], [3]),
             _turn([1, 2, 3, 4], [5]),  # extends
             _turn([1, 7, 3, 4, 5], [6]),  # re-rendered differently: a new sequence
             _turn([1, 7, 3, 4, 5, 6, 0], [8]),  # extends the new one
             _turn([], []),  # no tokens (an over-long conversation): skipped
             ]
    first, second = episode_datums(turns, 1.0)
    assert first.model_input + first.target_tokens[-1:] == [1, 2, 3, 4, 5]
    assert second.model_input + second.target_tokens[-1:] == [1, 7, 3, 4, 5, 6, 0, 8]
    assert second.advantages == [0, 0, 0, 0, 1, 0, 1]
    with pytest.raises(ValueError, match="log-probs"):
        episode_datums([_turn([1], [2, 3], [-1.0])], 1.0)
