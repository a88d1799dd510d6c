"""The HTTP side of the local server (aiohttp): routes, who may call them, futures, injected faults (tests only).

Model work goes to one worker thread in arrival order (one model, serialised), so the event loop keeps answering
heartbeats and ``retrieve_future`` polls while a step runs. An RPC answers ``{"request_id"}`` at once; its result is
fetched with ``retrieve_future``, which waits up to ``POLL_WAIT`` seconds and then says ``try_again``: a request takes
as long as its work does, with no limit here (a client's deadline is its own).

Who may call: loopback clients, naming the server in ``Host`` (one of ``allowed_hosts``: no DNS rebinding), with one
of the server's keys (``X-API-Key``, compared in constant time). A session belongs to the key that opened it, and so
do its models, samplers, futures and the checkpoints of its models; every id a request names is checked whole
(:mod:`.wire`) and looked up in the server's tables, and another key's is answered 404, as an unknown one is. Session
and request ids are random, so a session cannot guess another's. Checkpoints of runs no session of this server made
(an earlier server's on the same state dir) may be read with any of its keys.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import logging
import secrets
import traceback
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from aitrainsai_tinker_local_server import MODEL_NAME
from aitrainsai_tinker_local_server.billing import Billing, CreateSessionBody, session_of
from aitrainsai_tinker_local_server.engine import Engine, check_loss, lora_shape
from aitrainsai_tinker_local_server.stability import StabilityStore, sampler_session, training_session
from aitrainsai_tinker_local_server.wire import (
    MODEL_ID,
    SAMPLER_ID,
    SESSION_ID,
    AdamParamsBody,
    BadRequest,
    CreateModelBody,
    CreateSamplingSessionBody,
    FaultBody,
    LoadWeightsBody,
    ModelIdBody,
    NotFound,
    OptimStepBody,
    RetrieveBody,
    SampleBody,
    SaveExternalBody,
    SaveForSamplerBody,
    SaveWeightsBody,
    SessionBody,
    TinkerPath,
    check_name,
    forward_backward_output,
    parse_forward_backward,
    sample_response,
    shown,
)

log = logging.getLogger("aitrainsai.tinker_serve")

POLL_WAIT = 25.0  # seconds a retrieve_future waits before answering try_again (the SDK reads for 45 s)
MAX_BODY = 64 * 2**20  # fwd/bwd chunks reach ~5 MB; aiohttp's default limit is 1 MiB
KEPT_RESULTS = 4096  # finished futures kept for (repeated) retrieval
PROTO = "application/x-protobuf"
B = TypeVar("B", bound=BaseModel)


@dataclass
class Session:
    principal: str  # which of the server's keys opened it ("api" or "billing")
    finished: bool = False


@dataclass
class Fault:
    op: str
    status: int | None
    remaining: int | None  # None: until cleared
    hang: bool


class LocalTinker:
    def __init__(self, engine: Engine, *, api_key: str, billing: Billing | None = None):
        self.engine = engine
        self.billing = billing or Billing()  # usage per session, its prices, who may read it
        # the keys it takes, by the role each plays; the billing key is accepted besides the API key
        self.keys = {"api": api_key} | ({"billing": self.billing.billing_key} if self.billing.billing_key else {})
        self.allowed_hosts: frozenset[str] = frozenset()  # "host:port" values of Host it answers (set once bound)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-model")
        self.sessions: dict[str, Session] = {}
        self.futures: OrderedDict[str, tuple[asyncio.Future, str]] = OrderedDict()  # id -> (future, its principal)
        self.faults: list[Fault] = []  # injected by tests (app(test_routes=True) only)
        self.hung: set[asyncio.Future] = set()
        self.names: tuple[str, ...] = (MODEL_NAME,)  # the names its one model answers to (--serve-as)
        self.stability = StabilityStore()  # stable_reinforce's records of samplers with record_stability_info
        self._ids = itertools.count(1)

    # --- application ---

    def app(self, *, test_routes: bool = False) -> web.Application:
        """The served app; ``test_routes``: with the fault switch (``POST /_local/faults``), which only the test
        server has (``testing.serve_for_tests``), never the ``tinker-serve`` command."""
        middlewares = [self._origin, *([self._faulty] if test_routes else []), self._guard]
        app = web.Application(client_max_size=MAX_BODY, middlewares=middlewares)
        post, get = web.post, web.get
        handlers: list[tuple[Callable, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = [
            (post, "client/config", self.client_config), (post, "client/dynamic_config", self.dynamic_config),
            (post, "telemetry", self.telemetry), (get, "healthz", self.healthz),
            (post, "create_session", self.create_session), (post, "session_heartbeat", self.heartbeat),
            (post, "sessions/{session_id}/finish", self.finish_session),
            (get, "get_server_capabilities", self.capabilities),
            (post, "create_model", self.create_model), (post, "get_info", self.get_info),
            (post, "forward_backward", self.forward_backward), (post, "optim_step", self.optim_step),
            (post, "save_weights", self.save_weights), (post, "load_weights", self.load_weights),
            (post, "save_weights_for_sampler", self.save_for_sampler),
            (post, "save_weights_external", self.save_external),
            (post, "create_sampling_session", self.create_sampling_session),
            (get, "samplers/{sampler_id}", self.get_sampler), (post, "asample", self.asample),
            (post, "retrieve_future", self.retrieve_future), (post, "cancel_future", self.cancel_future),
            (get, "training_runs/{run_id}/checkpoints", self.list_checkpoints),
            (get, "training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls", self.external_urls),
            (get, "billing/usage/events", self.billing_usage),
        ]
        app.add_routes([method("/api/v1/" + path, handler) for method, path, handler in handlers])
        if test_routes:
            app.add_routes([post("/_local/faults", self.set_faults)])
        app.on_shutdown.append(self._shutdown)
        return app

    async def _shutdown(self, _app: web.Application) -> None:
        for waiter in self.hung:
            waiter.cancel()
        self.worker.shutdown(wait=False, cancel_futures=True)

    @web.middleware
    async def _origin(self, request: web.Request, handler) -> web.StreamResponse:
        """Loopback peers only, naming this server in Host: a browser page of another name (DNS rebinding) is
        refused before anything else."""
        if request.remote not in ("127.0.0.1", "::1", None):
            return _error(403, "the local Tinker server answers loopback clients only")
        hosts = request.headers.getall("Host", [])
        if len(hosts) != 1 or hosts[0].lower() not in self.allowed_hosts:  # 421 Misdirected Request, as the viewer
            return _error(421, "the local Tinker server answers requests for "
                          + ", ".join(sorted(self.allowed_hosts)) + " only (Host; --allow-host adds a name)")
        return await handler(request)

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        principal = self._principal(request.headers.get("X-API-Key"))
        if principal is None:
            reason = ("invalid API key: this local Tinker server was started with a different --api-key (or made "
                      "its own, printed at start)" if request.headers.get("X-API-Key") else
                      "missing API key: send the X-API-Key header with the server's key")
            return _error(401, reason)
        request["principal"] = principal
        try:
            return await handler(request)
        except NotFound as error:
            return _error(404, str(error))
        except BadRequest as error:
            return _error(400, str(error))
        except ValidationError as error:
            return _error(400, f"bad request body for {request.path}: {_short(error)}")

    def _principal(self, key: str | None) -> str | None:
        """The role of ``key`` if it is one of the server's keys (each compared in constant time), else None."""
        if not key:
            return None
        given = key.encode("utf-8", "surrogateescape")  # header bytes that are not UTF-8 arrive as surrogates
        found = None
        for principal, expected in self.keys.items():
            if secrets.compare_digest(given, expected.encode()):
                found = principal
        return found

    # --- what a request names: checked whole, looked up, the caller's ---

    def _session(self, request: web.Request, session_id: str) -> str:
        session = self.sessions.get(session_id) if SESSION_ID.fullmatch(session_id) else None
        if session is None or session.principal != request["principal"]:
            raise NotFound(f"no session {shown(session_id)} on this server")
        return session_id

    def _owner(self, request: web.Request, session_id: str) -> bool:
        session = self.sessions.get(session_id)
        return session is not None and session.principal == request["principal"]

    def _model(self, request: web.Request, model_id: str) -> str:
        match = MODEL_ID.fullmatch(model_id)
        if match is None or not self._owner(request, match[1]) or model_id not in self.engine.runs:
            raise NotFound(f"no training model {shown(model_id)} on this server")
        return model_id

    def _sampler(self, request: web.Request, sampler_id: str) -> str:
        match = SAMPLER_ID.fullmatch(sampler_id)
        if match is None or not self._owner(request, match[1]) or sampler_id not in self.engine.samplers:
            raise NotFound(f"no sampler {shown(sampler_id)} on this server")
        return sampler_id

    def _checkpoint(self, request: web.Request, path: TinkerPath) -> TinkerPath:
        """``path`` if it is in the state dir and the caller may read it: a checkpoint of a run of its own key's
        sessions, or of no session of this server's (an earlier server's, on the same state dir)."""
        match = MODEL_ID.fullmatch(path.run_id)
        assert match is not None  # TinkerPath checked it
        if match[1] in self.sessions and not self._owner(request, match[1]) or not self.engine.exists(path):
            raise NotFound(f"no checkpoint {path} in this server's state dir")
        return path

    # --- injected faults (the test server's) ---

    @web.middleware
    async def _faulty(self, request: web.Request, handler) -> web.StreamResponse:
        op = request.path.removeprefix("/api/v1/") if request.path.startswith("/api/v1/") else None
        fault = self._fault_for(op) if op is not None else None
        if fault is None:
            return await handler(request)
        if fault.hang:
            waiter = asyncio.get_running_loop().create_future()
            self.hung.add(waiter)
            try:
                await waiter  # released by {"clear": true}, then answers 503
            finally:
                self.hung.discard(waiter)
            return _error(503, f"injected fault: {op} hung until faults were cleared")
        return _error(fault.status or 500, f"injected fault: {op} answered {fault.status}")

    def _fault_for(self, op: str) -> Fault | None:
        for fault in self.faults:
            if fault.op in ("*", op) or op.startswith(fault.op + "/"):
                if fault.remaining is not None:
                    fault.remaining -= 1
                    if fault.remaining <= 0:
                        self.faults.remove(fault)
                return fault
        return None

    async def set_faults(self, request: web.Request) -> web.Response:
        spec = await _parse(request, FaultBody)
        if spec.clear:
            self.faults.clear()
            for waiter in list(self.hung):
                if not waiter.done():
                    waiter.set_result(None)
        elif spec.hang or spec.status is not None:
            self.faults.append(Fault(spec.op, spec.status, spec.count, spec.hang))
        else:
            raise BadRequest('a fault needs "status" or "hang": true (or send {"clear": true})')
        return web.json_response({"faults": [vars(f) for f in self.faults], "hung": len(self.hung)})

    # --- futures ---

    def _new_id(self, kind: str) -> str:
        return f"{kind}-{secrets.token_urlsafe(18)}"

    def _submit(self, request: web.Request, work: Callable[[], tuple[str, Any]], *,
                request_id: str | None = None) -> str:
        """Queue ``work`` on the model thread; its ``(kind, payload)`` becomes the future's result, for the
        caller's key only."""
        request_id = request_id or self._new_id("req")
        future = asyncio.get_running_loop().run_in_executor(self.worker, _guarded, work)
        self.futures[request_id] = (future, request["principal"])
        while len(self.futures) > KEPT_RESULTS:
            oldest, (stale, _) = next(iter(self.futures.items()))
            if not stale.done():
                break
            del self.futures[oldest]
        return request_id

    def _future(self, request: web.Request, request_id: str) -> asyncio.Future:
        entry = self.futures.get(request_id)
        if entry is None or entry[1] != request["principal"]:
            raise NotFound(f"no request {shown(request_id)} on this server (a restarted server forgets them)")
        return entry[0]

    async def retrieve_future(self, request: web.Request) -> web.StreamResponse:
        body = await _parse(request, RetrieveBody)
        future = self._future(request, body.request_id)
        try:
            kind, payload = await asyncio.wait_for(asyncio.shield(future), POLL_WAIT)
        except TimeoutError:
            return web.json_response({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        if kind == "proto":
            return web.Response(body=payload, content_type=PROTO)
        return web.json_response(payload)

    async def cancel_future(self, request: web.Request) -> web.Response:
        self._future(request, (await _parse(request, RetrieveBody)).request_id)  # work once started runs to its end
        return web.json_response({})

    async def _rpc(self, request: web.Request, work: Callable[[], tuple[str, Any]], **extra) -> web.Response:
        request_id = self._submit(request, work)
        return web.json_response({"request_id": request_id, **extra})

    # --- service ---

    async def client_config(self, request: web.Request) -> web.Response:
        return web.json_response({"use_pyqwest_transport": False, "pjwt_auth_enabled": False,
                                  "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                                  "sample_join_sampling_session": False, "custom_loss_server_side": False})

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response({"sample_cancel_enabled": False})

    async def telemetry(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "accepted"})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def create_session(self, request: web.Request) -> web.Response:
        body = await _parse(request, CreateSessionBody)
        session_id = self._new_id("session")
        self.sessions[session_id] = Session(request["principal"])
        self.billing.session(session_id, body.user_metadata)
        return web.json_response({"type": "create_session", "session_id": session_id, "info_message": None})

    async def heartbeat(self, request: web.Request) -> web.Response:
        session_id = self._session(request, (await _parse(request, SessionBody)).session_id)
        if self.sessions[session_id].finished:
            return _error(410, f"session {session_id} has finished")
        return web.json_response({"type": "session_heartbeat"})

    async def finish_session(self, request: web.Request) -> web.Response:
        self.sessions[self._session(request, request.match_info["session_id"])].finished = True
        return web.json_response(None)

    async def capabilities(self, request: web.Request) -> web.Response:
        models = [{"model_name": name, "max_context_length": self.engine.context_length,
                   "trainable": True, "sampleable": True} for name in self.names]
        return web.json_response({"supported_models": models})

    # --- training ---

    async def create_model(self, request: web.Request) -> web.Response:
        body = await _parse(request, CreateModelBody)
        session_id = self._session(request, body.session_id)
        _check_model(body.base_model, self.names)
        if body.optimizer_config.type != "adamw":
            raise BadRequest(f"optimizer {shown(body.optimizer_config.type)}: the local server has Adam only")
        lora = body.lora_config
        if lora is None:
            raise BadRequest("the local server trains LoRA adapters only: give a lora_config")
        shape = lora_shape(lora.rank, train_attn=lora.train_attn, train_mlp=lora.train_mlp,
                           train_unembed=lora.train_unembed)
        model_id = f"{session_id}:train:{body.model_seq_id}"

        def work():
            return "json", self.engine.create_run(model_id, shape, seed=lora.seed)

        return await self._rpc(request, work, model_id=model_id)

    async def get_info(self, request: web.Request) -> web.Response:
        body = await _parse(request, ModelIdBody)
        return web.json_response(self.engine.info(self._model(request, body.model_id)))

    async def forward_backward(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if request.headers.get("Content-Encoding", "").lower() == "zstd":
            import zstandard

            try:  # the SDK compresses only when client_config says so (it does not): bounded all the same
                raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=MAX_BODY)
            except zstandard.ZstdError as error:
                raise BadRequest(f"forward_backward body is not zstd within {MAX_BODY} bytes: {error}") from None
        parsed = parse_forward_backward(raw)
        self._model(request, parsed.model_id)
        check_loss(parsed, self.engine.context_length)
        if parsed.loss_fn == "stable_reinforce":
            self.stability.attach(parsed, training_session(parsed.model_id))

        def work():
            outputs, metrics = self.engine.forward_backward(parsed)
            self.billing.trained(session_of(parsed.model_id), sum(len(d.tokens) for d in parsed.data))
            return "proto", forward_backward_output(outputs, metrics)

        return await self._rpc(request, work, model_id=parsed.model_id)

    async def optim_step(self, request: web.Request) -> web.Response:
        body = await _parse(request, OptimStepBody)
        model_id = self._model(request, body.model_id)
        if body.optimizer_params is not None and body.adam_params is None:
            raise BadRequest("the local server has Adam only: send AdamParams")
        adam = body.adam_params or AdamParamsBody()
        return await self._rpc(request, lambda: ("json", self.engine.optim_step(model_id, adam)), model_id=model_id)

    async def save_weights(self, request: web.Request) -> web.Response:
        body = await _parse(request, SaveWeightsBody)
        model_id = self._model(request, body.model_id)
        name = check_name(body.path) if body.path else f"state-{next(self._ids):06d}"
        return await self._rpc(request, lambda: ("json", self.engine.save_state(model_id, name, body.overwrite)),
                               model_id=model_id)

    async def load_weights(self, request: web.Request) -> web.Response:
        body = await _parse(request, LoadWeightsBody)
        if body.session_id is not None and body.model_seq_id is not None:
            model_id = f"{self._session(request, body.session_id)}:train:{body.model_seq_id}"
        elif body.model_id is not None:
            model_id = self._model(request, body.model_id)
        else:
            raise BadRequest("load_weights needs session_id and model_seq_id, or model_id")
        path = self._checkpoint(request, TinkerPath.parse(body.path))
        if body.base_model is not None:
            _check_model(body.base_model, self.names)
        if body.optimizer_config is not None and body.optimizer_config.type != "adamw":
            raise BadRequest(f"optimizer {shown(body.optimizer_config.type)}: the local server has Adam only")
        return await self._rpc(request, lambda: ("json", self.engine.load_state(model_id, path, body.optimizer)),
                               model_id=model_id)

    async def save_for_sampler(self, request: web.Request) -> web.Response:
        body = await _parse(request, SaveForSamplerBody)
        model_id = self._model(request, body.model_id)
        if body.kind != "snapshot":
            raise BadRequest(f"sampler kind {shown(body.kind)}: the local server has snapshot samplers only")
        if body.path is not None:
            name = check_name(body.path)
            return await self._rpc(request, lambda: ("json", self.engine.save_for_sampler(model_id, name=name,
                                                                                          sampler_id=None)))
        if body.sampling_session_seq_id is None:
            raise BadRequest("save_weights_for_sampler needs a path (name) or a sampling_session_seq_id")
        sampler_id = f"{training_session(model_id)}:sample:{body.sampling_session_seq_id}"
        return await self._rpc(request, lambda: ("json", self.engine.save_for_sampler(model_id, name=None,
                                                                                      sampler_id=sampler_id)))

    async def save_external(self, request: web.Request) -> web.Response:
        body = await _parse(request, SaveExternalBody)
        model_id = self._model(request, body.model_id)
        if body.age_encryption_recipients:
            raise BadRequest("the local server does not encrypt exports (age_encryption_recipients)")
        name = check_name(body.path)
        return await self._rpc(request, lambda: ("json", self.engine.save_external(model_id, name)))

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        run_id = request.match_info["run_id"]
        match = MODEL_ID.fullmatch(run_id)
        if match is None or (match[1] in self.sessions and not self._owner(request, match[1])) \
                or not self.engine.has_run(run_id):
            raise NotFound(f"no training run {shown(run_id)} on this server")
        found = self.engine.list_checkpoints(run_id)
        for item in found:
            item["time"] = datetime.datetime.fromtimestamp(item["time"], datetime.UTC).isoformat()
        return web.json_response({"checkpoints": found, "cursor": None})

    async def external_urls(self, request: web.Request) -> web.Response:
        info = request.match_info
        path = self._checkpoint(request, TinkerPath(info["run_id"], info["kind"], info["name"]))  # type: ignore[arg-type]
        expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3650)
        return web.json_response({"urls": self.engine.external_files(path), "expires": expires.isoformat()})

    # --- sampling ---

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        body = await _parse(request, CreateSamplingSessionBody)
        session_id = self._session(request, body.session_id)
        if body.base_model is not None:
            _check_model(body.base_model, self.names)
        model_path = None
        if body.model_path is not None:
            model_path = str(self._checkpoint(request, TinkerPath.parse(body.model_path)))
        sampler_id = f"{session_id}:sample:{body.sampling_session_seq_id}"
        # reading a checkpoint is quick; on the worker it stays ordered with the saves before it (a refusal, or
        # no such checkpoint, is raised here: a 400 or 404)
        return web.json_response(await asyncio.get_running_loop().run_in_executor(
            self.worker, lambda: self.engine.create_sampler(sampler_id, model_path=model_path)))

    async def get_sampler(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.sampler_info(self._sampler(request, request.match_info["sampler_id"])))

    async def asample(self, request: web.Request) -> web.Response:
        body = await _parse(request, SampleBody)
        params = body.sampling_params
        if params.top_k not in (-1, 0) or params.top_p != 1.0:
            raise BadRequest("top_k / top_p: the local server samples from the full distribution only")
        if body.topk_prompt_logprobs or body.topk_sample_logprobs or body.prompt_alt_tokens_k:
            raise BadRequest("top-k log-probs and prompt_alt_tokens are not supported by the local server")
        if body.target_prompt_logprobs is not None:
            raise BadRequest("target_prompt_logprobs is not supported by the local server")
        if body.sampling_session_id is not None:
            sampler_id = self._sampler(request, body.sampling_session_id)
        else:
            if body.base_model is not None:
                _check_model(body.base_model, self.names)
            path = body.model_path
            if path is not None:
                path = str(self._checkpoint(request, TinkerPath.parse(path)))
            sampler_id = self._new_id("oneoff")
            await asyncio.get_running_loop().run_in_executor(
                self.worker, lambda: self.engine.create_sampler(sampler_id, model_path=path))
        tokens = body.prompt.tokens()
        if not tokens:
            raise BadRequest("the prompt is empty")
        if body.prompt_logprobs_last_n is not None and not 1 <= body.prompt_logprobs_last_n <= len(tokens) - 1:
            raise BadRequest("prompt_logprobs_last_n must be between 1 and len(prompt) - 1")

        def work():
            sequences, prompt_logprobs = self.engine.sample(sampler_id, body)
            if body.record_stability_info:
                self.stability.record(ids, session, tokens, sequences)
            hits = self.billing.sampled(session_of(sampler_id), tokens, [s[0] for s in sequences])
            return "proto", sample_response(sequences, prompt_logprobs, cache_hit_tokens=hits)

        session = sampler_session(sampler_id)
        if body.record_stability_info and session is None:
            raise BadRequest("record_stability_info needs a sampling session (a SamplingClient), not a one-off sample")
        request_id = self._new_id("req")
        ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
        self._submit(request, work, request_id=request_id)
        return web.json_response({"request_id": request_id, "sample_sequence_ids": ids})

    # --- billing ---

    async def billing_usage(self, request: web.Request) -> web.Response:
        if self.billing.billing_key is not None and request["principal"] != "billing":
            return _error(403, "permission denied: this API key has no billing role (the local Tinker server was "
                          "started with --billing-key; only that key may read billing)")
        return web.json_response(self.billing.usage(request.query.get("starting_on"),
                                                    request.query.get("ending_before")))


async def _parse(request: web.Request, model: type[B]) -> B:
    """A JSON body as ``model``: text that is not UTF-8 or JSON, or nests past the parser, is a 400."""
    try:
        data = json.loads(await request.text())
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequest(f"the body of {request.path} is not JSON") from None
    return model.model_validate(data)


def _guarded(work: Callable[[], tuple[str, Any]]) -> tuple[str, Any]:
    """Run model work; a refusal or a crash becomes the future's error (the SDK raises RequestFailedError)."""
    try:
        return work()
    except BadRequest as error:
        return "json", {"error": str(error), "category": "user"}
    except Exception as error:  # noqa: BLE001 - any crash is reported to the client, and logged
        from aitrainsai_trainer_local.llama import TooLarge  # loaded: the model work ran

        if isinstance(error, TooLarge):  # the request's shapes need more than the trainer's memory bound
            return "json", {"error": f"the request is too large: {error}", "category": "user"}
        log.error("model work failed:\n%s", traceback.format_exc())
        return "json", {"error": f"{type(error).__name__}: {error}", "category": "server"}


def _check_model(name: str, names: tuple[str, ...] = (MODEL_NAME,)) -> None:
    if name not in names and not (MODEL_NAME in names and name.split("/")[-1] == MODEL_NAME):
        raise BadRequest(f"base model {shown(name)} is not served here; the local Tinker server has "
                         + ", ".join(repr(n) for n in names))


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "detail": message}, status=status)


def _short(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()[:3])
