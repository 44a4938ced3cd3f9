"""``tandem users`` and ``tandem audit``: a tenant's people, their tokens and its audit log, over
the agent's HTTP API (``/v1/users``, ``/v1/audit``) with an admin's key: by default the running
stack's own key (``$TANDEM_HOME/api-key``, an admin of its tenant), or ``--api-key``.

Also the guard of ``tandem keys revoke``: revoking a tenant's last admin (a live admin key when no
other admin key or admin user is left) is refused unless ``--force``.

An error of the API ends the command with exit status 1 and the API's message, which names
the field or the id at fault.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, NoReturn

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from services.cli import stack
from services.common.auth import ADMIN, KEY_PREFIX, OPERATOR, KeyStore, hash_key, tenant_role
from services.common.config import CommonSettings, load_settings
from services.common.redis_conn import async_redis
from services.common.users import UserStore

users_app = typer.Typer(help="The tenant's people and their personal tokens (admins).", no_args_is_help=True)
tokens_app = typer.Typer(help="A user's personal API tokens.", no_args_is_help=True)
users_app.add_typer(tokens_app, name="token")
console = Console()
err = Console(stderr=True)

API_KEY_HELP = "An admin's API key or token (default: the running stack's key, $TANDEM_HOME/api-key)."
AGENT_URL_HELP = "The agent's URL (default: the running stack's, else from settings)."
AUDIT_PAGE = 1000  # entries per request when paging through the log


def fail(message: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _when(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds)) if seconds else ""


# -- talking to the agent ---------------------------------------------------------------------


def _agent_url(common: CommonSettings, given: str) -> str:
    if given:
        return given.rstrip("/")
    try:
        state = json.loads(stack.Layout(common.home_dir).state_file.read_text())
        return str(state["urls"]["agent"]).rstrip("/")
    except (OSError, ValueError, KeyError, TypeError):
        return common.url_of("agent").rstrip("/")


def _api_key(common: CommonSettings, given: str) -> str:
    if given:
        return given
    path = stack.Layout(common.home_dir).key_file
    try:
        return path.read_text().strip()
    except OSError:
        fail(f"no API key: {path} is missing (start the stack with `tandem up`, or give --api-key)")


@contextmanager
def agent_client(api_key: str, agent_url: str) -> Iterator[httpx.Client]:
    common = load_settings(CommonSettings, check_unknown=False)
    key, url = _api_key(common, api_key), _agent_url(common, agent_url)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60.0) as client:
        try:
            yield client
        except httpx.HTTPError as exc:
            fail(f"the agent at {url} did not answer: {exc}")


def _answer(resp: httpx.Response) -> Any:
    """The JSON body of a success; the API's own error message otherwise."""
    if resp.status_code >= 400:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:300]
        fail(f"HTTP {resp.status_code}: {message}")
    return resp.json() if resp.content else None


# -- users ------------------------------------------------------------------------------------

ApiKey = typer.Option("", "--api-key", help=API_KEY_HELP)
AgentUrl = typer.Option("", "--agent-url", help=AGENT_URL_HELP)


@users_app.command("list")
def users_list(api_key: str = ApiKey, agent_url: str = AgentUrl) -> None:
    """The tenant's users: id, email, role and groups."""
    with agent_client(api_key, agent_url) as client:
        users = _answer(client.get("/v1/users"))["data"]
    table = Table()
    for col in ("user id", "email", "role", "groups", "created"):
        table.add_column(col)
    for u in users:
        table.add_row(u["id"], u["email"], u["role"], ", ".join(u["groups"]), _when(u["created_at"]))
    console.print(table)


@users_app.command("create")
def users_create(
    email: str = typer.Argument(..., help="The person's email (unique in the tenant)."),
    role: str = typer.Option("member", "--role", help="admin, member or viewer."),
    groups: list[str] = typer.Option([], "--group", help="A group the user belongs to (repeat for more)."),
    api_key: str = ApiKey,
    agent_url: str = AgentUrl,
) -> None:
    """Create a user; its id is printed on the last line."""
    with agent_client(api_key, agent_url) as client:
        user = _answer(client.post("/v1/users", json={"email": email, "role": role, "groups": groups}))
    console.print(f"user {escape(user['email'])} ({user['role']}) created:", highlight=False)
    print(user["id"])


