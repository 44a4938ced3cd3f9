"""The agent's HTTP interfaces (pipelines JSON/SSE, OpenAI facade, conversations, proxy, web) over real
HTTP, with doubles for retrieval and inference (their real versions run in test_integration.py)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.responses import JSONResponse

from services.common.replicas import replica_pool
from tests.agent.doubles import ScriptedModel, cite_first, inference_double
from tests.agent.stack import Stack, agent_stack
from tests.conftest import auth
from tests.helpers.servers import free_port, serve_app
from tests.helpers.waiting import wait_until


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agent_stack(redis_url, tmp_path_factory.mktemp("home")) as s:
        yield s


def sse_events(resp: httpx.Response) -> list[dict[str, Any]]:
    return data_events(resp.iter_lines())


def data_events(lines: Iterable[str]) -> list[dict[str, Any]]:
    return [
        json.loads(line[5:]) for line in lines if line.startswith("data:") and line[5:].strip() != "[DONE]"
    ]


def test_chat_documents_json_cites_the_right_document(stack: Stack, api_key: str) -> None:
    stack.model.replies = cite_first
    resp = httpx.post(
        f"{stack.url}/v1/pipelines/chat-documents-generate/run",
        json={"query": "What is the capital of Germany?", "collection": "geo"},
        headers={**auth(api_key), "X-Request-ID": "rid-123"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["answer"].endswith("[1].") and "Berlin" in body["answer"]
    [cite] = body["citations"]
    assert (cite["index"], cite["document_id"], cite["chunk_id"], cite["title"]) == (
        1,
        "de",
        "de#0",
        "Germany",
    )
    assert (cite["start"], cite["end"], cite["kind"]) == (0, len(cite["text"]), "cited")
    assert body["usage"]["total_tokens"] == 15
    # The user's own key and the request id went upstream.
    assert stack.model.headers[-1]["authorization"] == f"Bearer {api_key}"
    assert stack.corpus.seen_headers[-1]["authorization"] == f"Bearer {api_key}"
    assert stack.corpus.seen_headers[-1]["x-request-id"] == "rid-123"


def test_chat_documents_sse_streams_tokens_then_citation_then_done(stack: Stack, api_key: str) -> None:
    stack.model.replies = cite_first
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/pipelines/chat-documents/run",
        json={"query": "What is the capital of France?", "collection": "geo", "stream": True},
        headers=auth(api_key),
        timeout=30,
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    types = [e["type"] for e in events]
    assert types[0] == "token" and types[-1] == "done" and types.count("citation") == 1
    assert types.index("citation") < len(types) - 1
    citation = next(e for e in events if e["type"] == "citation")
    assert citation["document_id"] == "fr"
    assert events[-1]["citations"][0]["document_id"] == "fr"


def test_nothing_relevant_says_it_does_not_know(stack: Stack, api_key: str) -> None:
    stack.model.requests.clear()
    resp = httpx.post(
        f"{stack.url}/v1/pipelines/chat-documents/run",
        json={"query": "How do volcanoes erupt under the ocean?", "collection": "geo"},
        headers=auth(api_key),
        timeout=30,
    )
    body = resp.json()
    assert body["answer"].startswith("I don't know") and body["citations"] == []
    assert stack.model.requests == []  # no model call, nothing invented


def test_semantic_search_highlights_the_passage(stack: Stack, api_key: str) -> None:
    resp = httpx.post(
        f"{stack.url}/v1/pipelines/semantic-search/run",
        json={"query": "Where is the Eiffel Tower?", "collection": "geo"},
        headers=auth(api_key),
    )
    top = resp.json()["results"][0]
    assert top["document_id"] == "eiffel"
    assert top["passage"]["text"] == "The Eiffel Tower stands in Paris."
    text = stack.corpus.collections["geo"]["eiffel"][1]
    assert text[top["passage"]["start"] : top["passage"]["end"]] == top["passage"]["text"]
    assert "<mark>Eiffel</mark>" in top["highlighted"]


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        (
            "/v1/pipelines/nope/run",
            {"query": "x", "collection": "geo"},
            404,
            "unknown pipeline or agent 'nope'",
        ),
        (
            "/v1/pipelines/chat-documents/run",
            {"query": "capital", "collection": "missing"},
            404,
            "unknown collection 'missing'",
        ),
        (
            "/v1/pipelines/chat-documents/run",
            {"query": "capital", "collection": "missing", "stream": True},
            404,
            "missing",
        ),
        ("/v1/pipelines/chat-documents/run", {"query": "capital"}, 400, "needs a 'collection'"),
        ("/v1/pipelines/chat-documents/run", {"query": "  ", "collection": "geo"}, 400, "empty"),
        (
            "/v1/pipelines/chat-documents/run",
            {"query": "x" * 20000, "collection": "geo"},
            413,
            "limit is 16000",
        ),
        ("/v1/pipelines/chat-documents/run", {"query": "x", "collection": "geo", "top_k": 0}, 400, "top_k"),
        ("/v1/pipelines/chat-documents/run", {"query": "x", "collection": "../etc"}, 400, "collection"),
        (
            "/v1/pipelines/chat-documents/run",
            {"query": "x", "collection": "geo", "conversation_id": "conv_nope"},
            404,
            "no conversation",
        ),
    ],
)
def test_bad_input_is_a_clear_4xx(
    stack: Stack, api_key: str, path: str, body: dict[str, Any], status: int, needle: str
) -> None:
    resp = httpx.post(f"{stack.url}{path}", json=body, headers=auth(api_key), timeout=30)
    assert resp.status_code == status, resp.text
    assert needle in resp.json()["error"]["message"]


def test_every_route_needs_a_key(stack: Stack) -> None:
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/v1/conversations"),
        ("POST", "/v1/pipelines/chat-documents/run"),
    ]:
        assert httpx.request(method, f"{stack.url}{path}").status_code == 401


def test_openai_client_chats_with_documents(stack: Stack, api_key: str) -> None:
    stack.model.replies = cite_first
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=api_key)
    ids = [m.id for m in client.models.list().data]
    assert {"chat-documents", "semantic-search", "tools-agent"} <= set(ids)
    out = client.chat.completions.create(
        model="chat-documents",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body={"collection": "geo"},
    )
    assert "Paris" in (out.choices[0].message.content or "")
    assert out.model_extra and out.model_extra["citations"][0]["document_id"] == "fr"
    chunks = list(
        client.chat.completions.create(
            model="chat-documents",
            messages=[
                {"role": "user", "content": "Tell me about Germany"},
                {"role": "assistant", "content": "Germany is in Europe."},
                {"role": "user", "content": "What is its capital?"},
            ],
            extra_body={"collection": "geo"},
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Berlin" in text  # "its" was rewritten with the history: the search found Germany
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].model_extra and chunks[-1].model_extra["citations"][0]["document_id"] == "de"
    with pytest.raises(openai.NotFoundError, match="unknown pipeline or agent 'gpt-4'"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


FRANCE = {
    "index": 1,
    "chunk_id": "fr#0",
    "document_id": "fr",
    "title": "France",
    "text": "Paris is the capital of France. France is known for wine and cheese.",
    "start": 0,
    "end": 68,
}
GERMANY = {
    "index": 2,
    "chunk_id": "de#0",
    "document_id": "de",
    "title": "Germany",
    "text": "Berlin is the capital of Germany. Germany has many forests.",
    "start": 0,
    "end": 59,
}
ADD = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


def _facade(stack: Stack, api_key: str, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The facade's answer to ``body``, and its chunks when streamed (with usage), with the
    values that change from call to call (ids, times) replaced by their kind."""

    def masked(out: dict[str, Any]) -> dict[str, Any]:
        assert out["id"].startswith("chatcmpl-") and isinstance(out["created"], int)
        out.update(id="chatcmpl-*", created=0)
        if "message_id" in out:
            assert out["message_id"].startswith("msg_")
            out["message_id"] = "msg_*"
        return out

    url = f"{stack.url}/v1/chat/completions"
    resp = httpx.post(url, json=body, headers=auth(api_key), timeout=60)
    assert resp.status_code == 200, resp.text
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=streamed, headers=auth(api_key), timeout=60) as chunks:
        assert chunks.status_code == 200
        lines = [line for line in chunks.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return masked(resp.json()), [masked(c) for c in data_events(lines)]


def _chunk(model: str, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    head = {"id": "chatcmpl-*", "object": "chat.completion.chunk", "created": 0, "model": model}
    return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def test_the_openai_facade_keeps_its_wire_shape(stack: Stack, api_key: str) -> None:
    """The exact JSON of the facade's answers and stream chunks (the contract its typed models
    must keep): a cited answer, a search's rendered results, and the model's tool calls."""
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    stack.model.replies = lambda body: "Paris is the capital [1]."
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    answer, chunks = _facade(
        stack, api_key, {"model": "chat-documents-generate", "messages": ask, "collection": "geo"}
    )
    # where the cited sentence is (services/agent/locate.py); page/section/anchor: none for this source
    span = {"start": 0, "end": 31, "text": "Paris is the capital of France."}
    cited = {**FRANCE, "kind": "cited", "page": None, "section": None, "anchor": None, "span": span}
    assert answer == {
        "id": "chatcmpl-*",
        "object": "chat.completion",
        "created": 0,
        "model": "chat-documents-generate",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Paris is the capital [1]."},
                "finish_reason": "stop",
            }
        ],
        "usage": usage,
        "citations": [cited],
        "answer_kind": "generated",
        "message_id": "msg_*",
        "conversation_id": None,
    }
    ends = {
        "citations": [cited],
        "message_id": "msg_*",
        "conversation_id": None,
        "kind": "generated",
        "answer_kind": "generated",
        "usage": usage,
    }
    assert chunks == [
        _chunk("chat-documents-generate", {"role": "assistant", "content": ""}),
        *[
            _chunk("chat-documents-generate", {"content": piece})
            for piece in ("Paris ", "is ", "the ", "capital ", "[1].")
        ],
        _chunk("chat-documents-generate", {}, "stop", **ends),
    ]
    assert list(chunks[-1]) == ["id", "object", "created", "model", "choices", *ends]

    listed = "[1] France: Paris is the capital of France.\n[2] Germany: Berlin is the capital of Germany."
    search_for = [{"role": "user", "content": "capital of France"}]
    search = {"model": "semantic-search", "messages": search_for, "collection": "geo"}
    answer, chunks = _facade(stack, api_key, search)
    assert answer["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": listed}, "finish_reason": "stop"}
    ]
    nothing = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    assert (answer["usage"], answer["citations"]) == (nothing, [FRANCE, GERMANY])
    ends = {"citations": [FRANCE, GERMANY], "message_id": "msg_*", "conversation_id": None, "usage": nothing}
    assert chunks == [
        _chunk("semantic-search", {"role": "assistant", "content": ""}),
        _chunk("semantic-search", {"content": listed}),
        _chunk("semantic-search", {}, "stop", **ends),
    ]

    stack.model.replies = lambda body: {"role": "assistant", "content": None, "tool_calls": [ADD]}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    body = {"model": "chat-documents-generate", "messages": ask, "collection": "geo", "tools": tools}
    answer, chunks = _facade(stack, api_key, body)
    message = {"role": "assistant", "content": None, "tool_calls": [ADD]}
    assert answer["choices"] == [{"index": 0, "message": message, "finish_reason": "tool_calls"}]
    # the sources the model was given, none cited
    # each located at its sentence closest to the question (services/agent/locate.py)
    none = {"page": None, "section": None, "anchor": None}
    fr_span = {"start": 0, "end": 31, "text": "Paris is the capital of France."}
    de_span = {"start": 0, "end": 33, "text": "Berlin is the capital of Germany."}
    sources = [
        {**FRANCE, "kind": "source", **none, "span": fr_span},
        {**GERMANY, "kind": "source", **none, "span": de_span},
    ]
    assert (answer["usage"], answer["citations"]) == (usage, sources)
    first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": ""}}
    ends = {
        "citations": sources,
        "message_id": "msg_*",
        "conversation_id": None,
        "usage": usage,  # calls are not checked for groundedness: no "kind"
    }
    assert chunks == [
        _chunk("chat-documents-generate", {"role": "assistant", "content": ""}),
        _chunk("chat-documents-generate", {"tool_calls": [first]}),
        _chunk(
            "chat-documents-generate", {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}
        ),
        _chunk("chat-documents-generate", {}, "tool_calls", **ends),
    ]
    # and the official client reads both
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=api_key, max_retries=0)
    parsed = client.chat.completions.create(
        model="chat-documents-generate", messages=ask, tools=tools, extra_body={"collection": "geo"}
    )
    [call] = parsed.choices[0].message.tool_calls or []
    assert (call.id, call.function.name, call.function.arguments) == ("call_1", "add", '{"a": 1}')
    streamed = list(
        client.chat.completions.create(
            model="chat-documents-generate",
            messages=ask,
            tools=tools,
            extra_body={"collection": "geo"},
            stream=True,
        )
    )
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    [first_piece] = streamed[1].choices[0].delta.tool_calls or []
    assert (first_piece.id, first_piece.function and first_piece.function.name) == ("call_1", "add")


