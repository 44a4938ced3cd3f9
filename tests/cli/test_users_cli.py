"""``tandem users``, ``tandem audit`` and the last-admin guard of ``tandem keys revoke``: the cli
over the agent's real HTTP API (in-process, real Valkey), with an admin key."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner, Result

from services.cli import main as cli
from services.common.auth import KeyStore
from tests.agent.stack import Stack, agent_stack
from tests.conftest import auth

runner = CliRunner()


@pytest.fixture(scope="module")
def agent(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agent_stack(redis_url, tmp_path_factory.mktemp("home")) as s:
        yield s


def tandem(agent: Stack, key: str, *args: str) -> Result:
    return runner.invoke(cli.app, [*args, "--api-key", key, "--agent-url", agent.url])


def last_line(result: Result) -> str:
    return result.output.strip().splitlines()[-1]


def test_an_admin_manages_users_and_tokens_and_reads_the_audit_log(
    tandem_env: Path, agent: Stack, key_store: KeyStore
) -> None:
    tenant = f"p{secrets.token_hex(4)}"
    admin = key_store.create(tenant, "admin", role="admin")[0]
    made = tandem(agent, admin, "users", "create", "Ada@Example.org", "--role", "member", "--group", "ops")
    assert made.exit_code == 0, made.output
    uid = last_line(made)
    listed = tandem(agent, admin, "users", "list")
    assert listed.exit_code == 0 and uid in listed.output and "ada@example.org" in listed.output

    changed = tandem(
        agent, admin, "users", "update", uid, "--role", "viewer", "--group", "hr", "--group", "ops"
    )
    assert changed.exit_code == 0 and "viewer" in changed.output and "hr, ops" in changed.output
    token_made = tandem(agent, admin, "users", "token", "create", uid, "--name", "laptop", "--days", "1")
    assert token_made.exit_code == 0, token_made.output
    token = last_line(token_made)
    me = httpx.get(f"{agent.url}/v1/users/{uid}", headers=auth(token), timeout=30)
    assert me.status_code == 200 and me.json()["role"] == "viewer"
    tokens = tandem(agent, admin, "users", "token", "list", uid)
    token_id = token.split("_")[1]
    assert tokens.exit_code == 0 and token_id in tokens.output and "laptop" in tokens.output
    assert tandem(agent, admin, "users", "token", "revoke", uid, token_id).exit_code == 0
    gone = httpx.get(f"{agent.url}/v1/users/{uid}", headers=auth(token), timeout=30)
    assert gone.status_code == 401 and "revoked" in gone.json()["error"]["message"]
    assert tandem(agent, admin, "users", "delete", uid).exit_code == 0

    # the API's refusals end the command with status 1 and its message
    missing = tandem(agent, admin, "users", "delete", uid)
    assert missing.exit_code == 1 and "HTTP 404" in missing.output and uid in missing.output
    bad = tandem(agent, admin, "users", "create", "nobody", "--role", "member")
    assert bad.exit_code == 1 and "email" in bad.output
    nothing = tandem(agent, admin, "users", "update", "u_0")
    assert nothing.exit_code == 1 and "nothing to change" in nothing.output

    # the log: a table newest first, filtered; or every entry, oldest first, as JSON lines
    table = tandem(agent, admin, "audit", "--action", "token.revoke")
    assert table.exit_code == 0 and token_id in table.output and "user.create" not in table.output
    exported = tandem(agent, admin, "audit", "--jsonl", "--since", "2001-09-09T01:46:40Z")
    assert exported.exit_code == 0, exported.output
    entries = [json.loads(line) for line in exported.output.splitlines()]
    assert [e["action"] for e in entries] == [
        "user.create",
        "user.update",
        "token.create",
        "token.revoke",
        "user.delete",
    ]
    assert {e["actor"]["id"] for e in entries} == {admin.split("_")[1]}
    mine = tandem(agent, admin, "audit", "--jsonl", "--user", "someone-else")
    assert mine.exit_code == 0 and mine.output.strip() == ""
    future = tandem(agent, admin, "audit", "--jsonl", "--since", "2090-01-01")
    assert future.exit_code == 0 and future.output.strip() == ""
    when = tandem(agent, admin, "audit", "--since", "yesterday")
    assert when.exit_code == 1 and "--since: 'yesterday'" in when.output

    # a member may do none of it: the API's 403 names its role
    member = key_store.create(tenant, "app", role="member")[0]
    refused = tandem(agent, member, "audit")
    assert refused.exit_code == 1 and "HTTP 403" in refused.output and "member" in refused.output


def test_revoking_the_last_admin_key_needs_force(tandem_env: Path, agent: Stack, key_store: KeyStore) -> None:
    tenant = f"k{secrets.token_hex(4)}"
    admin, admin_rec = key_store.create(tenant, "first", role="admin")
    member_rec = key_store.create(tenant, "app", role="member")[1]
    # a member key is never the last admin
    assert runner.invoke(cli.app, ["keys", "revoke", member_rec.key_id]).exit_code == 0
    refused = runner.invoke(cli.app, ["keys", "revoke", admin])  # the whole key, too
    assert refused.exit_code == 1, refused.output
    assert f"key {admin_rec.key_id} is the last admin of tenant '{tenant}'" in refused.output
    assert "--force" in refused.output
    assert not next(k for k in key_store.list(tenant) if k.key_id == admin_rec.key_id).revoked

    # with an admin user beside it, the key may go: the user administers the tenant
    made = tandem(agent, admin, "users", "create", "lin@example.org", "--role", "admin")
    assert made.exit_code == 0, made.output
    assert runner.invoke(cli.app, ["keys", "revoke", admin_rec.key_id]).exit_code == 0

    # a tenant's only admin key goes with --force
    other_rec = key_store.create(f"k{secrets.token_hex(4)}", "only", role="admin")[1]
    assert runner.invoke(cli.app, ["keys", "revoke", other_rec.key_id]).exit_code == 1
    forced = runner.invoke(cli.app, ["keys", "revoke", "--force", other_rec.key_id])
    assert forced.exit_code == 0 and f"revoked key {other_rec.key_id}" in forced.output
