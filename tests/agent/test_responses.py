"""The agent's ``/v1/responses``: the official ``openai`` client's ``responses.create`` / ``.stream``
/ ``.retrieve`` and LangChain's ``ChatOpenAI(use_responses_api=True)`` against a real agent service
over real HTTP, with the doubles of retrieval and inference (a scripted model that cites its first
source), so the citations, calls and stored state are known exactly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.agent.doubles import cite_first
from tests.agent.stack import Stack, agent_stack, new_key
from tests.conftest import auth

GEO = {"collection": "geo"}
ASK = "What is the capital of Germany?"
ADD_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
ADD = {"type": "function", "name": "add", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agent_stack(redis_url, tmp_path_factory.mktemp("responses")) as s:
        yield s


@pytest.fixture(scope="module")
def key(redis_url: str) -> str:
    return new_key(redis_url, "acme-responses")


@pytest.fixture(scope="module")
def client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=60)


def _error(call: Any, error: type[openai.APIStatusError], param: str) -> dict[str, Any]:
    with pytest.raises(error) as err:
        call()
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    return body


def test_a_pipeline_answer_carries_its_citations_as_file_citations(
    stack: Stack, client: openai.OpenAI
) -> None:
    stack.model.replies = cite_first
    out = client.responses.create(model="chat-documents-generate", input=ASK, extra_body=GEO)
    assert out.status == "completed" and out.model == "chat-documents-generate"
    text = out.output_text
    assert "Berlin" in text and text.endswith("[1].")
    [message] = out.output
    assert message.type == "message"
    [annotation] = message.content[0].annotations
    assert annotation.type == "file_citation"
    assert (annotation.file_id, annotation.filename, annotation.index) == ("de", "Germany", text.index("[1]"))
    assert out.usage is not None and (out.usage.input_tokens, out.usage.output_tokens) == (10, 5)
    extra = out.model_extra or {}
    assert str(extra["message_id"]).startswith("msg_")
    assert client.responses.retrieve(out.id).model_dump() == out.model_dump()


def test_previous_response_id_sends_the_conversation_and_is_per_tenant(
    stack: Stack, client: openai.OpenAI, redis_url: str
) -> None:
    stack.model.replies = cite_first
    first = client.responses.create(model="chat-documents-generate", input=ASK, extra_body=GEO)
    second = client.responses.create(
        model="chat-documents-generate", input="And of France?", previous_response_id=first.id, extra_body=GEO
    )
    sent = stack.model.requests[-1]["messages"]
    # the first question and answer come before the new question
    assert [m["content"] for m in sent if m["role"] == "assistant"][-1] == first.output_text
    assert any(m["role"] == "user" and m["content"] == ASK for m in sent)
    assert second.previous_response_id == first.id

    other = openai.OpenAI(
        base_url=client.base_url, api_key=new_key(redis_url, "globex-responses"), max_retries=0
    )
    _error(lambda: other.responses.retrieve(first.id), openai.NotFoundError, "response_id")
    _error(
        lambda: other.responses.create(
            model="chat-documents-generate", input="x", previous_response_id=first.id, extra_body=GEO
        ),
        openai.NotFoundError,
        "previous_response_id",
    )
    client.responses.delete(first.id)
    _error(lambda: client.responses.retrieve(first.id), openai.NotFoundError, "response_id")
    # store false keeps nothing
    kept = client.responses.create(model="chat-documents-generate", input=ASK, store=False, extra_body=GEO)
    _error(lambda: client.responses.retrieve(kept.id), openai.NotFoundError, "response_id")


def test_the_stream_has_typed_events_with_the_annotations(stack: Stack, client: openai.OpenAI) -> None:
    stack.model.replies = cite_first
    with client.responses.stream(model="chat-documents", input=ASK, extra_body=GEO) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-5:] == [
        "response.output_text.annotation.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and text.endswith("[1].")
    [message] = final.output
    assert message.type == "message"
    assert [(a.file_id, a.index) for a in message.content[0].annotations] == [("de", text.index("[1]"))]  # type: ignore[union-attr]
    assert client.responses.retrieve(final.id).output_text == text


def test_function_tools_reach_the_pipeline_and_calls_come_back(stack: Stack, client: openai.OpenAI) -> None:
    stack.model.replies = lambda body: {"role": "assistant", "content": None, "tool_calls": [ADD_CALL]}
    out = client.responses.create(model="chat-documents", input=ASK, tools=[ADD], extra_body=GEO)  # type: ignore[list-item]
    [call] = out.output
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == ("call_1", "add", '{"a": 1}')
    sent = stack.model.requests[-1]
    assert sent["tools"] == [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    ]

    events = list(
        client.responses.create(model="chat-documents", input=ASK, tools=[ADD], stream=True, extra_body=GEO)  # type: ignore[list-item]
    )
    types = [e.type for e in events]
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    last = events[-1]
    assert last.type == "response.completed"
    [streamed] = last.response.output
    assert streamed.type == "function_call" and streamed.arguments == '{"a": 1}'

    # the result goes back as a function_call_output, after the stored call
    stack.model.replies = cite_first
    follow = client.responses.create(
        model="chat-documents",
        previous_response_id=out.id,
        input=[{"type": "function_call_output", "call_id": "call_1", "output": "2"}],
        tools=[ADD],  # type: ignore[list-item]
        extra_body=GEO,
    )
    assert follow.output_text
    tail = stack.model.requests[-1]["messages"][-2:]
    assert tail[0]["tool_calls"][0]["id"] == "call_1"
    assert (tail[1]["role"], tail[1]["tool_call_id"], tail[1]["content"]) == ("tool", "call_1", "2")


def test_bad_input_is_a_4xx_naming_the_field(stack: Stack, client: openai.OpenAI, key: str) -> None:
    bad = openai.BadRequestError
    _error(
        lambda: client.responses.create(
            model="chat-documents", input="x", tools=[{"type": "web_search"}], extra_body=GEO
        ),  # type: ignore[list-item]
        bad,
        "tools[0].type",
    )
    _error(
        lambda: client.responses.create(model="nope", input="x", extra_body=GEO),
        openai.NotFoundError,
        "model",
    )
    _error(
        lambda: client.responses.create(
            model="chat-documents", input=[{"type": "item_reference", "id": "x"}], extra_body=GEO
        ),  # type: ignore[list-item]
        bad,
        "input[0].type",
    )
    _error(
        lambda: client.responses.create(
            model="chat-documents", input="x", previous_response_id="resp_" + "a" * 32, extra_body=GEO
        ),
        openai.NotFoundError,
        "previous_response_id",
    )
    only_assistant = [{"role": "assistant", "content": "x"}]
    body = _error(
        lambda: client.responses.create(model="chat-documents", input=only_assistant, extra_body=GEO),  # type: ignore[arg-type]
        bad,
        "input",
    )
    assert body["message"].startswith("input: ")
    mcp = {"type": "mcp", "server_label": "nowhere", "server_url": "http://127.0.0.1:9/mcp"}
    # an MCP server's tools join an agent's run, not a pipeline's
    with pytest.raises(openai.APIStatusError) as err:
        client.responses.create(model="chat-documents", input="x", tools=[mcp], extra_body=GEO)  # type: ignore[list-item]
    assert err.value.status_code == 400 and isinstance(err.value.body, dict)
    assert str(err.value.body["param"]).startswith("tools[0]")
    # an agent with a server that is not registered for this key
    with pytest.raises(openai.APIStatusError) as err:
        client.responses.create(model="tools-agent", input="x", tools=[mcp])  # type: ignore[list-item]
    assert err.value.status_code in (400, 404) and isinstance(err.value.body, dict)
    assert str(err.value.body["param"]).startswith("tools[0]")
    assert (
        httpx.post(f"{stack.url}/v1/responses", json={"model": "chat-documents", "input": "x"}).status_code
        == 401
    )
    resp = httpx.post(f"{stack.url}/v1/responses", json={"model": "chat-documents"}, headers=auth(key))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input"


def test_langchain_chat_openai_on_the_responses_api(stack: Stack, key: str) -> None:
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_openai import ChatOpenAI

    stack.model.replies = cite_first
    llm = ChatOpenAI(
        model="chat-documents-generate",
        base_url=f"{stack.url}/v1",
        api_key=key,  # type: ignore[arg-type]
        use_responses_api=True,
        extra_body=GEO,
        max_retries=0,
    )
    answer = llm.invoke([HumanMessage(ASK), AIMessage("Hello."), HumanMessage(ASK)])
    assert "Berlin" in answer.text
    blocks = [b for b in answer.content if isinstance(b, dict)]
    annotations = [a for b in blocks for a in b.get("annotations", [])]
    assert [a.get("file_id") for a in annotations] == ["de"]
    assert answer.usage_metadata is not None and answer.usage_metadata["total_tokens"] == 15
    streamed = "".join(chunk.text for chunk in llm.stream(ASK))
    assert streamed == answer.text
    sent = stack.model.requests[-2]["messages"]
    assert json.dumps(sent).count("Hello.") == 1


def _knowledge_server_url() -> Any:
    """A real MCP server (the SDK's server API, Streamable HTTP on 127.0.0.1) with one tool."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.transport_security import TransportSecuritySettings
    from mcp.types import ToolAnnotations

    from tests.helpers.servers import serve_app

    mcp = MCPServer("kb")

    @mcp.tool(description="The capital city of a country.", annotations=ToolAnnotations(read_only_hint=True))
    def lookup_capital(country: str) -> str:
        return f"The capital of {country} is Poseidonia."

    app = mcp.streamable_http_app(
        stateless_http=True,
        json_response=True,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    return serve_app(app)


def test_mcp_tools_of_a_registered_server_come_back_as_mcp_calls(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from services.agent.protocol import ChatCompletionRequest

    if "mcp_servers" not in ChatCompletionRequest.model_fields:
        pytest.skip("this build has no registered MCP servers")
    from services.agent.tools.mcp import agent_tool_name

    tool = agent_tool_name("kb", "lookup_capital")

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        called = any(m.get("role") == "tool" and m.get("tool_call_id") == "c1" for m in body["messages"])
        name, args, call_id = (
            ("final_answer", {"answer": "It is Poseidonia."}, "c2")
            if called
            else (tool, {"country": "Atlantis"}, "c1")
        )
        fn = {"name": name, "arguments": json.dumps(args)}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": fn}],
        }

    key = new_key(redis_url, "acme-responses-mcp")
    with (
        _knowledge_server_url() as kb,
        agent_stack(redis_url, tmp_path_factory.mktemp("responses-mcp"), mcp_allow_private=True) as stack,
    ):
        registered = httpx.post(
            f"{stack.url}/v1/mcp/servers",
            json={"name": "kb", "url": f"{kb}/mcp"},
            headers=auth(key),
            timeout=30,
        )
        assert registered.status_code in (200, 201), registered.text
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=60)
        mcp = {"type": "mcp", "server_label": "kb", "require_approval": "never"}
        stack.model.replies = reply
        out = client.responses.create(
            model="tools-agent", input="What is the capital of Atlantis?", tools=[mcp]
        )  # type: ignore[list-item]
        kinds = [item.type for item in out.output]
        assert kinds == ["mcp_call", "message"], kinds
        call = out.output[0]
        assert call.type == "mcp_call" and (call.server_label, call.name) == ("kb", "lookup_capital")
        assert json.loads(call.arguments) == {"country": "Atlantis"}
        assert "Poseidonia" in (call.output or "") and call.error is None
        assert "Poseidonia" in out.output_text

        stack.model.replies = reply
        with client.responses.stream(model="tools-agent", input="And Atlantis?", tools=[mcp]) as stream:  # type: ignore[list-item]
            for _ in stream:
                pass
            final = stream.get_final_response()
        assert [item.type for item in final.output] == ["mcp_call", "message"]


@pytest.mark.e2e
def test_over_the_real_services(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path
) -> None:
    """Through the real retrieval and inference services (a tiny random model: the grammar makes
    every forced call and JSON answer valid): calls, structured output with the sources as
    annotations, and the inference's 400 named by the Responses field."""
    import jsonschema

    from tests.agent.stack import real_services
    from tests.inference.schemas import ADD_PARAMETERS, THING_SCHEMA

    docs = [
        {"id": "bees", "title": "Honey bees", "text": "Honey bees make honey from the nectar of flowers."}
    ]
    facts = {"collection": "facts"}
    ask = "What do honey bees make honey from?"
    with real_services(
        redis_url,
        tmp_path_factory.mktemp("responses-real"),
        tiny_model_path,
        new_key(redis_url, "acme-responses-real"),
        docs,
        inference={"served_model_name": "tiny", "max_batch_size": 4},
        tokenizer=str(tiny_model_path),
        max_answer_tokens=100,
        grounding_embedder=False,
    ) as real:
        client = openai.OpenAI(base_url=f"{real.agent}/v1", api_key=real.key, max_retries=0, timeout=300)
        add = {"type": "function", "name": "add", "parameters": ADD_PARAMETERS}
        out = client.responses.create(
            model="chat-documents",
            input=ask,
            tools=[add],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "add"},
            extra_body=facts,
        )
        [call] = out.output
        assert call.type == "function_call" and call.name == "add"
        jsonschema.validate(json.loads(call.arguments), ADD_PARAMETERS)

        thing = {"format": {"type": "json_schema", "name": "thing", "schema": THING_SCHEMA, "strict": True}}
        with client.responses.stream(
            model="chat-documents", input=ask, text=thing, extra_body=facts
        ) as stream:  # type: ignore[arg-type]
            for _ in stream:
                pass
            answer = stream.get_final_response()
        jsonschema.validate(json.loads(answer.output_text), THING_SCHEMA)
        [message] = answer.output
        assert message.type == "message"
        # the sources the model was shown, not cited by a marker: at the end of the text
        annotations = message.content[0].annotations  # type: ignore[union-attr]
        assert [(a.file_id, a.index) for a in annotations] == [("bees", len(answer.output_text))]  # type: ignore[union-attr]

        _error(
            lambda: client.responses.create(
                model="chat-documents",
                input=ask,
                tools=[add, {"type": "function", "name": "bad name"}],  # type: ignore[list-item]
                extra_body=facts,
            ),
            openai.BadRequestError,
            "tools[1].name",
        )
