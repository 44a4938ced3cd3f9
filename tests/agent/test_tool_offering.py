"""Which tools an agent run is offered (services/agent/agents/offering.py): only those that can run
for the request, the tools of a server the request names first, and what is left out said with why.

The tools are the product's own (document search, the calculator, HTTP GET, MCP tools and the
stand-in of a server that could not be listed); the collection check asks a real HTTP server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

from services.agent.agents.offering import (
    NO_COLLECTION,
    Conditions,
    offer,
    preference_note,
    readable_collection,
    summary,
)
from services.agent.agents.runner import AgentRunner
from services.agent.clients import InferenceClient, RetrievalClient
from services.agent.tools.base import Tool, ToolContext
from services.agent.tools.calculator import Calculator
from services.agent.tools.http_get import HttpGet
from services.agent.tools.mcp import McpEndpoint, McpLimits, McpTool, McpToolInfo, UnavailableServer
from services.agent.tools.search import DocumentSearch
from tests.agent.doubles import ScriptedModel, inference_double
from tests.agent.stack import Stack, agent_stack
from tests.conftest import auth
from tests.helpers.mcp import serve_mcp
from tests.helpers.servers import serve_app

READ_ONLY_CONVERT = McpToolInfo(
    "convert",
    "Converts a length between units.",
    {"type": "object", "properties": {"value": {"type": "number"}, "to": {"type": "string"}}},
    read_only=True,
)
CLOCK_NOW = McpToolInfo(
    "now", "The time now in a city.", {"type": "object", "properties": {"city": {"type": "string"}}}, True
)
SEND = McpToolInfo("send", "Sends a message.", {"type": "object", "properties": {"to": {"type": "string"}}})


def mcp_tool(server: str, info: McpToolInfo) -> McpTool:
    return McpTool.of(server, info, McpEndpoint(f"https://{server}.example/mcp"), McpLimits())


def toolbox(*extra: Tool) -> dict[str, Tool]:
    tools: dict[str, Tool] = {"document_search": DocumentSearch(), "calculator": Calculator()}
    return tools | {t.name: t for t in extra}


def test_document_search_is_left_out_without_a_collection_and_says_why() -> None:
    offered = offer(toolbox(), Conditions())
    assert list(offered.tools) == ["calculator"]
    [left] = offered.left_out
    assert (left.tool, left.cause, left.reason) == ("document_search", "collection", NO_COLLECTION)
    assert (
        offered.notable
        and summary(offered) == f"offered: calculator; left out: document_search ({NO_COLLECTION})"
    )


def test_document_search_is_offered_with_a_readable_collection() -> None:
    offered = offer(toolbox(), Conditions(collection="handbook"))
    assert list(offered.tools) == ["document_search", "calculator"] and offered.left_out == []
    assert not offered.notable  # nothing to say: the run sends no tools step


def test_http_get_needs_outbound_calls_and_an_agent_that_accepts_side_effects() -> None:
    fetch = HttpGet()
    off = offer(toolbox(fetch), Conditions(collection="c", outbound=False, side_effects="approve"))
    assert "http_get" not in off.tools and [lo.cause for lo in off.left_out] == ["outbound"]
    assert "TANDEM_AGENT_HTTP_TOOL_ENABLED" in off.left_out[0].reason
    refused = offer(toolbox(fetch), Conditions(collection="c", outbound=True, side_effects="refuse"))
    assert "http_get" not in refused.tools and [lo.cause for lo in refused.left_out] == ["side_effects"]
    approved = offer(toolbox(fetch), Conditions(collection="c", outbound=True, side_effects="approve"))
    assert "http_get" in approved.tools and approved.left_out == []


def test_a_server_that_could_not_be_listed_is_left_out_with_its_error() -> None:
    gone = UnavailableServer.of("clock", "MCP server clock.example did not answer tools/list within 10 s")
    offered = offer(toolbox(gone), Conditions(named=("clock",)))
    assert gone.name not in offered.tools and offered.preferred == []
    [_, left] = offered.left_out
    assert (left.tool, left.server, left.cause) == ("clock__unavailable", "clock", "unavailable")
    assert "did not answer tools/list" in left.reason
    assert preference_note(offered, Conditions(named=("clock",))) == ""  # nothing of it to point at


def test_a_named_servers_tools_come_first_in_the_order_the_request_names_them() -> None:
    tools = toolbox(mcp_tool("units", READ_ONLY_CONVERT), mcp_tool("clock", CLOCK_NOW))
    conditions = Conditions(collection="c", named=("clock", "units"))
    offered = offer(tools, conditions)
    assert list(offered.tools) == ["clock__now", "units__convert", "document_search", "calculator"]
    assert offered.preferred == ["clock__now", "units__convert"]
    note = preference_note(offered, conditions)
    assert note == "This question is for the MCP server 'clock', 'units': call clock__now or units__convert."


def test_a_server_enabled_for_the_agent_but_not_named_keeps_its_place() -> None:
    tools = toolbox(mcp_tool("units", READ_ONLY_CONVERT))
    offered = offer(tools, Conditions(collection="c"))
    assert list(offered.tools) == ["document_search", "calculator", "units__convert"]
    assert offered.preferred == [] and preference_note(offered, Conditions(collection="c")) == ""


def test_a_named_servers_tool_with_side_effects_is_still_refused() -> None:
    tools = toolbox(mcp_tool("mail", SEND))
    offered = offer(tools, Conditions(named=("mail",), side_effects="refuse"))
    assert "mail__send" not in offered.tools and offered.preferred == []
    assert {(lo.tool, lo.server, lo.cause) for lo in offered.left_out} == {
        ("mail__send", "mail", "side_effects"),
        ("document_search", None, "collection"),
    }


@pytest.fixture(scope="module")
def retrieval_url() -> Iterator[str]:
    """A retrieval service's collection route: ``handbook`` exists and this caller reads it,
    anything else is the 404 retrieval answers for a collection it may not see."""
    app = FastAPI()

    @app.get("/v1/collections/{name}")
    async def collection(name: str) -> Any:
        if name != "handbook":
            return JSONResponse(
                {"error": {"type": "not_found_error", "message": f"no collection {name!r}"}}, status_code=404
            )
        return {"name": name}

    with serve_app(app) as url:
        yield url


@pytest.mark.anyio
async def test_the_collection_counts_only_when_the_caller_may_read_it(retrieval_url: str) -> None:
    client = RetrievalClient(retrieval_url, "k")
    assert await readable_collection(ToolContext(client, "handbook")) == ("handbook", "")
    missing, why = await readable_collection(ToolContext(client, "payroll"))
    assert missing is None and why == "collection 'payroll' does not exist or this caller may not read it"
    assert await readable_collection(ToolContext(client, None)) == (None, NO_COLLECTION)
    down = RetrievalClient("http://127.0.0.1:9", "k")
    unreachable, why = await readable_collection(ToolContext(down, "handbook"))
    assert unreachable is None and why.startswith("collection 'handbook' could not be checked")


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[ScriptedModel, str]]:
    model = ScriptedModel()
    with serve_app(inference_double(model)) as url:
        yield model, url


def _call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    fn = {"name": name, "arguments": json.dumps(args)}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": fn}],
    }


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["openai", "react"])
async def test_a_run_shows_the_model_only_what_can_run_and_points_at_the_named_server(
    scripted: tuple[ScriptedModel, str], mode: str
) -> None:
    model, url = scripted
    model.requests.clear()
    reply = {"thought": "I do not know.", "final_answer": "I cannot tell."}
    model.replies = ["I cannot tell." if mode == "openai" else json.dumps(reply)]
    tools = toolbox(mcp_tool("clock", CLOCK_NOW))
    runner = AgentRunner(
        InferenceClient(url, "k"), "scripted", tools, ToolContext(), named_servers=("clock",)
    )
    events = [e async for e in runner.run("What time is it in Lisbon?", [], mode=mode)]
    first = model.requests[0]
    system = first["messages"][0]["content"]
    assert "This question is for the MCP server 'clock': call clock__now." in system
    # the first step may only call the named server's tool (the engine's grammar holds it to it)
    if mode == "openai":
        assert [t["function"]["name"] for t in first["tools"]] == ["clock__now"]
        assert first["tool_choice"] == "required"
    else:
        [action] = first["response_format"]["json_schema"]["schema"]["anyOf"]
        assert action["properties"]["action"]["enum"] == ["clock__now"]
        assert "- document_search:" not in system
        assert system.index("- clock__now:") < system.index("- calculator:")
    # the first event says what the run was offered and what it was not, and why
    assert events[0] == {
        "type": "step",
        "kind": "tools",
        "text": f"offered: clock__now, calculator; left out: document_search ({NO_COLLECTION})",
        "offered": ["clock__now", "calculator"],
        "preferred": ["clock__now"],
        "left_out": [{"tool": "document_search", "reason": NO_COLLECTION}],
    }
    assert runner.result.answer == "I cannot tell." and [lo.tool for lo in runner.left_out] == [
        "document_search"
    ]


@pytest.mark.anyio
async def test_a_run_with_nothing_left_out_and_no_server_named_sends_no_tools_step(
    scripted: tuple[ScriptedModel, str],
) -> None:
    model, url = scripted
    model.replies = ["Four."]
    runner = AgentRunner(InferenceClient(url, "k"), "scripted", {"calculator": Calculator()}, ToolContext())
    events = [e async for e in runner.run("2+2?", [], mode="openai")]
    assert not any(e.get("kind") == "tools" for e in events) and runner.result.answer == "Four."


# -- end to end: a real MCP server (the SDK's server API over Streamable HTTP) and the agent service


def clock_server() -> MCPServer:
    mcp = MCPServer("clock")

    @mcp.tool(description="The local time in a city.", annotations=ToolAnnotations(read_only_hint=True))
    def local_time(city: str) -> str:
        if city == "Atlantis":
            raise ToolError("no time zone known for Atlantis")
        return f"It is 09:30 in {city}."

    return mcp


@pytest.fixture(scope="module")
def clock_url() -> Iterator[str]:
    with serve_mcp(clock_server()) as url:
        yield url


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agent_stack(redis_url, tmp_path_factory.mktemp("home"), mcp_allow_private=True) as s:
        yield s


def test_a_named_server_is_offered_first_and_document_search_not_without_a_collection(
    stack: Stack, clock_url: str, api_key: str
) -> None:
    body = {"name": "clock", "url": clock_url}
    assert (
        httpx.post(f"{stack.url}/v1/mcp/servers", json=body, headers=auth(api_key), timeout=30).status_code
        == 201
    )
    stack.model.requests.clear()
    stack.model.replies = [
        _call("clock__local_time", {"city": "Lisbon"}),
        json.dumps({"name": "final_answer", "arguments": {"answer": "09:30"}}),
    ]
    run = {"query": "What time is it in Lisbon?", "mcp_servers": ["clock"]}
    resp = httpx.post(
        f"{stack.url}/v1/pipelines/tools-agent/run", json=run, headers=auth(api_key), timeout=60
    )
    assert resp.status_code == 200, resp.text
    first = stack.model.requests[0]
    assert [t["function"]["name"] for t in first["tools"]] == ["clock__local_time"]  # the first step
    assert "call clock__local_time" in first["messages"][0]["content"]
    steps = resp.json()["steps"]
    assert [s["kind"] for s in steps] == ["tools", "tool_call", "observation", "final"]
    assert steps[0]["offered"] == ["clock__local_time", "calculator"]
    assert steps[0]["preferred"] == ["clock__local_time"]
    assert steps[0]["left_out"] == [{"tool": "document_search", "reason": NO_COLLECTION}]
    assert (
        steps[2]["ok"] and steps[2]["text"] == "It is 09:30 in Lisbon." and resp.json()["answer"] == "09:30"
    )
    # with a collection the caller reads, document search is offered again, after the named
    # server; and once the server's tool failed, the next step may call any tool
    stack.model.requests.clear()
    stack.model.replies = [_call("clock__local_time", {"city": "Atlantis"}), "No time zone is known."]
    resp = httpx.post(
        f"{stack.url}/v1/pipelines/tools-agent/run",
        json={**run, "collection": "geo"},
        headers=auth(api_key),
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    [tools] = [s for s in resp.json()["steps"] if s["kind"] == "tools"]
    assert tools["offered"] == ["clock__local_time", "document_search", "calculator"]
    assert tools["left_out"] == [] and tools["preferred"] == ["clock__local_time"]
    [failed] = [s for s in resp.json()["steps"] if s["kind"] == "observation"]
    assert not failed["ok"] and "Atlantis" in failed["text"]
    after = [t["function"]["name"] for t in stack.model.requests[1]["tools"]]
    assert after == ["clock__local_time", "document_search", "calculator", "final_answer"]
