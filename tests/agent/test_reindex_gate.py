"""``POST /v1/collections/{name}/reindex`` on the agent: the tenant's regression sets over the
collection become retrieval's ``only_if_better`` gate (each answerable question that names a
source, with the ids of the documents that source names), beside the caller's own queries; the
real retrieval service, in process over HTTP, receives the PATCH and its reindex job runs here."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

from services.agent.app import create_app
from services.agent.config import AgentSettings
from services.common.auth import KeyStore
from services.common.config import CommonSettings
from services.retrieval.reindex import run_reindex
from tests.agent.doubles import ScriptedModel, inference_double
from tests.conftest import TEST_CACHE, auth
from tests.helpers.servers import serve_app, wait_ready

DOCS = {
    "facts": [
        {
            "id": "ops-guide",
            "text": "Restart the worker when the queue stalls.",
            "metadata": {"source": "docs/operations.md"},
        },
        {
            "id": "install-linux",
            "text": "Install the wheel with pip on Linux.",
            "metadata": {"filename": "install.md"},
        },
        {
            "id": "install-mac",
            "text": "Install the wheel with pip on macOS.",
            "metadata": {"filename": "install.md"},
        },
        {"id": "faq", "title": "FAQ", "text": "Questions people ask about licences and support."},
        {"id": "changelog", "text": "Version 2 renamed the settings."},
    ],
    "notes": [{"id": "note-1", "text": "Meeting notes from Monday."}],
    "plain": [{"id": "p", "text": "Nothing gates this collection."}],
}


def q(question: str, source: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"question": question, "answers": ["x"], **({"source": source} if source else {}), **extra}


@dataclass
class ReindexStack:
    agent: str
    retrieval_app: Any
    embedder: str
    admin: str
    member: str
    tenant: str

    def post(self, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.agent}{path}", json=body, headers=auth(key), timeout=120)

    def gate_of(self, job_id: str) -> dict[str, Any] | None:
        """The gate retrieval stored with the job (what its PATCH carried)."""
        raw = self.retrieval_app.state.jobs.raw(job_id)
        return json.loads(raw["gate"]) if raw.get("gate") else None


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReindexStack]:
    from services.retrieval.app import create_app as create_retrieval
    from services.retrieval.config import RetrievalSettings
    from tests.retrieval.conftest import make_tiny_embedder

    root = TEST_CACHE / "retrieval-models"
    root.mkdir(parents=True, exist_ok=True)
    embedder = make_tiny_embedder(root / "tiny-embedder")
    target = make_tiny_embedder(root / "tiny-embedder-48", hidden=48)  # what the reindexes switch to
    tenant = f"rx{secrets.token_hex(4)}"
    keys = KeyStore(redis.Redis.from_url(redis_url, decode_responses=True))
    admin, member = keys.create(tenant, "admin")[0], keys.create(tenant, "app")[0]  # the first is admin
    home = tmp_path_factory.mktemp("home")
    with ExitStack() as es:
        base = CommonSettings(home=home, redis_url=redis_url, log_json=False, model_roots=str(root))
        r_app = create_retrieval(base, RetrievalSettings(embedding_model=str(embedder)))
        r_url = es.enter_context(serve_app(r_app))
        wait_ready(r_url)
        i_url = es.enter_context(serve_app(inference_double(ScriptedModel())))
        common = base.model_copy(update={"retrieval_url": r_url, "inference_url": i_url})
        agent = es.enter_context(serve_app(create_app(common, AgentSettings(grounding_embedder=False))))
        with httpx.Client(base_url=r_url, headers=auth(admin), timeout=120) as client:
            for name, docs in DOCS.items():
                assert client.post("/v1/collections", json={"name": name}).status_code == 201
                resp = client.post(f"/v1/collections/{name}/documents", json={"documents": docs})
                assert resp.status_code == 201, resp.text
        yield ReindexStack(agent, r_app, str(target), admin, member, tenant)


def test_the_regression_sets_questions_gate_the_reindex_with_their_documents(stack: ReindexStack) -> None:
    regression = [
        q("How do I restart a stalled worker?", "docs/operations.md"),
        q("How do I install it?", "install.md", also_in=["faq"]),
        q("What changed?"),  # no source: nothing to rank against
        {"question": "Who wrote it?", "answerable": False, "source": "changelog"},
        q("Where is the roadmap?", "roadmap.md"),  # no such document
    ]
    sets = [
        {"name": "gate", "collection": "facts", "regression": True, "questions": regression},
        {"name": "not regression", "collection": "facts", "questions": [q("Changes?", "changelog")]},
        {"name": "elsewhere", "collection": "plain-other", "regression": True, "questions": [q("P?", "p")]},
    ]
    ids = []
    for s in sets:
        r = stack.post(stack.admin, "/v1/evals/sets", s)
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    body = {
        "embedder": stack.embedder,
        "mode": "dense",
        "queries": [{"query": "version history", "relevant": ["changelog"]}],
    }

    denied = stack.post(stack.member, "/v1/collections/facts/reindex", body)
    assert denied.status_code == 403 and "admin" in denied.text, denied.text

    r = stack.post(stack.admin, "/v1/collections/facts/reindex", body)
    assert r.status_code == 202, r.text
    out = r.json()
    assert (out["collection"], out["gated"], out["regression_queries"], out["queries"]) == (
        "facts",
        True,
        2,
        3,
    )
    assert out["sets"] == [{"id": ids[0], "name": "gate", "queries": 2, "unmatched": 1}]
    gate = stack.gate_of(out["job_id"])
    assert gate is not None and gate["mode"] == "dense"
    got = {g["query"]: sorted(g["relevant"]) for g in gate["queries"]}
    assert got == {
        "How do I restart a stalled worker?": ["ops-guide"],
        "How do I install it?": ["faq", "install-linux", "install-mac"],
        "version history": ["changelog"],
    }
    app = stack.retrieval_app
    verdict = run_reindex(app.state.collections, app.state.jobs, stack.tenant, "facts", out["job_id"])
    assert verdict["queries"] == 3 and verdict["mode"] == "dense", verdict


def test_no_gate_is_a_400_unless_the_caller_opts_out(stack: ReindexStack) -> None:
    embedder = stack.embedder
    # A regression set whose questions name no document of the collection cannot gate it.
    r = stack.post(
        stack.admin,
        "/v1/evals/sets",
        {"name": "stale", "collection": "notes", "regression": True, "questions": [q("Q?", "gone.md")]},
    )
    assert r.status_code == 201, r.text
    for extra in ({}, {"queries": [{"query": "monday", "relevant": ["note-1"]}]}, {"gate": False}):
        r = stack.post(stack.admin, "/v1/collections/notes/reindex", {"embedder": embedder, **extra})
        assert r.status_code == 400, r.text
    r = stack.post(stack.admin, "/v1/collections/notes/reindex", {"embedder": embedder})
    assert r.json()["error"]["code"] == "no_regression_queries" and "stale" in r.text

    # No regression set and no queries: a 400 naming queries, unless gate is false.
    r = stack.post(stack.admin, "/v1/collections/plain/reindex", {"embedder": embedder})
    assert r.status_code == 400 and r.json()["error"]["param"] == "queries", r.text
    r = stack.post(stack.admin, "/v1/collections/plain/reindex", {"embedder": embedder, "gate": False})
    assert r.status_code == 202, r.text
    assert (r.json()["gated"], r.json()["queries"], r.json()["sets"]) == (False, 0, [])
    assert stack.gate_of(r.json()["job_id"]) is None
    # That job is still queued: a second reindex is retrieval's conflict, and the agent's.
    again = stack.post(stack.admin, "/v1/collections/plain/reindex", {"embedder": embedder, "gate": False})
    assert again.status_code == 409, again.text

    # A missing collection is retrieval's 404; bad fields are 400s naming them.
    missing = stack.post(stack.admin, "/v1/collections/nope/reindex", {"embedder": embedder, "gate": False})
    assert missing.status_code == 404, missing.text
    for bad, field in (
        ({"embedder": embedder, "min_gain": 2.0}, "min_gain"),
        ({"embedder": embedder, "mode": "sparse"}, "mode"),
        ({"embedder": embedder, "gate": "no"}, "gate"),
        ({"embedder": embedder, "queries": [{"query": "x", "relevant": []}]}, "relevant"),
    ):
        r = stack.post(stack.admin, "/v1/collections/plain/reindex", bad)
        assert r.status_code == 400 and field in r.text, r.text
