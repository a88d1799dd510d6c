"""The local engine under the core's hidden eval: the model is fed exactly what a rollout feeds it, turn by turn,
so that moving the eval loop into the core changes no score."""

from types import SimpleNamespace

import pytest

from aitrainsai.evaluation import evaluate_items
from aitrainsai_trainer_local import engine as engine_module
from aitrainsai_trainer_local.engine import LocalChatEngine
from aitrainsai_trainer_local.rollout import family_conversation, rollout

CALL = '<tool_call>\n{"name": "read_register", "arguments": {"name": "%s"}}\n</tool_call>'


def script(turn, row):
    if turn == 0:
        return "Reading." + CALL % "r0"
    if turn == 1 and row == 0:
        return CALL % "r1" + "\n" + CALL % "r2"  # two calls in one reply
    return "<answer>7</answer>"


def test_the_core_eval_feeds_the_model_exactly_what_rollout_does(demo_family, chat_only, scripted, monkeypatch):
    items = demo_family.generate(5, 1, 3)
    batch = 2
    by_rollout, transcripts = [], []
    for start in range(0, len(items), batch):
        sampler = scripted(chat_only.tokenizer, script)
        done = rollout(chat_only, [family_conversation(demo_family, item) for item in items[start:start + batch]],
                       max_new_tokens=64, temperature=0.0, sampler=sampler)
        by_rollout.append(sampler.calls)
        transcripts += [r.transcript for r in done]

    samplers = []

    def make_sampler(*args):
        samplers.append(scripted(chat_only.tokenizer, script))
        return samplers[-1]

    monkeypatch.setattr(engine_module, "Sampler", make_sampler)
    policy = SimpleNamespace(**vars(chat_only), dtype="float32", inference_model=lambda: None)
    engine = LocalChatEngine(policy, max_new_tokens=64, batch_size=batch)
    scores, core_transcripts = evaluate_items(demo_family, items, engine)
    assert [s.calls for s in samplers] == by_rollout  # the same tokens, the same cache rows, turn by turn
    assert core_transcripts == transcripts
    assert len(by_rollout[0]) == 3 and by_rollout[0][1]["rows"] == [0, 1]  # the multi-turn path was exercised
    assert scores == [float(demo_family.score(item, t)) for item, t in zip(items, transcripts)]


@pytest.mark.slow
def test_the_core_eval_scores_a_real_model_as_rollouts_do(demo_family, policy_fp32):
    from aitrainsai_trainer_local.sampling import Sampler

    items = demo_family.generate(5, 1, 3)
    expected = []
    for start in range(0, len(items), 2):
        sampler = Sampler(policy_fp32.inference_model(), policy_fp32.stop_ids, policy_fp32.pad_id)
        done = rollout(policy_fp32, [family_conversation(demo_family, i) for i in items[start:start + 2]],
                       max_new_tokens=12, temperature=0.0, sampler=sampler)
        expected += [r.transcript for r in done]
    engine = LocalChatEngine(policy_fp32, max_new_tokens=12, batch_size=2)
    _, transcripts = evaluate_items(demo_family, items, engine)
    assert transcripts == expected
    assert engine.spec.dtype == "float32" and engine.spec.base_model == "SmolLM2-135M-Instruct"
