"""Registers the wandb tracker (``wandb`` itself is imported only when a tracker starts)."""

from aitrainsai import hookimpl


@hookimpl
def register_trackers(register):
    from aitrainsai_tracker_wandb.tracker import WandbTracker

    register(WandbTracker)
