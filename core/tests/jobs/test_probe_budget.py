"""The probe holds a job's code to a budget of CPU seconds, which load does not stretch; its wall-clock net stretches
with the machine's load, so a loaded machine does not refuse what a quiet one accepts."""

import os

import pytest

from aitrainsai.jobs.probe import MAX_STRETCH, wall_net


@pytest.mark.parametrize("load, cores, expected", [(0.3, 2, 90.0), (2.0, 2, 90.0), (8.0, 2, 360.0), (13.0, 2, 585.0),
                                                   (500.0, 2, 90.0 * MAX_STRETCH), (8.0, 16, 90.0)])
def test_the_wall_clock_net_stretches_with_the_load_per_core(monkeypatch, load, cores, expected):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert wall_net(90.0) == pytest.approx(expected)


def test_no_load_average_is_a_quiet_machine(monkeypatch):
    def unavailable():
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", unavailable)
    assert wall_net(90.0) == 90.0
