"""The tinker trainer's start against services that are not what the config says: a 404, a server error, a closed
port, a base model not offered. Each is one line naming the address and what it answered, quickly (not the SDK's
minutes of retries), and says whether a resume can help. Everything runs against a small loopback HTTP server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from aitrainsai import StopRun
from aitrainsai_outer_tinker.trainer import SECTION, TinkerConfig, TinkerTrainer

KEY = "tml-fake-service-key"
OFFERED = "Qwen/Qwen3-4B-Instruct-2507"  # a chat format the trainer knows


class FakeService:
    """Answers every request with ``status``; with 200, ``client/config`` and ``get_server_capabilities`` as a Tinker
    service offering ``OFFERED``."""

    def __init__(self, status: int):
        self.status = status
        self.requests: list[str] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                service.requests.append(f"{self.command} {self.path}")
                code, body = service.status, {"detail": "no such thing"}
                if code == 200 and self.path.endswith("/client/config"):
                    body = {"pjwt_auth_enabled": False}
                elif code == 200 and self.path.endswith("/get_server_capabilities"):
                    if self.headers.get("X-API-Key") == KEY:
                        body = {"supported_models": [{"model_name": OFFERED}]}
                    else:
                        code, body = 401, {"detail": "send the X-API-Key header"}
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service(request, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")  # loopback traffic never through a proxy
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    fake = FakeService(request.param)
    yield fake
    fake.close()


def trainer(url: str, tmp_path, **changes) -> TinkerTrainer:
    options = {"base_url": url, "base_model": OFFERED, "retries": 1, "backoff_s": 0.05, "call_timeout_s": 20.0,
               "prices": {}}  # the rate table has no row for OFFERED
    return TinkerTrainer(TinkerConfig(**(options | changes)), state_dir=tmp_path)


def refusal(started: TinkerTrainer) -> tuple[StopRun, float]:
    began = time.monotonic()
    with pytest.raises(StopRun) as stopped:
        asyncio.run(started.start())
    assert started._service is None
    return stopped.value, time.monotonic() - began


@pytest.mark.parametrize("service", [404], indirect=True)
def test_a_404_at_start_is_one_line_that_a_resume_cannot_fix(service, tmp_path):
    error, seconds = refusal(trainer(service.url, tmp_path))
    assert str(error) == (f"{SECTION}: {service.url} answered 404 Not Found to GET /api/v1/get_server_capabilities: "
                          "it is not a Tinker service (check base_url)")
    assert not error.resumable and seconds < 10
    assert service.requests == ["GET /api/v1/get_server_capabilities"]  # nothing more, and never the key


@pytest.mark.parametrize("service", [503], indirect=True)
def test_a_server_error_at_start_is_one_line_after_bounded_retries(service, tmp_path):
    error, seconds = refusal(trainer(service.url, tmp_path))
    assert str(error) == f"{SECTION}: the Tinker service at {service.url} answered 503 Service Unavailable"
    assert error.resumable and seconds < 10, "the SDK would retry a 503 for five minutes"
    assert len(service.requests) == 2  # the first try and one retry


def test_a_closed_port_at_start_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    error, seconds = refusal(trainer(url, tmp_path))
    assert str(error).startswith(f"{SECTION}: cannot reach the Tinker service at {url}: ")
    assert "Connection refused" in str(error) and "\n" not in str(error)
    assert error.resumable and seconds < 10, "the SDK would retry a connection for five minutes"


@pytest.mark.parametrize("service", [200], indirect=True)
def test_a_base_model_not_offered_is_refused_before_the_run_and_at_start(service, tmp_path):
    """Not offered: a resume cannot help (the base model is in the run's config). ``service_problems`` says so before
    a run exists; ``start`` says it again for a run that got past that."""
    config = TinkerConfig(base_url=service.url, base_model="Qwen/Qwen3-235B-A22B-Instruct-2507", prices={})
    (problem,) = TinkerTrainer.service_problems(config)
    assert problem == ("base model 'Qwen/Qwen3-235B-A22B-Instruct-2507' is not offered by the service; "
                       f"the service offers: {OFFERED} (at {service.url}; "
                       f"choose one with -s {SECTION}.base_model=NAME)")
    error, _ = refusal(trainer(service.url, tmp_path, base_model="Qwen/Qwen3-235B-A22B-Instruct-2507"))
    assert str(error) == f"{SECTION}: {problem}" and not error.resumable and "--resume" not in problem
    assert TinkerTrainer.service_problems(config.model_copy(update={"base_model": OFFERED})) == []


@pytest.mark.parametrize("service", [200], indirect=True)
def test_a_refused_key_before_the_run_names_the_variable_not_the_key(service, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", "tml-not-this-services-key")
    (problem,) = TinkerTrainer.service_problems(TinkerConfig(base_url=service.url, base_model=OFFERED, prices={}))
    assert problem == "the Tinker service refused the key in $TINKER_API_KEY (401)"  # the caller names the section


def test_the_local_server_is_not_asked_before_the_run():
    assert TinkerTrainer.service_problems(TinkerConfig(base_url="local")) == []
