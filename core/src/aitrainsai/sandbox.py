"""Old path of :mod:`aitrainsai.isolation` (kept importable for one release)."""

from aitrainsai.isolation import *  # noqa: F403
from aitrainsai.isolation import __all__  # noqa: F401
from aitrainsai.isolation.container import ContainerIsolation, ContainerSandbox  # noqa: F401
from aitrainsai.isolation.namespace import NamespaceIsolation, NamespaceSandbox, bwrap_path, python_folders  # noqa: F401
