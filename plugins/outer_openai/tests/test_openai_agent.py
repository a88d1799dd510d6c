"""The agent against a local server that speaks the chat-completions wire format."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from aitrainsai.testing import OuterTrainerConformance
from aitrainsai import AgentTask, ScoredEpisode
from aitrainsai_outer_openai.agent import OpenAIAgent


class ChatServer(BaseHTTPRequestHandler):
    requests: list[dict] = []
    replies: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ChatServer.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
        if not ChatServer.replies:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "no reply scripted"}}')
            return
        message = ChatServer.replies.pop(0)
        payload = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                   "choices": [{"index": 0, "message": message,
                                "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
                   "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = HTTPServer(("127.0.0.1", 0), ChatServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    ChatServer.requests, ChatServer.replies = [], []
    yield f"http://127.0.0.1:{httpd.server_port}/v1"
    httpd.shutdown()


TASK = AgentTask(family="calc_chain", level=1, levels=[1], held_out=False, template={}, allowed_bases=["a"],
                 max_train_steps=10, max_dataset_size=10)


class TestOpenAIConformance(OuterTrainerConformance):
    trainer = OpenAIAgent
    distribution = "aitrainsai-outer-openai"


def test_tool_calls_come_back_as_agent_turns(server, tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_KEY", "sk-test")
    agent = OpenAIAgent(OpenAIAgent.Config(base_url=server, model="frozen-1", api_key_env="TEST_KEY"),
                        state_dir=tmp_path)
    ChatServer.replies.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "list_files", "arguments": "{}"}}]})
    tools = [{"type": "function", "function": {"name": "list_files", "description": "List files.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "tool", "tool_call_id": "x", "name": "read_file", "content": "r"}]
    async def sample_then_close():
        await agent.start()
        try:
            return await agent.sample(messages, tools, TASK, mode="eval")
        finally:
            await agent.close()

    turn = asyncio.run(sample_then_close())
    assert turn.message["tool_calls"][0]["function"]["name"] == "list_files" and agent._client is None
    request = ChatServer.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["auth"] == "Bearer sk-test"
    assert request["body"]["model"] == "frozen-1" and request["body"]["tools"] == tools
    assert "name" not in request["body"]["messages"][2], "only wire fields are sent"


def test_an_endpoint_failure_is_a_parse_error_not_a_crash(server, tmp_path):
    agent = OpenAIAgent(OpenAIAgent.Config(base_url=server, timeout_s=5), state_dir=tmp_path)
    turn = asyncio.run(agent.sample([{"role": "user", "content": "u"}], [], TASK))
    assert turn.parse_error and "endpoint failed" in turn.parse_error


def test_it_never_trains(tmp_path):
    agent = OpenAIAgent(OpenAIAgent.Config(), state_dir=tmp_path)
    metrics = asyncio.run(agent.update([[ScoredEpisode(id="a", turns=[], reward=1.0),
                                         ScoredEpisode(id="b", turns=[], reward=0.0)]]))
    assert metrics == {"mean_reward": 0.5} and agent.policy_version == 0
