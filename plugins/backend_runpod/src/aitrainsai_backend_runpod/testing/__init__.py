"""Test support: :class:`~aitrainsai_backend_runpod.testing.fake_runpod.FakeRunpod` and :func:`require_sshd`."""

from __future__ import annotations

import os
from pathlib import Path

SSHD = Path("/usr/sbin/sshd")


def require_sshd() -> None:
    """Skip the calling test where OpenSSH's server is missing, unless ``AITRAINSAI_REQUIRE_SSHD=1`` (CI installs it)
    makes that a failure."""
    import pytest

    if not SSHD.exists():
        if os.environ.get("AITRAINSAI_REQUIRE_SSHD") == "1":
            pytest.fail("AITRAINSAI_REQUIRE_SSHD=1 but /usr/sbin/sshd is missing (apt-get install openssh-server)")
        pytest.skip("the Runpod backend's tests need OpenSSH's server (/usr/sbin/sshd): apt-get install openssh-server")
