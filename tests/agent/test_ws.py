"""Websocket /v1/ws/chat: protocol, bad frames, stop, disconnects, conversations and tenant isolation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tests.agent.doubles import cite_first
from tests.agent.stack import Stack, agent_stack
from tests.conftest import auth
from tests.helpers.waiting import wait_until


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agent_stack(redis_url, tmp_path_factory.mktemp("home"), ws_max_frame_bytes=4096) as s:
        yield s


def ws(stack: Stack, key: str) -> ClientConnection:
    return connect(stack.ws_url, additional_headers=auth(key), open_timeout=10)


def until_done(conn: ClientConnection, timeout: float = 30) -> list[dict[str, Any]]:
    """Events up to ``done``, or a lone ``error`` (the answer to a frame refused outright)."""
    events: list[dict[str, Any]] = []
    while True:
        events.append(json.loads(conn.recv(timeout=timeout)))
        if events[-1]["type"] == "done" or (events[-1]["type"] == "error" and len(events) == 1):
            return events


def test_chat_turn_event_sequence_and_conversation_memory(stack: Stack, api_key: str) -> None:
    stack.model.replies = cite_first
    with ws(stack, api_key) as conn:
        conn.send(
            json.dumps(
                {
                    "pipeline": "chat-documents-generate",
                    "collection": "geo",
                    "message": "What is the capital of France?",
                }
            )
        )
        events = until_done(conn)
        types = [e["type"] for e in events]
        assert types[0] == "conversation" and types[-1] == "done" and "token" in types and "citation" in types
        conv = events[0]["conversation_id"]
        assert events[-1]["conversation_id"] == conv and events[-1]["citations"][0]["document_id"] == "fr"
        # A follow-up in the same conversation uses the history ("its" -> France's).
        conn.send(
            json.dumps(
                {
                    "pipeline": "chat-documents-generate",
                    "collection": "geo",
                    "conversation_id": conv,
                    "message": "What is it known for?",
                }
            )
        )
        events = until_done(conn)
        assert events[-1]["citations"][0]["document_id"] == "fr"
        prompt = stack.model.requests[-1]["messages"]
        assert prompt[0]["content"] == "What is the capital of France?"  # history went into the prompt
    got = httpx.get(f"{stack.url}/v1/conversations/{conv}", headers=auth(api_key)).json()
    assert [m["role"] for m in got["messages"]] == ["user", "assistant", "user", "assistant"]
    assert got["messages"][1]["citations"][0]["document_id"] == "fr"
    assert conv in [
        c["id"] for c in httpx.get(f"{stack.url}/v1/conversations", headers=auth(api_key)).json()["data"]
    ]


def test_conversations_are_isolated_between_tenants(stack: Stack, api_key: str, other_key: str) -> None:
    stack.model.replies = cite_first
    with ws(stack, api_key) as conn:
        conn.send(
            json.dumps({"pipeline": "chat-documents", "collection": "geo", "message": "capital of Germany?"})
        )
        conv = until_done(conn)[0]["conversation_id"]
    other = auth(other_key)
    assert httpx.get(f"{stack.url}/v1/conversations/{conv}", headers=other).status_code == 404
    assert httpx.delete(f"{stack.url}/v1/conversations/{conv}", headers=other).status_code == 404
    assert conv not in str(httpx.get(f"{stack.url}/v1/conversations", headers=other).json())
    with ws(stack, other_key) as conn:  # nor can another tenant continue it
        conn.send(
            json.dumps(
                {
                    "pipeline": "chat-documents",
                    "collection": "geo",
                    "conversation_id": conv,
                    "message": "and?",
                }
            )
        )
        [event] = until_done(conn)
        assert event["type"] == "error" and event["code"] == "not_found_error"
    assert (
        httpx.patch(f"{stack.url}/v1/conversations/{conv}", json={"title": "x"}, headers=other).status_code
        == 404
    )
    renamed = httpx.patch(
        f"{stack.url}/v1/conversations/{conv}", json={"title": "Germany"}, headers=auth(api_key)
    )
    assert renamed.json()["title"] == "Germany"
    assert httpx.delete(f"{stack.url}/v1/conversations/{conv}", headers=auth(api_key)).status_code == 204
    assert httpx.get(f"{stack.url}/v1/conversations/{conv}", headers=auth(api_key)).status_code == 404


def test_bad_frames_get_error_events_and_the_connection_keeps_working(stack: Stack, api_key: str) -> None:
    stack.model.replies = cite_first
    bad = [
        ("{not json", "invalid_json"),
        ("[1, 2]", "invalid_frame"),
        (json.dumps({"pipeline": "chat-documents", "message": "x", "colour": "red"}), "invalid_frame"),
        (json.dumps({"message": "hi"}), "invalid_frame"),
        (json.dumps({"pipeline": "chat-documents", "collection": "geo"}), "invalid_frame"),
        (json.dumps({"pipeline": "nope", "collection": "geo", "message": "hi"}), "not_found_error"),
        (
            json.dumps({"pipeline": "chat-documents", "collection": "missing", "message": "capital"}),
            "not_found_error",
        ),
        (json.dumps({"pipeline": "chat-documents", "message": "x" * 5000}), "message_too_large"),
        (b"\xff\xfe binary junk", "invalid_json"),
        # nested past Python's recursion limit: crashed the handler
        ("[" * 1900 + "]" * 1900, "json_too_deep"),
        ('{"a":' * 100 + "1" + "}" * 100, "json_too_deep"),
        (
            json.dumps({"pipeline": "chat-documents", "message": "x"})[:-1] + ', "n": NaN}',
            "non_finite_number",
        ),
    ]
    with ws(stack, api_key) as conn:
        for frame, code in bad:
            conn.send(frame)
            events = []
            while not events or events[-1]["type"] not in ("error", "done"):
                events.append(json.loads(conn.recv(timeout=30)))
            assert events[-1]["type"] == "error" and events[-1]["code"] == code, (frame, events)
            assert events[-1]["message"]
        conn.send(
            json.dumps({"pipeline": "chat-documents", "collection": "geo", "message": "capital of Germany?"})
        )
        assert until_done(conn)[-1]["citations"][0]["document_id"] == "de"


def test_stop_and_busy(stack: Stack, api_key: str) -> None:
    stack.model.replies = lambda body: "word " * 200 + "[1]"
    stack.model.delay = 0.02
    stack.model.disconnected = 0
    try:
        with ws(stack, api_key) as conn:
            conn.send(
                json.dumps(
                    {
                        "pipeline": "chat-documents-generate",
                        "collection": "geo",
                        "message": "capital of France?",
                    }
                )
            )
            first = [json.loads(conn.recv(timeout=30)) for _ in range(3)]
            assert first[0]["type"] == "conversation" and first[1]["type"] == "token"
            conn.send(
                json.dumps({"pipeline": "chat-documents-generate", "collection": "geo", "message": "again"})
            )
            conn.send(json.dumps({"type": "stop"}))
            events = []
            while not events or events[-1]["type"] != "done":
                events.append(json.loads(conn.recv(timeout=30)))
            assert {
                "type": "error",
                "message": events[[e["type"] for e in events].index("error")]["message"],
                "code": "busy",
            } in events
            assert events[-1]["finish_reason"] == "stopped"
            wait_until(lambda: stack.model.disconnected, 5, "the upstream sees the disconnect")
            assert stack.model.disconnected == 1  # the upstream generation was abandoned, not run out
            conv = first[0]["conversation_id"]
        stored = httpx.get(f"{stack.url}/v1/conversations/{conv}", headers=auth(api_key)).json()["messages"]
        assert stored[-1]["stopped"] is True and stored[-1]["content"].startswith("word")
    finally:
        stack.model.delay = 0.0


def test_disconnect_mid_answer_frees_upstream_and_service_keeps_serving(stack: Stack, api_key: str) -> None:
    stack.model.replies = lambda body: "word " * 300
    stack.model.delay = 0.02
    stack.model.disconnected = 0
    try:
        conn = ws(stack, api_key)
        conn.send(
            json.dumps(
                {"pipeline": "chat-documents-generate", "collection": "geo", "message": "capital of France?"}
            )
        )
        assert json.loads(conn.recv(timeout=30))["type"] == "conversation"
        json.loads(conn.recv(timeout=30))
        conn.close()
        wait_until(lambda: stack.model.disconnected, 5, "the upstream sees the disconnect")
        assert stack.model.disconnected == 1
    finally:
        stack.model.delay = 0.0
    stack.model.replies = cite_first
    with ws(stack, api_key) as conn:
        conn.send(
            json.dumps(
                {"pipeline": "chat-documents-generate", "collection": "geo", "message": "capital of Germany?"}
            )
        )
        assert until_done(conn)[-1]["citations"][0]["document_id"] == "de"


def test_browser_subprotocol_auth_and_refusals(stack: Stack, api_key: str) -> None:
    with connect(stack.ws_url, subprotocols=["tandem.bearer", api_key], open_timeout=10) as conn:  # type: ignore[list-item]
        assert conn.subprotocol == "tandem.bearer"
    for kwargs in ({}, {"additional_headers": auth("tdm_bad_key")}):
        with pytest.raises(InvalidStatus), connect(stack.ws_url, open_timeout=10, **kwargs):
            pass


def test_agent_steps_stream_over_the_websocket(stack: Stack, api_key: str) -> None:
    """The default agent mode: OpenAI tool calls, then the forced final_answer call's JSON."""
    call = {"name": "calculator", "arguments": json.dumps({"expression": "1234 + 4321"})}
    stack.model.replies = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": call}],
        },
        json.dumps({"name": "final_answer", "arguments": {"answer": "5555"}}),
    ]
    with ws(stack, api_key) as conn:
        conn.send(json.dumps({"agent": "tools-agent", "message": "What is 1234 + 4321?"}))
        events = until_done(conn)
    kinds = [e.get("kind") for e in events if e["type"] == "step"]
    assert kinds == ["tools", "tool_call", "observation", "final"]
    # no collection: the document tool is left out, and the first step says why
    tools = next(e for e in events if e.get("kind") == "tools")
    assert [lo["tool"] for lo in tools["left_out"]] == ["document_search"] and "calculator" in tools[
        "offered"
    ]
    assert stack.model.requests[-2]["tool_choice"] == "required"
    assert next(e for e in events if e.get("kind") == "final")["text"] == "5555"
    assert next(e for e in events if e.get("kind") == "observation")["text"] == "5555"
    assert events[-1]["type"] == "done"
