"""Conformance checks for GPU backends: they run payloads and report done or dead honestly."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import ClassVar

from aitrainsai.backends import GpuBackend, JobPayload
from aitrainsai.components import ComponentConfig
from aitrainsai.testing.plugins import PluginConformance


class GpuBackendConformance(PluginConformance):
    """Set ``backend`` to the class; override :meth:`make_config` to point it at a test server."""

    backend: ClassVar[type[GpuBackend]]
    kind = "gpu_backends"

    def component_names(self) -> list[str]:
        return [self.backend.name]

    def make_config(self) -> ComponentConfig:
        return self.backend.Config()

    def _run(self, tmp_path: Path, command: list[str], timeout_s: float = 60, outputs=()):
        async def go():
            backend = self.backend(self.make_config(), workdir=tmp_path)
            await backend.start()
            try:
                payload = JobPayload(job_id="conformance", workdir=tmp_path / "job", command=command,
                                     timeout_s=timeout_s, outputs=list(outputs))
                return await backend.run(payload)
            finally:
                await backend.close()

        (tmp_path / "job").mkdir(exist_ok=True)
        return asyncio.run(go())

    def test_a_payload_that_succeeds_is_done(self, tmp_path):
        code = "open('out.txt','w').write('ok'); print('hello from the job')"
        result = self._run(tmp_path, [sys.executable, "-c", code], outputs=["out.txt"])
        assert result.status == "done", result
        assert "hello from the job" in result.log_tail
        assert result.cost_usd >= 0 and result.wall_s > 0

    def test_a_payload_that_crashes_is_dead_with_its_log(self, tmp_path):
        result = self._run(tmp_path, [sys.executable, "-c", "print('about to fail'); raise SystemExit(3)"])
        assert result.status == "dead" and "about to fail" in result.log_tail and result.reason

    def test_a_payload_that_hangs_is_dead(self, tmp_path):
        result = self._run(tmp_path, [sys.executable, "-c", "import time; time.sleep(600)"], timeout_s=1)
        assert result.status == "dead" and "timed out" in result.reason
