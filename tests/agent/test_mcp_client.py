"""Tandem agents as MCP clients: a tenant registers a real MCP server (written with the SDK's
server API, over Streamable HTTP on 127.0.0.1) and an agent run calls its tools.

The model is the scripted double (these tests are about the MCP wiring, not the model's words);
the MCP server, the agent service and the registration are real, over real HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from mcp.types import ToolAnnotations
from starlette.types import ASGIApp, Receive, Scope, Send

from services.agent.config import AgentSettings
from services.agent.mcp_servers import McpServerCreate, McpServerStore, load_cipher
from services.agent.tools.mcp import (
    McpEndpoint,
    McpFailed,
    McpLimits,
    agent_tool_name,
    call_tool,
    constrained_schema,
    list_tools,
)
from services.common.redis_conn import async_redis
from tests.agent.stack import Stack, agent_stack
from tests.conftest import auth
from tests.helpers.servers import serve_app

SECRET = "Bearer kb-secret-7f3a"
CAPITAL = "Poseidonia"


class HeaderLog:
    """ASGI wrapper recording the Authorization header of every request to the MCP server."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seen: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            self.seen.append(headers.get(b"authorization", b"").decode())
        await self.app(scope, receive, send)


# the server's tools only read: an agent's default ("refuse") offers only such tools
READ_ONLY = ToolAnnotations(read_only_hint=True)


def knowledge_server() -> MCPServer:
    mcp = MCPServer("kb")
    never = asyncio.Event()

    @mcp.tool(description="The capital city of a country.", annotations=READ_ONLY)
    def lookup_capital(country: str) -> str:
        if country.lower() != "atlantis":
            raise ToolError(f"no capital known for {country!r}")
        return f"The capital of Atlantis is {CAPITAL}."

    @mcp.tool(description="Never answers.", annotations=READ_ONLY)
    async def hang() -> str:
        await never.wait()
        return "unreachable"

    @mcp.tool(description="Answers two megabytes.", annotations=READ_ONLY)
    def flood() -> str:
        return "x" * (2 << 20)

    return mcp


