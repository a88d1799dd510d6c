"""Registers the ``ray`` GPU backend (imports deferred to use: loading the plugin never imports ray)."""

from aitrainsai import hookimpl


@hookimpl
def register_gpu_backends(register):
    from aitrainsai_backend_ray.backend import RayBackend

    register(RayBackend)
