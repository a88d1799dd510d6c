"""Serving the viewer with uvicorn (imported only by the ``view`` command, and by tests)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import webbrowser
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import click
import uvicorn

from aitrainsai_viewer.app import LOOPBACK_NAMES, Hosts, create_app

WILDCARDS = ("0.0.0.0", "::", "")


def hosts_for(host: str, *, public: bool = False, allowed: Iterable[str] = ()) -> Hosts:
    """The names a viewer bound to ``host`` answers to: loopback's, ``host`` itself, the ``allowed`` names (a name
    of this machine the browser uses); with ``public``, this machine's own names, and bound to every address
    (0.0.0.0, ::), any address literal."""
    names = {*LOOPBACK_NAMES, host.strip("[]").lower(), *(name.strip("[]").lower() for name in allowed)}
    if public:
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
    names.discard("")
    return Hosts(frozenset(names), any_address=public and host.strip("[]") in WILDCARDS)


def serve(runs_dir: Path, host: str, port: int, *, open_browser: bool = False,
          plugins: Callable[[], Any] | None = None, hosts: Hosts | None = None) -> None:
    """Serve until Ctrl-C."""
    app = create_app(runs_dir, plugins, hosts=hosts or hosts_for(host))
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/"
    click.echo(f"aitrainsai view: {runs_dir} at {url} (read-only; Ctrl-C stops)")
    if open_browser:
        threading.Timer(1.0, webbrowser.open, (url,)).start()
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2)


@contextlib.contextmanager
def served(app: Any, host: str = "127.0.0.1") -> Iterator[str]:
    """``app`` served on ``host`` at a free port, in a thread: its address (``http://127.0.0.1:PORT``); stopped and
    joined on exit. For tests."""
    sock = socket.socket()
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the viewer did not start"
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
        assert not thread.is_alive(), "the viewer did not stop"
