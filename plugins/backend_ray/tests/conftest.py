"""One local Ray head (4 CPUs, no GPU, every server on loopback) per test module that asks for it: stopped when that
module is done, so that its idle servers do not share the CPUs with the rest of the suite."""

from __future__ import annotations

import os
import time

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """A running LocalCluster: ``url`` is its dashboard (the job submission API), ``started_s`` how long it took."""
    from aitrainsai_backend_ray.cluster import LOCAL_ENV, LocalCluster

    saved = {k: os.environ.get(k) for k in LOCAL_ENV}
    os.environ.update(LOCAL_ENV)  # clients in this process (the state API's) send no usage report either
    begin = time.monotonic()
    cluster = LocalCluster(num_cpus=4, num_gpus=0, object_store_mb=128).start(timeout_s=180)
    print(f"\nthe Ray head answered after {cluster.started_s:.1f} s ({time.monotonic() - begin:.1f} s in all)")
    try:
        yield cluster
    finally:
        cluster.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
