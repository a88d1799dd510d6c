"""Registers the ``tinker-serve`` command (the server's modules are imported when it runs)."""

from aitrainsai import hookimpl


@hookimpl
def register_commands(cli):
    from aitrainsai_tinker_local_server.serve_command import tinker_serve

    cli.add_command(tinker_serve)
