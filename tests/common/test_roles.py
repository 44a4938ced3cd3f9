"""Operator keys: created by ``tandem keys create --operator``, recognised by every service
(``Principal.operator``), listed with their role; ``tandem up``'s service key is one, and an
older service key is upgraded. Real Valkey, the real CLI (Typer's runner, in process)."""

from __future__ import annotations

import asyncio
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
