"""Registers the ledger family with aitrainsai."""

from aitrainsai import hookimpl


@hookimpl
def register_task_families(register):
    from aitrainsai_family_ledger.family import LedgerFamily

    register(LedgerFamily)
