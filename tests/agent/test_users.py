"""People in a tenant (``/v1/users``): admins create, change and remove users and their personal
tokens; a token acts with its user's role on the agent and on retrieval (a viewer chats and
searches but neither uploads nor gives feedback); revoked and expired tokens are 401s that say
why; a tenant keeps an admin; emails are unique per tenant. Real HTTP, real Valkey, the real
retrieval service (a tiny embedder); doubles for inference and the trainer."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from services.common.auth import KeyStore, authenticate
from services.common.errors import Unauthorized
from services.common.redis_conn import async_redis
from services.common.users import UserStore
from tests.agent.doubles import ScriptedModel
from tests.agent.stack import Stack, agent_stack
from tests.agent.test_feedback import FRANCE, ask, rate, reply
from tests.conftest import TEST_CACHE, auth
from tests.helpers.servers import serve_app, wait_ready


@dataclass
class Services:
    agent: Stack
    retrieval: str
    retrieval_app: Any = None


@pytest.fixture(scope="module")
def services(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    from services.common.config import CommonSettings
    from services.retrieval.app import create_app as create_retrieval
    from services.retrieval.config import RetrievalSettings
    from tests.retrieval.conftest import make_tiny_embedder

    root = TEST_CACHE / "retrieval-models"
    root.mkdir(parents=True, exist_ok=True)
    embedder = make_tiny_embedder(root / "tiny-embedder")
    with ExitStack() as es:
        common = CommonSettings(
            home=tmp_path_factory.mktemp("retrieval"),
            redis_url=redis_url,
            log_json=False,
            model_roots=str(root),
        )
        r_app = create_retrieval(common, RetrievalSettings(embedding_model=str(embedder)))
        r_url = es.enter_context(serve_app(r_app))
        wait_ready(r_url)
        agent = es.enter_context(
            agent_stack(
                redis_url,
                tmp_path_factory.mktemp("home"),
                model=ScriptedModel(replies=reply, shared=["scripted"]),
                dataset_min_rows_sft=1,
                promotion_holdout=0.0,
                mcp_allow_private=True,
            )
        )
        yield Services(agent, r_url, r_app)


@pytest.fixture()
def tenant(key_store: KeyStore) -> tuple[str, str]:
    """A fresh tenant and its admin key."""
    name = f"u{secrets.token_hex(4)}"
    return name, key_store.create(name, "admin", role="admin")[0]


def call(method: str, url: str, key: str, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
    headers = {**auth(key), **kw.pop("headers", {})}
    return httpx.request(method, url, json=body, headers=headers, timeout=60, **kw)


def make_user(
    s: Services, key: str, email: str, role: str = "member", groups: list[str] | None = None
) -> str:
    resp = call(
        "POST", f"{s.agent.url}/v1/users", key, {"email": email, "role": role, "groups": groups or []}
    )
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


def make_token(s: Services, key: str, user_id: str, name: str = "laptop") -> str:
    resp = call("POST", f"{s.agent.url}/v1/users/{user_id}/tokens", key, {"name": name})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["token"])


def error(resp: httpx.Response) -> str:
    return str(resp.json()["error"]["message"])


def test_an_admin_manages_users_and_tokens(services: Services, tenant: tuple[str, str]) -> None:
    s, (_, admin) = services, tenant
    uid = make_user(s, admin, "Ada@Example.org", "member", ["research", "ops"])
    got = call("GET", f"{s.agent.url}/v1/users/{uid}", admin).json()
    assert (got["email"], got["role"], got["groups"]) == ("ada@example.org", "member", ["ops", "research"])
    assert [u["id"] for u in call("GET", f"{s.agent.url}/v1/users", admin).json()["data"]] == [uid]
    patched = call("PATCH", f"{s.agent.url}/v1/users/{uid}", admin, {"groups": ["ops"]})
    assert (
        patched.status_code == 200
        and patched.json()["groups"] == ["ops"]
        and patched.json()["role"] == "member"
    )

    token = make_token(s, admin, uid)
    assert token.startswith("tdu_")
    who = call("GET", f"{s.agent.url}/v1/whoami", token)
    assert who.status_code == 200 and who.json()["key_id"] == uid, who.text
    listed = call("GET", f"{s.agent.url}/v1/users/{uid}/tokens", admin).json()["data"]
    assert [t["name"] for t in listed] == ["laptop"] and listed[0]["last_used_at"] is not None
    assert token not in str(listed) and "sha256" not in str(listed)
    # the user reads itself with its own token, but no one else's, and lists no users
    assert call("GET", f"{s.agent.url}/v1/users/{uid}", token).status_code == 200
    assert call("GET", f"{s.agent.url}/v1/users", token).status_code == 403

    revoked = call("DELETE", f"{s.agent.url}/v1/users/{uid}/tokens/{listed[0]['id']}", admin)
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    for url in (f"{s.agent.url}/v1/whoami", f"{s.retrieval}/v1/collections"):
        refused = call("GET", url, token)
        assert refused.status_code == 401 and "revoked" in error(refused), refused.text

    other = make_token(s, admin, uid, "phone")
    assert call("DELETE", f"{s.agent.url}/v1/users/{uid}", admin).status_code == 204
    gone = call("GET", f"{s.agent.url}/v1/users/{uid}", admin)
    assert gone.status_code == 404 and uid in error(gone)
    # a deleted user's tokens stop at once
    refused = call("GET", f"{s.agent.url}/v1/whoami", other)
    assert refused.status_code == 401 and "revoked" in error(refused)


def test_members_and_other_tenants_cannot_manage_users(
    services: Services, tenant: tuple[str, str], key_store: KeyStore
) -> None:
    s, (name, admin) = services, tenant
    member_key = key_store.create(name, "app", role="member")[0]
    resp = call("POST", f"{s.agent.url}/v1/users", member_key, {"email": "x@example.org"})
    assert resp.status_code == 403 and "member" in error(resp), resp.text
    uid = make_user(s, admin, "member@example.org", "member")
    member_token = make_token(s, admin, uid)
    for method, path in (("POST", "/v1/users"), ("GET", "/v1/audit"), ("DELETE", f"/v1/users/{uid}")):
        resp = call(
            method,
            f"{s.agent.url}{path}",
            member_token,
            {"email": "y@example.org"} if method == "POST" else None,
        )
        assert resp.status_code == 403 and "member" in error(resp), (path, resp.text)
    # another tenant's admin sees no such user
    stranger = key_store.create(f"o{secrets.token_hex(4)}", role="admin")[0]
    resp = call("GET", f"{s.agent.url}/v1/users/{uid}", stranger)
    assert resp.status_code == 404 and uid in error(resp)


def test_a_token_acts_with_its_users_role_on_agent_and_retrieval(
    services: Services, tenant: tuple[str, str]
) -> None:
    s, (_, admin) = services, tenant
    assert call("POST", f"{s.retrieval}/v1/collections", admin, {"name": "notes"}).status_code == 201
    member = make_token(s, admin, make_user(s, admin, "writer@example.org", "member"))
    viewer_id = make_user(s, admin, "reader@example.org", "viewer")
    viewer = make_token(s, admin, viewer_id)
    # a viewer manages its own tokens, nobody else's
    assert make_token(s, viewer, viewer_id, "second").startswith("tdu_")
    other = call("POST", f"{s.agent.url}/v1/users", viewer, {"email": "z@example.org"})
    assert other.status_code == 403 and "viewer" in error(other), other.text

    # a member uploads and searches on retrieval
    doc = {"documents": [{"id": "d1", "text": "The library opens at nine on weekdays."}]}
    up = call("POST", f"{s.retrieval}/v1/collections/notes/documents", member, doc)
    assert up.status_code == 201, up.text
    # a viewer searches, but neither uploads nor changes the collection
    found = call("POST", f"{s.retrieval}/v1/collections/notes/search", viewer, {"query": "library hours"})
    assert found.status_code == 200 and found.json()["results"], found.text
    for method, path, body in (
        ("POST", "/v1/collections/notes/documents", doc),
        ("DELETE", "/v1/collections/notes/documents/d1", None),
        ("DELETE", "/v1/collections/notes", None),
    ):
        resp = call(method, f"{s.retrieval}{path}", viewer, body)
        assert resp.status_code == 403 and "viewer" in error(resp), (path, resp.text)

    # on the agent a viewer chats, but gives no feedback and trains nothing
    answer = ask(s.agent, viewer, FRANCE)
    assert answer["message_id"]
    resp = rate(s.agent, viewer, answer["message_id"], 1)
    assert resp.status_code == 403 and "viewer" in error(resp) and "member or admin" in error(resp), resp.text
    with connect(s.agent.ws_url, additional_headers=auth(viewer), open_timeout=10) as conn:
        conn.send(json.dumps({"type": "feedback", "message_id": answer["message_id"], "rating": 1}))
        event = json.loads(conn.recv(timeout=10))
        assert event["type"] == "error" and "viewer" in event["message"], event
    resp = call("POST", f"{s.agent.url}/v1/feedback/train", viewer, {"format": "kto"})
    assert resp.status_code == 403 and "viewer" in error(resp)
    # the member's own answer takes its feedback
    mine = ask(s.agent, member, FRANCE)
    assert rate(s.agent, member, mine["message_id"], 1).status_code == 200
    # promoted to member, the same token may now give feedback: the role is read at each request
    assert call("PATCH", f"{s.agent.url}/v1/users/{viewer_id}", admin, {"role": "member"}).status_code == 200
    assert rate(s.agent, viewer, answer["message_id"], 1).status_code == 200


def test_a_tenant_keeps_an_admin_and_emails_are_unique(
    services: Services, tenant: tuple[str, str], key_store: KeyStore
) -> None:
    s, (_, admin) = services, tenant
    first = make_user(s, admin, "first@example.org", "admin")
    first_token = make_token(s, admin, first)
    key_store.revoke(admin)  # the user is now the tenant's only admin
    for method, body in (("PATCH", {"role": "viewer"}), ("DELETE", None)):
        resp = call(method, f"{s.agent.url}/v1/users/{first}", first_token, body)
        assert resp.status_code == 409 and "without an admin" in error(resp), resp.text
    second = make_user(s, first_token, "second@example.org", "admin")
    second_token = make_token(s, first_token, second)
    assert (
        call("PATCH", f"{s.agent.url}/v1/users/{first}", first_token, {"role": "member"}).status_code == 200
    )
    # a demoted admin is a member at once
    assert call("GET", f"{s.agent.url}/v1/users", first_token).status_code == 403
    dup = call("POST", f"{s.agent.url}/v1/users", second_token, {"email": "FIRST@example.org"})
    assert dup.status_code == 409 and "first@example.org" in error(dup), dup.text
    taken = call("PATCH", f"{s.agent.url}/v1/users/{second}", second_token, {"email": "first@example.org"})
    assert taken.status_code == 409
    for method, path in (
        ("GET", "/v1/users/u_nobody"),
        ("PATCH", "/v1/users/u_nobody"),
        ("POST", "/v1/users/u_nobody/tokens"),
        ("DELETE", f"/v1/users/{second}/tokens/nosuchtoken"),
    ):
        resp = call(method, f"{s.agent.url}{path}", second_token, {} if method in ("PATCH", "POST") else None)
        assert resp.status_code == 404, (path, resp.text)
        assert ("u_nobody" if "nobody" in path else "nosuchtoken") in error(resp)
    bad = call("POST", f"{s.agent.url}/v1/users", second_token, {"email": "not an address"})
    assert bad.status_code == 400 and "not an address" in error(bad)
    bad = call("POST", f"{s.agent.url}/v1/users", second_token, {"email": "a@b.org", "role": "owner"})
    assert bad.status_code == 400


def test_an_expired_token_says_so(services: Services, tenant: tuple[str, str], redis_url: str) -> None:
    s, (_, admin) = services, tenant
    uid = make_user(s, admin, "temp@example.org", "member")
    past = call("POST", f"{s.agent.url}/v1/users/{uid}/tokens", admin, {"name": "old", "expires_at": 1000.0})
    assert past.status_code == 400 and "expires_at" in error(past)

    async def made_long_ago() -> str:
        client = async_redis(redis_url)
        try:
            # made when the clock read 1,000,000 s, valid for an hour: long expired now
            store = UserStore(client, clock=lambda: 1_000_000.0)
            tenant_name = tenant[0]
            return (await store.create_token(tenant_name, uid, "old", expires_at=1_003_600.0))[0]
        finally:
            await client.aclose()

    token = asyncio.run(made_long_ago())
    resp = call("GET", f"{s.agent.url}/v1/whoami", token)
    assert resp.status_code == 401 and "expired" in error(resp), resp.text
    fresh = call(
        "POST", f"{s.agent.url}/v1/users/{uid}/tokens", admin, {"name": "new", "expires_at": 4_000_000_000}
    )
    assert call("GET", f"{s.agent.url}/v1/whoami", fresh.json()["token"]).status_code == 200


def test_ended_sessions_are_forgotten_and_revoked_tokens_kept(redis_url: str) -> None:
    async def run() -> None:
        client = async_redis(redis_url)
        now = [2_000_000.0]
        try:
            store = UserStore(client, clock=lambda: now[0])
            tenant_name = f"forget{secrets.token_hex(3)}"
            user = await store.create(tenant_name, "s@example.org", "member", [])
            expired, _ = await store.create_token(tenant_name, user.id, "web sign-in", expires_at=now[0] + 10)
            _, revoked = await store.create_token(tenant_name, user.id, "web sign-in")
            _, live = await store.create_token(tenant_name, user.id, "web sign-in", expires_at=now[0] + 1000)
            _, personal = await store.create_token(tenant_name, user.id, "laptop")
            await store.revoke_token(tenant_name, user.id, revoked.id)
            await store.revoke_token(tenant_name, user.id, personal.id)
            now[0] += 100
            assert await store.forget_ended(tenant_name, user.id, "web sign-in") == 2
            left = {t.id for t in await store.tokens(tenant_name, user.id)}
            assert left == {live.id, personal.id}
            with pytest.raises(Unauthorized, match="no such token"):
                await authenticate(client, expired, now=now[0])
        finally:
            await client.aclose()

    asyncio.run(run())