def test_proxy_forwards_auth_request_id_and_streams_sse(stack: Stack, api_key: str) -> None:
    resp = httpx.post(
        f"{stack.url}/api/retrieval/v1/collections/geo/search",
        json={"query": "Berlin", "top_k": 1},
        headers={**auth(api_key), "X-Request-ID": "proxied-1"},
    )
    assert resp.status_code == 200 and resp.json()["results"][0]["document_id"] == "de"
    assert stack.corpus.seen_headers[-1]["authorization"] == f"Bearer {api_key}"
    assert stack.corpus.seen_headers[-1]["x-request-id"] == "proxied-1"
    assert (
        httpx.post(f"{stack.url}/api/retrieval/v1/collections/nope/search", json={"query": "x"}).status_code
        == 404
    )
    stack.model.replies = ["one two three four"]
    with httpx.stream(
        "POST",
        f"{stack.url}/api/inference/v1/chat/completions",
        json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        headers=auth(api_key),
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        pieces = [
            json.loads(line[5:])["choices"][0]["delta"].get("content", "")
            for line in resp.iter_lines()
            if line.startswith("data: {")
        ]
    assert "".join(pieces) == "one two three four"
    assert httpx.get(f"{stack.url}/api/elsewhere/v1/x").status_code in (404, 400)


def test_web_front_end_is_served_when_built(redis_url: str, tmp_path: Path, api_key: str) -> None:
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "index.html").write_text("<html>tandem web</html>")
    with agent_stack(redis_url, tmp_path / "home", web_dist=str(dist)) as s:
        assert "tandem web" in httpx.get(f"{s.url}/").text
        assert httpx.get(f"{s.url}/v1/models", headers=auth(api_key)).status_code == 200
        assert httpx.get(f"{s.url}/healthz").status_code == 200


