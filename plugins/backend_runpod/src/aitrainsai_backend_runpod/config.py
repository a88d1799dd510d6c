"""The Runpod backend's options (``gpu_backend.runpod``)."""

from __future__ import annotations

from typing import Literal

from aitrainsai import ComponentConfig
from pydantic import Field, field_validator


class RunpodConfig(ComponentConfig):
    api_key_env: str = Field("RUNPOD_API_KEY", description="the environment variable holding the API key")
    api_base_url: str | None = Field(None, description="GraphQL base URL; None: $RUNPOD_API_BASE_URL or the SDK's")
    rest_url: str = Field("https://rest.runpod.io/v1", description="REST API a pod calls to delete itself")
    gpu_types: list[str] = Field(["NVIDIA GeForce RTX 4090", "NVIDIA RTX A6000", "NVIDIA A100 80GB PCIe"],
                                 min_length=1, description="GPU type ids, in order of preference")
    data_centers: list[str] = Field(default_factory=list, description="data centre ids in order; empty: any")
    cloud_type: Literal["SECURE", "COMMUNITY", "ALL"] = "SECURE"
    image: str = "runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04"
    container_disk_gb: int = Field(50, ge=5)
    volume_gb: int = Field(0, ge=0)
    memory_gb: int = Field(32, ge=1, description="host memory a pod must have (its shared memory is at most this)")
    min_pods: int = Field(0, ge=0, description="pods kept however idle")
    max_pods: int = Field(16, ge=1, le=64, description="pods at most; start() boots this many")
    boot_timeout_s: float = Field(900.0, gt=0, description="a pod not answering SSH by then is replaced")
    boot_attempts: int = Field(3, ge=1, description="pod creations or boots that may fail per pod wanted")
    idle_timeout_s: float = Field(600.0, gt=0, description="an idle pod beyond min_pods is terminated after this")
    lost_retries: int = Field(1, ge=0, description="a job whose pod vanishes mid-job runs again on another pod this "
                                                   "many times (an infrastructure failure) before it is reported lost")
    ssh_user: str = "root"
    ssh_timeout_s: float = Field(10.0, gt=0, description="SSH connect timeout")
    remote_root: str = Field("aitrainsai", description="the backend's folder on a pod (relative: under its home)")
    python: str = Field("python3", description="the pod's interpreter for payloads without a runtime")
    pip_args: list[str] = Field(default_factory=list, description="extra pip arguments for runtime installs")
    ship_local_wheels: bool = Field(True, description="build wheels of a runtime's distributions installed here from "
                                                      "a local folder (not on an index) and install them from those")
    deadman_s: float = Field(900.0, ge=2, description="a pod with no heartbeat this long deletes itself")
    max_usd: float | None = Field(None, gt=0, description="stop launching jobs once the pool has cost this much")
    poll_s: float = Field(5.0, gt=0, description="seconds between pool ticks (one pod listing each)")
    wait_s: float = Field(30.0, gt=0, description="a job poll waits on the pod this long for the exit code")
    api_retries: int = Field(5, ge=0)
    backoff_s: float = Field(2.0, ge=0)
    max_artifact_mb: float = Field(2048.0, gt=0)
    name_prefix: str = Field("aitrainsai", pattern=r"^[a-z][a-z0-9-]{0,30}$")

    @field_validator("remote_root")
    @classmethod
    def _plain_root(cls, value: str) -> str:
        if not value or any(c in value for c in "'\"`$\\ \n;&|<>*?"):
            raise ValueError(f"remote_root {value!r}: a plain path (no spaces or shell characters)")
        return value.rstrip("/")
