"""A server for tests (this distribution's and its clients'): one started with a fixed key, billing key and rate
card, answering to its own name and to today's default Tinker base, and a handle with its fault switch.

    with serve_for_tests(state_dir) as server:       # a LocalTinker: .base_url, .api_key, .faults(...)
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)

The fault switch (``POST /_local/faults``) is this server's alone: it runs as ``python -m
aitrainsai_tinker_local_server.testing`` (below), and no option of ``aitrainsai tinker-serve`` serves it.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from aitrainsai_tinker_local_server import MODEL_NAME, start_local_server
from aitrainsai_trainer_local.model import TINY_BASE  # the local trainer's mechanics base

API_KEY = "tml-local-test"
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


@contextmanager
def serve_for_tests(state_dir: Path, base: str = TINY_BASE) -> Iterator[LocalTinker]:
    """Start the test server on ``state_dir`` (no SDK telemetry, loopback never through a proxy: set in this
    process's environment) and stop it on exit. It serves ``base``: by default the two-layer model of the mechanics
    tests (tokens, logprobs, losses, faults, resume: the same tokenizer and chat format, in a tenth of the time);
    a test that asserts learning asks for ``"SmolLM2-135M-Instruct"``."""
    os.environ["TINKER_TELEMETRY"] = "0"
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost,::1"
    with start_local_server(state_dir, api_key=API_KEY, timeout=180, rates=RATES, billing_key=BILLING_KEY,
                            serve_as=[MODEL_NAME, CURRENT_MODEL], base=base, test_routes=True) as server:
        yield LocalTinker(server.base_url, API_KEY, Path(state_dir), rates=RATES)


if __name__ == "__main__":  # the test server: the command's arguments, and the fault switch
    from aitrainsai_tinker_local_server.__main__ import exit_now, main

    exit_now(main(test_routes=True))
