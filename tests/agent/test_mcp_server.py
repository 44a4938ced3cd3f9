"""Tandem as an MCP server (``/mcp``), called with the official SDK's client over real HTTP.

The agent runs over the real retrieval service (a tiny random embedder, so tenants and their
collections are the real ones) and the scripted inference double (the test is not about the
model's words)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from services.agent.app import create_app
from services.agent.config import AgentSettings
from services.common.config import CommonSettings
from tests.agent.doubles import ScriptedModel, inference_double
from tests.agent.stack import agent_stack, new_key
from tests.conftest import TEST_CACHE, auth
from tests.helpers.servers import serve_app, wait_ready

pytestmark = pytest.mark.anyio

DOCS = [
    {
        "id": "eiffel",
        "title": "Eiffel Tower",
        "text": "The Eiffel Tower stands in Paris and is 330 metres tall.",
    },
    {"id": "honey", "title": "Honey", "text": "Honey never spoils; jars of it were found in old tombs."},
]


# A name the agent is told it is served under (TANDEM_AGENT_MCP_ALLOWED_HOSTS).
ALLOWED_NAME = "tandem.test"


@dataclass
class McpStack:
    agent: str
    key: str  # tenant acme, owner of the collection "facts"
    other_key: str  # tenant globex, with no collection
    model: ScriptedModel

    @property
    def mcp(self) -> str:
        return f"{self.agent}/mcp"

    @property
    def port(self) -> int:
        return int(self.agent.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpStack]:
    from services.retrieval.app import create_app as create_retrieval
    from services.retrieval.config import RetrievalSettings
    from tests.retrieval.conftest import make_tiny_embedder

    root = TEST_CACHE / "retrieval-models"
    root.mkdir(parents=True, exist_ok=True)
    embedder = make_tiny_embedder(root / "tiny-embedder")
    home = tmp_path_factory.mktemp("home")
    key, other = new_key(redis_url, "acme"), new_key(redis_url, "globex")
    model = ScriptedModel()
    with ExitStack() as es:
        base = CommonSettings(home=home, redis_url=redis_url, log_json=False, model_roots=str(root))
        r_url = es.enter_context(
            serve_app(create_retrieval(base, RetrievalSettings(embedding_model=str(embedder))))
        )
        wait_ready(r_url)
        i_url = es.enter_context(serve_app(inference_double(model)))
        common = base.model_copy(update={"retrieval_url": r_url, "inference_url": i_url, "max_body_mb": 1})
        settings = AgentSettings.model_validate(
            {"grounding_embedder": False, "mcp_allowed_hosts": f"{ALLOWED_NAME}:*"}
        )
        agent = es.enter_context(serve_app(create_app(common, settings)))
        with httpx.Client(base_url=r_url, headers=auth(key), timeout=120) as client:
            assert client.post("/v1/collections", json={"name": "facts"}).status_code == 201
            resp = client.post("/v1/collections/facts/documents", json={"documents": DOCS})
            assert resp.status_code == 201, resp.text
        yield McpStack(agent, key, other, model)


def client(url: str, key: str | None, **headers: str) -> Client:
    http = httpx2.AsyncClient(headers={**(auth(key) if key else {}), **headers}, timeout=60)
    return Client(streamable_http_client(url, http_client=http))


def text(result: Any) -> str:
    """The text of a tool result's first block."""
    return str(result.content[0].text)


