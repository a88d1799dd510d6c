"""Registers the string_pipeline family with aitrainsai."""

from aitrainsai import hookimpl


@hookimpl
def register_task_families(register):
    from aitrainsai_family_string_pipeline.family import StringPipelineFamily

    register(StringPipelineFamily)
