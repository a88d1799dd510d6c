"""The chat engine of the hidden eval on a worker: an OpenAI-compatible server (vLLM) serving the base model and,
for a trained job, its LoRA adapter. Greedy (temperature 0), Qwen3's thinking off, the family's tools as OpenAI
tools; requests of one turn go out concurrently. Standard library only: the driver's runtime needs no HTTP client.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aitrainsai import ChatRequest, EngineSpec, Message

MAX_RESPONSE_BYTES = 4 * 2**20


class ServerError(RuntimeError):
    """The server did not answer a request after retries; the message is one line."""


class OpenAIChatEngine:
    """``engine(requests)``: one chat-completions call per conversation, ``concurrency`` at a time."""

    def __init__(self, base_url: str, model: str, spec: EngineSpec, *, concurrency: int, timeout_s: float = 600.0,
                 retries: int = 3, api_key: str = "EMPTY"):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.spec = spec
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.retries = retries
        self.api_key = api_key
        self.requests_sent = 0

    def new_batch(self) -> None:
        """Conversations are stateless here: every request carries the whole conversation."""

    def __call__(self, requests: Sequence[ChatRequest]) -> list[Message]:
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(requests)))) as pool:
            return list(pool.map(self._one, requests))

    def _one(self, request: ChatRequest) -> Message:
        body: dict[str, Any] = {
            "model": self.model, "messages": [_wire(m) for m in request.messages], "temperature": 0.0,
            "max_tokens": self.spec.max_new_tokens, "seed": 0,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        if request.tools:
            body["tools"] = request.tools
        data = self._post("/chat/completions", body)
        try:
            message = data["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"malformed chat completion: {str(data)[:200]}") from None
        reply: Message = {"role": "assistant", "content": message.get("content") or ""}
        calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
        if calls:
            reply["tool_calls"] = [{"id": c.get("id", ""), "type": "function", "function": c.get("function", {})}
                                   for c in calls]
        self.requests_sent += 1
        return reply

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        payload = json.dumps(body).encode()
        last = ""
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.base_url + path, data=payload, method="POST", headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read(MAX_RESPONSE_BYTES))
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {exc.read(300).decode(errors='replace')}"
                if exc.code < 500 and exc.code != 429:
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as exc:
                last = str(exc)
            time.sleep(min(8.0, 0.5 * 2**attempt))
        raise ServerError(f"{self.base_url}{path}: {' '.join(last.split())[:300]}")


def wait_ready(base_url: str, *, timeout_s: float, alive=lambda: True) -> None:
    """Wait until the server lists its models; ``alive()`` false (its process ended) stops waiting at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise ServerError("the inference server exited before it was ready")
        with contextlib.suppress(urllib.error.URLError, TimeoutError, ConnectionError):
            with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(1.0)
    raise ServerError(f"the inference server was not ready within {timeout_s:.0f} s")


def _wire(message: Message) -> dict[str, Any]:
    """A transcript message as the chat-completions API takes it (tool call arguments as JSON text)."""
    out: dict[str, Any] = {k: copy.deepcopy(v) for k, v in message.items()
           if k in ("role", "content", "tool_calls", "tool_call_id", "name")}  # the transcript stays as it is
    for call in out.get("tool_calls") or []:
        arguments = call.get("function", {}).get("arguments")
        if not isinstance(arguments, str):
            call["function"]["arguments"] = json.dumps(arguments)
    return out
