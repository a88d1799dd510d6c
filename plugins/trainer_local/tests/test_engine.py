"""The local engine under the core's hidden eval: the model is fed exactly what a rollout feeds it, turn by turn,
so that moving the eval loop into the core changes no score."""

from types import SimpleNamespace

import pytest

from aitrainsai import evaluate_items
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


def test_baseline_and_post_scores_come_from_the_core_eval_with_the_same_settings(tmp_path, monkeypatch, tiny_base,
                                                                                 calc_chain):
    """The untrained base (a baseline) and the trained checkpoint (post) are scored by the same evaluation payload,
    through the core's evaluate_family and the same engine settings; the core compares them only then. On the tiny
    base: the payloads' mechanics, not the model's scores."""
    import aitrainsai
    from aitrainsai import Baseline, Constraints, EngineMismatch, JobResult, compare, job_template
    from aitrainsai_trainer_local import job as driver
    from aitrainsai_trainer_local.inner import LocalTrainer
    from aitrainsai_trainer_local.lora import LoraSettings, LoraModel

    specs = []
    original = aitrainsai.evaluate_family

    def spy(family, level, engine, **kwargs):
        specs.append(engine.spec)
        return original(family, level, engine, **kwargs)

    monkeypatch.setattr(aitrainsai, "evaluate_family", spy)

    def train(job_dir, config, spec):  # stands in for GRPO: an adapter that changes nothing yet
        LoraModel.load(lora=LoraSettings(rank=4, alpha=8), dtype="float32", seed=0).save_adapter(driver.ADAPTER_DIR)
        return {"steps": []}

    monkeypatch.setattr(driver, "_train", train)
    monkeypatch.chdir(tmp_path)
    trainer = LocalTrainer(LocalTrainer.Config(eval_size=2, eval_max_new_tokens=4, eval_batch_size=2, dtype="float32"))
    spec = calc_chain.task_spec(1, trainer.constraints(Constraints()))

    def run(payload) -> JobResult:
        for name, value in payload.env.items():  # as a worker would see them
            monkeypatch.setenv(name, value)
        assert driver.main(str(payload.workdir / "job.json")) == 0
        return JobResult(job_id=payload.job_id, status="done",
                         artifacts={name: payload.workdir / path for name, path in payload.artifacts.items()})

    pre = trainer.eval_result(run(trainer.eval_payload(calc_chain, 1, tiny_base, None, tmp_path / "baseline", "b")))
    baseline = Baseline(family="calc_chain", level=1, base_model=tiny_base, eval_seed=pre.eval_seed,
                        eval_size=pre.eval_size, score=pre.score, item_scores=pre.item_scores, engine=pre.engine)
    job = tmp_path / "episode" / "probe-1" / "job"
    job.mkdir(parents=True)
    for name, text in job_template(spec, trainer.config_template(spec)).items():
        (job / name).write_text(text)
    trained = trainer.result(run(trainer.payload(job, spec, "e-job", calc_chain)))
    post = trainer.eval_result(run(trainer.eval_payload(calc_chain, 1, tiny_base, trained.checkpoint,
                                                        tmp_path / "eval", "e-job-eval")))

    assert len(specs) == 2 and specs[0] == specs[1] == pre.engine == post.engine
    assert pre.engine.dtype == "float32" and pre.engine.max_new_tokens == 4 and len(post.item_scores) == 2
    result = compare(baseline, post, trained)
    assert result.pre == pre.score and result.post == post.score and result.uplift == post.score - pre.score
    other = baseline.model_copy(update={"engine": pre.engine.model_copy(update={"max_new_tokens": 8})})
    with pytest.raises(EngineMismatch):  # never compared across settings
        compare(other, post, trained)
