"""The one SSE reader, the typed OpenAI chunks, the upstream-error mapping, and the shared client's
retry on another replica over real HTTP (small servers that die in the ways replicas do)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common import errors
from services.common.openai_client import OpenAIClient
from services.common.openai_stream import SSEEvent, iter_sse, openai_chunks
from services.common.openai_wire import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    FunctionCall,
    ModelCard,
    TextCompletion,
    ToolCall,
    Usage,
)
from services.common.replicas import ReplicaPool
from services.common.upstream import (
    UpstreamBroken,
    UpstreamReply,
    UpstreamStatus,
    tandem_error,
    upstream_error,
)
from tests.helpers.servers import free_port, serve_app


async def lines_of(*lines: str) -> AsyncIterator[str]:
    for line in lines:
        yield line


async def chunks_of(*lines: str) -> list[ChatCompletionChunk]:
    return [c async for c in openai_chunks(lines_of(*lines), ChatCompletionChunk)]


def test_sse_events_as_the_spec_has_them() -> None:
    lines = [
        ": a comment",
        "event: progress",
        'data: {"a": 1}',
        "",
        "data: one",
        "data:two",
        "",
        "data: tail",
    ]
    assert list(iter_sse(lines)) == [
        SSEEvent('{"a": 1}', "progress"),
        SSEEvent("one\ntwo"),
        SSEEvent("tail"),  # the last event without its blank line is not lost
    ]


def test_chunks_are_typed_and_done_ends_the_stream() -> None:
    role = '{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": null}'
    text = '{"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}], "x_extra": 1}'
    call = (
        '{"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", '
        '"arguments": "{}"}}]}}]}'
    )
    usage = '{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}'
    got = asyncio.run(chunks_of(f"data: {role}", "", f"data: {text}", "", f"data: {call}", "", f"data: {usage}",
                                "", "data: [DONE]", "", "data: {\"after\": \"done\"}"))  # fmt: skip
    assert len(got) == 4
    assert not got[0].has_output() and got[1].has_output()
    assert got[1].choices[0].text == "Hi" and got[1].model_extra == {"x_extra": 1}
    tool = got[2].choices[0].delta.tool_calls
    assert tool and tool[0].function and tool[0].function.name == "f"
    assert got[3].usage is not None and got[3].usage.completion_tokens == 1 and got[3].has_output()


def test_a_stream_without_done_an_error_object_or_a_bad_chunk_is_broken() -> None:
    with pytest.raises(UpstreamBroken) as cut:
        asyncio.run(chunks_of('data: {"choices": []}', ""))
    assert cut.value.truncated
    with pytest.raises(UpstreamBroken, match="engine timed out") as err:
        asyncio.run(chunks_of('data: {"error": {"message": "engine timed out", "type": "timeout"}}', ""))
    assert not err.value.truncated
    with pytest.raises(UpstreamBroken, match="malformed"):
        asyncio.run(chunks_of("data: {not json", ""))
    with pytest.raises(UpstreamBroken, match="malformed"):
        asyncio.run(chunks_of('data: {"choices": [{"index": "first"}]}', ""))

    async def completion() -> list[TextCompletion]:
        lines = lines_of('data: {"choices": [{"text": "x", "finish_reason": "length"}]}', "", "data: [DONE]")
        return [c async for c in openai_chunks(lines, TextCompletion)]

    (only,) = asyncio.run(completion())
    assert only.choices[0].text == "x" and only.has_output()


def test_what_is_written_reads_back_as_it_was() -> None:
    """One model set writes and reads: an answer read back (as a client reads it) writes the same
    JSON, and an upstream's card without Tandem's fields reads with their defaults, its own kept."""
    call = ToolCall(id="call_1", function=FunctionCall(name="add", arguments='{"a": 1}'))
    message = ChatCompletionMessage(content=None, tool_calls=[call])
    answer = ChatCompletion(
        id="chatcmpl-1",
        created=7,
        model="m",
        choices=[ChatChoice(index=0, message=message, finish_reason="tool_calls")],
        usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5),
    )
    wire = json.dumps(answer.model_dump())
    read = ChatCompletion.model_validate_json(wire)
    assert read.message.tool_calls == [call] and json.dumps(read.model_dump()) == wire
    card = ModelCard.model_validate({"id": "m", "object": "model", "owned_by": "vllm", "x_extra": 1})
    assert (card.kind, card.owned_by, card.model_dump()["x_extra"]) == ("base", "vllm", 1)


def reply(status: int, content: bytes, headers: dict[str, str] | None = None) -> UpstreamReply:
    return UpstreamReply.of("inference", httpx.Response(status, content=content, headers=headers))


def test_upstream_replies_are_read_in_every_shape_and_mapped_once() -> None:
    openai_shape = b'{"error": {"message": "unknown model", "type": "not_found_error", "param": "model"}}'
    r = reply(404, openai_shape)
    assert (r.message, r.param) == ("unknown model", "model")
    assert reply(422, b'{"detail": "bad field"}').message == "bad field"
    assert reply(500, b"Internal Server Error").message == "Internal Server Error"
    assert reply(502, b"").message == "Bad Gateway"
    cases: list[tuple[int, type[errors.TandemError]]] = [
        (404, errors.NotFound),
        (429, errors.TooManyRequests),
        (401, errors.UpstreamError),
        (403, errors.UpstreamError),
        (400, errors.InvalidRequest),
        (422, errors.InvalidRequest),
        (500, errors.UpstreamError),
        (503, errors.UpstreamError),
    ]
    for status, kind in cases:
        mapped = upstream_error(reply(status, openai_shape, {"Retry-After": "7"}), param="collection")
        assert type(mapped) is kind, status
        assert mapped.message.startswith("inference: unknown model")
    assert upstream_error(reply(429, b"{}", {"Retry-After": "7"})).headers == {"Retry-After": "7"}
    assert "refused upstream" in upstream_error(reply(401, b"{}")).message
    assert isinstance(tandem_error("inference", httpx.ConnectError("refused")), errors.ServiceUnavailable)
    assert isinstance(tandem_error("inference", UpstreamBroken("cut")), errors.UpstreamError)


# -- the client over replicas, real HTTP ------------------------------------------------------


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}


def token(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


async def die() -> AsyncIterator[bytes]:
    raise RuntimeError("the replica died")
    yield b""


def replica(name: str, dies: str | None = None) -> tuple[FastAPI, list[str]]:
    """An OpenAI-compatible replica answering ``name``; ``dies``: how it dies mid-request
    ("before-token": the role chunk then the connection dropped; "after-token": one token, then
    dropped; "quietly": the role chunk, then the stream ends without [DONE])."""
    app = FastAPI()
    seen: list[str] = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        seen.append("stream" if body.get("stream") else "json")
        if not body.get("stream"):
            if dies:  # the status line goes out, then the connection drops: no answer at all
                return StreamingResponse(die(), media_type="application/json")
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": name}}]}

        async def stream() -> AsyncIterator[bytes]:
            yield sse(ROLE)
            if dies == "after-token":
                yield sse(token(name))
            if dies in ("before-token", "after-token"):
                raise RuntimeError("died mid-stream")
            if dies == "quietly":
                return
            yield sse(token(name))
            yield sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models() -> Any:
        if dies:
            return JSONResponse({"error": {"message": "not ready", "type": "service_unavailable"}}, 503)
        return {"data": [{"id": name}]}

    return app, seen


@pytest.fixture(scope="module")
def replicas() -> Iterator[dict[str, tuple[str, list[str]]]]:
    with contextlib.ExitStack() as stack:
        out = {}
        for name in ("good", "before-token", "after-token", "quietly"):
            app, seen = replica(name, None if name == "good" else name)
            out[name] = (stack.enter_context(serve_app(app)), seen)
        yield out


def client_for(first: str, then: str) -> OpenAIClient:
    """A client whose first try goes to ``first`` (the other is busier), its retry to ``then``."""
    pool = ReplicaPool([first, then])
    for url in (first, then):
        pool.observe(url, True)
    pool.health_ttl_s = float("inf")
    pool._replica(then).in_flight = 1  # a request in flight elsewhere: the first try goes to `first`
    return OpenAIClient(pool, "k", timeout=10)


async def answer(client: OpenAIClient) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    chunks = [c async for c in client.stream("/chat/completions", body, ChatCompletionChunk)]
    assert not chunks[0].has_output()  # the role chunk comes first, from the replica that answered
    return "".join(ch.text for c in chunks for ch in c.choices)


@pytest.mark.parametrize("death", ["before-token", "quietly"])
def test_a_stream_whose_replica_dies_before_the_first_token_is_answered_by_another(
    replicas: dict[str, tuple[str, list[str]]], death: str
) -> None:
    dying, seen = replicas[death]
    good, good_seen = replicas["good"]
    seen.clear()
    good_seen.clear()
    client = client_for(dying, good)
    assert asyncio.run(answer(client)) == "good"
    assert seen == ["stream"] and good_seen == ["stream"]
    assert client.pool.retries == 1 and client.pool.replicas[0].healthy is False


def test_a_refused_connection_is_retried_and_a_json_call_too(
    replicas: dict[str, tuple[str, list[str]]],
) -> None:
    good, _ = replicas["good"]
    client = client_for(f"http://127.0.0.1:{free_port()}", good)
    assert asyncio.run(answer(client)) == "good"
    dropped, _ = replicas["before-token"]
    client = client_for(dropped, good)
    body = {"model": "m", "messages": []}
    got = asyncio.run(client.request_as(ChatCompletion, "POST", "/chat/completions", body))
    assert got.message.content == "good" and client.pool.retries == 1


def test_after_the_first_token_a_death_is_the_callers_error_not_a_retry(
    replicas: dict[str, tuple[str, list[str]]],
) -> None:
    dying, _ = replicas["after-token"]
    good, good_seen = replicas["good"]
    good_seen.clear()
    client = client_for(dying, good)
    got: list[str] = []

    async def run() -> None:
        body = {"model": "m", "messages": []}
        async for c in client.stream("/chat/completions", body, ChatCompletionChunk):
            got.extend(ch.text for ch in c.choices)

    # a cut stream, the same error as one that ends without [DONE] (not "unreachable")
    with pytest.raises(UpstreamBroken, match="cut after its first tokens") as cut:
        asyncio.run(run())
    assert isinstance(cut.value.__cause__, httpx.RemoteProtocolError)
    assert "".join(got) == "after-token" and good_seen == [] and client.pool.retries == 0


def test_an_error_status_is_an_answer_not_a_death(replicas: dict[str, tuple[str, list[str]]]) -> None:
    dying, _ = replicas["quietly"]
    good, _ = replicas["good"]
    client = client_for(dying, good)
    with pytest.raises(UpstreamStatus) as err:
        asyncio.run(client.request("GET", "/models"))
    assert err.value.reply.status_code == 503 and err.value.reply.message == "not ready"
    assert client.pool.retries == 0 and client.pool.replicas[0].healthy is True


def test_a_synchronous_call_fails_over_and_maps_errors_as_an_async_one(
    replicas: dict[str, tuple[str, list[str]]],
) -> None:
    """request_sync (worker threads: retrieval's embedder) over the same replicas and retry."""
    good, _ = replicas["good"]
    dropped, _ = replicas["before-token"]
    body = {"model": "m", "messages": []}
    for dead in (f"http://127.0.0.1:{free_port()}", dropped):  # refused, then dropped mid-answer
        client = client_for(dead, good)
        got = client.request_sync("POST", "/chat/completions", body)
        assert got["choices"][0]["message"]["content"] == "good" and client.pool.retries == 1
        assert client.pool.replicas[0].healthy is False
    client = OpenAIClient(replicas["quietly"][0], "k", timeout=10, persistent=True)
    with pytest.raises(UpstreamStatus) as err:  # an error status is an answer: no retry
        client.request_sync("GET", "/models")
    assert err.value.reply.status_code == 503 and err.value.reply.message == "not ready"
    client.close()
