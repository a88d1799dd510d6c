"""The local Tinker-compatible server is a distribution of its own (aitrainsai-tinker-local-server): imported here
only when a config asks for it (``base_url = "local"``, or the local model's tokenizer), so this plugin installs and
imports without it, and without the local trainer it builds on."""

from __future__ import annotations

import importlib.util
from types import ModuleType

DISTRIBUTION = "aitrainsai-tinker-local-server"
PACKAGE = "aitrainsai_tinker_local_server"
INSTALL = f"pip install {DISTRIBUTION} (or 'aitrainsai-outer-tinker[local]')"


class LocalServerMissing(RuntimeError):
    """The local server's distribution is not installed (one line naming it)."""


def installed() -> bool:
    return importlib.util.find_spec(PACKAGE) is not None


def server() -> ModuleType:
    """``aitrainsai_tinker_local_server`` (``start_local_server``, ``local_chat``, ``MODEL_NAME``), or
    :class:`LocalServerMissing`."""
    try:
        return importlib.import_module(PACKAGE)
    except ImportError as exc:
        if exc.name is not None and exc.name != PACKAGE:  # installed, but its own import failed: say that
            raise LocalServerMissing(f"the local Tinker server ({DISTRIBUTION}) does not import: {exc}") from None
        raise LocalServerMissing(f"the local Tinker server is not installed: {INSTALL}") from None
