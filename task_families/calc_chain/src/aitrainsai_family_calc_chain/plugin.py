"""Registers the calc_chain family with aitrainsai."""

from aitrainsai import hookimpl


@hookimpl
def register_task_families(register):
    from aitrainsai_family_calc_chain.family import CalcChainFamily

    register(CalcChainFamily)
