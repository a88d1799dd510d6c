"""Wheels of distributions installed here from a local folder (an editable checkout, not on any index), so a remote
worker can install a payload's runtime without an index that holds them.

A distribution counts as local when its PEP 610 ``direct_url.json`` names a ``file://`` folder that holds a
``pyproject.toml``. Its wheel is built from that folder with the build backend installed here (no build isolation,
no index: nothing is downloaded).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from aitrainsai.errors import AitrainsaiError

if TYPE_CHECKING:
    from aitrainsai.backends import Runtime


class WheelError(RuntimeError, AitrainsaiError):
    """A local distribution's wheel could not be built; the message is one line."""


def local_source(name: str) -> Path | None:
    """The folder ``name`` was installed from, when it was installed from a local folder; else None."""
    try:
        text = metadata.distribution(name).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    url = urlparse(record.get("url", ""))
    if url.scheme != "file" or "dir_info" not in record:
        return None
    folder = Path(unquote(url.path))
    return folder if (folder / "pyproject.toml").is_file() else None


def build_local_wheels(names: list[str], destination: Path) -> dict[str, Path]:
    """Build a wheel into ``destination`` for each of ``names`` installed from a local folder: name -> wheel."""
    destination.mkdir(parents=True, exist_ok=True)
    built: dict[str, Path] = {}
    for name in sorted(names):
        source = local_source(name)
        if source is None:
            continue
        with tempfile.TemporaryDirectory(dir=destination, prefix=".build-") as scratch:
            result = subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                 "-w", scratch, str(source)], capture_output=True, text=True, timeout=600)
            wheels = list(Path(scratch).glob("*.whl"))
            if result.returncode != 0 or len(wheels) != 1:
                tail = " ".join((result.stderr or result.stdout).split())[-300:]
                raise WheelError(f"the wheel of {name} (from {source}) could not be built: {tail or 'no wheel'}")
            target = destination / wheels[0].name
            wheels[0].replace(target)
        built[name] = target
    return built


@dataclass(frozen=True)
class RuntimeWheels:
    """A runtime's wheels built here: ``key`` names the runtime and the wheels' contents, ``folder`` holds them."""

    key: str
    folder: Path
    wheels: dict[str, Path]


class WheelCache:
    """Wheels of each runtime's distributions installed here from a folder, built once per runtime into
    ``root/<digest of the runtime>/`` (none when ``enabled`` is false); safe to share between a backend's tasks.
    A build that fails raises ``WheelError``, ``OSError`` or ``subprocess.SubprocessError``."""

    def __init__(self, root: Path, *, enabled: bool = True):
        self.root = Path(root)
        self.enabled = enabled
        self._built: dict[str, RuntimeWheels] = {}
        self._lock: asyncio.Lock | None = None

    async def get(self, runtime: Runtime) -> RuntimeWheels:
        text = json.dumps([sorted(runtime.distributions.items()), sorted(runtime.no_deps)])
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if text not in self._built:
                folder = self.root / hashlib.sha256(text.encode()).hexdigest()[:16]
                if self.enabled:
                    wheels = await asyncio.to_thread(build_local_wheels, list(runtime.distributions), folder)
                else:
                    folder.mkdir(parents=True, exist_ok=True)
                    wheels = {}
                digest = hashlib.sha256(text.encode())
                for name, wheel in sorted(wheels.items()):
                    digest.update(f"{name} {hashlib.sha256(wheel.read_bytes()).hexdigest()}".encode())
                self._built[text] = RuntimeWheels(digest.hexdigest()[:16], folder, wheels)
            return self._built[text]
