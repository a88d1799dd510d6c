"""Registers the TensorBoard tracker."""

from aitrainsai import hookimpl


@hookimpl
def register_trackers(register):
    from aitrainsai_tracker_tensorboard.tracker import TensorBoardTracker

    register(TensorBoardTracker)
