"""The local server's trust boundary, over loopback HTTP (raw requests, and the real tinker SDK): every route the app
defines refuses traversal names and reads nothing outside its checkpoint tree; only the server's key is taken (one
made per start unless given); only Host headers naming the server are answered; the fault switch exists in the test
server alone; one client key cannot act on another's models, samplers, checkpoints or futures."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote, urlsplit

import pytest

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.hostile

MODEL = "SmolLM2-135M-Instruct"
PROMPT = [1, 4093, 198, 5820, 253, 7302, 30, 2, 198, 1, 520, 9531, 198]
LEAK = b"LEAKED-"  # in the name of every file and folder planted outside the checkpoint tree, and in no request
# names a client might send to reach outside the checkpoint tree ("outside-run" is planted next to the state dir,
# "weights/ckpt" & co. in the state dir beside checkpoints/, "session-linked:train:0" is a link in checkpoints/)
HOSTILE = [
    "..", "../..", "../../outside-run", "..%2f..%2foutside-run", "%2e%2e%2f%2e%2e%2foutside-run", "%2e%2e",
    "/etc/passwd", "//etc", "\x00", "session-a\x00:train:0", "x" * 5000, "session-" + "a" * 5000 + ":train:0",
    "ｓｅｓｓｉｏｎ-ａ:train:0", "．．／．．／outside-run", "..\\..\\outside-run", "session-linked:train:0", "~",
    "session-a:train:0/../../..", "session-a:train:0\n", "",
]


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def request(base_url: str, method: str, path: str, body: bytes | None = None, *, key: str | None,
            host: str | None = None, content_type: str = "application/json") -> tuple[int, bytes]:
    """One HTTP request to the server on loopback, its path sent exactly as given (no normalising)."""
    address = urlsplit(base_url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    try:
        connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        connection.putheader("Host", address.netloc if host is None else host)
        if key is not None:
            connection.putheader("X-API-Key", key)
        if body is not None:
            connection.putheader("Content-Type", content_type)
            connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def raw(base_url: str, head: bytes) -> tuple[int, bytes]:
    """A request written byte for byte (headers http.client refuses to send: NUL, bytes that are not UTF-8)."""
    import socket

    address = urlsplit(base_url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(head + b"Connection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


# --- what a client owns, and what lies outside the checkpoint tree ---


@pytest.fixture(scope="module")
def owned(tinker_server):
    """A client of the server's key with a training model, a saved state, sampler weights (by name, and a sampling
    session) and an exported adapter: the ids it may use."""
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)

    async def make():
        training = await client.create_lora_training_client(MODEL, rank=8, seed=0, train_unembed=False)
        state = await training.save_state("ckpt-a")
        named = await training.save_weights_for_sampler("sampled-a")
        sampler = await training.save_weights_and_get_sampling_client()
        external = await training.save_weights_external("ext-a")
        return {"client": client, "training": training, "state": state.path, "named": named.path,
                "sampler": sampler, "external": external.path}

    ids = run(make(), 300)
    yield ids
    client.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def planted(tinker_server, owned):
    """Real checkpoints where a traversal would find them: next to the state dir (``outside-run``), in the state dir
    beside ``checkpoints/`` (``..``), and behind a link in ``checkpoints/`` named like a run. A load that got there
    would succeed; a listing or a URL would show a ``LEAKED-`` name."""
    state_dir = tinker_server.state_dir
    source = next((state_dir / "checkpoints").glob("*/weights/ckpt-a/checkpoint.pt"))
    outside = state_dir.parent / "outside-run"
    for root in (outside, state_dir):
        for kind in ("weights", "sampler_weights"):
            (root / kind / "ckpt").mkdir(parents=True, exist_ok=True)
            shutil.copy(source, root / kind / "ckpt" / "checkpoint.pt")
            (root / kind / "LEAKED-folder").mkdir(exist_ok=True)
        (root / "external_weights" / "ckpt").mkdir(parents=True, exist_ok=True)
        (root / "external_weights" / "ckpt" / "LEAKED-adapter.json").write_text("{}")
    link = state_dir / "checkpoints" / "session-linked:train:0"
    if not link.exists():
        link.symlink_to(outside, target_is_directory=True)
    before = _tree(outside) | _tree(state_dir, skip="checkpoints")
    try:
        yield outside
        assert _tree(outside) | _tree(state_dir, skip="checkpoints") == before, "a request wrote outside checkpoints/"
    finally:  # the session's server goes on as it was
        link.unlink()
        shutil.rmtree(outside)
        for kind in ("weights", "sampler_weights", "external_weights"):
            shutil.rmtree(state_dir / kind)


def _tree(root: Path, skip: str | None = None) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if not (skip and p.relative_to(root).parts[0] == skip) and p.name != "server.log"}


# --- every route, every traversal name ---

# routes that read no name from the client: what they answer does not depend on one
NAMELESS = {("POST", "/api/v1/client/config"), ("POST", "/api/v1/client/dynamic_config"),
            ("POST", "/api/v1/telemetry"), ("GET", "/api/v1/healthz"), ("HEAD", "/api/v1/healthz"),
            ("GET", "/api/v1/get_server_capabilities"), ("HEAD", "/api/v1/get_server_capabilities"),
            ("POST", "/api/v1/create_session")}


def app_routes() -> list[tuple[str, str]]:
    """(method, path template) of every route of the test server's app: what the command serves, and the test-only
    fault switch (the app is built without an engine: building it touches none)."""
    from aitrainsai_tinker_local_server.app import LocalTinker

    app = LocalTinker(cast(Any, None), api_key="tml-routes").app(test_routes=True)
    found = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        found.append((route.method, info.get("formatter") or info.get("path")))
    return found


def url_values(owned) -> dict[str, str]:
    """A valid value for each path parameter a route may have (the owned client's), so that each parameter is
    tried hostile with the others valid."""
    return {"run_id": owned["training"].model_id, "kind": "external_weights", "name": "ext-a",
            "sampler_id": owned["sampler"]._sampling_session_id, "session_id": owned["client"].holder.get_session_id()}


def json_bodies(name: str) -> list[bytes]:
    """Every name a body may carry set to ``name``: ids as themselves, paths as themselves and as the run of a
    tinker path (one body each way round)."""
    bodies = []
    for path, model_path in ((name, f"tinker://{name}/weights/ckpt"), (f"tinker://{name}/sampler_weights/ckpt", name)):
        bodies.append(json.dumps({
            "session_id": name, "model_id": name, "sampling_session_id": name, "request_id": name, "path": path,
            "model_path": model_path, "model_seq_id": 0, "sampling_session_seq_id": 0, "base_model": MODEL,
            "optimizer": True, "lora_config": {"rank": 8, "train_unembed": False}, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 1}, "adam_params": {"learning_rate": 0.1},
            "op": name, "status": 500}).encode())
    return bodies


def proto_body(model_id: str) -> bytes:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(PROMPT[:-1]),
                         loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)})
    sent = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=1)
    return forward_backward_request_to_proto(sent).SerializeToString()


def test_every_route_refuses_traversal_names_and_reads_nothing_outside(tinker_server, owned, planted):
    """Each route of the app (enumerated: a new one is walked too) with each hostile name in each place a name goes:
    each path parameter (the others valid, the owner's), the query, every name in a JSON body, the model id of a
    protobuf body. A route that reads names answers 4xx; no answer shows a file planted outside."""
    routes = app_routes()
    assert NAMELESS <= set(routes)  # a route that leaves the set is walked as one that reads names
    valid = url_values(owned)
    walked = 0
    for method, template in routes:
        params = re.findall(r"\{(\w+)\}", template)
        assert set(params) <= set(valid), f"{template}: give the walk a valid value for its new parameter"
        bodies: list[tuple[bytes | None, str]] = [(None, "application/json")]
        for name in HOSTILE:
            urls = set() if params else {template}
            for encoded in (quote(name, safe=""), quote(name, safe="/%")):
                for param in params:
                    urls.add(re.sub(r"\{(\w+)\}", lambda m, p=param, e=encoded: e if m[1] == p else valid[m[1]],
                                    template))
                if not params and method in ("GET", "HEAD"):
                    urls.add(f"{template}?starting_on={encoded}&ending_before={encoded}")
            if method == "POST":
                bodies = [(b, "application/json") for b in json_bodies(name)]
                bodies.append((proto_body(name), "application/x-protobuf"))
            for url in sorted(urls):
                for body, content_type in bodies:
                    status, answer = request(tinker_server.base_url, method, url, body, key=tinker_server.api_key,
                                             content_type=content_type)
                    walked += 1
                    seen = (method, url, body and body[:120], status, answer[:400])
                    assert LEAK not in answer, seen
                    if (method, template) not in NAMELESS:
                        assert 400 <= status < 500, seen
    assert walked > 1000


def test_hostile_checkpoint_paths_from_a_real_session(tinker_server, owned, planted):
    """What the SDK sends for a path (a live session, a valid model, the path hostile): each refused, nothing read."""
    client, training = owned["client"], owned["training"]
    paths = ["tinker://../weights/ckpt", "tinker://../sampler_weights/ckpt",
             "tinker://session-linked:train:0/weights/ckpt", "tinker://session-linked:train:0/sampler_weights/ckpt",
             "tinker://%2e%2e/weights/ckpt", f"tinker://{owned['training'].model_id}/weights/..",
             f"tinker://{owned['training'].model_id}/weights/ckpt-a\n", "tinker:///etc/weights/passwd",
             f"tinker://{planted}/weights/ckpt", "tinker://session-x:train:0/weights/../../../outside-run"]

    async def main():
        for path in paths:
            with pytest.raises((tinker.BadRequestError, tinker.NotFoundError)):
                await client.create_training_client_from_state(path)
            with pytest.raises((tinker.BadRequestError, tinker.NotFoundError)):
                await client.create_sampling_client(model_path=path)
        for name in ["..", "../x", "a/b", ".hidden", "x\n", "x" * 200, "ｘ", "a\x00b"]:
            with pytest.raises(tinker.BadRequestError):
                await training.save_state(name)
            with pytest.raises(tinker.BadRequestError):
                await training.save_weights_external(name)

    run(main())


def test_external_weight_urls_stay_in_the_state_dir(tinker_server, owned, planted):
    """A file in an exported folder that links outside (a copied checkpoint could hold one) is not offered."""
    rest = tinker.RestClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    folder = next((tinker_server.state_dir / "checkpoints").glob("*/external_weights/ext-a"))
    link = folder / "LEAKED-link.json"
    link.symlink_to(planted / "external_weights" / "ckpt" / "LEAKED-adapter.json")
    try:
        urls = rest.get_external_weights_urls(owned["external"]).result(timeout=60).urls
    finally:
        link.unlink()
    assert urls and all(u.startswith((tinker_server.state_dir / "checkpoints").resolve().as_uri() + "/")
                        for u in urls.values()), urls
    assert not any("LEAKED" in name or "LEAKED" in u for name, u in urls.items()), urls
    own = rest.list_checkpoints(owned["training"].model_id).result(timeout=60)
    assert {c.checkpoint_id for c in own.checkpoints} >= {"weights/ckpt-a", "external_weights/ext-a"}


# --- keys and hosts ---


def test_only_the_servers_key_is_taken(tinker_server):
    base, key = tinker_server.base_url, tinker_server.api_key
    path = "/api/v1/get_server_capabilities"
    assert request(base, "GET", path, key=key)[0] == 200
    for other in [None, "", "tml-", "tml-" + "x" * 40, key + "x", key[:-1], key.upper(), key + " x", "tml-é"]:
        status, answer = request(base, "GET", path, key=other)
        assert status == 401, (other, status, answer[:300])
    host = urlsplit(base).netloc.encode()
    for other in [b"tml-\xff\xfe", key.encode() + b"\x00", b"tml-" + "é".encode() * 3, key.encode() + b"\xc3"]:
        status, answer = raw(base, b"GET " + path.encode() + b" HTTP/1.1\r\nHost: " + host + b"\r\nX-API-Key: "
                             + other + b"\r\n")
        assert status in (400, 401), (other, status, answer[:300])


def test_a_foreign_host_is_refused(tinker_server):
    """DNS rebinding: a page of evil.example that resolves to 127.0.0.1 reaches the port, and names its own host."""
    base, key = tinker_server.base_url, tinker_server.api_key
    port = urlsplit(base).port
    path = "/api/v1/get_server_capabilities"
    assert request(base, "GET", path, key=key, host=f"127.0.0.1:{port}")[0] == 200
    assert request(base, "GET", path, key=key, host=f"localhost:{port}")[0] == 200
    for host in ["evil.example", f"evil.example:{port}", f"127.0.0.1.nip.io:{port}", f"127.0.0.1:{port}.evil",
                 "127.0.0.1", f"127.0.0.1:{port + 1}", f"localhost.evil.example:{port}", "", f"[::1]:{port}",
                 f"127.0.0.1:{port}@evil.example", f"0.0.0.0:{port}", f"EVIL.example:{port}"]:
        status, answer = request(base, "GET", path, key=key, host=host)
        assert status == 421, (host, status, answer[:300])
    # no Host at all (HTTP/1.0), and one with a NUL
    for head in [b"GET " + path.encode() + b" HTTP/1.0\r\nX-API-Key: " + key.encode() + b"\r\n",
                 b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1:" + str(port).encode() + b"\x00evil\r\n"
                 + b"X-API-Key: " + key.encode() + b"\r\n"]:
        assert raw(base, head)[0] in (400, 421)  # aiohttp refuses a NUL in a header itself


def test_the_command_makes_a_key_checks_the_host_and_has_no_test_routes(tmp_path):
    """``aitrainsai tinker-serve`` without --api-key: a key made for this start, printed once; any other 'tml-' key
    refused; a foreign Host refused unless named by --allow-host; no /_local/faults."""
    from aitrainsai_trainer_local.model import BASE_VARIABLE, TINY_BASE

    env = {k: v for k, v in os.environ.items() if not k.startswith("AITRAINSAI_")} | {BASE_VARIABLE: TINY_BASE}
    process = subprocess.Popen([sys.executable, "-m", "aitrainsai.cli", "tinker-serve", "--port", "0",
                                "--state-dir", str(tmp_path / "state"), "--allow-host", "tinker.internal"],
                               stdout=subprocess.PIPE, stderr=(tmp_path / "stderr").open("w"), text=True, env=env,
                               start_new_session=True)
    try:
        printed: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [printed.put(line) for line in process.stdout], daemon=True).start()
        lines: list[str] = []
        deadline = time.monotonic() + 180  # loading the model; the key comes right after the URL
        while time.monotonic() < deadline and not any("API key" in line for line in lines):
            with contextlib.suppress(queue.Empty):
                lines.append(printed.get(timeout=1))
            if process.poll() is not None or any("listening on" in line for line in lines):
                deadline = min(deadline, time.monotonic() + 10)
        listening = next((line for line in lines if "listening on" in line), None)
        assert listening is not None, (lines, (tmp_path / "stderr").read_text()[-2000:])
        base = re.search(r"http://127\.0\.0\.1:\d+", listening)[0]
        keys = re.findall(r"\btml-[A-Za-z0-9_-]{40,}", "".join(lines))
        assert len(keys) == 1, lines  # printed once
        (key,) = keys
        port = urlsplit(base).port
        path = "/api/v1/get_server_capabilities"
        assert request(base, "GET", path, key=key)[0] == 200
        for other in ["tml-local", "tml-" + key[4:][::-1], None]:
            assert request(base, "GET", path, key=other)[0] == 401
        assert request(base, "GET", path, key=key, host=f"evil.example:{port}")[0] == 421
        assert request(base, "GET", path, key=key, host=f"tinker.internal:{port}")[0] == 200
        status, _ = request(base, "POST", "/api/v1/create_session", b"{}", key=key)
        assert status == 200
        for method in ("POST", "GET"):
            assert request(base, method, "/_local/faults", b'{"clear": true}' if method == "POST" else None,
                           key=key)[0] == 404
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# --- one client key cannot act on another's things ---


@pytest.fixture(scope="module")
def intruder(tinker_server):
    """A second client on another key the server takes (the billing key: accepted besides the API key)."""
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.billing_key)
    yield client
    client.close("success").result(timeout=30)


REFUSED = (tinker.NotFoundError, tinker.PermissionDeniedError)


def test_another_key_cannot_read_a_models_info(owned, intruder):
    from tinker.lib.public_interfaces.training_client import fetch_training_info

    holder = intruder.holder
    with pytest.raises(REFUSED):
        holder.run_coroutine_threadsafe(fetch_training_info(holder, owned["training"].model_id)).result(timeout=60)


def _hijacked(owned, intruder):
    """The intruder's SDK aimed at the owner's model (its id, as if learned from a log)."""
    from tinker.lib.public_interfaces.training_client import TrainingClient

    training = owned["training"]
    return TrainingClient(intruder.holder, model_seq_id=0, model_id=training.model_id, info=training.get_info())


def test_another_key_cannot_save_a_models_weights(tinker_server, owned, intruder):
    hijacked = _hijacked(owned, intruder)

    async def main():
        with pytest.raises(REFUSED):
            await hijacked.save_state("stolen")
        with pytest.raises(REFUSED):
            await hijacked.save_weights_external("stolen")
        with pytest.raises(REFUSED):
            await hijacked.save_weights_for_sampler("stolen")
        with pytest.raises(REFUSED):
            await hijacked.save_weights_and_get_sampling_client()

    run(main())
    assert not list((tinker_server.state_dir / "checkpoints").glob("*/*/stolen"))


def test_another_key_cannot_train_a_model(owned, intruder):
    hijacked, training = _hijacked(owned, intruder), owned["training"]
    datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(PROMPT[:-1]),
                         loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)})

    async def logprobs():
        out = await training.forward([datum], "cross_entropy")
        return out.loss_fn_outputs[0]["logprobs"].to_numpy().tolist()

    async def main():
        before = await logprobs()
        with pytest.raises(REFUSED):
            await hijacked.forward_backward([datum], "cross_entropy")
        with pytest.raises(REFUSED):
            await hijacked.optim_step(tinker.AdamParams(learning_rate=0.1))
        with pytest.raises(REFUSED):
            await hijacked.forward([datum], "cross_entropy")
        assert await logprobs() == before

    run(main())


def test_another_key_cannot_sample_from_a_model(owned, intruder):
    from tinker.lib.public_interfaces.sampling_client import SamplingClient

    sampler = owned["sampler"]
    hijacked = SamplingClient(intruder.holder, sampling_session_id=sampler._sampling_session_id, base_model=MODEL)

    async def main():
        with pytest.raises(REFUSED):
            await hijacked.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(max_tokens=1))
        with pytest.raises(REFUSED):
            await hijacked.compute_logprobs(tinker.ModelInput.from_ints(PROMPT))
        for path in (owned["named"], owned["state"]):
            with pytest.raises(REFUSED):
                await intruder.create_sampling_client(model_path=path)
        with pytest.raises(REFUSED):
            await intruder.create_training_client_from_state(owned["state"])

    run(main())


def test_another_key_cannot_list_a_models_checkpoints(tinker_server, owned):
    theirs = tinker.RestClient(base_url=tinker_server.base_url, api_key=tinker_server.billing_key)
    with pytest.raises(REFUSED):
        theirs.list_checkpoints(owned["training"].model_id).result(timeout=60)
    with pytest.raises(REFUSED):
        theirs.get_external_weights_urls(owned["external"]).result(timeout=60)


def test_another_key_cannot_fetch_a_result_or_drive_a_session(tinker_server, owned):
    """Raw: a future's result (the owner's sampled tokens), a session's heartbeat, finish and models."""
    base, theirs = tinker_server.base_url, tinker_server.billing_key
    status, answer = request(base, "POST", "/api/v1/asample", json.dumps({
        "sampling_session_id": owned["sampler"]._sampling_session_id, "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 1}}).encode(), key=tinker_server.api_key)
    assert status == 200, answer
    request_id = json.loads(answer)["request_id"]
    session = owned["client"].holder.get_session_id()
    for path, body in [("/api/v1/retrieve_future", {"request_id": request_id}),
                       ("/api/v1/cancel_future", {"request_id": request_id}),
                       ("/api/v1/session_heartbeat", {"session_id": session}),
                       (f"/api/v1/sessions/{session}/finish", {}),
                       ("/api/v1/create_model", {"session_id": session, "model_seq_id": 99, "base_model": MODEL,
                                                 "lora_config": {"rank": 8, "train_unembed": False}}),
                       ("/api/v1/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 99})]:
        status, answer = request(base, "POST", path, json.dumps(body).encode(), key=theirs)
        assert status in (403, 404), (path, status, answer[:300])
    status, answer = request(base, "POST", "/api/v1/retrieve_future",
                             json.dumps({"request_id": request_id}).encode(), key=tinker_server.api_key)
    assert status == 200  # the owner's still


def test_ids_of_one_session_do_not_name_anothers(tinker_server, owned):
    """Same key, another session: its own session id, counted down and up, names no other session's model."""
    other = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    try:
        mine = other.holder.get_session_id()
        guesses = {mine + suffix for suffix in ("0", "1", "-1", "-2")}
        head, _, tail = mine.rpartition("-")
        if tail.isdigit():
            guesses |= {f"{head}-{n}" for n in range(max(0, int(tail) - 30), int(tail) + 30)}
        for session in sorted(guesses - {mine}):
            for seq in range(3):
                status, answer = request(tinker_server.base_url, "POST", "/api/v1/get_info",
                                         json.dumps({"model_id": f"{session}:train:{seq}"}).encode(),
                                         key=tinker_server.api_key)
                assert 400 <= status < 500, (session, seq, status, answer[:300])
    finally:
        other.close("success").result(timeout=30)
