"""Registers the MLflow tracker."""

from aitrainsai import hookimpl


@hookimpl
def register_trackers(register):
    from aitrainsai_tracker_mlflow.tracker import MlflowTracker

    register(MlflowTracker)
