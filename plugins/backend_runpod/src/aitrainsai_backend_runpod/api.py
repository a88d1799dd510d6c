"""The Runpod API as the backend uses it: the real ``runpod`` SDK (1.12.0, imported on first use), with retries.

The SDK has no retry and turns a 429 or a 5xx into assorted exceptions (``requests.JSONDecodeError`` for a text body,
``KeyError('data')`` for a JSON one without ``errors``); here they are one :class:`ApiUnavailable` after ``retries``
tries with exponential backoff. Pods are listed with one query for all of them (``myself { pods }``, asking for
``runtime``, which the SDK's own query does not), so the pool costs one call per tick, not one per pod.

Every value pasted into the SDK's GraphQL text is checked first: the SDK inserts it unescaped (runpod-python#150), so
a quote would break the query. Names, images and GPU types are plain words; the start command travels as base64.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

PODS_QUERY = """query myPods { myself { pods { id name desiredStatus lastStatusChange costPerHr gpuCount
  machine { gpuDisplayName } runtime { uptimeInSeconds ports { ip isIpPublic privatePort publicPort type } } } } }"""
NO_CAPACITY = re.compile(r"no longer any instances available|no instances? (are )?available|not enough", re.IGNORECASE)
NOT_FOUND = re.compile(r"not found", re.IGNORECASE)
_UNSAFE = re.compile(r'["\\\n\r]')


class ApiError(Exception):
    """The API refused a request (not worth repeating)."""


class AuthError(ApiError):
    """The key is missing or refused."""


class NoCapacity(ApiError):
    """No pod of the asked kind is available right now."""


class ApiUnavailable(ApiError):
    """The API kept failing (429, 5xx, no answer) through every retry."""


@dataclass
class PodInfo:
    """A pod as one listing shows it."""

    id: str
    name: str
    desired_status: str
    last_status_change: str = ""
    cost_per_hr: float = 0.0
    gpu: str = ""
    ssh: tuple[str, int] | None = None  # (ip, port) once the container is up with a public port 22
    uptime_s: float | None = None  # None: no runtime yet (or a telemetry gap)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def gone(self) -> bool:
        """Stopped, outbid or exited: it runs nothing any more."""
        return self.desired_status in ("EXITED", "TERMINATED", "DEAD")

    @staticmethod
    def parse(data: dict[str, Any]) -> PodInfo:
        runtime = data.get("runtime") or None
        ssh = None
        if runtime:
            for port in runtime.get("ports") or []:
                if port.get("privatePort") == 22 and port.get("isIpPublic") and port.get("ip"):
                    ssh = (str(port["ip"]), int(port["publicPort"]))
        return PodInfo(id=str(data["id"]), name=str(data.get("name") or ""),
                       desired_status=str(data.get("desiredStatus") or ""),
                       last_status_change=str(data.get("lastStatusChange") or ""),
                       cost_per_hr=float(data.get("costPerHr") or 0.0),
                       gpu=str((data.get("machine") or {}).get("gpuDisplayName") or ""), ssh=ssh,
                       uptime_s=float(runtime.get("uptimeInSeconds") or 0.0) if runtime else None, raw=data)


def check_plain(value: str, what: str) -> str:
    """``value`` unchanged, or ``ValueError`` where it would break the SDK's unescaped GraphQL."""
    if _UNSAFE.search(value):
        raise ValueError(f"{what} {value!r} contains a quote, a backslash or a line break, which the Runpod SDK "
                         "would paste unescaped into its query")
    return value


class RunpodApi:
    """Synchronous calls (run them in a thread); ``base_url`` None keeps ``$RUNPOD_API_BASE_URL`` or the SDK's."""

    def __init__(self, api_key: str, *, base_url: str | None = None, retries: int = 5, backoff_s: float = 2.0,
                 sleep: Callable[[float], None] = time.sleep):
        import runpod  # ~1.6 s: only when a Runpod backend is used

        self._runpod = runpod
        self.api_key = api_key
        self.base_url = base_url
        self.retries = retries
        self.backoff_s = backoff_s
        self._sleep = sleep

    def _call(self, what: str, function: Callable[[], T]) -> T:
        import requests
        from runpod import error

        self._runpod.api_key = self.api_key  # the SDK's mutations read only the module's global key
        if self.base_url:
            os.environ["RUNPOD_API_BASE_URL"] = self.base_url  # read by the SDK at each call
        last = ""
        for attempt in range(self.retries + 1):
            try:
                return function()
            except error.AuthenticationError as exc:
                raise AuthError(f"Runpod refused the API key ({exc})") from None
            except error.QueryError as exc:
                message = str(exc)
                if NO_CAPACITY.search(message):
                    raise NoCapacity(message) from None
                raise ApiError(f"{what}: {message}") from None
            except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
                # 429/5xx bodies the SDK cannot read (JSONDecodeError is a ValueError; KeyError('data')), a dropped
                # connection, a timeout
                last = f"{type(exc).__name__}: {exc}"
            if attempt < self.retries:
                self._sleep(min(self.backoff_s * 2 ** attempt, 60.0))
        raise ApiUnavailable(f"{what}: the Runpod API kept failing after {self.retries + 1} tries ({last})")

    def list_pods(self) -> list[PodInfo]:
        return self._call("list pods", self._pods)

    def _pods(self) -> list[PodInfo]:
        from runpod.api.graphql import run_graphql_query

        return [PodInfo.parse(p) for p in run_graphql_query(PODS_QUERY)["data"]["myself"]["pods"]]

    def create_pod(self, *, name: str, image: str, gpu_type: str, cloud_type: str, data_center: str | None,
                   container_disk_gb: int, volume_gb: int, env: dict[str, str], docker_args: str) -> str:
        """A new pod's id. Not retried blindly: after a failure that may have created it, the pod is looked up by
        its unique name first (a retried create must not leave a second pod billing)."""
        for what, value in [("pod name", name), ("image", image), ("GPU type", gpu_type),
                            ("start command", docker_args), *((f"env {k}", v) for k, v in env.items())]:
            check_plain(value, what)

        tries = 0

        def create() -> str:
            nonlocal tries
            tries += 1
            if tries > 1:  # the failed try may have created it
                existing = [p for p in self._pods() if p.name == name]
                if existing:
                    return existing[0].id
            pod = self._runpod.create_pod(
                name=name, image_name=image, gpu_type_id=gpu_type, cloud_type=cloud_type, data_center_id=data_center,
                container_disk_in_gb=container_disk_gb, volume_in_gb=volume_gb, ports="22/tcp",
                support_public_ip=True, start_ssh=True, env=env, docker_args=docker_args)
            return str(pod["id"])

        return self._call(f"create pod {name}", create)

    def terminate(self, pod_id: str) -> None:
        """Terminate a pod; one already gone counts as terminated."""

        from runpod import error

        def terminate() -> None:
            try:
                self._runpod.terminate_pod(pod_id)
            except error.QueryError as exc:
                if not NOT_FOUND.search(str(exc)):
                    raise

        self._call(f"terminate pod {pod_id}", terminate)
