"""A stand-in for ``vllm serve`` for tests without a GPU: the OpenAI chat-completions subset the evaluation uses,
on loopback. ``python -m aitrainsai_trainer_prime_rl.testing.fake_vllm --model M --port P [--lora-modules job=DIR]``
(other vLLM flags are accepted and ignored).

Replies are scripted so tests can see what reached the server: the base model answers ``<answer>0</answer>``; the
adapter ``job`` (served only when ``--lora-modules`` names a folder holding ``adapter_config.json``) first calls the
first tool it was given with the arguments ``{}`` and then answers ``<answer>1</answer>``. Every reply's text ends
with the sampling settings it was asked for (``[temperature=… thinking=…]``).
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def serve(model: str, port: int, lora: dict[str, Path]) -> None:
    models = [model, *lora]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            """No access log: the tests read the replies."""

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in models]})
            self._send(404, {"error": "not found"})

        def do_POST(self):
            if self.path != "/v1/chat/completions":
                return self._send(404, {"error": "not found"})
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if body.get("model") not in models:
                return self._send(404, {"error": {"message": f"model {body.get('model')!r} does not exist"}})
            settings = (f" [temperature={body.get('temperature')} "
                        f"thinking={body.get('chat_template_kwargs', {}).get('enable_thinking')}]")
            message = {"role": "assistant", "content": "<answer>0</answer>" + settings}
            tools = body.get("tools") or []
            if body["model"] in lora:
                if tools and body["messages"][-1].get("role") != "tool":
                    message = {"role": "assistant", "content": "", "tool_calls": [{
                        "id": "call_x", "type": "function",
                        "function": {"name": tools[0]["function"]["name"], "arguments": "{}"}}]}
                else:
                    message["content"] = "<answer>1</answer>" + settings
            self._send(200, {"id": "cmpl", "object": "chat.completion", "model": body["model"],
                             "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"fake vLLM serving {models} on 127.0.0.1:{port}", flush=True)
    server.serve_forever()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--lora-modules", nargs="*", default=[])
    known, _ = parser.parse_known_args(argv)
    lora = {}
    for entry in known.lora_modules:
        name, _, path = entry.partition("=")
        if not (Path(path) / "adapter_config.json").is_file():
            print(f"no adapter at {path}", file=sys.stderr)
            return 1
        lora[name] = Path(path)
    serve(known.model, known.port, lora)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
