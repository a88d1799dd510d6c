"""Registers the triage family with aitrainsai."""

from aitrainsai import hookimpl


@hookimpl
def register_task_families(register):
    from aitrainsai_family_triage.family import TriageFamily

    register(TriageFamily)
