"""The local server's losses: every loss it accepts, value and gradient against a direct computation written here
(numpy, analytic gradients) on the same tensors; the stability info behind ``stable_reinforce`` (records, provenance
checks, expiry, the memory bound); and ``stable_reinforce`` end to end through the real SDK."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tinker = pytest.importorskip("tinker")

from aitrainsai_tinker_local_server.engine import LOSSES, _loss, check_loss  # noqa: E402
from aitrainsai_tinker_local_server.stability import StabilityStore  # noqa: E402
from aitrainsai_tinker_local_server.wire import (  # noqa: E402
    BadRequest,
    Datum,
    FwdBwdRequest,
    Span,
    parse_forward_backward,
)

# --- fixed tensors: six target positions ---

LOGP = np.array([-0.3, -1.2, -2.0, -0.05, -3.0, -0.7])  # the trainer's log-probs (what autograd differentiates)
SAMPLER = np.array([-0.5, -0.9, -2.9, -0.05, -1.5, -0.72])  # the client's sampler log-probs ("logprobs")
ADV = np.array([1.0, -0.5, 2.0, 0.0, -1.5, 0.7])
WEIGHTS = np.array([0.0, 1.0, 1.0, 0.5, 1.0, 2.0])
RATIO_MASK = np.array([0.0, 1.0, 1.0, 1.0, 1.0, 0.0])  # gspo's sequence_ratio_mask
# stable_reinforce: the RECORDED sampler log-probs (0 where no SampledProvenanceSpan covers) and that coverage
RECORDED = np.array([0.0, 0.0, -2.9, -0.05, -1.5, -0.72])
SAMPLED = np.array([False, False, True, True, True, True])
SR_ADV = np.where(SAMPLED, ADV, 0.0)


def clip(x, low, high):
    return np.minimum(np.maximum(x, low), high)


def direct(name: str, config: dict) -> tuple[np.ndarray, np.ndarray]:
    """(per-token loss, d loss / d trainer log-prob), from the documented formulas, in float64."""
    lp, q, adv = LOGP, SAMPLER, ADV
    r = np.exp(lp - q)
    if name == "cross_entropy":
        return -lp * WEIGHTS, -WEIGHTS
    if name == "importance_sampling":
        return -r * adv, -r * adv
    if name in ("ppo", "gspo"):
        low, high = config["clip_low_threshold"], config["clip_high_threshold"]
        if name == "gspo":  # one sequence ratio for every token; each token's gradient through its own log-prob
            marked = RATIO_MASK != 0
            r = np.full_like(lp, np.exp(np.mean((lp - q)[marked])))
        unclipped, clipped = r * adv, clip(r, low, high) * adv
        # the unclipped term is the min, or both are equal inside the range: d(r A)/d logp = r A; else a constant
        active = (unclipped < clipped) | ((r > low) & (r < high))
        return -np.minimum(unclipped, clipped), np.where(active, -r * adv, 0.0)
    if name == "cispo":
        w = clip(r, config["clip_low_threshold"], config["clip_high_threshold"])
        return -w * lp * adv, -w * adv
    if name == "dro":
        beta = config["beta"]
        return -(lp * adv - 0.5 * beta * (lp - q) ** 2), -adv + beta * (lp - q)
    assert name == "stable_reinforce"
    cap, kl = config["ratio_cap"], config["kl_coeff"]
    log_r = lp - RECORDED
    r = np.exp(log_r)
    m = SAMPLED.astype(float)
    loss = m * (-np.minimum(r, cap) * SR_ADV * lp + kl * ((r - 1) - log_r))
    return loss, m * (-np.minimum(r, cap) * SR_ADV + kl * (r - 1))


def inputs_for(name: str) -> dict[str, np.ndarray]:
    f32 = np.float32
    if name == "cross_entropy":
        return {"target_tokens": np.arange(6), "weights": WEIGHTS.astype(f32)}
    if name == "stable_reinforce":
        # the client's "logprobs" (here deliberately wrong) are ignored: the recorded ones are used
        return {"target_tokens": np.arange(6), "advantages": SR_ADV.astype(f32), "logprobs": np.zeros(6, f32),
                "recorded_logprobs": RECORDED.astype(f32), "sampled_mask": SAMPLED}
    found = {"target_tokens": np.arange(6), "logprobs": SAMPLER.astype(f32), "advantages": ADV.astype(f32)}
    if name == "gspo":
        found["sequence_ratio_mask"] = RATIO_MASK.astype(f32)
    return found


CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.5}),
    ("cispo", {}),
    ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    ("dro", {"beta": 0.05}),
    ("dro", {"beta": 0.7}),
    ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),  # s = e^-0.375 is clipped
    ("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}),  # s inside the range
    ("stable_reinforce", {}),
    ("stable_reinforce", {"ratio_cap": 1.5, "kl_coeff": 0.1}),
]


def test_every_accepted_loss_has_a_case():
    assert {name for name, _ in CASES} == set(LOSSES)


@pytest.mark.parametrize(("name", "given"), CASES, ids=[f"{n}-{'-'.join(map(str, c.values())) or 'defaults'}"
                                                         for n, c in CASES])
def test_loss_value_and_gradient_match_the_direct_computation(name, given):
    config = {**LOSSES[name][1], **given}
    logprobs = torch.tensor(LOGP, dtype=torch.float32, requires_grad=True)
    per_token = _loss(name, logprobs, inputs_for(name), config)
    per_token.sum().backward()
    want_loss, want_grad = direct(name, config)
    assert per_token.shape == (6,)
    np.testing.assert_allclose(per_token.detach().numpy(), want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logprobs.grad.numpy(), want_grad, rtol=1e-5, atol=1e-6)


def test_the_cases_exercise_clipping_and_capping():
    # guards the fixed tensors: the clipped branches and the cap really are taken somewhere
    _, ppo_grad = direct("ppo", LOSSES["ppo"][1])
    assert (ppo_grad == 0).sum() >= 2 and (ppo_grad != 0).sum() >= 1
    r = np.exp(LOGP - RECORDED)[SAMPLED]
    assert (r > 2.0).any() and (r < 1.5).any()
    _, gspo_grad = direct("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    assert (gspo_grad == 0).any() and (gspo_grad != 0).any()


# --- what check_loss refuses ---

def request(loss_fn: str, data: list[Datum], config: dict | None = None, model_id: str = "s1:train:0") -> FwdBwdRequest:
    return FwdBwdRequest(model_id, 1, loss_fn, dict(config or {}), False, data)


def plain(name: str, **drop) -> Datum:
    inputs = {k: v for k, v in inputs_for(name).items() if k not in ("recorded_logprobs", "sampled_mask")}
    return Datum(list(range(6)), {k: v for k, v in inputs.items() if k not in drop})


@pytest.mark.parametrize(("loss_fn", "data", "config", "message"), [
    ("not_a_loss", [plain("ppo")], {}, "not supported by the local server; it has cispo, cross_entropy, dro, gspo"),
    ("dro", [plain("dro")], {}, r"'dro' needs loss_fn_config \['beta'\]"),
    ("gspo", [plain("gspo")], {"clip_low_threshold": 0.8}, r"needs loss_fn_config \['clip_high_threshold'\]"),
    ("ppo", [plain("ppo")], {"kl_coeff": 0.1}, r"\['kl_coeff'\] are not taken by 'ppo'"),
    ("stable_reinforce", [plain("stable_reinforce")], {"kl_coeff": "high"}, "must be a finite number"),
    ("stable_reinforce", [plain("stable_reinforce")], {"ratio_cap": 0.0}, "ratio_cap > 0"),
    ("stable_reinforce", [plain("stable_reinforce", advantages=1)], {}, r"missing \['advantages'\]"),
])
def test_check_loss_refuses_in_one_line(loss_fn, data, config, message):
    with pytest.raises(BadRequest, match=message):
        check_loss(request(loss_fn, data, config), 8192)


def test_gspo_refuses_a_datum_whose_ratio_mask_is_empty():
    datum = plain("gspo")
    datum.inputs["sequence_ratio_mask"] = np.zeros(6, np.float32)
    with pytest.raises(BadRequest, match="sequence_ratio_mask marks no token"):
        check_loss(request("gspo", [datum], {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}), 8192)


def test_stable_reinforce_takes_logprobs_or_not():
    check_loss(request("stable_reinforce", [plain("stable_reinforce")]), 8192)
    check_loss(request("stable_reinforce", [plain("stable_reinforce", logprobs=1)]), 8192)


# --- stability info and provenance ---

def prompt_span(seq: str, length: int, offset: int = 0) -> Span:
    return Span("prompt", seq, offset, length)


def sampled_span(seq: str, length: int, offset: int = 0) -> Span:
    return Span("sampled", seq, offset, length)


def cookbook_datum(prompt: list[int], seq: str, sampled: list[int], advantage: float) -> Datum:
    """As the cookbook builds it: prompt + sampled tokens shifted by one, with provenance."""
    full = prompt + sampled
    n_p, n_s = len(prompt), len(sampled)
    inputs = {"target_tokens": np.asarray(full[1:], np.int64),
              "advantages": np.asarray([0.0] * (n_p - 1) + [advantage] * n_s, np.float32)}
    return Datum(full[:-1], inputs, [prompt_span(seq, n_p), sampled_span(seq, n_s - 1)],
                 [prompt_span(seq, n_p - 1, offset=1), sampled_span(seq, n_s)])


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store(clock):
    store = StabilityStore(clock=clock)
    store.record(["a:0", "a:1"], "s1", [1, 2, 3], [([7, 8], [-0.5, -1.25], True), ([7, 9], [-0.5, -2.0], False)])
    return store


def test_a_cookbook_datum_gets_the_recorded_logprobs(store):
    datum = cookbook_datum([1, 2, 3], "a:1", [7, 9], 1.0)
    datum.inputs["logprobs"] = np.full(4, -9.0, np.float32)  # the client's own: not used
    store.attach(request("stable_reinforce", [datum]), "s1")
    np.testing.assert_array_equal(datum.recorded_logprobs, [0.0, 0.0, -0.5, -2.0])
    np.testing.assert_array_equal(datum.sampled_mask, [False, False, True, True])
    assert set(datum.loss_inputs()) == {"target_tokens", "advantages", "logprobs", "recorded_logprobs",
                                        "sampled_mask"}


def test_a_multi_turn_datum_chains_its_turns(store):
    # turn 2 was sampled from turn 1's prompt + completion + two environment tokens
    store.record(["b:0"], "s1", [1, 2, 3, 7, 8, 4, 5], [([9, 2], [-0.25, -0.125], True)])
    full = [1, 2, 3, 7, 8, 4, 5, 9, 2]
    spans = [prompt_span("a:0", 3), sampled_span("a:0", 2), prompt_span("b:0", 2, offset=5), sampled_span("b:0", 2)]
    model_input = spans[:-1] + [sampled_span("b:0", 1)]  # the last token is not input
    loss = [prompt_span("a:0", 2, offset=1)] + spans[1:]  # the first token is not a target
    advantages = np.array([0, 0, 1, 1, 0, 0, 1, 1], np.float32)
    datum = Datum(full[:-1], {"target_tokens": np.asarray(full[1:]), "advantages": advantages}, model_input, loss)
    store.attach(request("stable_reinforce", [datum]), "s1")
    np.testing.assert_array_equal(datum.recorded_logprobs, [0, 0, -0.5, -1.25, 0, 0, -0.25, -0.125])
    np.testing.assert_array_equal(datum.sampled_mask, advantages != 0)


def edit(datum: Datum, **changes) -> Datum:
    for key, value in changes.items():
        setattr(datum, key, value)
    return datum


def refusals():
    good = lambda: cookbook_datum([1, 2, 3], "a:0", [7, 8], 1.0)  # noqa: E731
    no_provenance = edit(good(), model_input_spans=None, loss_fn_input_spans=None)
    short = edit(good(), loss_fn_input_spans=[prompt_span("a:0", 2, offset=1), sampled_span("a:0", 1)])
    unknown = cookbook_datum([1, 2, 3], "zz:0", [7, 8], 1.0)
    wrong_sample = cookbook_datum([1, 2, 3], "a:0", [7, 5], 1.0)
    wrong_prompt = cookbook_datum([1, 4, 3], "a:0", [7, 8], 1.0)
    overrun = edit(good(), loss_fn_input_spans=[prompt_span("a:0", 2, offset=2), sampled_span("a:0", 2)])
    prompt_advantage = good()
    prompt_advantage.inputs["advantages"][0] = 0.5
    # a:0's sampled tokens after b's prompt: every token matches a record, but not the context a:0 was sampled in
    mixed = edit(good(), model_input_spans=[prompt_span("c:0", 3), sampled_span("a:0", 1)],
                 loss_fn_input_spans=[prompt_span("c:0", 2, offset=1), sampled_span("a:0", 2)])
    mixed.tokens[1] = mixed.inputs["target_tokens"][0] = 5
    return [
        ("no provenance", no_provenance, "needs provenance: sample with record_stability_info=True"),
        ("spans do not tile", short, "loss_fn_inputs provenance spans cover 3 positions of 4"),
        ("unknown sequence", unknown, "no stability info for sequence 'zz:0'"),
        ("sampled token differs", wrong_sample,
         "loss_fn_inputs position 3 is token 5, but sequence 'a:0' recorded token 8 at sampled position 1"),
        ("prompt token differs", wrong_prompt, "model_input position 1 is token 4, but sequence 'a:0' recorded "
                                               "token 2 at prompt position 1"),
        ("span past the record", overrun, "claims prompt tokens 2..3 of sequence 'a:0', which has 3"),
        ("advantage on a prompt token", prompt_advantage, "advantage 0.5 at target position 0, which no "
                                                          "SampledProvenanceSpan covers"),
        ("another context", mixed, "is not the prompt of sequence 'a:0' followed by its sampled tokens"),
    ]


@pytest.mark.parametrize(("datum", "message"), [(d, m) for _, d, m in refusals()], ids=[i for i, _, _ in refusals()])
def test_stable_reinforce_refuses_what_its_records_do_not_back(store, datum, message):
    store.record(["c:0"], "s1", [1, 5, 3], [([6], [-1.0], True)])
    good = cookbook_datum([1, 2, 3], "a:0", [7, 8], 1.0)
    with pytest.raises(BadRequest, match=message.replace("(", r"\(").replace(".", r"\.")):
        store.attach(request("stable_reinforce", [good, datum]), "s1")
    assert good.recorded_logprobs is None  # a refused request changes no datum


def test_records_belong_to_the_session_that_sampled_them(store):
    with pytest.raises(BadRequest, match="'a:0' was sampled in another session"):
        store.attach(request("stable_reinforce", [cookbook_datum([1, 2, 3], "a:0", [7, 8], 1.0)]), "s2")


def test_records_live_a_day_from_their_last_use(store, clock):
    data = lambda seq: [cookbook_datum([1, 2, 3], seq, [7, 8] if seq == "a:0" else [7, 9], 1.0)]  # noqa: E731
    clock.now += 0.9 * 86400
    store.attach(request("stable_reinforce", data("a:0")), "s1")  # restarts a:0's day, not a:1's
    clock.now += 0.2 * 86400
    store.attach(request("stable_reinforce", data("a:0")), "s1")
    with pytest.raises(BadRequest, match="no stability info for sequence 'a:1'.*expired"):
        store.attach(request("stable_reinforce", data("a:1")), "s1")
    assert "a:1" not in store
    clock.now += 1.01 * 86400
    with pytest.raises(BadRequest, match="no stability info for sequence 'a:0'"):
        store.attach(request("stable_reinforce", data("a:0")), "s1")


def test_memory_is_bounded_least_recently_used_first(clock):
    store = StabilityStore(clock=clock, max_sequences=2, max_tokens=12)
    store.record(["x:0"], "s", [1, 2], [([3], [-1.0], True)])
    store.record(["y:0"], "s", [1, 2], [([4], [-1.0], True)])
    clock.now += 1
    store.attach(request("stable_reinforce", [cookbook_datum([1, 2], "x:0", [3], 1.0)]), "s")  # x:0 used last
    store.record(["z:0"], "s", [1, 2], [([5], [-1.0], True)])
    assert ("x:0" in store, "y:0" in store, "z:0" in store) == (True, False, True)
    store.record(["w:0"], "s", [1, 2, 3, 4, 5, 6, 7, 8, 9], [([5], [-1.0], True)])  # 10 tokens: over 12 with any other
    assert len(store) == 1 and "w:0" in store


def test_spans_come_through_the_sdks_proto():
    datum = tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2, 3, 7]),
                         loss_fn_inputs={"target_tokens": [2, 3, 7, 8], "advantages": [0.0, 0.0, 1.0, 1.0]})
    datum = datum.with_provenance(
        model_input=[tinker.PromptProvenanceSpan(sequence_id="a:0", length=3),
                     tinker.SampledProvenanceSpan(sequence_id="a:0", length=1)],
        loss_fn_inputs=[tinker.PromptProvenanceSpan(sequence_id="a:0", offset=1, length=2),
                        tinker.SampledProvenanceSpan(sequence_id="a:0", length=2)])
    from tinker.proto.request_conv import forward_backward_request_to_proto

    sent = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(data=[datum], loss_fn="stable_reinforce",
                                                                 loss_fn_config={"kl_coeff": 0.1}),
        model_id="s1:train:0", seq_id=1)
    parsed = parse_forward_backward(forward_backward_request_to_proto(sent).SerializeToString())
    (got,) = parsed.data
    assert parsed.config == {"kl_coeff": pytest.approx(0.1)}
    assert got.model_input_spans == [prompt_span("a:0", 3), sampled_span("a:0", 1)]
    assert got.loss_fn_input_spans == [prompt_span("a:0", 2, offset=1), sampled_span("a:0", 2)]


# --- end to end: the real SDK against the session's local server ---

MODEL = "SmolLM2-135M-Instruct"
PROMPT = [1, 4093, 198, 5820, 253, 7302, 30, 2, 198, 1, 520, 9531, 198]  # a short chat prompt (see test_server.py)


def sdk_datum(prompt: list[int], sequence, advantage: float, client_logprobs: float = 0.0) -> tinker.Datum:
    full = prompt + list(sequence.tokens)
    n_p, n_s = len(prompt), len(sequence.tokens)
    seq = sequence.sequence_id
    datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
        "target_tokens": full[1:], "logprobs": [client_logprobs] * (n_p + n_s - 1),
        "advantages": [0.0] * (n_p - 1) + [advantage] * n_s})
    return datum.with_provenance(
        model_input=[tinker.PromptProvenanceSpan(sequence_id=seq, length=n_p),
                     tinker.SampledProvenanceSpan(sequence_id=seq, length=n_s - 1)],
        loss_fn_inputs=[tinker.PromptProvenanceSpan(sequence_id=seq, offset=1, length=n_p - 1),
                        tinker.SampledProvenanceSpan(sequence_id=seq, length=n_s)])


def test_stable_reinforce_through_the_sdk(tinker_server, service_client):
    other = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)  # a second session

    async def main():
        training = await service_client.create_lora_training_client(MODEL, rank=8, seed=4, train_unembed=False)
        recording = await training.save_weights_and_get_sampling_client(record_stability_info=True)
        params = tinker.SamplingParams(max_tokens=3, temperature=0.7, seed=11)  # q at T=0.7: the ratio is not 1
        sequences = (await recording.sample(tinker.ModelInput.from_ints(PROMPT), 2, params)).sequences
        assert len({s.sequence_id for s in sequences}) == 2
        config = {"ratio_cap": 1.2, "kl_coeff": 0.3}
        # the client's logprobs are nonsense on purpose: the server uses the ones it recorded
        data = [sdk_datum(PROMPT, s, a, client_logprobs=-5.0) for s, a in zip(sequences, (1.0, -1.0))]
        result = await training.forward_backward(data, "stable_reinforce", config)
        total = 0.0
        for sequence, advantage, out in zip(sequences, (1.0, -1.0), result.loss_fn_outputs):
            n = len(sequence.tokens)
            lp = out["logprobs"].to_numpy().astype(np.float64)[-n:]
            log_r = lp - np.asarray(sequence.logprobs, np.float64)
            r = np.exp(log_r)
            per_token = -np.minimum(r, 1.2) * advantage * lp + 0.3 * ((r - 1) - log_r)
            elementwise = out["elementwise_loss"].to_numpy()
            np.testing.assert_allclose(elementwise[-n:], per_token, rtol=1e-4, atol=1e-5)
            assert not elementwise[:-n].any()  # prompt targets carry nothing
            total += per_token.sum()
        assert result.metrics["loss:sum"] == pytest.approx(total, rel=1e-4, abs=1e-5)

        plain = await training.save_weights_and_get_sampling_client()  # no record_stability_info
        unrecorded = (await plain.sample(tinker.ModelInput.from_ints(PROMPT), 1, params)).sequences[0]
        assert unrecorded.sequence_id  # ids come back, but nothing is kept for them
        with pytest.raises(tinker.BadRequestError, match="no stability info for sequence"):
            await training.forward_backward([sdk_datum(PROMPT, unrecorded, 1.0)], "stable_reinforce")
        with pytest.raises(tinker.BadRequestError, match="needs provenance"):
            bare = tinker.Datum(model_input=data[0].model_input, loss_fn_inputs=data[0].loss_fn_inputs)
            await training.forward_backward([bare], "stable_reinforce")
        theirs = await other.create_sampling_client(base_model=MODEL, record_stability_info=True)
        foreign = (await theirs.sample(tinker.ModelInput.from_ints(PROMPT), 1,
                                       tinker.SamplingParams(max_tokens=2, seed=1))).sequences[0]
        with pytest.raises(tinker.BadRequestError, match="was sampled in another session"):
            await training.forward_backward([sdk_datum(PROMPT, foreign, 1.0)], "stable_reinforce")

    try:
        asyncio.run(asyncio.wait_for(main(), 300))
    finally:
        other.close("success").result(timeout=30)
