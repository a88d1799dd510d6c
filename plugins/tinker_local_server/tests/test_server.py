"""The local Tinker-compatible server, driven through the real tinker SDK over loopback HTTP (no monkeypatching):
log-probs that are the model's own, Adam steps, sampler versions, save and resume, a learning signal, faults, keys."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from aitrainsai_tinker_local_server.testing import TINY_BASE

tinker = pytest.importorskip("tinker")

MODEL = "SmolLM2-135M-Instruct"  # the name the server answers to (serving the mechanics base in these tests)
# "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n" in SmolLM2's tokenizer
PROMPT = [1, 4093, 198, 5820, 253, 7302, 30, 2, 198, 1, 520, 9531, 198]


def run(coro, timeout: float = 300):
    # generous: a loaded 2-core machine runs this model several times slower than an idle one
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def new_client(service_client, seed: int = 0):
    return await service_client.create_lora_training_client(MODEL, rank=8, seed=seed, train_unembed=False)


def datum(tokens: list[int], **inputs) -> tinker.Datum:
    """One sequence, ``model_input = tokens[:-1]`` predicting ``tokens[1:]``; inputs are per predicted token."""
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


def is_datum(prompt: list[int], reply: list[int], sampler_logprobs: list[float], advantage: float) -> tinker.Datum:
    lead = len(prompt) - 1
    return datum(prompt + reply, logprobs=[0.0] * lead + list(sampler_logprobs),
                 advantages=[0.0] * lead + [advantage] * len(reply))


async def forward_logprobs(training, tokens: list[int]) -> np.ndarray:
    out = await training.forward([datum(tokens, weights=[0.0] * (len(tokens) - 1))], "cross_entropy")
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def test_capabilities_and_info(tinker_server, service_client):
    async def main():
        rest = tinker.RestClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
        caps = await rest.get_server_capabilities()
        model, alias = caps.supported_models  # its own name, and the --serve-as name serve_for_tests gives it
        assert (model.model_name, model.trainable, model.sampleable) == (MODEL, True, True)
        assert alias.model_name == "Qwen/Qwen3.6-35B-A3B"
        assert model.max_context_length == 8192
        training = await new_client(service_client)
        info = training.get_info()
        assert (info.lora_rank, info.is_lora, info.model_data.model_name) == (8, True, MODEL)
        assert training.get_tokenizer().decode(PROMPT).startswith("<|im_start|>user\nName a colour.")
        with pytest.raises(tinker.BadRequestError, match="train_unembed"):
            await service_client.create_lora_training_client(MODEL, rank=8)

    run(main())


def test_sampled_logprobs_are_the_models_own(service_client):
    async def main():
        training = await new_client(service_client, seed=1)
        sampler = await training.save_weights_and_get_sampling_client()
        params = tinker.SamplingParams(max_tokens=6, temperature=0.8, seed=7)
        result = await sampler.sample(tinker.ModelInput.from_ints(PROMPT), 2, params)
        again = await sampler.sample(tinker.ModelInput.from_ints(PROMPT), 2, params)
        assert [s.tokens for s in result.sequences] == [s.tokens for s in again.sequences]  # the seed fixes draws
        for sequence in result.sequences:
            assert 1 <= len(sequence.tokens) <= 6 and len(sequence.logprobs) == len(sequence.tokens)
            assert sequence.stop_reason == ("stop" if sequence.tokens[-1] == 2 else "length")
            full = PROMPT + sequence.tokens
            # the trainer's log-probs of the same tokens are at temperature 1; the sampler's at 0.8
            ours = (await forward_logprobs(training, full))[-len(sequence.tokens):]
            prompt_lps = (await sampler.compute_logprobs(tinker.ModelInput.from_ints(full)))[-len(sequence.tokens):]
            np.testing.assert_allclose(ours, prompt_lps, atol=1e-4)
        at_one = await sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1,
                                      tinker.SamplingParams(max_tokens=4, temperature=1.0, seed=3))
        (sequence,) = at_one.sequences
        ours = (await forward_logprobs(training, PROMPT + sequence.tokens))[-len(sequence.tokens):]
        np.testing.assert_allclose(sequence.logprobs, ours, atol=1e-4)
        stopped = await sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1,
                                       tinker.SamplingParams(max_tokens=4, seed=3, stop=[sequence.tokens[1]]))
        assert stopped.sequences[0].tokens == sequence.tokens[:2] and stopped.sequences[0].stop_reason == "stop"

    run(main())


def test_update_makes_a_new_version_and_keeps_the_old(service_client):
    async def main():
        training = await new_client(service_client, seed=2)
        old = await training.save_weights_and_get_sampling_client()
        sample = (await old.sample(tinker.ModelInput.from_ints(PROMPT), 1,
                                   tinker.SamplingParams(max_tokens=4, seed=1))).sequences[0]
        full = tinker.ModelInput.from_ints(PROMPT + sample.tokens)
        before = await old.compute_logprobs(full)
        # submitted before either is awaited, as the SDK intends
        backward = training.forward_backward([is_datum(PROMPT, sample.tokens, sample.logprobs, 1.0)],
                                             "importance_sampling")
        step = training.optim_step(tinker.AdamParams(learning_rate=1e-3))
        result, stepped = await backward, await step
        # on-policy, the ratio is 1: the loss is minus the summed advantages
        assert result.metrics["loss:sum"] == pytest.approx(-len(sample.tokens), abs=1e-3)
        assert stepped.metrics["grad_norm:mean"] > 0
        new = await training.save_weights_and_get_sampling_client()
        after_new = await new.compute_logprobs(full)
        after_old = await old.compute_logprobs(full)
        assert after_old == before
        assert sum(after_new[len(PROMPT):]) > sum(before[len(PROMPT):])  # advantage +1 made the reply likelier

    run(main())


def test_save_state_and_resume_with_optimizer_is_identical(service_client):
    async def main():
        batch = [is_datum(PROMPT, [504, 2], [-1.0, -1.0], 1.0), is_datum(PROMPT, [2188, 2], [-2.0, -1.0], -0.5)]
        adam = tinker.AdamParams(learning_rate=2e-3)
        stayed = await new_client(service_client, seed=3)
        await stayed.forward_backward(batch, "importance_sampling")
        await stayed.optim_step(adam)
        saved = await stayed.save_state("after-one")
        assert saved.path == f"tinker://{stayed.model_id}/weights/after-one"
        resumed = await service_client.create_training_client_from_state_with_optimizer(saved.path)
        weights_only = await service_client.create_training_client_from_state(saved.path)
        probe = PROMPT + [504, 2]
        np.testing.assert_array_equal(await forward_logprobs(stayed, probe), await forward_logprobs(resumed, probe))
        for client in (stayed, resumed, weights_only):
            backward = client.forward_backward(batch, "importance_sampling")
            step = client.optim_step(adam)
            await backward
            await step
        after_stayed = await forward_logprobs(stayed, probe)
        np.testing.assert_array_equal(after_stayed, await forward_logprobs(resumed, probe))
        # a fresh Adam state takes a different second step
        assert not np.allclose(after_stayed, await forward_logprobs(weights_only, probe), atol=1e-6)

    run(main())


def test_a_bf16_server_samples_as_it_trains(tinker_server, tmp_path):
    """The session's server computes in float32 on a CPU (``auto``); a bf16 one's trained adapter samples log-probs
    that are the training forward's to within 1e-3 a token (folding LoRA into bf16 weights, as fp32 samplers do,
    misses them by ~0.05 after one step like this)."""
    import torch

    from aitrainsai_tinker_local_server import start_local_server

    auto = "bfloat16" if torch.cuda.is_available() else "float32"
    assert f"({auto}, state dir" in (tinker_server.state_dir / "server.log").read_text()
    with start_local_server(tmp_path / "bf16", api_key="tml-bf16", timeout=180, dtype="bfloat16",
                            base=TINY_BASE) as bf16:
        assert bf16.dtype == "bfloat16"
        client = tinker.ServiceClient(base_url=bf16.base_url, api_key="tml-bf16")
        try:
            run(_sampled_as_trained(client))
        finally:
            client.close("success").result(timeout=30)


async def _sampled_as_trained(service_client) -> None:
    training = await new_client(service_client, seed=5)
    first = await training.save_weights_and_get_sampling_client()
    sample = (await first.sample(tinker.ModelInput.from_ints(PROMPT), 1,
                                 tinker.SamplingParams(max_tokens=4, seed=2))).sequences[0]
    backward = training.forward_backward([is_datum(PROMPT, sample.tokens, sample.logprobs, 1.0)],
                                         "importance_sampling")
    step = training.optim_step(tinker.AdamParams(learning_rate=1e-3))
    await backward
    await step
    sampler = await training.save_weights_and_get_sampling_client()
    result = await sampler.sample(tinker.ModelInput.from_ints(PROMPT), 2,
                                  tinker.SamplingParams(max_tokens=12, temperature=1.0, seed=3))
    gaps = []
    for sequence in result.sequences:
        trained = (await forward_logprobs(training, PROMPT + sequence.tokens))[-len(sequence.tokens):]
        gaps.append(np.abs(trained - np.asarray(sequence.logprobs)))
    gap = np.concatenate(gaps)
    assert gap.mean() < 1e-3 and gap.max() < 1e-2, gap


def test_checkpoints_load_across_dtypes(tmp_path):
    """An fp32 server's checkpoint loads into a bf16 one and back: adapter and Adam moments bit for bit, fp32."""
    from aitrainsai_tinker_local_server.engine import Engine
    import torch

    from aitrainsai_tinker_local_server.wire import AdamParamsBody, Datum, FwdBwdRequest, TinkerPath

    tokens = PROMPT + [504, 2]
    data = [Datum(tokens[:-1], {"target_tokens": np.array(tokens[1:], np.int64),
                                "weights": np.ones(len(tokens) - 1, np.float32)})]

    def train(engine: Engine, model_id: str, name: str) -> None:
        engine.forward_backward(FwdBwdRequest(model_id, 0, "cross_entropy", {}, False, data))
        engine.optim_step(model_id, AdamParamsBody(learning_rate=1e-3))
        engine.save_state(model_id, name, overwrite=False)

    def same_state(a, b) -> None:
        for mine, theirs in [(a.adapter, b.adapter), (a.exp_avg, b.exp_avg), (a.exp_avg_sq, b.exp_avg_sq)]:
            assert all(x.dtype == torch.float32 and torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))

    fp32, bf16 = Engine(tmp_path, dtype="float32"), Engine(tmp_path, dtype="bfloat16")
    assert (fp32.compute_dtype, bf16.compute_dtype) == ("float32", "bfloat16")
    a, b, c = (f"session-{name}:train:0" for name in "abc")
    fp32.create_run(a, fp32.default_shape, seed=0)
    train(fp32, a, "one")
    bf16.load_state(b, TinkerPath(a, "weights", "one"), optimizer=True)
    same_state(fp32.run(a), bf16.run(b))
    train(bf16, b, "two")
    fp32.load_state(c, TinkerPath(b, "weights", "two"), optimizer=True)
    same_state(bf16.run(b), fp32.run(c))
    assert fp32.run(c).steps == 2


