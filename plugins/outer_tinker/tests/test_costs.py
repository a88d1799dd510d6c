"""Cost: the shipped rate table and its overrides, cached prefill, per-episode accounts, and the reconciliation of
the trainer's estimate with the service's billing (the local server's billing endpoint, through the real SDK)."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from aitrainsai_outer_tinker import costs
from aitrainsai_outer_tinker.costs import (
    RATE_CARD,
    BillingCheck,
    CostMeter,
    Prices,
    Tokens,
    check_billing,
    price_problem,
    prices_for,
    reconcile,
    session_metadata,
)

MODEL = "SmolLM2-135M-Instruct"
PROMPT = [1, 4093, 198, 5820, 253, 7302, 30, 2, 198, 1, 520, 9531, 198]  # a user turn and the assistant header


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# -- the rate table -------------------------------------------------------------------------------------------------
def test_the_rate_table_is_dated_and_prices_qwen36_from_it():
    assert RATE_CARD.effective == dt.date(2026, 7, 17) and "tinker-docs.thinkingmachines.ai" in RATE_CARD.source
    assert prices_for("Qwen/Qwen3.6-35B-A3B") == Prices(prefill=0.54, prefill_cached=0.108, sampled=1.335,
                                                        trained=1.177)
    assert prices_for("qwen/qwen3.6-35b-a3b") == prices_for("Qwen/Qwen3.6-35B-A3B")  # names are case-blind
    for prices in RATE_CARD.models.values():  # every row has all four rates: cached prefill is 80% off prefill
        assert prices.prefill_cached == pytest.approx(prices.prefill * 0.2)
    assert prices_for(MODEL) == Prices(prefill=0, prefill_cached=0, sampled=0, trained=0)  # the local server's
    assert prices_for("HuggingFaceTB/SmolLM2-135M-Instruct").trained == 0


def test_an_override_wins_and_an_unknown_model_is_one_line():
    mine = Prices(prefill=1.0, prefill_cached=0.5, sampled=2.0, trained=3.0)
    assert prices_for("Qwen/Qwen3.6-35B-A3B", mine) is mine and prices_for("acme/unknown-7b", mine) is mine
    assert price_problem("Qwen/Qwen3.6-35B-A3B") is None and price_problem("acme/unknown-7b", mine) is None
    problem = price_problem("acme/unknown-7b")
    assert "\n" not in problem and "'acme/unknown-7b'" in problem and "outer_trainer.tinker.prices" in problem
    assert "2026-07-17" in problem
    with pytest.raises(ValueError, match="no published Tinker rates"):
        prices_for("acme/unknown-7b")
    retired = price_problem("Qwen/Qwen3-30B-A3B-Instruct-2507")
    assert "retired 2026-06-12" in retired and "Qwen/Qwen3.6-35B-A3B" in retired


# -- tokens and the meter ---------------------------------------------------------------------------------------------
def test_cache_hits_are_priced_at_the_cached_rate():
    prices = Prices(prefill=1.0, prefill_cached=0.25, sampled=2.0, trained=4.0)
    one = Tokens.sampling(1_000_000, 500_000, cache_hits=600_000)
    assert (one.prefill, one.prefill_cached, one.sampled) == (1_000_000, 600_000, 500_000)
    assert one.usd(prices) == pytest.approx(0.4 + 0.15 + 1.0)
    three = Tokens.sampling(100, 30, cache_hits=40, num_samples=3)  # the repeats of a shared prompt are hits
    assert (three.prefill, three.prefill_cached) == (300, 240)
    assert Tokens.sampling(10, 1, cache_hits=99).prefill_cached == 10
    no_rate = Prices(prefill=1.0, sampled=0, trained=0)  # no cached rate: hits cost full prefill (an upper bound)
    assert one.usd(no_rate) == pytest.approx(1.0)
    assert (one + three).prefill_cached == 600_240


def test_the_meter_keeps_an_account_per_episode(monkeypatch):
    prices = Prices(prefill=1.0, prefill_cached=0.5, sampled=2.0, trained=4.0)
    meter = CostMeter()
    assert meter.add(Tokens.sampling(500_000, 250_000, cache_hits=200_000), prices, episode="a") == pytest.approx(0.9)
    meter.add(Tokens.sampling(100_000, 0), prices, episode="b")
    meter.add(Tokens(trained=250_000), prices, episode="a")
    meter.add(Tokens(trained=1), prices)  # no episode: the run's and the step's only
    a = meter.episode("a")
    assert (a.tokens.prefill, a.tokens.prefill_cached, a.tokens.trained) == (500_000, 200_000, 250_000)
    assert a.usd == pytest.approx(1.9) and meter.episode("b").usd == pytest.approx(0.1)
    assert meter.episode("never").usd == 0.0
    step = meter.close_step()
    assert step == {"cost_usd": pytest.approx(2.000004), "cost_usd_total": pytest.approx(2.000004),
                    "tokens_prefill": 600_000.0, "tokens_prefill_cached": 200_000.0, "tokens_sampled": 250_000.0,
                    "tokens_trained": 250_001.0}
    assert CostMeter.model_validate_json(meter.model_dump_json()) == meter  # saved with the policy
    assert meter.pop_episode("a").usd == pytest.approx(1.9) and meter.episode("a").usd == 0.0
    meter.charge("b", Tokens(trained=250_000), prices)  # counted before, now put on the episode's account only
    assert meter.episode("b").usd == pytest.approx(1.1) and meter.usd_total == pytest.approx(2.000004)
    monkeypatch.setattr(costs, "MAX_EPISODES", 3)
    for name in "cdef":
        meter.add(Tokens(sampled=1), prices, episode=name)
    assert list(meter.episodes) == ["d", "e", "f"]  # bounded: the oldest accounts go first


# -- reconciliation (no service) ----------------------------------------------------------------------------------
def usage(*events: tuple, sessions: dict | None = None):
    from tinker import types

    hour = dt.datetime(2026, 11, 30, 20, tzinfo=dt.UTC)
    infos = {"prefill": {"type": "sampling_prefill", "cached": False}, "cached": {"type": "sampling_prefill",
             "cached": True}, "sample": {"type": "sampling_sample"}, "train": {"type": "training"}}
    data = [{"bucket_start": hour, "bucket_end": hour + dt.timedelta(hours=1), "session_id": sid,
             "estimated_cost_usd": cost, "event_info": {**infos[kind], "token_count": count}}
            for sid, kind, count, cost in events]
    return types.BillingUsageResponse.model_validate({"data": data, "sessions": sessions or {}})


def test_reconcile_sums_the_run_sessions_by_kind():
    response = usage(("s1", "prefill", 900, 0.9), ("s1", "cached", 100, 0.05), ("s1", "sample", 50, 0.5),
                     ("s2", "train", 1000, 2.0), ("other", "train", 10**6, 99.0),
                     sessions={"s1": {"user_metadata": session_metadata("run-7")}, "s2": {"user_metadata": None},
                               "other": {"user_metadata": session_metadata("run-8")}})
    estimate = Tokens(prefill=1000, prefill_cached=100, sampled=50, trained=1000)
    check = reconcile(response, estimate=estimate, estimate_usd=3.5, session_ids=["s2"], run_id="run-7")
    assert check.checked and check.sessions == ["s1", "s2"] and not check.partial and check.note is None
    assert check.billed_usd == {"prefill": 0.9, "prefill_cached": 0.05, "sampled": 0.5, "trained": 2.0}
    assert check.billed_usd_total == pytest.approx(3.45) and check.difference_usd == pytest.approx(-0.05)
    assert check.billed_tokens == estimate and set(check.tokens_difference.values()) == {0}
    assert "billed $3.4500 for 2 session(s)" in check.line()


def test_reconcile_says_when_usage_lags_or_is_unpriced():
    response = usage(("s1", "sample", 40, None), sessions={"s1": {"user_metadata": None}})
    check = reconcile(response, estimate=Tokens(sampled=50), estimate_usd=1.0, session_ids=["s1"])
    assert check.partial and check.unpriced_events == 1 and check.tokens_difference["sampled"] == -10
    assert "lags" in check.note and "no cost yet" in check.note
    nothing = reconcile(response, estimate=Tokens(sampled=50), estimate_usd=1.0, run_id="run-unknown")
    assert nothing.sessions == [] and "no usage" in nothing.note and nothing.difference_usd == -1.0


def test_billing_windows_cover_the_run_in_hours_of_at_most_two_weeks():
    start = dt.datetime(2026, 11, 1, 9, 41, tzinfo=dt.UTC)
    (only,) = costs.billing_windows(start, start + dt.timedelta(minutes=10))
    assert only == (start.replace(minute=0), start.replace(hour=10, minute=0))
    windows = costs.billing_windows(start, start + dt.timedelta(days=20))
    assert len(windows) == 2 and windows[0][1] - windows[0][0] == dt.timedelta(days=14)
    assert windows[1][0] == windows[0][1] and windows[1][1] == dt.datetime(2026, 11, 21, 10, tzinfo=dt.UTC)


# -- the local server's bookkeeping (no model) ----------------------------------------------------------------------
def test_the_cache_hit_stand_in_is_the_longest_prefix_seen_in_the_session():
    from tinker import types

    billing_module = pytest.importorskip("aitrainsai_tinker_local_server.billing", reason="the local server")
    Billing, Rates = billing_module.Billing, billing_module.Rates

    billing = Billing(Rates(prefill=1.0, prefill_cached=0.5, sampled=2.0), clock=lambda: 1_764_536_400.0 + 60)
    assert billing.sampled("s1", [1, 2, 3, 4], [[5, 6]]) == 0
    assert billing.sampled("s1", [1, 2, 3, 4, 5, 6, 7, 8], [[9]]) == 6  # extends the earlier prompt and reply
    assert billing.sampled("s1", [1, 2, 3, 9], [[]]) == 3
    assert billing.sampled("s1", [1, 2, 3, 4], [[0], [0]]) == 3  # the last prompt token is always prefilled
    assert billing.sampled("s2", [1, 2, 3, 4], [[5]]) == 0  # another session shares no cache
    billing.session("s1", session_metadata("run-1", outer_step=3))
    response = types.BillingUsageResponse.model_validate(
        billing.usage("2025-11-30T21:00:00Z", "2025-11-30T22:00:00Z"))
    assert response.sessions["s1"].user_metadata == {"aitrainsai_run_id": "run-1", "outer_step": "3"}
    assert response.sessions["s2"].user_metadata is None
    check = reconcile(response, estimate=Tokens(), estimate_usd=0.0, session_ids=["s1"])
    # prompts 4 + 8 + 4 + 2 x 4 (two samples: the repeat is a hit) = 24 read, 0 + 6 + 3 + 3 + 4 = 16 of them hits
    assert check.billed_tokens == Tokens(prefill=24, prefill_cached=16, sampled=5)
    assert check.billed_usd_total == pytest.approx((8 * 1.0 + 16 * 0.5 + 5 * 2.0) / 1e6)
    with pytest.raises(ValueError, match="aligned to a UTC hour"):
        billing.usage("2025-11-30T21:30:00Z", "2025-11-30T22:00:00Z")
    with pytest.raises(ValueError, match="at most 14 days"):
        billing.usage("2025-11-01T00:00:00Z", "2025-11-30T00:00:00Z")


# -- against the local server, through the SDK ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def billed_run(tinker_server):
    """A run's session (its user_metadata naming the run): two samples, the second continuing the first, and one
    forward-backward, with the trainer-side estimate of each at the server's own rates."""
    import tinker

    run_id = f"costs-{dt.datetime.now(dt.UTC):%H%M%S%f}"
    started = dt.datetime.now(dt.UTC)
    prices = Prices(**tinker_server.rates)
    meter = CostMeter()

    async def main():
        service = tinker.ServiceClient(session_metadata(run_id, outer_step=0), base_url=tinker_server.base_url,
                                       api_key=tinker_server.api_key)
        try:
            training = await service.create_lora_training_client(MODEL, rank=4, seed=0, train_unembed=False)
            sampler = await training.save_weights_and_get_sampling_client()
            params = tinker.SamplingParams(max_tokens=3, temperature=1.0, seed=1)
            hits, replies = [], []
            prompt = PROMPT
            for _ in range(2):
                response = await sampler.sample(tinker.ModelInput.from_ints(prompt), 1, params)
                reply = list(response.sequences[0].tokens)
                hits.append(response.prompt_cache_hit_tokens)
                replies.append(reply)
                meter.add(Tokens.sampling(len(prompt), len(reply), cache_hits=response.prompt_cache_hit_tokens),
                          prices, episode="e1")
                prompt = prompt + reply + [2, 198]
            tokens = prompt[:12]
            datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                                 loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11})
            await training.forward_backward([datum], "cross_entropy")
            meter.add(Tokens(trained=datum.model_input.length), prices, episode="e1")
            return hits, replies, service.holder.get_session_id()
        finally:
            service.close("success").result(timeout=30)

    hits, replies, session_id = run(main())
    return {"run_id": run_id, "started": started, "meter": meter, "hits": hits, "replies": replies,
            "session_id": session_id, "prices": prices}