def structured(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content
    if result.structured_content is not None:
        return dict(result.structured_content)
    return dict(json.loads(text(result)))


async def test_lists_tools_with_the_rest_schemas(stack: McpStack) -> None:
    async with client(stack.mcp, stack.key) as mcp:
        tools = {t.name: t for t in (await mcp.list_tools()).tools}
    assert {"search", "ask", "list_collections", "tools-agent"} <= set(tools)
    search = tools["search"].input_schema["properties"]
    assert {"collection", "query", "mode", "top_k", "filters"} <= set(search)
    assert search["top_k"]["maximum"] == 100 and search["mode"]["enum"] == ["dense", "sparse", "hybrid"]
    ask = tools["ask"].input_schema["properties"]
    # POST /v1/pipelines/{name}/run's body (less stream)
    assert {"query", "collection", "top_k", "llm", "history"} <= set(ask) and "stream" not in ask


async def test_search_ask_and_read_a_document(stack: McpStack) -> None:
    stack.model.replies = ["The Eiffel Tower is 330 metres tall [1]."]
    async with client(stack.mcp, stack.key) as mcp:
        found = structured(
            await mcp.call_tool("search", {"collection": "facts", "query": "Eiffel Tower", "mode": "sparse"})
        )
        assert found["results"][0]["document_id"] == "eiffel"
        answer = structured(
            await mcp.call_tool("ask", {"query": "How tall is the Eiffel Tower?", "collection": "facts"})
        )
        assert "330" in answer["answer"]
        assert answer["citations"][0]["document_id"] == "eiffel"
        listed = structured(await mcp.call_tool("list_collections", {}))
        assert [c["name"] for c in listed["collections"]] == ["facts"]
        doc = await mcp.read_resource("tandem://collections/facts/documents/honey")
    assert "never spoils" in json.loads(getattr(doc.contents[0], "text", ""))["text"]
    # ask ran the chat-documents pipeline: the retrieved sentence that answers, without a model call
    assert answer["answer_kind"] == "extractive" and "330 metres" in answer["answer"]
    assert not stack.model.requests


async def test_another_tenants_collection_is_refused(stack: McpStack) -> None:
    async with client(stack.mcp, stack.other_key) as mcp:
        result = await mcp.call_tool("search", {"collection": "facts", "query": "Eiffel"})
        assert result.is_error and "facts" in text(result)
        listed = structured(await mcp.call_tool("list_collections", {}))
        assert listed["collections"] == []
        with pytest.raises(Exception, match=r"honey|facts"):
            await mcp.read_resource("tandem://collections/facts/documents/honey")


async def test_a_bad_argument_is_a_tool_error_naming_the_field(stack: McpStack) -> None:
    async with client(stack.mcp, stack.key) as mcp:
        result = await mcp.call_tool("search", {"collection": "facts", "query": "x", "top_k": 1000})
        assert result.is_error and "top_k" in text(result)
        result = await mcp.call_tool("search", {"collection": "facts", "query": "x", "mode": "fuzzy"})
        assert result.is_error and "mode" in text(result)


async def test_a_key_is_needed_and_the_metadata_says_so(stack: McpStack) -> None:
    with pytest.raises(Exception):  # noqa: B017 - the SDK's error for a 401 varies by phase
        async with client(stack.mcp, None) as mcp:
            await mcp.list_tools()
    resp = httpx.post(stack.mcp, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert resp.status_code == 401 and resp.headers["www-authenticate"].startswith("Bearer")
    meta = httpx.get(f"{stack.agent}/.well-known/oauth-protected-resource/mcp").json()
    assert meta["resource"] == stack.mcp and meta["authorization_servers"] == []
    assert meta["bearer_methods_supported"] == ["header"] and meta["tandem_auth"]["scheme"] == "api_key"
    assert httpx.get(f"{stack.agent}/.well-known/oauth-authorization-server").status_code == 404


def test_the_body_limit_holds_for_mcp(stack: McpStack) -> None:
    big = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"pad": "x" * (2 << 20)}}
    resp = httpx.post(stack.mcp, json=big, headers=auth(stack.key), timeout=30)
    assert resp.status_code == 413, resp.text
    assert "limit" in resp.json()["error"]["message"]


def test_the_tenants_rate_limit_holds_for_mcp(redis_url: str, tmp_path: Path, api_key: str) -> None:
    with agent_stack(redis_url, tmp_path / "home", tenant_requests_per_minute=1, tenant_burst=2) as s:
        ask = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        answers = [httpx.post(f"{s.url}/mcp", json=ask, headers=auth(api_key), timeout=30) for _ in range(3)]
    assert [a.status_code == 429 for a in answers] == [False, False, True]
    assert int(answers[2].headers["retry-after"]) > 0


