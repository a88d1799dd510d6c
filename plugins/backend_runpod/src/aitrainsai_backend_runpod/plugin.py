"""Registers the ``runpod`` GPU backend and the ``aitrainsai runpod`` commands (imports deferred to use)."""

from aitrainsai import hookimpl


@hookimpl
def register_gpu_backends(register):
    from aitrainsai_backend_runpod.backend import RunpodBackend

    register(RunpodBackend)


@hookimpl
def register_commands(cli):
    from aitrainsai_backend_runpod.commands import runpod_group

    cli.add_command(runpod_group)
