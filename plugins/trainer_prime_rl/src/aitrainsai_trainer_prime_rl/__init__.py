"""aitrainsai's prime-rl inner trainer. Modules: ``pins`` (the pinned prime-rl stack), ``config`` (``trainer.toml``
and run options), ``rltoml`` (``rl.toml`` and this plugin's model of prime-rl's schema), ``envpkg`` (a job as an
environment package), ``inner`` (the plugin: probe, payloads, trusted scoring), ``job`` (the driver on a worker),
``engine`` (the eval's chat engine over vLLM's API), ``testing`` (stand-ins for prime-rl and vLLM)."""