@users_app.command("update")
def users_update(
    user_id: str = typer.Argument(..., help="The user's id."),
    email: str | None = typer.Option(None, "--email", help="A new email."),
    role: str | None = typer.Option(None, "--role", help="A new role: admin, member or viewer."),
    groups: list[str] = typer.Option(
        [], "--group", help="The user's groups, replacing the ones it has (repeat for more)."
    ),
    no_groups: bool = typer.Option(False, "--no-groups", help="Remove the user from every group."),
    api_key: str = ApiKey,
    agent_url: str = AgentUrl,
) -> None:
    """Change a user's email, role or groups (what is not given stays)."""
    if groups and no_groups:
        fail("--group and --no-groups: give one or the other")
    body: dict[str, Any] = {}
    if email is not None:
        body["email"] = email
    if role is not None:
        body["role"] = role
    if groups or no_groups:
        body["groups"] = groups
    if not body:
        fail("nothing to change: give --email, --role, --group or --no-groups")
    with agent_client(api_key, agent_url) as client:
        user = _answer(client.patch(f"/v1/users/{user_id}", json=body))
    console.print(
        f"user {user['id']}: {escape(user['email'])}, {user['role']}, groups: {', '.join(user['groups']) or '-'}",
        highlight=False,
    )


@users_app.command("delete")
def users_delete(
    user_id: str = typer.Argument(..., help="The user's id."),
    api_key: str = ApiKey,
    agent_url: str = AgentUrl,
) -> None:
    """Remove a user and revoke its tokens (the tenant's last admin cannot be removed)."""
    with agent_client(api_key, agent_url) as client:
        _answer(client.delete(f"/v1/users/{user_id}"))
    console.print(f"user {user_id} removed; its tokens are revoked")


@tokens_app.command("list")
def tokens_list(
    user_id: str = typer.Argument(..., help="The user's id."),
    api_key: str = ApiKey,
    agent_url: str = AgentUrl,
) -> None:
    """A user's tokens (never the tokens themselves)."""
    with agent_client(api_key, agent_url) as client:
        tokens = _answer(client.get(f"/v1/users/{user_id}/tokens"))["data"]
    table = Table()
    for col in ("token id", "name", "created", "last used", "expires", "revoked"):
        table.add_column(col)
    for t in tokens:
        table.add_row(
            t["id"],
            t["name"],
            _when(t["created_at"]),
            _when(t.get("last_used_at")),
            _when(t.get("expires_at")),
            "yes" if t["revoked"] else "",
        )
    console.print(table)


@tokens_app.command("create")
def tokens_create(
    user_id: str = typer.Argument(..., help="The user's id."),
    name: str = typer.Option(..., "--name", help="A label to recognise the token by."),
    days: float | None = typer.Option(None, "--days", min=0.001, help="Expire after this many days."),
    api_key: str = ApiKey,
    agent_url: str = AgentUrl,
) -> None:
    """Create a personal token acting with the user's role; printed once, on the last line."""
    body: dict[str, Any] = {"name": name}
    if days is not None:
        body["expires_at"] = time.time() + days * 86_400
    with agent_client(api_key, agent_url) as client:
        made = _answer(client.post(f"/v1/users/{user_id}/tokens", json=body))
    console.print(f"token {made['id']} of user {user_id} (shown once):")
    print(made["token"])


@tokens_app.command("revoke")
def tokens_revoke(
    user_id: str = typer.Argument(..., help="The user's id."),
    token_id: str = typer.Argument(..., help="The token's id (`tandem users token list`)."),
    api_key: str = ApiKey,
    agent_url: str = AgentUrl,
) -> None:
    """Revoke a token at once, in every service."""
    with agent_client(api_key, agent_url) as client:
        _answer(client.delete(f"/v1/users/{user_id}/tokens/{token_id}"))
    console.print(f"revoked token {token_id} of user {user_id}")