def test_importance_sampling_updates_raise_the_rewarded_first_token(service_client):
    """A tiny bandit: reward 1 when the first sampled token is the rewarded one, group-centred advantages,
    IS-GRPO steps; the rewarded token's log-prob must rise by a real margin."""

    async def main():
        training = await new_client(service_client, seed=4)
        prompt = tinker.ModelInput.from_ints(PROMPT)
        sampler = await training.save_weights_and_get_sampling_client()
        first = await sampler.sample(prompt, 8, tinker.SamplingParams(max_tokens=1, seed=11))
        counts: dict[int, int] = {}
        for s in first.sequences:
            counts[s.tokens[0]] = counts.get(s.tokens[0], 0) + 1
        rewarded = min(counts, key=lambda t: (counts[t], t))  # the rarest: room to rise
        start = (await sampler.compute_logprobs(tinker.ModelInput.from_ints(PROMPT + [rewarded])))[-1]
        for step in range(3):
            group = (await sampler.sample(prompt, 8, tinker.SamplingParams(max_tokens=1, seed=100 + step))).sequences
            rewards = np.array([float(s.tokens[0] == rewarded) for s in group])
            advantages = rewards - rewards.mean()
            data = [is_datum(PROMPT, s.tokens, s.logprobs, float(a)) for s, a in zip(group, advantages) if a != 0]
            if not data:  # every sample alike: nothing to learn from, as in GRPO
                data = [is_datum(PROMPT, [rewarded], [start], 1.0)]
            backward = training.forward_backward(data, "importance_sampling")
            update = training.optim_step(tinker.AdamParams(learning_rate=3e-3))
            await backward
            await update
            sampler = await training.save_weights_and_get_sampling_client()
        end = (await sampler.compute_logprobs(tinker.ModelInput.from_ints(PROMPT + [rewarded])))[-1]
        assert end > start + 0.5, (start, end)

    run(main(), timeout=400)


