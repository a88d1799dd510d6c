"""The Runpod API as the backend uses it: the real ``runpod`` SDK (1.12.0, imported on first use), with retries.

The SDK has no retry and turns a 429 or a 5xx into assorted exceptions (``requests.JSONDecodeError`` for a text body,
``KeyError('data')`` for a JSON one without ``errors``); here they are one :class:`ApiUnavailable` after ``retries``
tries with exponential backoff. Pods are listed with one query for all of them (``myself { pods }``, asking for
``runtime``, which the SDK's own query does not), so the pool costs one call per tick, not one per pod.

Every value pasted into the SDK's GraphQL text is checked first: the SDK inserts it unescaped (runpod-python#150), so
a quote would break the query. Names, images and GPU types are plain words; the start command travels as base64.

Listing and terminating go through :meth:`RunpodApi.graphql`, the SDK's ``run_graphql_query`` with a timeout of the
caller's choosing (the SDK's is fixed at 30 s): a closing pool gives each terminate a few seconds and retries it
until its deadline, and :attr:`RunpodApi.stop` ends every other call's retries at once.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

PODS_QUERY = """query myPods { myself { pods { id name desiredStatus lastStatusChange costPerHr gpuCount
  machine { gpuDisplayName } runtime { uptimeInSeconds ports { ip isIpPublic privatePort publicPort type } } } } }"""
NO_CAPACITY = re.compile(r"no longer any instances available|no instances? (are )?available|not enough", re.IGNORECASE)
NOT_FOUND = re.compile(r"not found", re.IGNORECASE)
NO_GPU = re.compile(r"^No GPU found", re.IGNORECASE)  # the SDK's create_pod pre-check (a ValueError)
REQUEST_TIMEOUT_S = 30.0  # one request's limit, as the SDK's own
_UNSAFE = re.compile(r'["\\\n\r]')


class ApiError(Exception):
    """The API refused a request (not worth repeating)."""


class AuthError(ApiError):
    """The key is missing or refused."""


class NoCapacity(ApiError):
    """No pod of the asked kind is available right now."""


class ApiUnavailable(ApiError):
    """The API kept failing (429, 5xx, no answer) through every retry, or its deadline passed."""


class UnknownGpuType(ApiError):
    """Runpod has no GPU type of that id (a typo in ``gpu_types``): not worth repeating."""


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
                 sleep: Callable[[float], None] | None = None):
        import runpod  # ~1.6 s: only when a Runpod backend is used

        self._runpod = runpod
        self.api_key = api_key
        self.base_url = base_url
        self.retries = retries
        self.backoff_s = backoff_s
        self.stop = threading.Event()  # set: calls without a deadline stop retrying (the pool is closing)
        self._sleep = sleep

    def _wait(self, seconds: float) -> bool:
        """Sleep between tries; True when :attr:`stop` was set meanwhile."""
        if self._sleep is not None:
            self._sleep(seconds)
            return self.stop.is_set()
        return self.stop.wait(seconds)

    def _call(self, what: str, function: Callable[[], T], *, until: float | None = None) -> T:
        """``function()`` with retries of what may pass (429, 5xx, a dropped connection, a timeout): ``retries``
        more tries with exponential backoff; with ``until`` (a ``time.monotonic()`` deadline) instead as many as fit
        before it, with a short backoff, whatever :attr:`stop` says."""
        import requests
        from runpod import error

        self._runpod.api_key = self.api_key  # the SDK's mutations read only the module's global key
        if self.base_url:
            os.environ["RUNPOD_API_BASE_URL"] = self.base_url  # read by the SDK at each call
        last = ""
        for attempt in itertools.count():
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
            if until is not None:
                delay = min(0.25 * 2 ** attempt, 2.0)
                if time.monotonic() + delay >= until:
                    raise ApiUnavailable(f"{what}: no answer from the Runpod API in time ({attempt + 1} tries; "
                                         f"{last})")
                time.sleep(delay)
                continue
            if attempt >= self.retries:
                break
            if self._wait(min(self.backoff_s * 2 ** attempt, 60.0)):
                raise ApiUnavailable(f"{what}: given up, the pool is closing ({last})")
        raise ApiUnavailable(f"{what}: the Runpod API kept failing after {self.retries + 1} tries ({last})")

    def graphql(self, query: str, *, timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """The SDK's ``run_graphql_query`` (same address, headers and errors) with a timeout of ``timeout_s``."""
        import requests
        from runpod import error
        from runpod.user_agent import USER_AGENT

        base = self.base_url or os.environ.get("RUNPOD_API_BASE_URL", "https://api.runpod.io")
        response = requests.post(f"{base}/graphql", data=json.dumps({"query": query}), timeout=timeout_s,
                                 headers={"Content-Type": "application/json", "User-Agent": USER_AGENT,
                                          "Authorization": f"Bearer {self.api_key}"})
        if response.status_code == 401:
            raise error.AuthenticationError("Unauthorized request, please check your API key.")
        body = response.json()
        if "errors" in body:
            raise error.QueryError(body["errors"][0]["message"], query)
        return body

    def gpu_type_ids(self) -> list[str]:
        """The ids of every GPU type Runpod lists."""
        return self._call("list GPU types", lambda: sorted(str(g["id"]) for g in self._runpod.get_gpus()))

    def list_pods(self) -> list[PodInfo]:
        return self._call("list pods", self._pods)

    def list_pods_by(self, until: float, timeout_s: float) -> list[PodInfo]:
        """:meth:`list_pods` with requests of ``timeout_s`` retried until the deadline ``until``."""
        return self._call("list pods", lambda: self._pods(timeout_s), until=until)

    def _pods(self, timeout_s: float = REQUEST_TIMEOUT_S) -> list[PodInfo]:
        return [PodInfo.parse(p) for p in self.graphql(PODS_QUERY, timeout_s=timeout_s)["data"]["myself"]["pods"]]

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
            try:
                pod = self._runpod.create_pod(
                    name=name, image_name=image, gpu_type_id=gpu_type, cloud_type=cloud_type,
                    data_center_id=data_center, container_disk_in_gb=container_disk_gb, volume_in_gb=volume_gb,
                    ports="22/tcp", support_public_ip=True, start_ssh=True, env=env, docker_args=docker_args)
            except ValueError as exc:  # the SDK's pre-check found no such GPU type: a typo, not an outage
                if not NO_GPU.search(str(exc)):
                    raise
                raise self._unknown_gpu(gpu_type) from None
            return str(pod["id"])

        return self._call(f"create pod {name}", create)

    def _unknown_gpu(self, gpu_type: str) -> UnknownGpuType:
        try:
            known = f"; it lists: {', '.join(self.gpu_type_ids())}"
        except ApiError:
            known = ""
        return UnknownGpuType(f"Runpod has no GPU type {gpu_type!r} (gpu_backend.runpod.gpu_types){known}")

    def terminate(self, pod_id: str, *, until: float | None = None, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        """Terminate a pod; one already gone counts as terminated. ``until``: retry until that deadline."""
        from runpod import error
        from runpod.api.mutations.pods import generate_pod_terminate_mutation

        check_plain(pod_id, "pod id")

        def terminate() -> None:
            try:
                self.graphql(generate_pod_terminate_mutation(pod_id), timeout_s=timeout_s)
            except error.QueryError as exc:
                if not NOT_FOUND.search(str(exc)):
                    raise

        self._call(f"terminate pod {pod_id}", terminate, until=until)