# A raw Streamable HTTP POST, as a browser page or a probe would send it.
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def run_agent_call(stack: McpStack, **headers: str) -> httpx.Response:
    """tools/call of the agent tool, which asks the scripted model (so a run is visible)."""
    call = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {"name": "tools-agent", "arguments": {"query": "What is 2 + 2?"}},
    }
    hdrs = {**auth(stack.key), **MCP_HEADERS, **headers}
    return httpx.post(stack.mcp, json=call, headers=hdrs, timeout=60)


def test_a_foreign_host_or_origin_is_refused_before_any_tool_runs(stack: McpStack) -> None:
    stack.model.requests.clear()
    foreign = [
        ({"Host": "evil.example"}, 421, "host"),
        ({"Host": f"attacker.example:{stack.port}"}, 421, "host"),
        ({"Origin": "http://evil.example"}, 403, "origin"),
        ({"Origin": "null"}, 403, "origin"),
        ({"Origin": f"http://attacker.example:{stack.port}"}, 403, "origin"),
    ]
    for headers, status, param in foreign:
        resp = run_agent_call(stack, **headers)
        assert resp.status_code == status, (headers, resp.text)
        error = resp.json()["error"]
        assert error["param"] == param and next(iter(headers.values())) in error["message"]
        assert "TANDEM_AGENT_MCP_ALLOWED_HOSTS" in error["message"]
    assert not stack.model.requests
    # the same call under the served names (and a page of the service's own origin) runs the agent
    stack.model.replies = ["Final Answer: 4"] * 3
    for headers in (
        {},
        {"Host": f"localhost:{stack.port}"},
        {"Origin": stack.agent},
        {"Host": f"{ALLOWED_NAME}:{stack.port}", "Origin": f"https://{ALLOWED_NAME}:{stack.port}"},
    ):
        before = len(stack.model.requests)
        resp = run_agent_call(stack, **headers)
        assert resp.status_code == 200 and "result" in resp.json(), (headers, resp.text)
        assert len(stack.model.requests) > before


async def test_an_allowed_host_works_with_the_official_client(stack: McpStack) -> None:
    async with client(stack.mcp, stack.key, Host=f"{ALLOWED_NAME}:{stack.port}") as mcp:
        found = structured(await mcp.call_tool("search", {"collection": "facts", "query": "honey"}))
    assert found["results"][0]["document_id"] == "honey"
    with pytest.raises(Exception):  # noqa: B017 - the SDK's error for a refused request varies by phase
        async with client(stack.mcp, stack.key, Host=f"other.test:{stack.port}") as mcp:
            await mcp.list_tools()


async def test_get_is_a_405_that_holds_no_slot_of_the_tenant(stack: McpStack, redis_url: str) -> None:
    # More GETs than the tenant's 32 concurrent requests, all kept open: an event stream per GET
    # would hold a slot each and lock the tenant out.
    async with httpx.AsyncClient(headers=auth(stack.key), timeout=60) as http, AsyncExitStack() as held:
        answers = [
            await held.enter_async_context(
                http.stream("GET", stack.mcp, headers={"Accept": "text/event-stream"})
            )
            for _ in range(40)
        ]
        assert [a.status_code for a in answers] == [405] * 40
        assert answers[0].headers["allow"] == "POST"
        other = new_key(redis_url, "acme")
        resp = await http.get(f"{stack.agent}/v1/pipelines", headers=auth(other))
        assert resp.status_code == 200, resp.text
    resp = httpx.delete(stack.mcp, headers=auth(stack.key))
    assert resp.status_code == 405


