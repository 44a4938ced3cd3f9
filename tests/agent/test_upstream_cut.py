"""An inference stream cut mid-answer (the replica killed, the connection reset, a chunked body
left incomplete) ends every streaming route of the agent with an error event naming the upstream
failure, never with a clean finish: the OpenAI facade's chat completions and Responses (read by
the official ``openai`` client), the pipeline SSE route and the websocket.

The upstream is a real socket server that speaks just enough HTTP/1.1: it lists a model, then
answers a streamed chat completion with a few SSE chunks and drops the connection."""

from __future__ import annotations

import json
import socket
import socketserver
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
from websockets.sync.client import connect

from tests.agent.stack import Stack, agent_stack
from tests.conftest import auth
from tests.helpers.sse import named_events

PIPELINE = "chat-documents-generate"
QUESTION = "What is the capital of France?"
# the chunks the upstream sends before it drops: the role, then two tokens
SENT = ["Paris ", "is "]


def _chunk(delta: dict[str, str]) -> bytes:
    body = {
        "id": "chatcmpl-cut",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "scripted",
        "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
    }
    event = f"data: {json.dumps(body)}\n\n".encode()
    return b"%x\r\n%s\r\n" % (len(event), event)  # one HTTP/1.1 chunk


class _CutUpstream(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        request_line = self.rfile.readline().decode()
        if not request_line:
            return
        method, path, _ = request_line.split(" ", 2)
        length = 0
        while line := self.rfile.readline().decode().strip():
            name, _, value = line.partition(":")
            if name.lower() == "content-length":
                length = int(value)
        self.rfile.read(length)
        self.server.requests.append(f"{method} {path}")
        if method == "GET" and path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "scripted", "object": "model"}]}).encode()
            head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            self.wfile.write(head.encode() + b"Connection: close\r\n\r\n" + body)
        elif method == "POST" and path == "/v1/chat/completions":
            self.wfile.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            self.wfile.write(_chunk({"role": "assistant", "content": ""}))
            for text in SENT:
                self.wfile.write(_chunk({"content": text}))
            self.wfile.flush()
            if self.server.mode == "reset":
                # as a killed process's socket: the kernel answers with RST, not FIN
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()  # "close": the chunked body ends incomplete
        else:
            self.wfile.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True

    def __init__(self, mode: str) -> None:
        super().__init__(("127.0.0.1", 0), _CutUpstream)
        self.mode = mode
        self.requests: list[str] = []


@contextmanager
def cut_upstream(mode: str) -> Iterator[tuple[_Server, str]]:
    server = _Server(mode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module", params=["close", "reset"])
def cut(
    request: pytest.FixtureRequest, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, _Server]]:
    with (
        cut_upstream(request.param) as (server, url),
        agent_stack(redis_url, tmp_path_factory.mktemp("home"), inference_urls=url) as stack,
    ):
        yield stack, server


def _names_the_cut(message: str) -> None:
    assert message.startswith("inference: ") and "stream was cut after its first tokens" in message, message


def test_the_facade_chat_stream_raises_the_upstream_failure_in_the_openai_client(
    cut: tuple[Stack, _Server], api_key: str
) -> None:
    stack, server = cut
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=api_key, max_retries=0, timeout=60)
    texts: list[str] = []
    with pytest.raises(openai.APIError) as failed:
        for chunk in client.chat.completions.create(
            model=PIPELINE,
            messages=[{"role": "user", "content": QUESTION}],
            stream=True,
            extra_body={"collection": "geo"},
        ):
            assert all(c.finish_reason is None for c in chunk.choices), "a cut answer finished cleanly"
            texts += [c.delta.content or "" for c in chunk.choices]
    _names_the_cut(failed.value.message)
    assert "".join(texts) == "".join(SENT)  # what came before the cut reached the client
    assert "POST /v1/chat/completions" in server.requests


def test_the_facade_chat_stream_ends_on_its_error_event(cut: tuple[Stack, _Server], api_key: str) -> None:
    stack, _ = cut
    body = {
        "model": PIPELINE,
        "messages": [{"role": "user", "content": QUESTION}],
        "stream": True,
        "collection": "geo",
    }
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, headers=auth(api_key)) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    _names_the_cut(error["message"])
    assert error["code"] == "upstream_error"


def test_the_facade_responses_stream_ends_failed(cut: tuple[Stack, _Server], api_key: str) -> None:
    stack, _ = cut
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=api_key, max_retries=0, timeout=60)
    events = list(
        client.responses.create(model=PIPELINE, input=QUESTION, stream=True, extra_body={"collection": "geo"})
    )
    types = [e.type for e in events]
    assert types[-1] == "response.failed" and "response.completed" not in types, types
    failed = events[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None
    _names_the_cut(failed.error.message)


def test_the_pipeline_sse_stream_ends_with_an_error_event(cut: tuple[Stack, _Server], api_key: str) -> None:
    stack, _ = cut
    body = {"query": QUESTION, "collection": "geo", "stream": True}
    url = f"{stack.url}/v1/pipelines/{PIPELINE}/run"
    with httpx.stream("POST", url, json=body, headers=auth(api_key), timeout=60) as resp:
        assert resp.status_code == 200
        events = [data for _, data in named_events(resp.iter_lines())]
    types = [e["type"] for e in events]
    assert types[-1] == "error" and "done" not in types, types
    assert [e["text"] for e in events if e["type"] == "token"] == SENT
    _names_the_cut(events[-1]["message"])
    assert events[-1]["status"] == 502


def test_the_websocket_turn_ends_with_an_error_event(cut: tuple[Stack, _Server], api_key: str) -> None:
    stack, _ = cut
    frame = {"pipeline": PIPELINE, "collection": "geo", "message": QUESTION}
    events: list[dict[str, Any]] = []
    with connect(stack.ws_url, additional_headers=auth(api_key), open_timeout=10) as conn:
        conn.send(json.dumps(frame))
        while not events or events[-1]["type"] not in ("done", "error"):
            events.append(json.loads(conn.recv(timeout=60)))
    assert events[-1]["type"] == "error", [e["type"] for e in events]
    _names_the_cut(events[-1]["message"])
