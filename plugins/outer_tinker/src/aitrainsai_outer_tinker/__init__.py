"""The ``tinker`` outer trainer and a local Tinker-compatible server."""