def test_refusals_are_clear(service_client):
    async def main():
        training = await new_client(service_client)
        with pytest.raises(tinker.BadRequestError, match="loss_fn 'not_a_loss' is not supported.*it has cispo"):
            await training.forward([datum(PROMPT, weights=[1.0] * (len(PROMPT) - 1))], "not_a_loss")
        with pytest.raises(tinker.BadRequestError, match="unknown \\['mask'\\]"):
            await training.forward([datum(PROMPT, weights=[1.0] * (len(PROMPT) - 1),
                                          mask=tinker.TensorData(data=[1.0] * (len(PROMPT) - 1), dtype="float32",
                                                                 shape=[len(PROMPT) - 1]))], "cross_entropy")

    run(main(), timeout=60)


def test_a_request_over_the_trainers_memory_bound_is_the_clients_error():
    """The local trainer refuses a forward whose activations would pass its bound (one long datum in bfloat16 on
    SmolLM2: tens of GB) before it takes the memory; the server answers that as the request's fault, in a line."""
    from aitrainsai_trainer_local.llama import ActivationsTooLarge

    from aitrainsai_tinker_local_server.app import _guarded

    refusal = "training keeps 12.0 GB of activations (1 rows of 8191 tokens after 0), over the trainer's 10.0 GB"

    def work():
        raise ActivationsTooLarge(refusal)

    assert _guarded(work) == ("json", {"error": f"the request is too large: {refusal}", "category": "user"})


