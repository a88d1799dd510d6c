"""One fake Runpod (the real SDK's wire format, pods that are real sshd servers) for the whole test session."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def runpod_fake(tmp_path_factory):
    """A running FakeRunpod with RUNPOD_API_KEY set to its key (processes the tests start inherit it)."""
    from aitrainsai_backend_runpod.testing import require_sshd

    require_sshd()
    from aitrainsai_backend_runpod.testing.fake_runpod import FakeRunpod

    saved = os.environ.get("RUNPOD_API_KEY")
    with FakeRunpod(tmp_path_factory.mktemp("fake-runpod")) as fake:
        os.environ["RUNPOD_API_KEY"] = fake.api_key
        try:
            yield fake
        finally:
            if saved is None:
                os.environ.pop("RUNPOD_API_KEY", None)
            else:
                os.environ["RUNPOD_API_KEY"] = saved