# -- the audit log ----------------------------------------------------------------------------


def unix_time(text: str, option: str) -> float:
    """Unix seconds, or an ISO 8601 date or time (UTC unless it names its offset)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        fail(
            f"{option}: {text!r} is neither unix seconds nor an ISO 8601 date or time (e.g. 2030-01-31T09:00)"
        )
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def audit_command(
    user: str | None = typer.Option(None, "--user", help="Only what this user (or key) did: its id."),
    action: str | None = typer.Option(None, "--action", help="Only this action, e.g. user.create."),
    since: str | None = typer.Option(None, "--since", help="At or after: unix seconds or ISO 8601."),
    until: str | None = typer.Option(None, "--until", help="At or before: unix seconds or ISO 8601."),
    limit: int = typer.Option(100, "--limit", min=1, help="The newest entries to show (not with --jsonl)."),
    jsonl: bool = typer.Option(
        False, "--jsonl", help="Every matching entry, oldest first, one JSON object a line (an export)."
    ),
    api_key: str = ApiKey,
    agent_url: str = AgentUrl,
) -> None:
    """The tenant's audit log: who did what, newest first (admins)."""
    params: dict[str, Any] = {}
    if user:
        params["actor"] = user
    if action:
        params["action"] = action
    if since:
        params["since"] = unix_time(since, "--since")
    if until:
        params["until"] = unix_time(until, "--until")
    with agent_client(api_key, agent_url) as client:
        if jsonl:
            with client.stream("GET", "/v1/audit", params={**params, "format": "jsonl"}) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _answer(resp)
                for line in resp.iter_lines():
                    if line:
                        print(line)
            return
        entries: list[dict[str, Any]] = []
        before: str | None = None
        while len(entries) < limit:
            page_params = {**params, "limit": min(AUDIT_PAGE, limit - len(entries))}
            if before:
                page_params["before"] = before
            page = _answer(client.get("/v1/audit", params=page_params))
            entries += page["data"]
            before = page.get("next_before")
            if not page.get("has_more") or not before:
                break
    table = Table()
    for col in ("at", "actor", "action", "target", "detail"):
        table.add_column(col)
    for e in entries:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["at"]))
        detail = json.dumps(e["detail"], sort_keys=True) if e["detail"] else ""
        table.add_row(
            at, f"{e['actor']['kind']}:{e['actor']['id']}", e["action"], e["target"], escape(detail)
        )
    console.print(table)


# -- the last admin of a tenant ---------------------------------------------------------------


def last_admin_refusal(store: KeyStore, redis_url: str, key: str) -> str | None:
    """Why revoking ``key`` (an id or the whole key) would leave its tenant without an admin; None
    when it would not (another admin key or admin user is live, or the key is no live admin key)."""
    key_id = key
    if key.startswith(KEY_PREFIX):
        found = store.r.get(f"tandem:keys:hash:{hash_key(key)}")
        if not found:
            return None  # unknown: the revocation names it
        key_id = found.decode() if isinstance(found, bytes) else str(found)
    raw = store.r.hgetall(f"tandem:keys:{key_id}")
    data = {
        (k.decode() if isinstance(k, bytes) else str(k)): (v.decode() if isinstance(v, bytes) else str(v))
        for k, v in dict(raw).items()  # type: ignore[call-overload]
    }
    role = data.get("role")
    if not data or data.get("revoked") != "0" or role == OPERATOR or tenant_role(role) != ADMIN:
        return None
    tenant = data["tenant"]

    async def admins() -> int:
        client = async_redis(redis_url)
        try:
            return await UserStore(client).admins(tenant)
        finally:
            await client.aclose()

    if asyncio.run(admins()) > 1:
        return None
    return (
        f"key {key_id} is the last admin of tenant {tenant!r}: revoking it would leave the tenant "
        "without an admin (make another key or user an admin first: `tandem keys create --role admin`, "
        "`tandem users create ... --role admin`), or pass --force"
    )