def test_a_looping_model_is_stopped_at_the_first_repeat(stack: Stack, api_key: str) -> None:
    stack.model.replies = lambda body: "Berlin is the capital of Germany [1]. " * 8 + "It has many museums."
    resp = httpx.post(
        f"{stack.url}/v1/pipelines/chat-documents/run",
        json={"query": "What is the capital of Germany?", "collection": "geo"},
        headers=auth(api_key),
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["answer"].count("Berlin is the capital of Germany") == 1, body["answer"]
    assert "museums" not in body["answer"]
    assert [c["document_id"] for c in body["citations"]] == ["de"]


def test_a_degenerate_answer_is_replaced_by_cited_source_sentences(stack: Stack, api_key: str) -> None:
    """The groundedness guard over real HTTP: SSE resets and streams the extractive answer, the done
    event and the citations say ``extractive``, the turn record keeps what the model wrote."""
    stack.model.replies = lambda body: "The answer is: The answer is:"
    request = {"query": "What is the capital of Germany?", "collection": "geo", "stream": True}
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/pipelines/chat-documents-generate/run",
        json=request,
        headers=auth(api_key),
        timeout=30,
    ) as resp:
        events = sse_events(resp)
    types = [e["type"] for e in events]
    reset = types.index("reset")
    assert events[reset]["reason"] == "preamble"
    shown = "".join(e["text"] for e in events[reset + 1 :] if e["type"] == "token")
    # the answering sentence and the rest of its passage
    assert shown == "Berlin is the capital of Germany. Germany has many forests [1]."
    done = events[-1]
    assert (done["type"], done["kind"], done["grounding"], done["unsupported"]) == (
        "done",
        "extractive",
        "preamble",
        [],
    )
    assert [(c["document_id"], c["kind"]) for c in done["citations"]] == [("de", "extractive")]
    record = httpx.get(
        f"{stack.url}/v1/messages/{done['message_id']}", headers=auth(api_key), timeout=30
    ).json()
    assert record["completion"] == "The answer is: The answer is:"  # the model's own words
    assert (record["answer"], record["answer_kind"]) == (shown, "extractive")

    # The JSON answer carries the same.
    body = httpx.post(
        f"{stack.url}/v1/pipelines/chat-documents-generate/run",
        json={**request, "stream": False},
        headers=auth(api_key),
        timeout=30,
    ).json()
    assert (body["answer"], body["kind"]) == (shown, "extractive")
    assert body["citations"][0]["kind"] == "extractive"


