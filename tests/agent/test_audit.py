"""The audit log: each change (users, tokens, keys from the cli, promotions, MCP servers,
training, uploads and deletions on retrieval) appends who did what; admins read it on the agent
filtered by actor, action and time, a page at a time or exported as JSON lines; members may
not; retention drops the oldest entries. Real HTTP, real Valkey, the real retrieval service
and cli; an injected clock."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from services.cli import main as cli
from services.common.audit import Actor, AuditFilter, AuditLog
from services.common.auth import KeyStore
from services.common.redis_conn import async_redis
from tests.agent.test_feedback import FRANCE, ask, rate
from tests.agent.test_users import Services, call, error, make_token, make_user
from tests.agent.test_users import services as services  # the module's fixture

T0 = 1_800_000_000.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def audit(s: Services, key: str, **params: Any) -> dict[str, Any]:
    resp = call("GET", f"{s.agent.url}/v1/audit", key, params=params)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def test_every_change_is_recorded_and_read_back_by_filter(services: Services, key_store: KeyStore) -> None:
    s = services
    tenant = f"a{secrets.token_hex(4)}"
    admin = key_store.create(tenant, "admin", role="admin")[0]
    admin_id = admin.split("_")[1]
    clock = Clock(T0)
    s.agent.app.state.audit.clock = clock
    s.retrieval_app.state.audit.clock = clock

    uid = make_user(s, admin, "lin@example.org", "admin")  # T0
    clock.now += 60
    token = make_token(s, admin, uid)  # T0 + 60
    token_id = call("GET", f"{s.agent.url}/v1/users/{uid}/tokens", admin).json()["data"][0]["id"]
    clock.now += 60
    # the user, with its own token, registers and removes an MCP server (T0 + 120)
    server = {"name": "tools", "url": "http://127.0.0.1:9/mcp"}
    assert call("POST", f"{s.agent.url}/v1/mcp/servers", token, server).status_code == 201
    assert (
        call("PATCH", f"{s.agent.url}/v1/mcp/servers/tools", token, {"agents": ["react"]}).status_code == 200
    )
    assert call("DELETE", f"{s.agent.url}/v1/mcp/servers/tools", token).status_code == 204
    clock.now += 60
    assert call("POST", f"{s.agent.url}/v1/models/scripted/promote", admin).status_code == 200
    assert call("POST", f"{s.agent.url}/v1/models/scripted/rollback", admin).status_code == 200
    answer = ask(s.agent, admin, FRANCE)
    assert rate(s.agent, admin, answer["message_id"], 1).status_code == 200
    trained = call("POST", f"{s.agent.url}/v1/feedback/train", admin, {"format": "sft"})
    assert trained.status_code == 200, trained.text
    assert call("POST", f"{s.retrieval}/v1/collections", admin, {"name": "docs"}).status_code == 201
    doc = {"documents": [{"id": "d1", "text": "Badges are renewed each January."}]}
    assert call("POST", f"{s.retrieval}/v1/collections/docs/documents", admin, doc).status_code == 201
    assert call("DELETE", f"{s.retrieval}/v1/collections/docs/documents/d1", admin).status_code == 204
    clock.now += 60
    assert call("PATCH", f"{s.agent.url}/v1/users/{uid}", admin, {"groups": ["ops"]}).status_code == 200
    assert call("DELETE", f"{s.agent.url}/v1/users/{uid}/tokens/{token_id}", admin).status_code == 200
    assert call("DELETE", f"{s.agent.url}/v1/users/{uid}", admin).status_code == 204

    page = audit(s, admin, limit=1000)
    entries = page["data"]
    assert page["has_more"] is False
    assert [e["action"] for e in reversed(entries)] == [
        "user.create",
        "token.create",
        "mcp_server.register",
        "mcp_server.update",
        "mcp_server.remove",
        "model.promote",
        "model.rollback",
        "training.start",
        "document.upload",
        "document.delete",
        "user.update",
        "token.revoke",
        "user.delete",
    ]
    by_action = {e["action"]: e for e in entries}
    assert by_action["user.create"]["actor"] == {"kind": "key", "id": admin_id}
    assert by_action["user.create"]["target"] == uid and by_action["user.create"]["at"] == T0
    assert by_action["user.update"]["detail"] == {"groups": {"from": [], "to": ["ops"]}}
    assert by_action["mcp_server.register"]["actor"] == {"kind": "user", "id": uid}
    assert by_action["document.delete"]["target"] == "docs"
    assert by_action["document.delete"]["detail"] == {"document": "d1"}
    assert by_action["training.start"]["target"] == trained.json()["job"]["id"]
    assert all(e["tenant"] == tenant for e in entries)

    # filters: by actor, by action, by time (inclusive), and a page at a time
    assert {e["action"] for e in audit(s, admin, actor=uid)["data"]} == {
        "mcp_server.register",
        "mcp_server.update",
        "mcp_server.remove",
    }
    assert [e["target"] for e in audit(s, admin, action="user.delete")["data"]] == [uid]
    window = audit(s, admin, since=T0 + 60, until=T0 + 120)["data"]
    assert [e["action"] for e in reversed(window)] == [
        "token.create",
        "mcp_server.register",
        "mcp_server.update",
        "mcp_server.remove",
    ]
    first = audit(s, admin, limit=5)
    assert first["has_more"] and len(first["data"]) == 5
    rest = audit(s, admin, limit=1000, before=first["next_before"])
    assert [e["id"] for e in first["data"] + rest["data"]] == [e["id"] for e in entries]
    bad = call("GET", f"{s.agent.url}/v1/audit", admin, params={"since": T0 + 10, "until": T0})
    assert bad.status_code == 400 and "since" in error(bad)

    # JSON lines, oldest first, by query or by Accept
    lines = call("GET", f"{s.agent.url}/v1/audit", admin, params={"format": "jsonl", "action": "user.create"})
    assert lines.headers["content-type"].startswith("application/jsonl")
    assert [json.loads(line)["target"] for line in lines.text.splitlines()] == [uid]
    resp = call("GET", f"{s.agent.url}/v1/audit", admin, headers={"Accept": "application/jsonl"})
    exported = [json.loads(line) for line in resp.text.splitlines()]
    assert [e["id"] for e in exported] == [e["id"] for e in reversed(entries)]

    # a member key may not read it; another tenant's admin reads its own (empty) log
    member = key_store.create(tenant, "app", role="member")[0]
    refused = call("GET", f"{s.agent.url}/v1/audit", member)
    assert refused.status_code == 403 and "member" in error(refused)
    stranger = key_store.create(f"o{secrets.token_hex(4)}", role="admin")[0]
    assert audit(s, stranger)["data"] == []


def test_keys_made_and_revoked_with_the_cli_are_recorded(tandem_env: Path, redis_url: str) -> None:
    tenant = f"c{secrets.token_hex(4)}"
    runner = CliRunner()
    made = runner.invoke(cli.app, ["keys", "create", "--tenant", tenant, "--name", "ci"])
    assert made.exit_code == 0, made.output
    key = made.output.strip().splitlines()[-1]
    # the tenant's only key is its last admin: revoked only with --force, and the log says so
    assert runner.invoke(cli.app, ["keys", "revoke", key.split("_")[1]]).exit_code == 1
    assert runner.invoke(cli.app, ["keys", "revoke", "--force", key.split("_")[1]]).exit_code == 0

    async def read() -> list[Any]:
        client = async_redis(redis_url)
        try:
            return (await AuditLog(client).entries(tenant, AuditFilter()))[0]
        finally:
            await client.aclose()

    entries = list(reversed(asyncio.run(read())))
    assert [(e.action, e.target, e.actor.kind) for e in entries] == [
        ("key.create", key.split("_")[1], "cli"),
        ("key.revoke", key.split("_")[1], "cli"),
    ]
    assert entries[0].detail == {"name": "ci", "role": "admin"}
    assert entries[1].detail == {"name": "ci", "forced": True}


@pytest.mark.parametrize("by", ["age", "count"])
def test_retention_drops_the_oldest_entries(redis_url: str, by: str) -> None:
    tenant = f"r{secrets.token_hex(4)}"
    clock = Clock(T0)

    async def run() -> list[str]:
        client = async_redis(redis_url)
        try:
            log = AuditLog(client, retention_days=1, max_entries=3 if by == "count" else 1000, clock=clock)
            who = Actor(kind="key", id="k1")
            for i in range(5):
                await log.record(tenant, who, "user.create", f"u{i}")
                clock.now += 3600 if by == "count" else 10 * 3600  # count: all within a day
            entries, _ = await log.entries(tenant, AuditFilter())
            return [e.target for e in reversed(entries)]
        finally:
            await client.aclose()

    # by age: each entry 10 h after the last; the fifth (40 h in) keeps those of the last day
    assert asyncio.run(run()) == ["u2", "u3", "u4"]
