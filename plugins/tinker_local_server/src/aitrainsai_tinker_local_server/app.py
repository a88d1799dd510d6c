"""The HTTP side of the local server (aiohttp): routes, the API key, futures, injected faults.

Model work goes to one worker thread in arrival order (one model, serialised), so the event loop keeps answering
heartbeats and ``retrieve_future`` polls while a step runs. An RPC answers ``{"request_id"}`` at once; its result is
fetched with ``retrieve_future``, which waits up to ``POLL_WAIT`` seconds and then says ``try_again``.
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
    AdamParamsBody,
    BadRequest,
    CreateModelBody,
    CreateSamplingSessionBody,
    FaultBody,
    LoadWeightsBody,
    ModelIdBody,
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
)

log = logging.getLogger("aitrainsai.tinker_serve")

POLL_WAIT = 25.0  # seconds a retrieve_future waits before answering try_again (the SDK reads for 45 s)
MAX_BODY = 64 * 2**20  # fwd/bwd chunks reach ~5 MB; aiohttp's default limit is 1 MiB
KEPT_RESULTS = 4096  # finished futures kept for (repeated) retrieval
PROTO = "application/x-protobuf"
B = TypeVar("B", bound=BaseModel)


@dataclass
class Fault:
    op: str
    status: int | None
    remaining: int | None  # None: until cleared
    hang: bool


class LocalTinker:
    def __init__(self, engine: Engine, *, api_key: str | None, billing: Billing | None = None):
        self.engine = engine
        self.api_key = api_key
        self.billing = billing or Billing()  # usage per session, its prices, who may read it
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-model")
        self.futures: OrderedDict[str, asyncio.Future] = OrderedDict()
        self.faults: list[Fault] = []
        self.hung: set[asyncio.Future] = set()
        self.finished_sessions: set[str] = set()
        self.names: tuple[str, ...] = (MODEL_NAME,)  # the names its one model answers to (--serve-as)
        self.stability = StabilityStore()  # stable_reinforce's records of samplers with record_stability_info
        self._ids = itertools.count(1)
        self._serial = secrets.token_hex(3)  # keeps ids of different server processes apart

    # --- application ---

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._guard])
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
        app.add_routes([post("/_local/faults", self.set_faults)])
        app.on_shutdown.append(self._shutdown)
        return app

    async def _shutdown(self, _app: web.Application) -> None:
        for waiter in self.hung:
            waiter.cancel()
        self.worker.shutdown(wait=False, cancel_futures=True)

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        if request.remote not in ("127.0.0.1", "::1", None):
            return _error(403, "the local Tinker server answers loopback clients only")
        op = request.path.removeprefix("/api/v1/") if request.path.startswith("/api/v1/") else None
        if op is not None:
            fault = self._fault_for(op)
            if fault is not None:
                if fault.hang:
                    waiter = asyncio.get_running_loop().create_future()
                    self.hung.add(waiter)
                    try:
                        await waiter  # released by {"clear": true}, then answers 503
                    finally:
                        self.hung.discard(waiter)
                    return _error(503, f"injected fault: {op} hung until faults were cleared")
                return _error(fault.status or 500, f"injected fault: {op} answered {fault.status}")
        problem = self._check_key(request.headers.get("X-API-Key"))
        if problem is not None:
            return _error(401, problem)
        try:
            return await handler(request)
        except BadRequest as error:
            return _error(400, str(error))
        except ValidationError as error:
            return _error(400, f"bad request body for {request.path}: {_short(error)}")
        except json.JSONDecodeError:
            return _error(400, f"the body of {request.path} is not JSON")

    def _check_key(self, key: str | None) -> str | None:
        if not key:
            return "missing API key: send the X-API-Key header (a key starting with 'tml-')"
        if not key.startswith("tml-"):
            return "invalid API key: keys start with 'tml-'"
        if self.billing.billing_key is not None and secrets.compare_digest(key, self.billing.billing_key):
            return None
        if self.api_key is not None and not secrets.compare_digest(key, self.api_key):
            return "invalid API key: this local Tinker server was started with a different --api-key"
        return None

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
        spec = FaultBody.model_validate(await request.json())
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
        return f"{kind}-{self._serial}-{next(self._ids)}"

    def _submit(self, work: Callable[[], tuple[str, Any]], *, request_id: str | None = None) -> str:
        """Queue ``work`` on the model thread; its ``(kind, payload)`` becomes the future's result."""
        request_id = request_id or self._new_id("req")
        future = asyncio.get_running_loop().run_in_executor(self.worker, _guarded, work)
        self.futures[request_id] = future
        while len(self.futures) > KEPT_RESULTS:
            oldest, stale = next(iter(self.futures.items()))
            if not stale.done():
                break
            del self.futures[oldest]
        return request_id

    async def retrieve_future(self, request: web.Request) -> web.StreamResponse:
        body = RetrieveBody.model_validate(await request.json())
        future = self.futures.get(body.request_id)
        if future is None:
            return _error(404, f"no request {body.request_id!r} on this server (a restarted server forgets them)")
        try:
            kind, payload = await asyncio.wait_for(asyncio.shield(future), POLL_WAIT)
        except TimeoutError:
            return web.json_response({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        if kind == "proto":
            return web.Response(body=payload, content_type=PROTO)
        return web.json_response(payload)

    async def cancel_future(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _rpc(self, work: Callable[[], tuple[str, Any]], **extra) -> web.Response:
        request_id = self._submit(work)
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
        session_id = self._new_id("session")
        self.billing.session(session_id, CreateSessionBody.model_validate(await request.json()).user_metadata)
        return web.json_response({"type": "create_session", "session_id": session_id, "info_message": None})

    async def heartbeat(self, request: web.Request) -> web.Response:
        body = SessionBody.model_validate(await request.json())
        if body.session_id in self.finished_sessions:
            return _error(410, f"session {body.session_id} has finished")
        return web.json_response({"type": "session_heartbeat"})

    async def finish_session(self, request: web.Request) -> web.Response:
        self.finished_sessions.add(request.match_info["session_id"])
        return web.json_response(None)

    async def capabilities(self, request: web.Request) -> web.Response:
        models = [{"model_name": name, "max_context_length": self.engine.context_length,
                   "trainable": True, "sampleable": True} for name in self.names]
        return web.json_response({"supported_models": models})

    # --- training ---

    async def create_model(self, request: web.Request) -> web.Response:
        body = CreateModelBody.model_validate(await request.json())
        _check_model(body.base_model, self.names)
        if body.optimizer_config.type != "adamw":
            raise BadRequest(f"optimizer {body.optimizer_config.type!r}: the local server has Adam only")
        lora = body.lora_config
        if lora is None:
            raise BadRequest("the local server trains LoRA adapters only: give a lora_config")
        shape = lora_shape(lora.rank, train_attn=lora.train_attn, train_mlp=lora.train_mlp,
                           train_unembed=lora.train_unembed)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"

        def work():
            return "json", self.engine.create_run(model_id, shape, seed=lora.seed)

        return await self._rpc(work, model_id=model_id)

    async def get_info(self, request: web.Request) -> web.Response:
        body = ModelIdBody.model_validate(await request.json())
        return web.json_response(self.engine.info(body.model_id))

    async def forward_backward(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if request.headers.get("Content-Encoding", "").lower() == "zstd":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=16 * MAX_BODY)
        parsed = parse_forward_backward(raw)
        self.engine.run(parsed.model_id)
        check_loss(parsed, self.engine.context_length)
        if parsed.loss_fn == "stable_reinforce":
            self.stability.attach(parsed, training_session(parsed.model_id))

        def work():
            outputs, metrics = self.engine.forward_backward(parsed)
            self.billing.trained(session_of(parsed.model_id), sum(len(d.tokens) for d in parsed.data))
            return "proto", forward_backward_output(outputs, metrics)

        return await self._rpc(work, model_id=parsed.model_id)

    async def optim_step(self, request: web.Request) -> web.Response:
        body = OptimStepBody.model_validate(await request.json())
        if body.optimizer_params is not None and body.adam_params is None:
            raise BadRequest("the local server has Adam only: send AdamParams")
        adam = body.adam_params or AdamParamsBody()
        self.engine.run(body.model_id)
        return await self._rpc(lambda: ("json", self.engine.optim_step(body.model_id, adam)), model_id=body.model_id)

    async def save_weights(self, request: web.Request) -> web.Response:
        body = SaveWeightsBody.model_validate(await request.json())
        self.engine.run(body.model_id)
        name = check_name(body.path) if body.path else f"state-{next(self._ids):06d}"
        return await self._rpc(lambda: ("json", self.engine.save_state(body.model_id, name, body.overwrite)),
                               model_id=body.model_id)

    async def load_weights(self, request: web.Request) -> web.Response:
        body = LoadWeightsBody.model_validate(await request.json())
        path = TinkerPath.parse(body.path)
        if body.base_model is not None:
            _check_model(body.base_model, self.names)
        if body.session_id is not None and body.model_seq_id is not None:
            model_id = f"{body.session_id}:train:{body.model_seq_id}"
        elif body.model_id is not None:
            model_id = body.model_id
            self.engine.run(model_id)
        else:
            raise BadRequest("load_weights needs session_id and model_seq_id, or model_id")
        if body.optimizer_config is not None and body.optimizer_config.type != "adamw":
            raise BadRequest(f"optimizer {body.optimizer_config.type!r}: the local server has Adam only")
        return await self._rpc(lambda: ("json", self.engine.load_state(model_id, path, body.optimizer)),
                               model_id=model_id)

    async def save_for_sampler(self, request: web.Request) -> web.Response:
        body = SaveForSamplerBody.model_validate(await request.json())
        self.engine.run(body.model_id)
        if body.kind != "snapshot":
            raise BadRequest(f"sampler kind {body.kind!r}: the local server has snapshot samplers only")
        if body.path is not None:
            name = check_name(body.path)
            return await self._rpc(lambda: ("json", self.engine.save_for_sampler(body.model_id, name=name,
                                                                                 sampler_id=None)))
        if body.sampling_session_seq_id is None:
            raise BadRequest("save_weights_for_sampler needs a path (name) or a sampling_session_seq_id")
        session = body.model_id.split(":train:")[0]
        sampler_id = f"{session}:sample:{body.sampling_session_seq_id}"
        return await self._rpc(lambda: ("json", self.engine.save_for_sampler(body.model_id, name=None,
                                                                             sampler_id=sampler_id)))

    async def save_external(self, request: web.Request) -> web.Response:
        body = SaveExternalBody.model_validate(await request.json())
        self.engine.run(body.model_id)
        if body.age_encryption_recipients:
            raise BadRequest("the local server does not encrypt exports (age_encryption_recipients)")
        name = check_name(body.path)
        return await self._rpc(lambda: ("json", self.engine.save_external(body.model_id, name)))

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        found = self.engine.list_checkpoints(request.match_info["run_id"])
        for item in found:
            item["time"] = datetime.datetime.fromtimestamp(item["time"], datetime.UTC).isoformat()
        return web.json_response({"checkpoints": found, "cursor": None})

    async def external_urls(self, request: web.Request) -> web.Response:
        info = request.match_info
        path = TinkerPath(info["run_id"], info["kind"], check_name(info["name"]))  # type: ignore[arg-type]
        expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3650)
        return web.json_response({"urls": self.engine.external_files(path), "expires": expires.isoformat()})

    # --- sampling ---

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        body = CreateSamplingSessionBody.model_validate(await request.json())
        if body.base_model is not None:
            _check_model(body.base_model, self.names)
        if body.model_path is not None:
            TinkerPath.parse(body.model_path)
        sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        # reading a checkpoint is quick; on the worker it stays ordered with the saves before it
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self.worker, _guarded, lambda: (
            "json", self.engine.create_sampler(sampler_id, model_path=body.model_path)))
        if "error" in result[1]:
            return _error(400, result[1]["error"])
        return web.json_response(result[1])

    async def get_sampler(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.sampler_info(request.match_info["sampler_id"]))

    async def asample(self, request: web.Request) -> web.Response:
        body = SampleBody.model_validate(await request.json())
        params = body.sampling_params
        if params.top_k not in (-1, 0) or params.top_p != 1.0:
            raise BadRequest("top_k / top_p: the local server samples from the full distribution only")
        if body.topk_prompt_logprobs or body.topk_sample_logprobs or body.prompt_alt_tokens_k:
            raise BadRequest("top-k log-probs and prompt_alt_tokens are not supported by the local server")
        if body.target_prompt_logprobs is not None:
            raise BadRequest("target_prompt_logprobs is not supported by the local server")
        if body.sampling_session_id is not None:
            sampler_id = body.sampling_session_id
            self.engine.sampler_info(sampler_id)
        else:
            if body.base_model is not None:
                _check_model(body.base_model, self.names)
            sampler_id = self._new_id("oneoff")
            path = body.model_path
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
        self._submit(work, request_id=request_id)
        return web.json_response({"request_id": request_id, "sample_sequence_ids": ids})

    # --- billing ---

    async def billing_usage(self, request: web.Request) -> web.Response:
        problem = self.billing.key_problem(request.headers.get("X-API-Key"))
        if problem is not None:
            return _error(403, problem)
        return web.json_response(self.billing.usage(request.query.get("starting_on"),
                                                    request.query.get("ending_before")))


def _guarded(work: Callable[[], tuple[str, Any]]) -> tuple[str, Any]:
    """Run model work; a refusal or a crash becomes the future's error (the SDK raises RequestFailedError)."""
    try:
        return work()
    except BadRequest as error:
        return "json", {"error": str(error), "category": "user"}
    except Exception as error:  # noqa: BLE001 - any crash is reported to the client, and logged
        log.error("model work failed:\n%s", traceback.format_exc())
        return "json", {"error": f"{type(error).__name__}: {error}", "category": "server"}


def _check_model(name: str, names: tuple[str, ...] = (MODEL_NAME,)) -> None:
    if name not in names and not (MODEL_NAME in names and name.split("/")[-1] == MODEL_NAME):
        raise BadRequest(f"base model {name!r} is not served here; the local Tinker server has "
                         + ", ".join(repr(n) for n in names))


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "detail": message}, status=status)


def _short(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()[:3])
