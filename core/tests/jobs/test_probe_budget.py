"""The probe holds a job's code to a budget of CPU seconds, which load does not stretch; its wall-clock net stretches
with how much the machine slows the probe's own process, so a loaded machine does not refuse what a quiet one accepts,
and processes that only wait (a job can start hundreds, raising the load average) stretch nothing."""

import time

import pytest

from aitrainsai.jobs.probe import MAX_STRETCH, contention, wall_net


def test_a_quiet_process_is_not_stretched():
    assert 1.0 <= contention() < MAX_STRETCH
    assert 90.0 <= wall_net(90.0) <= 90.0 * MAX_STRETCH


@pytest.mark.parametrize("wall_per_cpu, expected", [(0.5, 1.0), (1.0, 1.0), (4.0, 4.0), (50.0, MAX_STRETCH)])
def test_the_net_is_the_wall_time_over_the_cpu_time_of_a_fixed_loop(monkeypatch, wall_per_cpu, expected):
    clock = {"wall": 0.0, "cpu": 0.0}

    def perf_counter():
        clock["wall"] += 0.5 * wall_per_cpu
        return clock["wall"]

    def thread_time():
        clock["cpu"] += 0.5
        return clock["cpu"]

    monkeypatch.setattr(time, "perf_counter", perf_counter)
    monkeypatch.setattr(time, "thread_time", thread_time)
    assert contention(size=10) == pytest.approx(expected)