def test_rate_limits_and_server_errors_are_retried_by_the_sdk(tinker_server, service_client):
    async def main():
        training = await new_client(service_client)
        sampler = await training.save_weights_and_get_sampling_client()
        prompt = tinker.ModelInput.from_ints(PROMPT)
        params = tinker.SamplingParams(max_tokens=2, seed=0)
        tinker_server.faults(op="asample", status=429, count=2)
        assert (await sampler.sample(prompt, 1, params)).sequences
        tinker_server.faults(op="asample", status=500, count=2)
        assert (await sampler.sample(prompt, 1, params)).sequences
        tinker_server.faults(op="*", status=503, count=2)
        assert len(await forward_logprobs(training, PROMPT)) == len(PROMPT) - 1
        assert tinker_server.faults(op="none", status=500, count=1)["faults"][0]["remaining"] == 1
        tinker_server.clear_faults()

    run(main(), timeout=300)


def test_a_server_that_never_answers_blocks_the_call(tinker_server, service_client):
    async def main():
        training = await new_client(service_client)
        sampler = await training.save_weights_and_get_sampling_client()
        tinker_server.faults(op="asample", hang=True)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1,
                                                      tinker.SamplingParams(max_tokens=2)), 3)
        finally:
            assert tinker_server.clear_faults()["hung"] >= 1

    run(main(), timeout=60)


def test_a_wrong_key_is_refused_with_the_servers_reason(tinker_server):
    async def main():
        client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key="tml-wrong-key")
        with pytest.raises(tinker.AuthenticationError, match="started with a different --api-key"):
            await client.create_lora_training_client(MODEL, rank=8, train_unembed=False)

    run(main(), timeout=60)


PARENT = """
import os, signal, sys
from aitrainsai_tinker_local_server import start_local_server

server = start_local_server(sys.argv[1], api_key="tml-local-parent", timeout=180, dtype="float32")
print(server.pid, server.dtype, flush=True)
if len(sys.argv) > 2:  # killed while the server is busy: a generation of thousands of tokens under way
    import time
    import tinker
    client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-local-parent")
    training = client.create_lora_training_client("SmolLM2-135M-Instruct", rank=8, train_unembed=False)
    sampler = training.save_weights_and_get_sampling_client()
    sampler.sample(tinker.ModelInput.from_ints([1, 2, 3]), 1, tinker.SamplingParams(max_tokens=6000, stop=[]))
    time.sleep(3)
os.kill(os.getpid(), signal.SIGKILL)  # no close, no atexit: the way a killed orchestrator ends
"""


@pytest.mark.parametrize("busy", [False, pytest.param(True, marks=pytest.mark.slow)],  # generating: a server of
                         ids=["idle", "generating"])  # its own on SmolLM2, tens of seconds on 2 CPUs
def test_the_server_stops_when_the_process_that_started_it_is_killed(tmp_path, busy):
    import subprocess
    import sys

    parent = subprocess.run([sys.executable, "-c", PARENT, str(tmp_path / "state"), *(["busy"] if busy else [])],
                            capture_output=True, text=True, timeout=240,
                            env=os.environ | {"TINKER_TELEMETRY": "0", "NO_PROXY": "127.0.0.1,localhost"})
    assert parent.returncode == -9, parent.stderr[-2000:]
    pid, dtype = parent.stdout.split()
    assert dtype == "float32"  # start_local_server(dtype=...) keeps fp32 available
    pid = int(pid)
    deadline = time.monotonic() + 30  # a busy server does not finish its generation first (minutes)
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    assert not _alive(pid), "the local Tinker server outlived the process that started it"


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie waiting for init to reap it is not running
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
