"""Conformance of ``/v1/responses``: the official ``openai`` client's ``responses.create`` /
``.stream`` / ``.retrieve`` / ``.delete`` and LangChain's ``ChatOpenAI(use_responses_api=True)``
against a real server (torch engine, tiny random model: what it says does not matter, only the
protocol; the chat path's grammar makes every call and JSON answer valid)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from services.common.config import CommonSettings
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from tests.helpers.servers import serve_app
from tests.inference.schemas import ADD_PARAMETERS, THING_SCHEMA, function_tool

ADD = {"type": "function", "name": "add", "description": "Add two numbers.", "parameters": ADD_PARAMETERS}
SHOUT_PARAMETERS = {
    "type": "object",
    "properties": {"word": {"enum": ["hey", "ho"]}},
    "required": ["word"],
    "additionalProperties": False,
}
SHOUT = {"type": "function", "name": "shout", "parameters": SHOUT_PARAMETERS}
SCHEMAS = {"add": ADD_PARAMETERS, "shout": SHOUT_PARAMETERS}
THING = {"format": {"type": "json_schema", "name": "thing", "schema": THING_SCHEMA, "strict": True}}


def _new_key(redis_url: str, tenant: str) -> str:
    from services.common.auth import KeyStore
    from services.common.redis_conn import sync_redis

    return str(KeyStore(sync_redis(redis_url)).create(tenant)[0])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, redis_url: str, lively_tiny_path: Path) -> Iterator[str]:
    home = tmp_path_factory.mktemp("responses-home")
    common = CommonSettings(home=home, redis_url=redis_url, model_roots=str(home / "models"), log_json=False)
    settings = InferenceSettings(
        model=str(lively_tiny_path), served_model_name="tiny", max_model_len=1024, max_batch_size=8
    )
    with serve_app(create_app(common, settings)) as url:
        yield url


@pytest.fixture(scope="module")
def client(served: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=served + "/v1", api_key=key, max_retries=0, timeout=120)


def _status(call: Any, error: type[openai.APIStatusError], param: str) -> dict[str, Any]:
    with pytest.raises(error) as err:
        call()
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    return body


def test_text_input_answers_retrieves_and_deletes(client: openai.OpenAI) -> None:
    out = client.responses.create(model="tiny", input="Say hello.", max_output_tokens=8, temperature=0)
    assert out.id.startswith("resp_") and out.object == "response" and out.model == "tiny"
    assert out.status == "incomplete" and out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    [message] = out.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert out.output_text and message.content[0].type == "output_text"
    assert out.usage is not None and out.usage.output_tokens == 8
    assert out.usage.total_tokens == out.usage.input_tokens + 8
    got = client.responses.retrieve(out.id)
    assert got.model_dump() == out.model_dump()
    client.responses.delete(out.id)
    _status(lambda: client.responses.retrieve(out.id), openai.NotFoundError, "response_id")


def test_instructions_and_messages_reach_the_prompt(client: openai.OpenAI) -> None:
    def used(**body: Any) -> int:
        out = client.responses.create(model="tiny", max_output_tokens=2, store=False, **body)
        assert out.usage is not None
        return out.usage.input_tokens

    plain = used(input="Hi")
    history = used(
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello there."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ]
    )
    assert history > plain + 5
    # the instructions are the system message (in place of the template's default one)
    instructions = "You are a terse assistant. " * 20
    assert used(input="Hi", instructions=instructions) > plain + 60
    told = client.responses.create(
        model="tiny", input="Hi", instructions="Be brief.", max_output_tokens=1, store=False
    )
    assert told.instructions == "Be brief."
    # store false: nothing to retrieve
    _status(lambda: client.responses.retrieve(told.id), openai.NotFoundError, "response_id")


def test_json_schema_text_format_validates(client: openai.OpenAI) -> None:
    for seed in (1, 2):
        out = client.responses.create(
            model="tiny",
            input="Give me a thing.",
            text=THING,  # type: ignore[arg-type]
            max_output_tokens=80,
            extra_body={"seed": seed},
        )
        assert out.status == "completed"
        jsonschema.validate(json.loads(out.output_text), THING_SCHEMA)
    assert out.text is not None and out.text.format.type == "json_schema"


def test_named_and_required_tool_choice_give_valid_calls(client: openai.OpenAI) -> None:
    named = client.responses.create(
        model="tiny",
        input="What is 2 + 3?",
        tools=[ADD, SHOUT],
        tool_choice={"type": "function", "name": "shout"},
    )
    [call] = named.output
    assert call.type == "function_call" and call.name == "shout" and call.call_id
    jsonschema.validate(json.loads(call.arguments), SHOUT_PARAMETERS)
    required = client.responses.create(
        model="tiny",
        input="What is 2 + 3?",
        tools=[ADD, SHOUT],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    assert [item.type for item in required.output] == ["function_call"]
    call = required.output[0]
    assert call.type == "function_call"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    # the result goes back as a function_call_output item, continuing the stored response
    follow = client.responses.create(
        model="tiny",
        previous_response_id=required.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
        tools=[ADD, SHOUT],
        tool_choice="none",
        max_output_tokens=4,
    )
    assert follow.previous_response_id == required.id
    assert [item.type for item in follow.output] == ["message"]
    assert follow.usage is not None and required.usage is not None
    assert follow.usage.input_tokens > required.usage.input_tokens + required.usage.output_tokens


def test_previous_response_id_puts_the_conversation_first(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=6)
    second = client.responses.create(
        model="tiny", input="What is my name?", previous_response_id=first.id, max_output_tokens=6
    )
    spelled_out = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        max_output_tokens=6,
        store=False,
    )
    alone = client.responses.create(model="tiny", input="What is my name?", max_output_tokens=6, store=False)
    assert second.usage is not None and spelled_out.usage is not None and alone.usage is not None
    # the first input and its output come before the new input: the same prompt as spelled out
    assert second.usage.input_tokens == spelled_out.usage.input_tokens > alone.usage.input_tokens + 6
    assert client.responses.retrieve(second.id).previous_response_id == first.id


def test_stream_events_are_typed_ordered_and_stored(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model="tiny", input="Tell me a story.", max_output_tokens=12, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else None
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1]
    assert last.type == "response.incomplete" and final is None
    assert last.response.output_text == text and text
    assert last.response.usage is not None and last.response.usage.output_tokens == 12
    # stored before the last event was sent
    assert client.responses.retrieve(last.response.id).output_text == text

    with client.responses.stream(
        model="tiny", input="Give me a thing.", text=THING, max_output_tokens=80
    ) as stream:  # type: ignore[arg-type]
        for _ in stream:
            pass
        done = stream.get_final_response()
    assert done.status == "completed"
    jsonschema.validate(json.loads(done.output_text), THING_SCHEMA)


def test_streamed_function_call_events(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model="tiny",
            input="What is 2 + 3?",
            tools=[ADD],
            tool_choice={"type": "function", "name": "add"},
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and "response.function_call_arguments.delta" in types
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == deltas
    jsonschema.validate(json.loads(deltas), ADD_PARAMETERS)
    final = events[-1]
    assert final.type == "response.completed"
    [call] = final.response.output
    assert call.type == "function_call" and call.name == "add" and call.arguments == deltas


def test_bad_input_is_a_4xx_naming_the_field(client: openai.OpenAI, served: str, redis_url: str) -> None:
    bad = openai.BadRequestError
    _status(
        lambda: client.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}]),
        bad,
        "tools[0].type",
    )  # type: ignore[list-item]
    _status(
        lambda: client.responses.create(
            model="tiny",
            input="x",
            tools=[ADD, {"type": "function", "name": "bad name"}],  # type: ignore[list-item]
        ),
        bad,
        "tools[1].name",
    )
    _status(
        lambda: client.responses.create(
            model="tiny",
            input="x",
            text={"format": {"type": "json_schema", "name": "t", "schema": {"type": 3}}},  # type: ignore[typeddict-item]
        ),
        bad,
        "text.format.schema",
    )
    _status(
        lambda: client.responses.create(model="tiny", input="x", text={"format": {"type": "yaml"}}),
        bad,
        "text.format.type",
    )  # type: ignore[typeddict-item]
    _status(
        lambda: client.responses.create(model="tiny", input=[{"type": "input_image", "image_url": "x"}]),  # type: ignore[list-item]
        bad,
        "input[0].type",
    )
    _status(
        lambda: client.responses.create(
            model="tiny", input="x", tool_choice={"type": "function", "name": "nope"}, tools=[ADD]
        ),
        bad,
        "tool_choice",
    )
    _status(
        lambda: client.responses.create(model="tiny", input="x", previous_response_id="resp_" + "0" * 32),
        openai.NotFoundError,
        "previous_response_id",
    )
    _status(lambda: client.responses.create(model="nope", input="x"), openai.NotFoundError, "model")
    # another tenant's response is not there for this one
    mine = client.responses.create(model="tiny", input="x", max_output_tokens=1)
    other = openai.OpenAI(base_url=served + "/v1", api_key=_new_key(redis_url, "globex-r"), max_retries=0)
    _status(lambda: other.responses.retrieve(mine.id), openai.NotFoundError, "response_id")
    _status(
        lambda: other.responses.create(model="tiny", input="x", previous_response_id=mine.id),
        openai.NotFoundError,
        "previous_response_id",
    )
    assert (
        httpx.delete(
            f"{served}/v1/responses/{mine.id}", headers={"Authorization": f"Bearer {other.api_key}"}
        ).status_code
        == 404
    )
    assert client.responses.retrieve(mine.id).id == mine.id
    assert httpx.post(f"{served}/v1/responses", json={"model": "tiny", "input": "x"}).status_code == 401


def test_langchain_chat_openai_on_the_responses_api(served: str, key: str) -> None:
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    llm = ChatOpenAI(
        model="tiny",
        base_url=served + "/v1",
        api_key=key,
        use_responses_api=True,
        temperature=0,
        max_tokens=6,
        max_retries=0,  # type: ignore[arg-type]
    )
    answer = llm.invoke([HumanMessage("Hi"), AIMessage("Hello."), HumanMessage("Hi again")])
    assert answer.text and answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] == 6
    streamed = "".join(chunk.text for chunk in llm.stream("Tell me a story."))
    assert streamed

    roomy = ChatOpenAI(
        model="tiny",
        base_url=served + "/v1",
        api_key=key,
        use_responses_api=True,
        temperature=0,
        max_tokens=40,
        max_retries=0,  # type: ignore[arg-type]
    )
    # bounded arguments (the random model never ends a free integer)
    called = roomy.bind_tools([function_tool("add", ADD_PARAMETERS)], tool_choice="add").invoke(
        "What is 2 + 3?"
    )
    assert isinstance(called, AIMessage)
    [call] = called.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}

    class Pick(BaseModel):
        word: str = Field(max_length=5)

    structured = roomy.with_structured_output(Pick, method="json_schema")
    assert isinstance(structured.invoke("Pick a word."), Pick)


# --- the request read in chat's terms (no server) --------------------------------------------------


def test_input_items_become_chat_messages() -> None:
    from services.common.responses_input import input_messages

    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"}
    messages = input_messages(
        [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "2 + "}, {"type": "input_text", "text": "3?"}],
            },
            {"role": "assistant", "content": "Let me add."},
            call,
            {**call, "call_id": "c2"},
            {"type": "function_call_output", "call_id": "c1", "output": "5"},
            {"type": "reasoning", "summary": []},
            {
                "type": "function_call_output",
                "call_id": "old",
                "output": [{"type": "input_text", "text": "7"}],
            },
        ],
        earlier=[
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "old", "function": {"name": "shout"}}],
            }
        ],
    )
    calls = [
        {"id": c, "type": "function", "function": {"name": "add", "arguments": "{}"}} for c in ("c1", "c2")
    ]
    assert messages == [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "5", "name": "add"},
        {"role": "tool", "tool_call_id": "old", "content": "7", "name": "shout"},
    ]


def test_chat_parameters_are_named_as_the_responses_fields() -> None:
    from services.common.errors import InvalidRequest
    from services.common.responses_input import rename_error, responses_param

    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("response_format.type") == "text.format.type"
    assert responses_param("tools[1].function.parameters", [0, 3]) == "tools[3].parameters"
    assert responses_param("tools[0].type", [2]) == "tools[2].type"
    assert responses_param("max_tokens") == "max_output_tokens"
    assert responses_param("messages[2].tool_call_id") == "input"
    assert responses_param("tool_choice") == "tool_choice"
    err = rename_error(
        InvalidRequest("tools[0].function.name must be ...", param="tools[0].function.name"), [1]
    )
    assert (err.param, err.message) == ("tools[1].name", "tools[1].name must be ...")
