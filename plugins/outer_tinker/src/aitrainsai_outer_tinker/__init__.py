"""The ``tinker`` outer trainer (the local Tinker-compatible server is aitrainsai-tinker-local-server)."""
