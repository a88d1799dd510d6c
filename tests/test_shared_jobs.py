"""Which inner trainers declare their training deterministic, so that identical jobs may share an outcome
(``loop.share_identical_jobs``; the sharing itself: core/tests/run/test_shared_jobs.py)."""

from __future__ import annotations


def test_the_local_trainer_is_deterministic_only_on_the_cpu_with_fixed_threads(tmp_path, monkeypatch):
    from aitrainsai import LocalBackend
    from aitrainsai.testing import GivenNumbersTrainer
    from aitrainsai_trainer_local.inner import LocalTrainer

    def backend(**config) -> LocalBackend:
        return LocalBackend(LocalBackend.Config(**config), workdir=tmp_path)

    trainer = LocalTrainer()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(LocalBackend, "gpus", lambda self: [])
    assert trainer.deterministic(backend(workers=2))  # two payloads at once split the cores: a fixed count each
    assert trainer.deterministic(backend(threads_per_payload=3))
    assert not trainer.deterministic(backend(workers=1))  # torch's default thread count
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert trainer.deterministic(backend(workers=1))
    monkeypatch.setattr(LocalBackend, "gpus", lambda self: ["NVIDIA H100 80GB HBM3"])
    assert not trainer.deterministic(backend(threads_per_payload=1))  # torch trains on the GPU it sees
    assert not GivenNumbersTrainer().deterministic(backend())  # declared only where configured
