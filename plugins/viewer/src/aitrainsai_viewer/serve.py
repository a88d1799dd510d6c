"""Serving the viewer with uvicorn (imported only by the ``view`` command)."""

from __future__ import annotations

import threading
import webbrowser
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import uvicorn

from aitrainsai_viewer.app import create_app


def serve(runs_dir: Path, host: str, port: int, *, open_browser: bool = False,
          plugins: Callable[[], Any] | None = None) -> None:
    """Serve until Ctrl-C."""
    app = create_app(runs_dir, plugins)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/"
    click.echo(f"aitrainsai view: {runs_dir} at {url} (read-only; Ctrl-C stops)")
    if open_browser:
        threading.Timer(1.0, webbrowser.open, (url,)).start()
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2)
