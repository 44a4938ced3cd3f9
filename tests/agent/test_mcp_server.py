"""Tandem as an MCP server (``/mcp``), called with the official SDK's client over real HTTP.

The agent runs over the real retrieval service (a tiny random embedder, so tenants and their
collections are the real ones) and the scripted inference double (the test is not about the
model's words)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
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


@dataclass
class McpStack:
    agent: str
    key: str  # tenant acme, owner of the collection "facts"
    other_key: str  # tenant globex, with no collection
    model: ScriptedModel

    @property
    def mcp(self) -> str:
        return f"{self.agent}/mcp"


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
        agent = es.enter_context(
            serve_app(create_app(common, AgentSettings.model_validate({"grounding_embedder": False})))
        )
        with httpx.Client(base_url=r_url, headers=auth(key), timeout=120) as client:
            assert client.post("/v1/collections", json={"name": "facts"}).status_code == 201
            resp = client.post("/v1/collections/facts/documents", json={"documents": DOCS})
            assert resp.status_code == 201, resp.text
        yield McpStack(agent, key, other, model)


def client(url: str, key: str | None) -> Client:
    http = httpx2.AsyncClient(headers=auth(key) if key else {}, timeout=60)
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
