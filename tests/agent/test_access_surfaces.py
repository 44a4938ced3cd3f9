"""Two people of one tenant with different rights cannot read each other's collection through any
surface of the agent: the pipelines (JSON and SSE), the websocket, the agents' document tool, the
MCP server's tools and resources, the OpenAI facade and the Responses API.

Alice may read ``hr`` (named by her user id), Bob ``eng`` (through his group). Each reaches their
own collection through every surface (the control: the secret sentence comes back), and the other
one's is refused as if it did not exist, with no sentence of it in the answer or in any prompt the
model was sent. Real HTTP, real Valkey, the real retrieval service with a tiny embedder; the
scripted inference double answers with the first line of its first source (or, for the agent,
calls the document tool and copies its result). Users and tokens are made with
services/common/users.py."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from websockets.sync.client import connect

from services.agent.app import create_app
from services.agent.config import AgentSettings
from services.common.auth import KeyStore
from services.common.config import CommonSettings
from tests.agent.doubles import ScriptedModel, cite_first, inference_double
from tests.agent.stack import chat_socket
from tests.conftest import TEST_CACHE, auth
from tests.helpers.people import Person, person
from tests.helpers.servers import serve_app, wait_ready

SECRETS = {
    "hr": ("salaries", "Salary bands for engineers are confidential payroll figures."),
    "eng": ("roadmap", "Salary reviews wait until the compiler rewrite ships in autumn."),
}
QUESTION = "What about the salary bands and reviews?"


def _call(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    fn = {"name": name, "arguments": json.dumps(arguments)}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": fn}],
    }


def agent_reply(body: dict[str, Any]) -> str | dict[str, Any]:
    """Chat with documents: cite the first source. The tools agent: search the documents once,
    then finish (the run's steps show what the tool returned)."""
    if not body.get("tools") and "response_format" not in body:
        return cite_first(body)
    messages = body["messages"]
    asked = max(i for i, m in enumerate(messages) if m.get("role") == "user" and m.get("content") == QUESTION)
    if not any(m.get("role") == "tool" for m in messages[asked:]):
        return _call("document_search", {"query": "salary"}, "c1")
    if "response_format" in body:
        answer = body["response_format"]["json_schema"]["schema"]["properties"]["arguments"]["properties"][
            "answer"
        ]
        return json.dumps({"name": "final_answer", "arguments": {"answer": answer["enum"][0]}})
    return _call("final_answer", {"answer": "done"}, "c2")


@dataclass
class People:
    agent: str
    model: ScriptedModel
    admin: str
    alice: Person  # reads hr
    bob: Person  # reads eng (group engineering)

    def pairs(self) -> list[tuple[Person, str, str]]:
        """(who, the collection they may read, the one they may not)."""
        return [(self.alice, "hr", "eng"), (self.bob, "eng", "hr")]

    def post(self, path: str, key: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.agent}{path}", json=body, headers=auth(key), timeout=60)


@pytest.fixture(scope="module")
def people(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[People]:
    from services.common.redis_conn import sync_redis
    from services.retrieval.app import create_app as create_retrieval
    from services.retrieval.config import RetrievalSettings
    from tests.retrieval.conftest import make_tiny_embedder

    root = TEST_CACHE / "retrieval-models"
    root.mkdir(parents=True, exist_ok=True)
    embedder = make_tiny_embedder(root / "tiny-embedder")
    tenant = f"t{secrets.token_hex(4)}"
    admin = KeyStore(sync_redis(redis_url)).create(tenant, "admin", role="admin")[0]
    model = ScriptedModel(replies=agent_reply)
    with ExitStack() as es:
        base = CommonSettings(
            home=tmp_path_factory.mktemp("home"), redis_url=redis_url, log_json=False, model_roots=str(root)
        )
        r_url = es.enter_context(
            serve_app(create_retrieval(base, RetrievalSettings(embedding_model=str(embedder))))
        )
        wait_ready(r_url)
        i_url = es.enter_context(serve_app(inference_double(model)))
        common = base.model_copy(update={"retrieval_url": r_url, "inference_url": i_url})
        settings = AgentSettings.model_validate({"grounding_embedder": False})
        agent = es.enter_context(serve_app(create_app(common, settings)))
        alice = person(redis_url, tenant)
        bob = person(redis_url, tenant, groups=("engineering",))
        with httpx.Client(base_url=r_url, headers=auth(admin), timeout=120) as client:
            for coll, (doc_id, text) in SECRETS.items():
                assert client.post("/v1/collections", json={"name": coll}).status_code == 201
                doc = {"id": doc_id, "title": doc_id.title(), "text": text}
                added = client.post(f"/v1/collections/{coll}/documents", json={"documents": [doc]})
                assert added.status_code == 201, added.text
            for coll, reader in (("hr", alice.entry), ("eng", "group:engineering")):
                put = client.put(f"/v1/collections/{coll}/access", json={"readers": [reader], "writers": []})
                assert put.status_code == 200, put.text
        yield People(agent, model, admin, alice, bob)


@pytest.fixture()
def model(people: People) -> Iterator[ScriptedModel]:
    """The model, its requests cleared before and after each test."""
    people.model.requests.clear()
    yield people.model
    people.model.requests.clear()


def secret(coll: str) -> str:
    return SECRETS[coll][1]


def not_in_prompts(model: ScriptedModel, coll: str) -> None:
    assert secret(coll) not in json.dumps(model.requests), f"{coll}'s text reached the model"


def refused(resp: httpx.Response, coll: str) -> None:
    """The 404 of a collection that does not exist, naming it, and nothing of its text."""
    assert resp.status_code == 404, resp.text
    assert f"'{coll}'" in resp.json()["error"]["message"] and secret(coll) not in resp.text


def test_the_pipelines_answer_from_the_collection_a_person_may_read_only(
    people: People, model: ScriptedModel
) -> None:
    for who, mine, theirs in people.pairs():
        for pipeline in ("chat-documents-generate", "chat-documents", "semantic-search"):
            body = {"query": QUESTION, "collection": mine}
            got = people.post(f"/v1/pipelines/{pipeline}/run", who.token, body)
            assert got.status_code == 200 and secret(mine) in got.text, (pipeline, got.text)
            model.requests.clear()
            refused(
                people.post(f"/v1/pipelines/{pipeline}/run", who.token, {**body, "collection": theirs}),
                theirs,
            )
            not_in_prompts(model, theirs)


def test_sse_streams_only_what_a_person_may_read(people: People, model: ScriptedModel) -> None:
    for who, mine, theirs in people.pairs():
        for coll in (mine, theirs):
            body = {"query": QUESTION, "collection": coll, "stream": True}
            url = f"{people.agent}/v1/pipelines/chat-documents-generate/run"
            model.requests.clear()
            with httpx.stream("POST", url, json=body, headers=auth(who.token), timeout=60) as resp:
                if coll == theirs:
                    resp.read()
                    refused(resp, theirs)
                    continue
                assert resp.status_code == 200
                events = [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")]
            assert events[-1]["type"] == "done" and secret(mine) in json.dumps(events)
        not_in_prompts(model, theirs)


def test_the_websocket_chats_only_over_what_a_person_may_read(people: People, model: ScriptedModel) -> None:
    for who, mine, theirs in people.pairs():
        with connect(chat_socket(people.agent), additional_headers=auth(who.token), open_timeout=10) as conn:
            seen: dict[str, list[dict[str, Any]]] = {}
            for coll in (mine, theirs):
                model.requests.clear()
                conn.send(
                    json.dumps(
                        {"pipeline": "chat-documents-generate", "collection": coll, "message": QUESTION}
                    )
                )
                events: list[dict[str, Any]] = []
                while not events or events[-1]["type"] not in ("done", "error"):
                    events.append(json.loads(conn.recv(timeout=30)))
                seen[coll] = events
        assert seen[mine][-1]["type"] == "done" and secret(mine) in json.dumps(seen[mine])
        error = seen[theirs][-1]
        assert error["type"] == "error" and f"'{theirs}'" in error["message"], error
        assert secret(theirs) not in json.dumps(seen[theirs])
        not_in_prompts(model, theirs)


def observations(resp: httpx.Response) -> list[dict[str, Any]]:
    assert resp.status_code == 200, resp.text
    return [s for s in resp.json()["steps"] if s["kind"] == "observation" and s["tool"] == "document_search"]


def test_the_agents_document_tool_searches_only_what_a_person_may_read(
    people: People, model: ScriptedModel
) -> None:
    for who, mine, theirs in people.pairs():
        own = people.post("/v1/pipelines/tools-agent/run", who.token, {"query": QUESTION, "collection": mine})
        [seen] = observations(own)
        assert seen["ok"] and secret(mine) in seen["text"], own.text
        model.requests.clear()
        other = people.post(
            "/v1/pipelines/tools-agent/run", who.token, {"query": QUESTION, "collection": theirs}
        )
        # a collection this person may not read: the document tool is not offered, and the run's
        # tools step says why, naming the collection
        assert "document_search" not in [t["function"]["name"] for t in model.requests[0]["tools"]]
        [tools] = [s for s in other.json()["steps"] if s["kind"] == "tools"]
        [why] = [lo for lo in tools["left_out"] if lo["tool"] == "document_search"]
        assert f"'{theirs}'" in why["reason"] and "may not read" in why["reason"], other.text
        assert not any(o["ok"] for o in observations(other))  # called anyway: an unknown tool
        assert secret(theirs) not in other.text
        not_in_prompts(model, theirs)


def mcp_client(url: str, key: str) -> Client:
    http = httpx2.AsyncClient(headers=auth(key), timeout=60)
    return Client(streamable_http_client(f"{url}/mcp", http_client=http))


@pytest.mark.anyio
async def test_the_mcp_servers_tools_and_resources_show_only_what_a_person_may_read(
    people: People, model: ScriptedModel
) -> None:
    for who, mine, theirs in people.pairs():
        async with mcp_client(people.agent, who.token) as mcp:
            listed = await mcp.call_tool("list_collections", {})
            assert [c["name"] for c in json.loads(listed.content[0].text)["collections"]] == [mine]
            for coll in (mine, theirs):
                model.requests.clear()
                search = await mcp.call_tool(
                    "search", {"collection": coll, "query": "salary", "mode": "sparse"}
                )
                ask = await mcp.call_tool("ask", {"query": QUESTION, "collection": coll})
                agent = await mcp.call_tool("tools-agent", {"query": QUESTION, "collection": coll})
                results = [search, ask, agent]
                if coll == mine:
                    assert all(not r.is_error and secret(mine) in r.content[0].text for r in results)
                    doc = await mcp.read_resource(f"tandem://collections/{mine}/documents/{SECRETS[mine][0]}")
                    assert secret(mine) in getattr(doc.contents[0], "text", "")
                    continue
                assert search.is_error and ask.is_error and f"'{theirs}'" in search.content[0].text
                assert all(secret(theirs) not in r.content[0].text for r in results)
                with pytest.raises(Exception, match=theirs) as caught:
                    await mcp.read_resource(f"tandem://collections/{theirs}/documents/{SECRETS[theirs][0]}")
                assert secret(theirs) not in str(caught.value)
        not_in_prompts(model, theirs)


OPENAI_BODIES = {
    "/v1/chat/completions": lambda coll, stream: {
        "model": "chat-documents-generate",
        "messages": [{"role": "user", "content": QUESTION}],
        "collection": coll,
        "stream": stream,
    },
    "/v1/responses": lambda coll, stream: {
        "model": "chat-documents-generate",
        "input": QUESTION,
        "collection": coll,
        "stream": stream,
    },
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", list(OPENAI_BODIES), ids=["facade", "responses"])
def test_the_openai_facade_and_responses_api_answer_only_from_what_a_person_may_read(
    people: People, model: ScriptedModel, path: str, stream: bool
) -> None:
    for who, mine, theirs in people.pairs():
        own = people.post(path, who.token, OPENAI_BODIES[path](mine, stream))
        assert own.status_code == 200 and secret(mine) in own.text, own.text
        model.requests.clear()
        refused(people.post(path, who.token, OPENAI_BODIES[path](theirs, stream)), theirs)
        not_in_prompts(model, theirs)


def test_a_stored_response_is_its_askers_alone(people: People, model: ScriptedModel) -> None:
    """A stored response quotes the asker's collection: another person of the tenant can neither
    read it, continue from it, nor delete it; the tenant's admin reads it."""
    body = {"model": "chat-documents-generate", "input": QUESTION, "collection": "hr"}
    made = people.post("/v1/responses", people.alice.token, body)
    assert made.status_code == 200 and secret("hr") in made.text, made.text
    resp_id = made.json()["id"]
    url = f"{people.agent}/v1/responses/{resp_id}"
    for method in ("GET", "DELETE"):
        hidden = httpx.request(method, url, headers=auth(people.bob.token), timeout=30)
        assert hidden.status_code == 404 and secret("hr") not in hidden.text, hidden.text
    model.requests.clear()
    follow = {"model": "chat-documents-generate", "input": "And then?", "collection": "eng"}
    went_on = people.post("/v1/responses", people.bob.token, {**follow, "previous_response_id": resp_id})
    assert went_on.status_code == 404 and went_on.json()["error"]["param"] == "previous_response_id"
    not_in_prompts(model, "hr")
    assert httpx.get(url, headers=auth(people.admin), timeout=30).status_code == 200
    mine = httpx.get(url, headers=auth(people.alice.token), timeout=30)
    assert mine.status_code == 200 and secret("hr") in mine.text


def test_the_tenants_admin_reads_both(people: People, model: ScriptedModel) -> None:
    for coll in SECRETS:
        got = people.post(
            "/v1/pipelines/chat-documents-generate/run", people.admin, {"query": QUESTION, "collection": coll}
        )
        assert got.status_code == 200 and secret(coll) in got.text
