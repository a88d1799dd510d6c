"""The Ray backend's options (``gpu_backend.ray``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from aitrainsai import ComponentConfig
from pydantic import Field


class RayConfig(ComponentConfig):
    address: str | None = Field(
        None, description="the cluster: its dashboard's job submission address 'http://head:8265'; "
                          "'ray://head:10001' (taken as http://head:<dashboard_port>); 'auto' or a GCS address "
                          "'head:6379' (Ray asks that cluster's GCS for its dashboard); None: start a Ray head on "
                          "this machine for the run (loopback only) and stop it at the end")
    dashboard_port: int = Field(8265, ge=1, le=65535, description="the dashboard's port for a ray:// address")
    shared_dir: Path | None = Field(
        None, description="a folder at the same path here and on every node (NFS, a cluster file system): jobs run "
                          "in copies of their workdirs there and their artifacts are read back from there; None: the "
                          "backend's folder of the run, which only a cluster on this machine sees")
    python: str | None = Field(
        None, description="the program that runs a payload's 'python' and the runner on the nodes; None: 'python' "
                          "on the nodes' PATH (Ray's images: Ray's own interpreter), or this interpreter for the "
                          "head the backend starts")
    cpus_per_job: float = Field(1.0, gt=0, description="CPUs each payload reserves (entrypoint_num_cpus); a cluster "
                                                       "without GPUs runs its CPUs // cpus_per_job payloads at once")
    poll_s: float = Field(1.0, gt=0, description="seconds between two status requests for a running job")
    kill_grace_s: float = Field(5.0, ge=0, description="seconds between SIGTERM and SIGKILL when a job times out")
    timeout_grace_s: float = Field(60.0, ge=0, description="a job still running this long past its timeout_s (its "
                                                           "runner did not end it) is stopped by the backend")
    unreachable_s: float = Field(300.0, gt=0, description="a job whose cluster does not answer this long is lost")
    max_artifact_mb: float = Field(2048.0, gt=0, description="the most a job's artifacts may hold, in all")
    max_artifact_files: int = Field(10_000, ge=1, description="the most files a job's artifacts may hold, in all")
    keep_job_folders: bool = Field(False, description="keep each job's folder under shared_dir once it has ended")
    runtime_env: Literal["none", "pip"] = Field(
        "none", description="'none': the nodes have the payload's distributions already (the runner checks them "
                            "before the payload runs); 'pip': Ray's pip runtime env installs them into a virtualenv "
                            "per distinct runtime on each node (kept by Ray for later jobs); distributions installed "
                            "here from a folder travel as wheels built into shared_dir/wheels")
    pip_args: list[str] = Field(default_factory=list, description="extra pip options for runtime_env='pip', e.g. "
                                                                  "['--index-url', 'https://mirror/simple']")
    ship_local_wheels: bool = Field(True, description="with runtime_env='pip': build wheels of distributions "
                                                      "installed here from a local folder (on no index)")
    local_num_cpus: int | None = Field(None, ge=1, description="CPUs of the head the backend starts; None: Ray "
                                                               "counts this machine's")
    local_num_gpus: int | None = Field(None, ge=0, description="GPUs of the head the backend starts; None: Ray "
                                                               "detects them")
    local_object_store_mb: int = Field(256, ge=80, description="object store of the head the backend starts "
                                                               "(payloads rarely use it)")
    start_timeout_s: float = Field(120.0, gt=0, description="how long the head the backend starts may take")
    keeper_grace_s: float = Field(
        300.0, gt=0, description="the head the backend starts is stopped by its keeper once the orchestrator has been "
                                 "gone (killed) this long; a run resumed before that adopts the head and its jobs")