def test_a_partly_supported_answer_flags_its_unsupported_sentence(stack: Stack, api_key: str) -> None:
    answer = "Berlin is the capital of Germany [1]. Its mayor rides a purple dragon."
    stack.model.replies = lambda body: answer
    body = httpx.post(
        f"{stack.url}/v1/pipelines/chat-documents-generate/run",
        json={"query": "What is the capital of Germany?", "collection": "geo"},
        headers=auth(api_key),
        timeout=30,
    ).json()
    assert (body["answer"], body["kind"], body["grounding"]) == (answer, "generated", "partial")
    assert [u["text"] for u in body["unsupported"]] == ["Its mayor rides a purple dragon."]
    assert [(c["document_id"], c["kind"]) for c in body["citations"]] == [("de", "cited")]


def test_an_agent_turn_that_fails_is_an_openai_error_not_a_200(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory, api_key: str
) -> None:
    """An agent that never gives a final answer within its steps: the facade answers the run's
    error in OpenAI's shape (500 with the code), where it used to be a 200 with ``length``; a
    stream, already 200, carries the error as a data event before its end."""

    def never_final(body: dict[str, Any]) -> str:
        return "Thought: more arithmetic.\nAction: calculator\nAction Input: 1 + 1"

    with agent_stack(
        redis_url, tmp_path_factory.mktemp("home"), agent_max_steps=1, tool_calling="react"
    ) as s:
        s.model.replies = never_final
        request = {"model": "tools-agent", "messages": [{"role": "user", "content": "Count forever."}]}
        resp = httpx.post(f"{s.url}/v1/chat/completions", json=request, headers=auth(api_key), timeout=60)
        assert resp.status_code == 500, resp.text
        error = resp.json()["error"]
        assert error["code"] == "step_budget_exceeded" and error["type"] == "server_error"
        assert "1 steps" in error["message"]
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=api_key, max_retries=0)
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(**request)
        with httpx.stream(
            "POST",
            f"{s.url}/v1/chat/completions",
            json={**request, "stream": True},
            headers=auth(api_key),
            timeout=60,
        ) as streamed:
            assert streamed.status_code == 200
            events = sse_events(streamed)
        assert any(e.get("error", {}).get("code") == "step_budget_exceeded" for e in events), events