def test_the_service_bills_the_run_exactly_as_the_trainer_estimated(tinker_server, billed_run):
    meter = billed_run["meter"]
    first, second = billed_run["hits"]
    assert first == 0 and second == len(PROMPT) + len(billed_run["replies"][0])  # the first prompt and reply
    check = run(check_billing(base_url=tinker_server.base_url, api_key=tinker_server.billing_key,
                              started_at=billed_run["started"], estimate=meter.total, estimate_usd=meter.usd_total,
                              run_id=billed_run["run_id"], deadline_s=60))
    assert isinstance(check, BillingCheck) and check.checked, check.reason
    assert check.sessions == [billed_run["session_id"]]  # found by the run id in its user_metadata
    assert check.billed_tokens == meter.total and meter.total.prefill_cached == second
    assert check.billed_usd_total == pytest.approx(meter.usd_total, rel=1e-12) and meter.usd_total > 0
    assert check.difference_usd == pytest.approx(0.0, abs=1e-15) and not check.partial
    assert check.billed_usd["prefill_cached"] == pytest.approx(second * billed_run["prices"].prefill_cached / 1e6)
    assert meter.episode("e1").usd == pytest.approx(meter.usd_total)


def test_a_key_without_the_billing_role_is_a_reason_not_an_exception(tinker_server, billed_run):
    meter = billed_run["meter"]
    check = run(check_billing(base_url=tinker_server.base_url, api_key=tinker_server.api_key,
                              started_at=billed_run["started"], estimate=meter.total, estimate_usd=meter.usd_total,
                              run_id=billed_run["run_id"], deadline_s=30))
    assert not check.checked and "may not read billing (HTTP 403" in check.reason and "billing role" in check.reason
    assert check.estimate_usd == meter.usd_total and check.line().startswith("the service's billing was not read")


def test_no_answer_in_time_is_a_reason_too(tinker_server, billed_run):
    tinker_server.faults(op="billing", hang=True)
    try:
        check = run(check_billing(base_url=tinker_server.base_url, api_key=tinker_server.billing_key,
                                  started_at=billed_run["started"], estimate=Tokens(), estimate_usd=0.0,
                                  session_ids=[billed_run["session_id"]], deadline_s=1.5))
    finally:
        tinker_server.clear_faults()
    assert not check.checked and "did not answer within 1.5 s" in check.reason
