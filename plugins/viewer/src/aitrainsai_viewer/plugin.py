"""The ``view`` command. Light on purpose: the web stack is imported only when the command runs."""

from __future__ import annotations

import ipaddress
import socket

import click

from aitrainsai import CommandState, InputError, hookimpl


def is_loopback(host: str) -> bool:
    """``host`` names only loopback addresses (127.0.0.0/8, ::1, or a name that resolves to nothing else; an address
    resolves to itself)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


@click.command("view")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback unless --public).")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--open/--no-open", "open_browser", default=False, show_default=True,
              help="Open the viewer in the default browser.")
@click.option("--public", is_flag=True, help="Allow a --host that is not loopback (the runs are then readable by "
                                            "anyone who can reach it).")
@click.option("--allow-host", "allowed", multiple=True, metavar="NAME",
              help="Also answer to this name of the machine (as the browser's address gives it); repeatable. Any other "
                   "name a request gives is refused (421), so that no other site can rebind its name to the viewer.")
def view(host: str, port: int, open_browser: bool, public: bool, allowed: tuple[str, ...]) -> None:
    """A local web viewer over the runs directory: runs, outer steps, jobs and transcripts, read-only."""
    state = click.get_current_context().ensure_object(CommandState)
    if not is_loopback(host):
        if not public:
            raise InputError(f"--host {host} is not a loopback address; add --public to serve the runs beyond "
                             "this machine")
        click.echo(f"warning: serving {state.runs_dir} on {host}, reachable from other machines; the viewer has no "
                   "login", err=True)
    from aitrainsai_viewer.serve import hosts_for, serve

    serve(state.runs_dir, host, port, open_browser=open_browser, plugins=lambda: state.plugins,
          hosts=hosts_for(host, public=public, allowed=allowed))


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(view)