def test_the_agent_spreads_over_the_ready_inference_replicas(
    redis_url: str, tmp_path: Path, api_key: str
) -> None:
    # TANDEM_INFERENCE_URLS: a replica that refuses connections, one whose /readyz says 503, two ready
    models = [ScriptedModel(replies=cite_first) for _ in range(3)]
    apps = [inference_double(m) for m in models]
    for app, status in zip(apps, (200, 200, 503), strict=True):
        app.add_api_route("/readyz", lambda status=status: JSONResponse({}, status_code=status))
    with ExitStack() as replicas:
        ready_a, ready_b, not_ready = (replicas.enter_context(serve_app(a)) for a in apps)
        urls = [f"http://127.0.0.1:{free_port()}", ready_a, ready_b, not_ready]
        # without a reader each turn makes one inference call (the chat), so the counts show the spread
        with agent_stack(redis_url, tmp_path, inference_urls=",".join(urls), reader="") as stack:

            def ask() -> None:
                resp = httpx.post(
                    f"{stack.url}/v1/pipelines/chat-documents-generate/run",
                    json={"query": "What is the capital of Germany?", "collection": "geo"},
                    headers=auth(api_key),
                    timeout=30,
                )
                assert resp.status_code == 200 and "Berlin" in resp.json()["answer"], resp.text

            ask()  # the dead replica may take it first: refused, marked down, sent to another
            pool = replica_pool(urls)  # the agent's pool (the service runs in this process)
            wait_until(
                lambda: [r.healthy for r in pool.replicas] == [False, True, True, False], 30, "the probes"
            )
            before = [len(m.requests) for m in models]
            for _ in range(8):
                ask()
            served = [len(m.requests) - b for m, b in zip(models, before, strict=True)]
    assert stack.model.requests == []  # the single TANDEM_INFERENCE_URL is not used
    assert served[0] > 0 and served[1] > 0 and served[2] == 0, served
