import pytest
from aitrainsai_trainer_prime_rl.testing import frozen_job


@pytest.fixture
def calc_job(tmp_path):
    return frozen_job(tmp_path / "episode" / "probe-1" / "job")
