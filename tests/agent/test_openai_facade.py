"""The agent's OpenAI facade with tools and structured output: the official ``openai`` client against
a real agent service over the real retrieval and inference services (a tiny random model: what it
says does not matter, only the protocol; the inference's grammar makes every call and JSON valid)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.agent.stack import RealStack, new_key, real_services
from tests.conftest import auth
from tests.inference.schemas import THING_SCHEMA
from tests.inference.test_openai_client import SCHEMAS, TOOLS
from tests.inference.test_openai_client import _check_calls as check_calls

DOCS = [
    {"id": "bees", "title": "Honey bees", "text": "Honey bees make honey from the nectar of flowers."},
    {"id": "moon", "title": "The Moon", "text": "The Moon is grey and has no air."},
]
# the inference conformance module's tools: "add" (two bounded integers) and "shout" (an enum)
THING = {"type": "json_schema", "json_schema": {"name": "thing", "schema": THING_SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "What do honey bees make honey from?"}]
FACTS = {"collection": "facts"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


@pytest.fixture(scope="module")
def stack(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path
) -> Iterator[RealStack]:
    with real_services(
        redis_url,
        tmp_path_factory.mktemp("facade"),
        tiny_model_path,
        new_key(redis_url, "acme-facade"),
        DOCS,
        inference={"served_model_name": "tiny", "max_batch_size": 4},
        tokenizer=str(tiny_model_path),
        max_answer_tokens=100,
        grounding_embedder=False,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: RealStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.agent}/v1", api_key=stack.key, max_retries=0, timeout=300)


def _streamed_calls(chunks: list[Any]) -> dict[int, dict[str, str]]:
    """The calls of a stream, checking each delta has OpenAI's shape: a call's first delta carries
    its index, id, type and name (arguments ""), the next ones argument text only."""
    calls: dict[int, dict[str, str]] = {}
    for d in [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]:
        if d.id is not None:
            assert d.index not in calls and d.type == "function" and d.function is not None
            assert d.function.name and d.function.arguments == ""
            calls[d.index] = {"name": d.function.name, "arguments": ""}
        else:
            assert d.function is not None and d.function.name is None and d.type is None
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return calls


def test_a_named_tool_choice_gives_a_call_whose_arguments_validate(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="chat-documents",
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "add"}},
        extra_body=FACTS,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls or []) == 1
    check_calls(choice.message.tool_calls, {"add"})
    # the retrieved sources were in the prompt: they ride as citations of kind "source"
    extra = out.model_extra or {}
    assert [c["document_id"] for c in extra["citations"]][:1] == ["bees"]
    assert {c["kind"] for c in extra["citations"]} == {"source"}
    assert out.usage is not None and out.usage.completion_tokens > 0
    # the turn record keeps the calls
    record = httpx.get(
        f"{client.base_url}messages/{extra['message_id']}", headers=auth(client.api_key), timeout=30
    ).json()
    assert record["tool_calls"] == [c.model_dump() for c in choice.message.tool_calls or []]
    assert "nectar of flowers" in record["prompt"][-1]["content"]


def test_streamed_tool_calls_have_openais_chunk_shape(client: openai.OpenAI) -> None:
    for choice_value in ({"type": "function", "function": {"name": "shout"}}, "required"):
        chunks = list(
            client.chat.completions.create(
                model="chat-documents",
                messages=ASK,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                tool_choice=choice_value,  # type: ignore[arg-type]
                parallel_tool_calls=False,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=FACTS,
            )
        )
        calls = _streamed_calls(chunks)
        assert len(calls) == 1  # one call: named, or parallel_tool_calls false
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        if isinstance(choice_value, dict):
            assert [c["name"] for c in calls.values()] == ["shout"]
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == ["tool_calls"]
        assert (chunks[-1].model_extra or {})["citations"]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_json_schema_strict_answers_parse_and_validate(client: openai.OpenAI) -> None:
    """The pipeline's text rewrites (citation markers, repetition cut, groundedness guard) leave a
    JSON answer alone: it parses, validates, and is what the model wrote."""
    out = client.chat.completions.create(
        model="chat-documents",
        messages=ASK,  # type: ignore[arg-type]
        response_format=THING,  # type: ignore[arg-type]
        extra_body=FACTS,
    )
    assert out.choices[0].finish_reason == "stop"
    content = out.choices[0].message.content or ""
    jsonschema.validate(json.loads(content), THING_SCHEMA)
    extra = out.model_extra or {}
    assert extra.get("kind", "generated") == "generated"
    assert {c["kind"] for c in extra["citations"]} == {"source"}
    chunks = list(
        client.chat.completions.create(
            model="chat-documents",
            messages=[{"role": "user", "content": "Which colour is the Moon?"}],
            response_format=THING,  # type: ignore[arg-type]
            stream=True,
            extra_body=FACTS,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), THING_SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"
    # nothing relevant in the collection: the model still answers, in the form asked for (a
    # canned "I don't know" would not parse)
    out = client.chat.completions.create(
        model="chat-documents",
        messages=[{"role": "user", "content": "Who won the 1998 football world cup final?"}],
        response_format={"type": "json_object"},
        max_tokens=40,
        extra_body=FACTS,
    )
    assert (out.model_extra or {})["citations"] == []
    assert not (out.choices[0].message.content or "").startswith("I don't know")
    assert out.choices[0].finish_reason in ("stop", "length")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


def test_tool_results_in_the_history_are_accepted(client: openai.OpenAI, stack: RealStack) -> None:
    """A tool result as the last message (the model continues after it), and a whole exchange
    before a new question (few-shot): both reach the model after the prompt the pipeline built."""
    called = [
        {"role": "developer", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
    ]
    result = {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    out = client.chat.completions.create(
        model="chat-documents",
        messages=[*called, result],  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=8,
        extra_body=FACTS,
    )
    assert out.choices[0].message.content is not None and not out.choices[0].message.tool_calls
    record = httpx.get(
        f"{stack.agent}/v1/messages/{(out.model_extra or {})['message_id']}",
        headers=auth(stack.key),
        timeout=30,
    ).json()
    *_, question, call, tool = record["prompt"]
    assert "nectar of flowers" in question["content"] and question["content"].endswith(ASK[0]["content"])
    assert call["tool_calls"] == [CALL] and tool == {**result}
    out = client.chat.completions.create(
        model="chat-documents",
        messages=[  # type: ignore[list-item]
            *called,
            {**result, "name": "add"},
            {"role": "assistant", "content": "5"},
            {"role": "user", "content": "And what is the Moon like?"},
        ],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        extra_body=FACTS,
    )
    check_calls(out.choices[0].message.tool_calls, {"add", "shout"})


def _bad(call: Any, param: str, status: type[openai.APIStatusError] = openai.BadRequestError) -> str:
    with pytest.raises(status) as err:
        call()
    body = err.value.body
    assert isinstance(body, dict) and set(body) >= {"message", "type", "param", "code"}, body
    assert body["param"] == param, body
    return str(body["message"])


def test_bad_input_is_an_openai_shaped_400_naming_the_parameter(client: openai.OpenAI) -> None:
    def chat(**kw: Any) -> Any:
        kw.setdefault("messages", ASK)
        kw.setdefault("extra_body", FACTS)
        return client.chat.completions.create(model=kw.pop("model", "chat-documents"), **kw)

    # the inference service's own validation, forwarded with its parameter
    nameless = [{"type": "function", "function": {"parameters": {}}}]
    _bad(lambda: chat(tools=nameless), "tools[0].function.name")
    _bad(lambda: chat(tools=nameless, stream=True), "tools[0].function.name")  # before the stream starts
    message = _bad(
        lambda: chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice",
    )
    assert "'nope'" in message
    _bad(lambda: chat(response_format={"type": "yaml"}), "response_format.type")
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    _bad(lambda: chat(response_format=bad_schema), "response_format.json_schema.schema")
    # the facade's: tool results need their call, the turn ends with a user message or a result
    orphan = [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "5"}]
    assert "call_9" in _bad(lambda: chat(messages=orphan, tools=TOOLS), "messages[1].tool_call_id")
    _bad(lambda: chat(messages=[*ASK, {"role": "assistant", "content": "hm"}]), "messages")
    _bad(lambda: chat(tool_choice=3), "tool_choice")
    _bad(lambda: chat(stream_options={"include_usage": True}), "stream_options")
    # agents run their own tools; a search pipeline writes no answer; a conversation keeps text only
    message = _bad(lambda: chat(model="tools-agent", tools=TOOLS), "tools")
    assert "agent 'tools-agent'" in message and "use a pipeline" in message
    _bad(lambda: chat(model="tools-agent", response_format=THING), "response_format")
    few_shot = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        *ASK,
    ]
    _bad(lambda: chat(model="tools-agent", messages=few_shot), "messages")
    _bad(lambda: chat(model="semantic-search", tools=TOOLS), "tools")
    _bad(lambda: chat(tools=TOOLS, extra_body={**FACTS, "conversation_id": "c1"}), "conversation_id")
    # and the service keeps answering
    assert chat(max_tokens=3).choices[0].message.content