@pytest.mark.parametrize(
    ("message", "member", "says"),
    [
        ({"jsonrpc": "2.0", "id": {"a": 1}, "method": "tools/list"}, "id", "an object"),
        ({"jsonrpc": "2.0", "id": [1], "method": "tools/list"}, "id", "an array"),
        # over 256 KiB, parsed off the event loop
        ({"jsonrpc": "2.0", "id": {"pad": "x" * (300 << 10)}, "method": "tools/list"}, "id", "an object"),
        ({"jsonrpc": "2.0", "id": True, "method": "tools/list"}, "id", "a boolean"),
        ({"jsonrpc": "2.0", "id": 1.5, "method": "tools/list"}, "id", "a number with a fraction"),
        ({"jsonrpc": "2.0", "id": None, "method": "tools/list"}, "id", "null"),
        ({"jsonrpc": "1.0", "id": 1, "method": "tools/list"}, "jsonrpc", '"1.0"'),
        ({"id": 1, "method": "tools/list"}, "jsonrpc", "null"),
        ({"jsonrpc": "2.0", "id": 1, "method": 5}, "method", "an integer"),
        ({"jsonrpc": "2.0", "id": 1, "result": {}}, "method", "missing"),
        ({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": [1]}, "params", "an array"),
        ({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "extra": 1}, "extra", "unknown member"),
        ([{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}], None, "batches are not supported"),
        ("tools/list", None, "a string"),
    ],
)
def test_a_malformed_envelope_is_a_400_naming_the_member(
    stack: McpStack, message: Any, member: str | None, says: str
) -> None:
    resp = httpx.post(stack.mcp, json=message, headers={**auth(stack.key), **MCP_HEADERS}, timeout=30)
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["jsonrpc"] == "2.0" and body["error"]["code"] == -32600
    assert body["error"]["data"]["member"] == member and says in body["error"]["message"]
    if member is not None:
        assert f"'{member}'" in body["error"]["message"]
    # the id is echoed once it is a usable one
    expected_id = message["id"] if member not in (None, "id") and "id" in message else None
    assert body["id"] == expected_id


def test_a_body_that_is_not_json_is_a_parse_error(stack: McpStack) -> None:
    headers = {**auth(stack.key), **MCP_HEADERS}
    resp = httpx.post(stack.mcp, content=b'{"jsonrpc": "2.0", "id": 1,', headers=headers, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == -32700 and resp.json()["id"] is None


def test_a_well_formed_notification_is_still_accepted(stack: McpStack) -> None:
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    resp = httpx.post(stack.mcp, json=note, headers={**auth(stack.key), **MCP_HEADERS}, timeout=30)
    assert resp.status_code == 202, resp.text


async def test_an_unknown_tool_argument_is_refused_naming_it(stack: McpStack) -> None:
    async with client(stack.mcp, stack.key) as mcp:
        tools = {t.name: t for t in (await mcp.list_tools()).tools}
        result = await mcp.call_tool("search", {"collection": "facts", "query": "x", "topk": 3})
        assert result.is_error and "topk" in text(result)
        result = await mcp.call_tool("ask", {"query": "x", "collection": "facts", "stream": True})
        assert result.is_error and "stream" in text(result)
        result = await mcp.call_tool("list_collections", {"tenant": "globex"})
        assert result.is_error and "tenant" in text(result)
    assert all(t.input_schema.get("additionalProperties") is False for t in tools.values())


def test_the_allowed_hosts_come_from_the_served_urls() -> None:
    from services.agent.mcp_server import allowed_hosts, transport_security

    common = CommonSettings(host="10.0.0.5", agent_port=9000, agent_url="https://tandem.example.com/")
    hosts = allowed_hosts(common, AgentSettings(mcp_allowed_hosts=" a.example , b.example:8443 "))
    assert {"10.0.0.5:9000", "tandem.example.com", "tandem.example.com:443"} <= set(hosts)
    assert {"a.example", "b.example:8443", "127.0.0.1:*", "localhost:*", "[::1]:*"} <= set(hosts)
    origins = transport_security(hosts).allowed_origins
    assert "https://tandem.example.com" in origins and "null" not in origins
    # a wildcard bind names no host of its own; an explicit port of the public URL is kept
    hosts = allowed_hosts(CommonSettings(host="0.0.0.0", agent_url="http://agent:8000"), AgentSettings())
    assert "agent:8000" in hosts and "agent" not in hosts and not any(h.startswith("0.0.0.0") for h in hosts)
    with pytest.raises(ValueError, match="host names"):
        AgentSettings(mcp_allowed_hosts="https://tandem.example.com")
