"""Registers the dispatch family with aitrainsai."""

from aitrainsai import hookimpl


@hookimpl
def register_task_families(register):
    from aitrainsai_family_dispatch.family import DispatchFamily

    register(DispatchFamily)