@contextmanager
def mcp_server() -> Iterator[tuple[str, HeaderLog]]:
    app = knowledge_server().streamable_http_app(
        stateless_http=True,
        json_response=True,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    logged = HeaderLog(app)
    with serve_app(logged) as url:
        yield f"{url}/mcp", logged


@pytest.fixture(scope="module")
def kb() -> Iterator[tuple[str, HeaderLog]]:
    with mcp_server() as served:
        yield served


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agent_stack(
        redis_url,
        tmp_path_factory.mktemp("home"),
        mcp_allow_private=True,
        mcp_timeout_s=2.0,
        mcp_max_response_bytes=256 * 1024,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def guarded(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The default: private MCP servers refused."""
    with agent_stack(redis_url, tmp_path_factory.mktemp("home")) as s:
        yield s


def register(stack: Stack, key: str, name: str, url: str, **extra: Any) -> httpx.Response:
    body = {"name": name, "url": url, **extra}
    return httpx.post(f"{stack.url}/v1/mcp/servers", json=body, headers=auth(key), timeout=30)


def call(name: str, args: dict[str, Any], call_id: str = "c1") -> dict[str, Any]:
    fn = {"name": name, "arguments": json.dumps(args)}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": fn}],
    }


def calls_then_answers(name: str, args: dict[str, Any], answer: str) -> Any:
    """A model that calls ``name`` once, then gives ``answer`` (a final_answer call, or the forced
    final step's format)."""

    def reply(body: dict[str, Any]) -> str | dict[str, Any]:
        called = any(m.get("role") == "tool" and m.get("tool_call_id") == "c1" for m in body["messages"])
        if not called:
            return call(name, args)
        if "response_format" in body:
            return json.dumps({"name": "final_answer", "arguments": {"answer": answer}})
        return call("final_answer", {"answer": answer}, "c2")

    return reply


def run_agent(stack: Stack, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/pipelines/tools-agent/run", json=body, headers=auth(key), timeout=60)


def test_register_list_tools_and_delete(
    stack: Stack, kb: tuple[str, HeaderLog], api_key: str, redis_client: redis.Redis
) -> None:
    url, log = kb
    resp = register(stack, api_key, "kb", url, headers={"Authorization": SECRET})
    assert resp.status_code == 201, resp.text
    assert resp.json()["header_names"] == ["Authorization"] and SECRET not in resp.text
    listed = httpx.get(f"{stack.url}/v1/mcp/servers", headers=auth(api_key)).json()["data"]
    assert [s["name"] for s in listed] == ["kb"] and SECRET not in json.dumps(listed)
    # stored encrypted: the secret is nowhere in Redis
    stored = redis_client.hgetall("tandem:agent:mcp:acme")
    assert "kb" in stored and SECRET not in json.dumps(stored)
    tools = httpx.get(f"{stack.url}/v1/mcp/servers/kb/tools", headers=auth(api_key), timeout=30)
    assert tools.status_code == 200, tools.text
    by_name = {t["name"]: t for t in tools.json()["data"]}
    assert set(by_name) == {"lookup_capital", "hang", "flood"}
    # as the server reports it
    assert by_name["lookup_capital"]["input_schema"]["properties"]["country"]["type"] == "string"
    assert log.seen[-1] == SECRET  # the stored header went to the server
    assert register(stack, api_key, "kb", url).status_code == 409
    gone = httpx.delete(f"{stack.url}/v1/mcp/servers/kb", headers=auth(api_key))
    assert gone.status_code == 204
    assert httpx.get(f"{stack.url}/v1/mcp/servers/kb/tools", headers=auth(api_key)).status_code == 404
    assert httpx.delete(f"{stack.url}/v1/mcp/servers/kb", headers=auth(api_key)).status_code == 404


def test_servers_are_the_tenants_own(
    stack: Stack, kb: tuple[str, HeaderLog], api_key: str, other_key: str
) -> None:
    assert register(stack, api_key, "mine", kb[0]).status_code == 201
    assert httpx.get(f"{stack.url}/v1/mcp/servers", headers=auth(other_key)).json()["data"] == []
    resp = httpx.get(f"{stack.url}/v1/mcp/servers/mine/tools", headers=auth(other_key))
    assert resp.status_code == 404
    resp = run_agent(stack, other_key, {"query": "hi", "mcp_servers": ["mine"]})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "mcp_servers"


def test_an_agent_answers_with_the_servers_tool(
    stack: Stack, kb: tuple[str, HeaderLog], api_key: str
) -> None:
    assert register(stack, api_key, "atlas", kb[0]).status_code == 201
    stack.model.requests.clear()
    stack.model.replies = calls_then_answers("atlas__lookup_capital", {"country": "Atlantis"}, CAPITAL)
    resp = run_agent(stack, api_key, {"query": "What is the capital of Atlantis?", "mcp_servers": ["atlas"]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["answer"] == CAPITAL
    steps = body["steps"]
    [tool_call] = [s for s in steps if s["kind"] == "tool_call"]
    [observation] = [s for s in steps if s["kind"] == "observation"]
    assert tool_call["tool"] == "atlas__lookup_capital" and tool_call["input"] == {"country": "Atlantis"}
    assert observation["ok"] and f"The capital of Atlantis is {CAPITAL}." in observation["text"]
    assert observation["text"] == f"The capital of Atlantis is {CAPITAL}."
    # the server's schema, made closed and bounded, is what the engine constrains the call with
    first = stack.model.requests[0]
    params = next(
        t["function"]["parameters"]
        for t in first["tools"]
        if t["function"]["name"] == "atlas__lookup_capital"
    )
    assert params["additionalProperties"] is False and params["required"] == ["country"]
    assert params["properties"]["country"] == {"type": "string", "maxLength": 200}
    assert first["tool_choice"] == "required"
    # the forced answer is a span of the result itself, never of its data-block tags
    forced = next(r for r in stack.model.requests if "response_format" in r)
    spans = forced["response_format"]["json_schema"]["schema"]["properties"]["arguments"]["properties"]
    assert CAPITAL in spans["answer"]["enum"] and not any("tool_result" in s for s in spans["answer"]["enum"])
    # the turn record keeps the call, its arguments and its result
    record = httpx.get(f"{stack.url}/v1/messages/{body['message_id']}", headers=auth(api_key)).json()
    prompt = json.dumps(record["prompt"])
    assert "atlas__lookup_capital" in prompt and "Atlantis" in prompt and f"{CAPITAL}." in prompt
    assert record["kind"] == "agent" and record["answer"] == CAPITAL


def test_servers_enabled_for_an_agent_and_single_tools(
    stack: Stack, kb: tuple[str, HeaderLog], api_key: str
) -> None:
    assert (
        register(
            stack, api_key, "enabled", kb[0], agents=["tools-agent"], tools=["lookup_capital"]
        ).status_code
        == 201
    )
    stack.model.requests.clear()
    stack.model.replies = calls_then_answers("enabled__lookup_capital", {"country": "Atlantis"}, CAPITAL)
    resp = run_agent(stack, api_key, {"query": "Capital of Atlantis?"})
    assert resp.status_code == 200 and resp.json()["answer"] == CAPITAL
    names = [t["function"]["name"] for t in stack.model.requests[0]["tools"]]
    assert "enabled__lookup_capital" in names and "enabled__hang" not in names
    patched = httpx.patch(
        f"{stack.url}/v1/mcp/servers/enabled", json={"agents": []}, headers=auth(api_key), timeout=30
    )
    assert patched.status_code == 200 and patched.json()["agents"] == []
    stack.model.requests.clear()
    stack.model.replies = calls_then_answers("calculator", {"expression": "1+1"}, "2")
    assert run_agent(stack, api_key, {"query": "1+1?"}).status_code == 200
    names = [t["function"]["name"] for t in stack.model.requests[0]["tools"]]
    assert not any(n.startswith("enabled__") for n in names)


@pytest.mark.parametrize(
    ("tool", "args", "expected"),
    [
        ("lookup_capital", {"country": "Mu"}, "no capital known for 'Mu'"),
        ("hang", {}, "did not answer"),
        ("flood", {}, "more than 262144"),
    ],
)
def test_a_failing_slow_or_flooding_tool_is_an_error_the_agent_sees(
    stack: Stack, kb: tuple[str, HeaderLog], api_key: str, tool: str, args: dict[str, Any], expected: str
) -> None:
    register(stack, api_key, "faulty", kb[0])
    stack.model.replies = calls_then_answers(f"faulty__{tool}", args, "I could not find out.")
    resp = run_agent(stack, api_key, {"query": "Try it.", "mcp_servers": ["faulty"]})
    assert resp.status_code == 200, resp.text
    [observation] = [s for s in resp.json()["steps"] if s["kind"] == "observation"]
    assert observation["ok"] is False and expected in observation["text"]
    assert "error" not in resp.json()


def test_an_unreachable_server_is_left_out_with_why_not_a_failed_turn(stack: Stack, api_key: str) -> None:
    assert register(stack, api_key, "gone", "http://127.0.0.1:9/mcp").status_code == 201
    stack.model.requests.clear()
    stack.model.replies = calls_then_answers("calculator", {"expression": "2+2"}, "4")
    resp = run_agent(stack, api_key, {"query": "Anything?", "mcp_servers": ["gone"]})
    assert resp.status_code == 200, resp.text
    # the model is not offered a tool that cannot run: the server's stand-in, nor document search
    offered = [t["function"]["name"] for t in stack.model.requests[0]["tools"]]
    assert "calculator" in offered and not any(n.startswith("gone") for n in offered)
    assert "document_search" not in offered
    [tools] = [s for s in resp.json()["steps"] if s["kind"] == "tools"]
    why = {lo["tool"]: lo for lo in tools["left_out"]}
    assert (
        why["gone__unavailable"]["server"] == "gone" and "127.0.0.1:9" in why["gone__unavailable"]["reason"]
    )
    assert why["document_search"]["reason"] == "no collection was given for this conversation"
    assert tools["preferred"] == [] and "gone__unavailable" in tools["text"]


def test_the_chat_completions_facade_takes_mcp_servers(
    stack: Stack, kb: tuple[str, HeaderLog], api_key: str
) -> None:
    register(stack, api_key, "facade", kb[0])
    stack.model.replies = calls_then_answers("facade__lookup_capital", {"country": "Atlantis"}, CAPITAL)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=api_key, max_retries=0)
    answer = client.chat.completions.create(
        model="tools-agent",
        messages=[{"role": "user", "content": "What is the capital of Atlantis?"}],
        extra_body={"mcp_servers": ["facade"]},
    )
    assert answer.choices[0].message.content == CAPITAL
    with pytest.raises(openai.NotFoundError, match="mcp_servers"):
        client.chat.completions.create(
            model="tools-agent",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"mcp_servers": ["nope"]},
        )


def test_bad_registrations_and_runs_are_4xx_naming_the_field(guarded: Stack, api_key: str) -> None:
    for url in ("http://127.0.0.1:8123/mcp", "http://localhost/mcp", "http://169.254.169.254/mcp"):
        resp = register(guarded, api_key, "private", url)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "url", resp.text
        assert "private, loopback or link-local" in resp.json()["error"]["message"]
    resp = register(guarded, api_key, "ftp", "ftp://example.com/mcp")
    assert resp.status_code == 400 and "http and https" in resp.json()["error"]["message"]
    for url in ("http://[::1/mcp", "http://example.com:99999/mcp"):
        resp = register(guarded, api_key, "malformed", url)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "url", resp.text
    resp = register(guarded, api_key, "Bad Name", "https://example.com/mcp")
    assert resp.status_code == 400 and "name" in resp.text
    resp = httpx.post(
        f"{guarded.url}/v1/pipelines/chat-documents/run",
        json={"query": "hi", "collection": "geo", "mcp_servers": ["x"]},
        headers=auth(api_key),
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "mcp_servers"
    resp = run_agent(guarded, api_key, {"query": "hi", "mcp_servers": ["never-registered"]})
    assert resp.status_code == 404 and "never-registered" in resp.json()["error"]["message"]


def test_a_servers_schema_becomes_closed_and_bounded() -> None:
    """What the engine's grammar constrains a call with: refs inlined, objects closed, open
    strings and arrays bounded; constraints the server gave are kept."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "title": "args",
        "properties": {
            "city": {"type": "string", "title": "City"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "where": {"$ref": "#/$defs/Point"},
            "limit": {"type": "integer", "minimum": 1, "default": 3},
        },
        "required": ["city"],
        "$defs": {"Point": {"type": "object", "properties": {"lat": {"type": "number"}}}},
    }
    out = constrained_schema(schema)
    assert out["additionalProperties"] is False and out["required"] == ["city"]
    assert "$schema" not in out and "$defs" not in out and "title" not in out
    props = out["properties"]
    assert props["city"] == {"type": "string", "maxLength": 200}
    assert props["code"] == {"type": "string", "pattern": "^[A-Z]{2}$"}
    assert props["tags"] == {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 8}
    assert props["where"] == {
        "type": "object",
        "properties": {"lat": {"type": "number"}},
        "additionalProperties": False,
    }
    assert props["limit"] == {"type": "integer", "minimum": 1}
    assert constrained_schema({}) == {"type": "object", "properties": {}, "additionalProperties": False}
    assert agent_tool_name("kb", "look up.city") == "kb__look_up_city"


@pytest.mark.anyio
async def test_an_agent_definition_names_servers_or_single_tools(
    redis_url: str, kb: tuple[str, HeaderLog], tmp_path: Path
) -> None:
    settings = AgentSettings.model_validate({"mcp_allow_private": True})
    store = McpServerStore(async_redis(redis_url), load_cipher(settings, tmp_path), settings)
    await store.add("defs", McpServerCreate(name="kb", url=kb[0]))
    named = await store.agent_tools("defs", "my-agent", [], ["kb/lookup_capital", "unregistered"])
    assert list(named) == ["kb__lookup_capital"]
    whole = await store.agent_tools("defs", "my-agent", [], ["kb/hang", "kb"])
    assert set(whole) == {"kb__lookup_capital", "kb__hang", "kb__flood"}
    assert await store.agent_tools("defs", "my-agent", []) == {}


@pytest.mark.anyio
async def test_every_call_checks_the_address_again() -> None:
    """A name that resolved to a public address when registered and to a private one later (DNS
    rebinding) is refused at the call, before any connection."""

    async def rebound(host: str, port: int) -> list[str]:
        return ["10.0.0.7"]

    limits = McpLimits(timeout_s=2.0, resolver=rebound)
    endpoint = McpEndpoint("http://mcp.rebound.test/mcp")
    with pytest.raises(McpFailed, match=r"10\.0\.0\.7, a private"):
        await list_tools(endpoint, limits)
    with pytest.raises(McpFailed, match="refused"):
        await call_tool(endpoint, "lookup_capital", {"country": "x"}, limits)
