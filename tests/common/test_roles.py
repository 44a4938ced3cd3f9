"""Operator keys: created by ``tandem keys create --operator``, recognised by every service
(``Principal.operator``), listed with their role; ``tandem up``'s service key is one, and an
older service key is upgraded. Real Valkey, the real CLI (Typer's runner, in process)."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import redis
from typer.testing import CliRunner

from services.cli import main as cli
from services.common.auth import KeyStore, Principal, verify_key
from services.common.redis_conn import async_redis


def _principal(redis_url: str, key: str) -> Principal | None:
    async def check() -> Principal | None:
        client = async_redis(redis_url)
        try:
            return await verify_key(client, key)
        finally:
            await client.aclose()

    return asyncio.run(check())


def test_keys_create_operator_and_list_show_the_role(tandem_env: Path, redis_url: str) -> None:
    runner = CliRunner()
    made = runner.invoke(cli.app, ["keys", "create", "--tenant", "ops", "--operator", "--name", "admin"])
    assert made.exit_code == 0, made.output
    key = made.output.strip().splitlines()[-1]
    assert "(operator)" in made.output
    plain = runner.invoke(cli.app, ["keys", "create", "--tenant", "ops"])
    plain_key = plain.output.strip().splitlines()[-1]
    admin, user = _principal(redis_url, key), _principal(redis_url, plain_key)
    assert admin is not None and admin.operator and admin.tenant == "ops"
    assert user is not None and not user.operator
    listed = runner.invoke(cli.app, ["keys", "list", "--tenant", "ops"], env={"COLUMNS": "200"})
    rows = [line for line in listed.output.splitlines() if admin.key_id in line or user.key_id in line]
    assert any(admin.key_id in r and "operator" in r for r in rows)
    assert any(user.key_id in r and "operator" not in r for r in rows)


def test_service_key_is_an_operator_key_and_old_ones_are_upgraded(tandem_env: Path, redis_url: str) -> None:
    from services.cli import stack

    layout = stack.Layout(tandem_env)
    env: dict[str, str] = {}
    cli._ensure_keys(layout, redis_url, env)
    service = _principal(redis_url, env["TANDEM_SERVICE_API_KEY"])
    assert service is not None and service.operator and service.tenant == "system"
    user = _principal(redis_url, layout.key_file.read_text().strip())
    assert user is not None and not user.operator  # the tenant's own key stays a plain one
    assert user.role == "admin" and user.is_admin  # ... and administers its tenant

    # a service key written before roles existed becomes an operator key on the next start
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    old = KeyStore(client).create("system", name="service-to-service")[0]
    client.close()
    (tandem_env / "service-key").write_text(old + "\n")
    before = _principal(redis_url, old)
    assert before is not None and not before.operator
    cli._ensure_keys(layout, redis_url, {})
    after = _principal(redis_url, old)
    assert after is not None and after.operator


def test_tenant_roles_default_to_admin_first_then_member(tandem_env: Path, redis_url: str) -> None:
    runner = CliRunner()
    tenant = f"roles{secrets.token_hex(4)}"

    def create(*extra: str) -> tuple[str, str]:
        made = runner.invoke(cli.app, ["keys", "create", "--tenant", tenant, *extra])
        assert made.exit_code == 0, made.output
        return made.output.strip().splitlines()[-1], made.output

    first, said = create()
    assert "(admin)" in said
    second, said = create()
    assert "(member)" in said
    third, _ = create("--role", "admin")
    fourth, _ = create("--role", "member")
    roles = [_principal(redis_url, k) for k in (first, second, third, fourth)]
    assert [(p.role, p.is_admin) for p in roles if p is not None] == [
        ("admin", True),
        ("member", False),
        ("admin", True),
        ("member", False),
    ]
    assert all(p is not None and p.owner == p.key_id for p in roles)
    bad = runner.invoke(cli.app, ["keys", "create", "--tenant", tenant, "--role", "viewer"])
    assert bad.exit_code != 0 and "role" in bad.output
    both = runner.invoke(cli.app, ["keys", "create", "--tenant", tenant, "--operator", "--role", "member"])
    assert both.exit_code != 0 and "--role" in both.output
    listed = runner.invoke(cli.app, ["keys", "list", "--tenant", tenant], env={"COLUMNS": "200"})
    assert sum(" member " in line for line in listed.output.splitlines() if tenant in line) == 2

    # A key made before tenant roles existed (no role) administers its tenant, and a tenant whose
    # keys are all revoked gets an admin again.
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    store = KeyStore(client)
    old, old_rec = store.create(f"old{secrets.token_hex(4)}")
    client.hset(f"tandem:keys:{old_rec.key_id}", "role", "")
    legacy = _principal(redis_url, old)
    assert legacy is not None and legacy.is_admin
    lone = f"lone{secrets.token_hex(4)}"
    _, only = store.create(lone)
    store.revoke(only.key_id)
    assert store.create(lone)[1].role == "admin"
    client.close()
