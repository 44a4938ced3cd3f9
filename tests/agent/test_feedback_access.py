"""The learning loop and people: each person counts for a capped number of a training set's
ratings and choices (all of its tokens together), and the set says whose feedback it left out and
why; a fine-tune from feedback remembers the collections its rows came from and answers a person
only if that person may read all of them, unless an admin allows it for everyone (audited).

Real HTTP, real Valkey, the real SQLite store, users and collection access lists; doubles for
retrieval, inference and the trainer."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from services.agent.app import create_app
from services.agent.config import AgentSettings
from services.common.access import AccessList, AccessStore
from services.common.auth import KeyStore
from services.common.config import CommonSettings
from services.common.model_restrictions import ModelRestriction, ModelRestrictions
from services.common.redis_conn import async_redis
from tests.agent.doubles import (
    FakeCorpus,
    RecordingTrainer,
    ScriptedModel,
    inference_double,
    retrieval_double,
    trainer_double,
)
from tests.agent.stack import CORPUS, Stack
from tests.agent.test_feedback import FRANCE, GERMANY, ask, rate, reply
from tests.conftest import auth
from tests.helpers.servers import serve_app

CAP = 2
HR = {"leave": ("Leave", "Staff get 30 days of paid leave a year. Leave requests go to the manager.")}
LEAVE = "How many days of paid leave do staff get?"


@dataclass
class LoopStack:
    stack: Stack
    redis_url: str


@pytest.fixture(scope="module")
def loop(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopStack]:
    corpus = FakeCorpus({**{k: dict(v) for k, v in CORPUS.items()}, "hr": dict(HR)})
    model = ScriptedModel(replies=reply, shared=["scripted"])
    trainer = RecordingTrainer()
    with ExitStack() as es:
        r_url = es.enter_context(serve_app(retrieval_double(corpus)))
        i_url = es.enter_context(serve_app(inference_double(model)))
        t_url = es.enter_context(serve_app(trainer_double(trainer)))
        common = CommonSettings(
            home=tmp_path_factory.mktemp("home"),
            redis_url=redis_url,
            retrieval_url=r_url,
            inference_url=i_url,
            trainer_url=t_url,
            log_json=False,
        )
        settings = AgentSettings(
            feedback_rows_per_key=CAP,
            dataset_min_rows_kto=1,
            dataset_min_rows_sft=1,
            promotion_holdout=0.0,
        )
        app = create_app(common, settings)
        url = es.enter_context(serve_app(app))
        yield LoopStack(Stack(url, corpus, model, r_url, i_url, trainer, app), redis_url)


def call(s: Stack, method: str, path: str, key: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(method, f"{s.url}{path}", json=body, headers=auth(key), timeout=30)


@dataclass
class Team:
    tenant: str
    admin: str
    users: dict[str, str]  # name -> user id
    tokens: dict[str, list[str]]  # name -> its tokens


@pytest.fixture()
def team(loop: LoopStack, key_store: KeyStore) -> Team:
    """A fresh tenant: its admin key, and two members, alice with two tokens and bob with one."""
    s = loop.stack
    tenant = f"l{secrets.token_hex(4)}"
    admin = key_store.create(tenant, "admin", role="admin")[0]
    users: dict[str, str] = {}
    tokens: dict[str, list[str]] = {}
    for name, count in (("alice", 2), ("bob", 1)):
        made = call(s, "POST", "/v1/users", admin, {"email": f"{name}@example.org", "role": "member"})
        assert made.status_code == 201, made.text
        users[name] = made.json()["id"]
        tokens[name] = []
        for i in range(count):
            tok = call(s, "POST", f"/v1/users/{users[name]}/tokens", admin, {"name": f"device {i}"})
            assert tok.status_code == 201, tok.text
            tokens[name].append(tok.json()["token"])
    return Team(tenant, admin, users, tokens)


def read_by(loop: LoopStack, team: Team, collection: str, *names: str) -> None:
    """Only these people of the team (and its admins) read ``collection``."""
    acl = AccessList(readers=[f"user:{team.users[n]}" for n in names], writers=[])

    async def put() -> None:
        client = async_redis(loop.redis_url)
        try:
            await AccessStore(client).put(team.tenant, collection, acl)
        finally:
            await client.aclose()

    asyncio.run(put())


def restriction(loop: LoopStack, team: Team, model: str) -> ModelRestriction | None:
    """What the inference service reads about ``model`` (services/common/model_restrictions.py)."""

    async def get() -> ModelRestriction | None:
        client = async_redis(loop.redis_url)
        try:
            return await ModelRestrictions(client).get(team.tenant, model)
        finally:
            await client.aclose()

    return asyncio.run(get())


def audit(s: Stack, key: str, action: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{s.url}/v1/audit", params={"action": action}, headers=auth(key), timeout=30)
    assert resp.status_code == 200, resp.text
    entries: list[dict[str, Any]] = resp.json()["data"]
    return entries


def test_each_person_counts_for_a_capped_share_and_the_set_says_what_it_left_out(
    loop: LoopStack, team: Team
) -> None:
    s = loop.stack
    alice_1, alice_2 = team.tokens["alice"]
    (bob,) = team.tokens["bob"]
    # alice rates four answers, through two tokens: she is one person, so four of hers count as one's
    for token in (alice_1, alice_2, alice_1, alice_2):
        answer = ask(s, token, FRANCE)
        assert rate(s, token, answer["message_id"], 1).status_code == 200
    late = rate(s, alice_2, ask(s, alice_2, FRANCE)["message_id"], 1)
    assert late.json()["counted"] is False  # her fifth: past the cap when given
    answer = ask(s, bob, GERMANY)
    assert rate(s, bob, answer["message_id"], 1).status_code == 200

    alice, bob_id = team.users["alice"], team.users["bob"]
    built = call(s, "POST", "/v1/feedback/datasets", team.admin, {"format": "sft"})
    assert built.status_code == 200, built.text
    out = built.json()
    assert out["contributors"] == {alice: CAP, bob_id: 1} and out["rows"] == CAP + 1
    assert out["over_cap"] == {alice: 3}
    [left] = out["left_out"]
    assert left == {
        "contributor": alice,
        "kind": "user",
        "reason": "over_cap",
        "ratings_and_choices": 3,
        "detail": f"3 ratings and choices past the cap of {CAP} per user (the first {CAP} it gave are counted)",
    }
    assert out["collections"] == ["geo"]

    # leaving bob out is said too; the job's record keeps what was left out
    trained = call(s, "POST", "/v1/feedback/train", team.admin, {"format": "sft", "exclude_keys": [bob_id]})
    assert trained.status_code == 200, trained.text
    body = trained.json()
    reasons = {(o["contributor"], o["reason"]) for o in body["dataset"]["left_out"]}
    assert reasons == {(alice, "over_cap"), (bob_id, "excluded")}
    assert body["promotion"]["left_out"] == body["dataset"]["left_out"]
    listed = call(s, "GET", "/v1/promotions", team.admin).json()["data"]
    assert [p["left_out"] for p in listed if p["job_id"] == body["job"]["id"]] == [
        body["dataset"]["left_out"]
    ]
    [started] = audit(s, team.admin, "training.start")
    assert started["detail"]["left_out"] == {f"over_cap:{alice}": 3, f"excluded:{bob_id}": None}
    assert started["detail"]["collections"] == ["geo"]


def test_a_fine_tune_is_served_only_to_people_who_may_read_its_collections(
    loop: LoopStack, team: Team
) -> None:
    s = loop.stack
    (alice,) = team.tokens["alice"][:1]
    (bob,) = team.tokens["bob"]
    read_by(loop, team, "hr", "alice")  # bob may not read hr; geo is open to the tenant

    # alice's feedback on an hr answer trains a fine-tune, which remembers hr
    answer = ask(s, alice, LEAVE, collection="hr")
    assert rate(s, alice, answer["message_id"], 1).status_code == 200
    trained = call(s, "POST", "/v1/feedback/train", team.admin, {"format": "sft"})
    assert trained.status_code == 200, trained.text
    assert trained.json()["dataset"]["collections"] == ["hr"]
    assert trained.json()["promotion"]["collections"] == ["hr"]
    # the trainer published it (ftjob-N as ft-N); every credential of the tenant sees it listed
    model = "ft-" + trained.json()["job"]["id"].removeprefix("ftjob-")
    # recorded where the inference service withholds it from bob too
    assert restriction(loop, team, model) == ModelRestriction(collections=["hr"], allowed=False)
    for credential in (team.admin, alice, bob):
        s.model.own[credential] = [model]
    promoted = call(s, "POST", f"/v1/models/{model}/promote", team.admin)
    assert promoted.status_code == 200 and promoted.json()["default"] == model, promoted.text

    def answered_by(token: str, **extra: Any) -> str:
        ask(s, token, FRANCE, **extra)
        return str(s.model.requests[-1]["model"])

    # the tenant's default answers alice; bob, who may not read hr, gets the model before it
    assert answered_by(alice) == model
    assert answered_by(bob) == "scripted"
    assert answered_by(team.admin) == model  # an admin reads every collection
    # an evaluation bob runs measures what bob would be served, and naming the model is refused
    made = call(
        s,
        "POST",
        "/v1/evals/sets",
        bob,
        {"name": "capitals", "collection": "geo", "questions": [{"question": FRANCE, "answers": ["Paris"]}]},
    )
    assert made.status_code == 201, made.text
    run = call(s, "POST", "/v1/evals/runs", bob, {"set": made.json()["id"]})
    assert run.status_code == 202 and run.json()["llm"] in (None, ""), run.text
    named = call(s, "POST", "/v1/evals/runs", bob, {"set": made.json()["id"], "llm": model})
    assert named.status_code == 403 and named.json()["error"]["code"] == "model_withheld", named.text
    admins = call(s, "POST", "/v1/evals/runs", team.admin, {"set": made.json()["id"]})
    assert admins.status_code == 202 and admins.json()["llm"] == model, admins.text
    # naming it is a 403 that says why, without naming the collection bob may not see
    refused = call(
        s,
        "POST",
        "/v1/pipelines/chat-documents-generate/run",
        bob,
        {"query": FRANCE, "collection": "geo", "llm": model},
    )
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["param"] == "llm" and error["code"] == "model_withheld"
    assert "may not read" in error["message"] and "hr" not in error["message"].replace(model, "")
    # a conversation that named it earlier does not carry it past the check either
    read_by(loop, team, "hr", "alice", "bob")
    first = ask(s, bob, FRANCE, llm=model, remember=True)
    read_by(loop, team, "hr", "alice")
    again = call(
        s,
        "POST",
        "/v1/pipelines/chat-documents-generate/run",
        bob,
        {"query": GERMANY, "collection": "geo", "conversation_id": first["conversation_id"]},
    )
    assert again.status_code == 403 and again.json()["error"]["code"] == "model_withheld", again.text

    # a member may not allow it; an unknown model is a 404 naming it
    assert call(s, "POST", f"/v1/models/{model}/allow", alice).status_code == 403
    unknown = call(s, "POST", "/v1/models/scripted/allow", team.admin)
    assert unknown.status_code == 404 and "'scripted'" in unknown.json()["error"]["message"]
    # an admin allows it for everyone: bob is served it, named or not; withdrawn, he is not
    allowed = call(s, "POST", f"/v1/models/{model}/allow", team.admin, {"reason": "reviewed"})
    assert allowed.status_code == 200, allowed.text
    assert allowed.json()["allowed"]["by"] == team.admin.split("_")[1]
    assert restriction(loop, team, model) == ModelRestriction(collections=["hr"], allowed=True)
    assert answered_by(bob) == model and answered_by(bob, llm=model) == model
    assert call(s, "DELETE", f"/v1/models/{model}/allow", team.admin).status_code == 200
    assert restriction(loop, team, model) == ModelRestriction(collections=["hr"], allowed=False)
    assert answered_by(bob) == "scripted"
    [granted] = audit(s, team.admin, "model.allow")
    assert granted["target"] == model
    assert granted["detail"] == {"collections": ["hr"], "reason": "reviewed"}
    [withdrawn] = audit(s, team.admin, "model.disallow")
    assert withdrawn["detail"] == {"collections": ["hr"], "was_allowed": True}


def test_mcp_servers_are_registered_changed_and_removed_by_admins_only(loop: LoopStack, team: Team) -> None:
    s = loop.stack
    (alice,) = team.tokens["alice"][:1]
    server = {"name": "tools", "url": "https://tools.example.org/mcp"}
    for method, path, body in (
        ("POST", "/v1/mcp/servers", server),
        ("PATCH", "/v1/mcp/servers/tools", {"agents": ["react"]}),
        ("DELETE", "/v1/mcp/servers/tools", None),
    ):
        refused = call(s, method, path, alice, body)
        assert refused.status_code == 403, (method, refused.text)
        assert "this user is a member" in refused.json()["error"]["message"]
    assert call(s, "GET", "/v1/mcp/servers", alice).json()["data"] == []  # members still list them
    assert audit(s, team.admin, "mcp_server.register") == []
