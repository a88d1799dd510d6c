"""Registers the multi_hop family with aitrainsai."""

from aitrainsai import hookimpl


@hookimpl
def register_task_families(register):
    from aitrainsai_family_multi_hop.family import MultiHopFamily

    register(MultiHopFamily)
