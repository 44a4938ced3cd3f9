"""The people pages in a real browser, against the real agent (which serves the built front end)
and the real retrieval service behind the agent's proxy, with real Valkey: an admin adds people
and changes their roles, is told plainly when the tenant would lose its last admin, makes and
revokes personal tokens (shown once), reads and exports the audit log, and restricts a
collection to some readers and writers; a member sees none of the admin pages."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.auth import KeyStore
from tests.conftest import TEST_CACHE, auth
from tests.helpers.servers import serve_app, wait_ready
from tests.web.conftest import DIST


@dataclass
class Served:
    url: str
    retrieval: str


@dataclass
class Tenant:
    name: str
    admin_id: str  # the user signed in: the tenant's only admin once its key is revoked
    admin_email: str
    admin_token: str


@pytest.fixture(scope="module")
def served(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from services.agent.app import create_app
    from services.agent.config import AgentSettings
    from services.common.config import CommonSettings
    from services.retrieval.app import create_app as create_retrieval
    from services.retrieval.config import RetrievalSettings
    from tests.agent.doubles import RecordingTrainer, ScriptedModel, inference_double, trainer_double
    from tests.retrieval.conftest import make_tiny_embedder

    root = TEST_CACHE / "retrieval-models"
    root.mkdir(parents=True, exist_ok=True)
    embedder = make_tiny_embedder(root / "tiny-embedder")
    with ExitStack() as es:
        base = CommonSettings(
            home=tmp_path_factory.mktemp("people"), redis_url=redis_url, log_json=False, model_roots=str(root)
        )
        r_url = es.enter_context(
            serve_app(create_retrieval(base, RetrievalSettings(embedding_model=str(embedder))))
        )
        wait_ready(r_url)
        i_url = es.enter_context(serve_app(inference_double(ScriptedModel())))
        t_url = es.enter_context(serve_app(trainer_double(RecordingTrainer())))
        common = base.model_copy(
            update={"retrieval_url": r_url, "inference_url": i_url, "trainer_url": t_url}
        )
        url = es.enter_context(serve_app(create_app(common, AgentSettings(web_dist=str(DIST)))))
        yield Served(url, r_url)


def call(method: str, url: str, key: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(method, url, json=body, headers=auth(key), timeout=60)


def make_user(s: Served, key: str, email: str, role: str, groups: list[str] | None = None) -> str:
    resp = call("POST", f"{s.url}/v1/users", key, {"email": email, "role": role, "groups": groups or []})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


def make_token(s: Served, key: str, user_id: str) -> str:
    resp = call("POST", f"{s.url}/v1/users/{user_id}/tokens", key, {"name": "setup"})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["token"])


@pytest.fixture()
def tenant(served: Served, key_store: KeyStore) -> Tenant:
    """A fresh tenant whose only admin is a person: its first key made that person, then went."""
    name = f"people{secrets.token_hex(4)}"
    key, record = key_store.create(name, "setup", role="admin")
    email = f"ada@{name}.example.org"
    admin_id = make_user(served, key, email, "admin")
    token = make_token(served, key, admin_id)
    key_store.revoke(record.key_id)
    return Tenant(name, admin_id, email, token)


def sign_in(page: Any, site: str, token: str, to: str) -> None:
    page.goto(f"{site}/#/signin?next={to}")
    page.get_by_label("API key").fill(token)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(rf".*#/{to}$"))


def nav(page: Any, name: str) -> Any:
    return page.get_by_role("navigation", name="Main").get_by_role("link", name=name, exact=True)


def test_an_admin_manages_people_and_is_told_the_tenant_must_keep_an_admin(
    page: Any, served: Served, tenant: Tenant
) -> None:
    page.on("dialog", lambda d: d.accept())
    sign_in(page, served.url, tenant.admin_token, "people")
    for entry in ("People", "Audit log", "Tokens"):
        nav(page, entry).wait_for()  # shown once the agent has said who signed in
    assert nav(page, "People").get_attribute("aria-current") == "page"
    me = page.locator(f'tr[data-user="{tenant.admin_id}"]')
    me.wait_for()
    assert tenant.admin_email in me.inner_text() and "you" in me.inner_text()

    page.get_by_label("Email", exact=True).fill("Bob@Example.org")
    page.get_by_label("Role", exact=True).select_option("member")
    page.get_by_label("Groups", exact=True).fill("hr, research")
    page.get_by_role("button", name="Add", exact=True).click()
    bob_role = page.get_by_label("Role of bob@example.org")
    bob_role.wait_for()
    users = {u["email"]: u for u in call("GET", f"{served.url}/v1/users", tenant.admin_token).json()["data"]}
    bob = users["bob@example.org"]
    assert (bob["role"], bob["groups"]) == ("member", ["hr", "research"])
    assert page.get_by_label("Groups of bob@example.org").input_value() == "hr, research"

    bob_role.select_option("viewer")
    page.get_by_label("Groups of bob@example.org").fill("hr")
    page.get_by_role("button", name="Save bob@example.org").click()
    page.get_by_text("bob@example.org saved: viewer, groups hr.").wait_for()
    got = call("GET", f"{served.url}/v1/users/{bob['id']}", tenant.admin_token).json()
    assert (got["role"], got["groups"]) == ("viewer", ["hr"])

    # The last admin demoting itself: refused, said next to the user, the field put back.
    page.get_by_label(f"Role of {tenant.admin_email}").select_option("member")
    page.get_by_role("button", name=f"Save {tenant.admin_email}").click()
    alert = page.get_by_role("alert").filter(has_text="must keep an admin")
    alert.wait_for()
    assert "without an admin" in alert.inner_text() and tenant.admin_email in alert.inner_text()
    assert page.get_by_label(f"Role of {tenant.admin_email}").input_value() == "admin"
    assert (
        call("GET", f"{served.url}/v1/users/{tenant.admin_id}", tenant.admin_token).json()["role"] == "admin"
    )
    page.get_by_role("button", name=f"Remove {tenant.admin_email}").click()
    page.get_by_role("alert").filter(
        has_text=f"{tenant.admin_email} not removed: the tenant must keep an admin"
    ).wait_for()
    assert call("GET", f"{served.url}/v1/users/{tenant.admin_id}", tenant.admin_token).status_code == 200

    page.get_by_role("button", name="Remove bob@example.org").click()
    page.get_by_text("bob@example.org removed.").wait_for()
    # the table is drawn again after the notice: wait for the row to go, not for a fixed time
    page.get_by_label("Role of bob@example.org").wait_for(state="detached")
    assert page.get_by_label("Role of bob@example.org").count() == 0
    assert call("GET", f"{served.url}/v1/users/{bob['id']}", tenant.admin_token).status_code == 404
    assert page.page_errors == []


def test_a_personal_token_is_shown_once_works_and_stops_when_revoked(
    page: Any, served: Served, tenant: Tenant
) -> None:
    page.on("dialog", lambda d: d.accept())
    sign_in(page, served.url, tenant.admin_token, "tokens")
    page.get_by_label("Token name").fill("laptop")
    page.get_by_label("Expires").select_option(label="30 days")
    page.get_by_role("button", name="Create token").click()
    shown = page.locator(".token-value")
    shown.wait_for()
    token = shown.inner_text()
    assert token.startswith("tdu_") and "not shown again" in page.locator(".token-once").inner_text()
    who = call("GET", f"{served.url}/v1/whoami", token).json()
    assert (who["tenant"], who["user_id"], who["role"]) == (tenant.name, tenant.admin_id, "admin")

    row = page.locator("table.tokens tr", has_text="laptop")
    row.wait_for()
    assert row.get_attribute("data-state") == "active" and "in 30 d" in row.inner_text()
    page.get_by_role("button", name="Done").click()
    page.reload()
    page.locator("table.tokens tr", has_text="laptop").wait_for()
    assert token not in page.content()

    page.get_by_role("button", name="Revoke laptop").click()
    page.locator('table.tokens tr[data-state="revoked"]', has_text="laptop").wait_for()
    refused = call("GET", f"{served.url}/v1/whoami", token)
    assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]
    assert page.page_errors == []


def test_a_member_sees_no_admin_pages_and_a_key_no_personal_tokens(
    page: Any, served: Served, tenant: Tenant, key_store: KeyStore
) -> None:
    assert (
        call("POST", f"{served.retrieval}/v1/collections", tenant.admin_token, {"name": "notes"}).status_code
        == 201
    )
    member_id = make_user(served, tenant.admin_token, f"cy@{tenant.name}.example.org", "member")
    sign_in(page, served.url, make_token(served, tenant.admin_token, member_id), "documents")
    page.goto(f"{served.url}/#/documents/notes")
    nav(page, "Tokens").wait_for()
    assert not nav(page, "People").is_visible() and not nav(page, "Audit log").is_visible()
    page.get_by_role("heading", name="Collection “notes”").wait_for()
    assert page.locator("#access-toggle").get_attribute("hidden") is not None
    page.goto(f"{served.url}/#/people")
    page.get_by_text("Only the tenant's admins manage people.").wait_for()
    page.goto(f"{served.url}/#/audit")
    page.get_by_text("Only the tenant's admins read the audit log.").wait_for()

    page.get_by_role("button", name="Sign out").click()
    sign_in(page, served.url, key_store.create(tenant.name, "bot", role="member")[0], "tokens")
    page.get_by_text("You are signed in with a tenant API key").wait_for()
    assert not nav(page, "Tokens").is_visible() and not nav(page, "People").is_visible()
    assert page.page_errors == []


def test_the_audit_log_filters_by_user_action_and_time_and_exports_json_lines(
    page: Any, served: Served, tenant: Tenant, tmp_path: Path
) -> None:
    bob = make_user(served, tenant.admin_token, f"bob@{tenant.name}.example.org", "member")
    call("PATCH", f"{served.url}/v1/users/{bob}", tenant.admin_token, {"role": "viewer"})
    bob_token = make_token(served, tenant.admin_token, bob)
    # bob makes a token of his own: an entry whose actor is bob
    assert call("POST", f"{served.url}/v1/users/{bob}/tokens", bob_token, {"name": "cli"}).status_code == 201

    sign_in(page, served.url, tenant.admin_token, "audit")
    rows = page.locator("table.audit tbody tr[data-entry]")
    rows.first.wait_for()
    actions = rows.evaluate_all("rs => rs.map(r => r.dataset.action)")
    # newest first: bob's token, the admin's token for bob, the role change, bob's creation, ...
    assert actions[:4] == ["token.create", "token.create", "user.update", "user.create"], actions
    update = page.locator('tr[data-action="user.update"]')
    assert (
        tenant.admin_email in update.inner_text() and f"bob@{tenant.name}.example.org" in update.inner_text()
    )
    assert '"to":"viewer"' in update.inner_text()

    page.get_by_label("Action", exact=True).fill("token.create")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_function(
        "() => { const rs = [...document.querySelectorAll('table.audit tbody tr[data-entry]')];"
        " return rs.length > 0 && rs.every(r => r.dataset.action === 'token.create'); }"
    )
    assert rows.count() == 3  # the setup token, bob's from the admin, bob's own
    page.get_by_label("User", exact=True).fill(f"bob@{tenant.name}.example.org")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_function("() => document.querySelectorAll('table.audit tbody tr[data-entry]').length === 1")
    assert "cli" in rows.first.inner_text()

    page.get_by_label("User", exact=True).fill("")
    page.get_by_label("Action", exact=True).fill("")
    page.get_by_label("From", exact=True).fill("2001-01-01T00:00:00")
    page.get_by_label("To", exact=True).fill("2001-01-02T00:00:00")
    page.get_by_role("button", name="Filter").click()
    page.get_by_text("No entries match.").wait_for()
    page.get_by_label("From", exact=True).fill("2001-01-03T00:00:00")
    page.get_by_role("button", name="Filter").click()
    page.get_by_role("alert").filter(has_text="“From” is after “To”.").wait_for()

    page.get_by_label("From", exact=True).fill("")
    page.get_by_label("To", exact=True).fill("")
    page.get_by_label("Action", exact=True).fill("user.create")
    with page.expect_download() as dl:
        page.get_by_role("button", name="Export JSON lines").click()
    target = tmp_path / "audit.jsonl"
    dl.value.save_as(target)
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    assert [(e["tenant"], e["action"]) for e in lines] == [(tenant.name, "user.create")] * 2
    assert lines[0]["at"] <= lines[1]["at"] and lines[1]["target"] == bob
    assert page.page_errors == []


def test_an_admin_restricts_a_collection_to_readers_and_writers(
    page: Any, served: Served, tenant: Tenant
) -> None:
    page.on("dialog", lambda d: d.accept())
    admin = tenant.admin_token
    assert call("POST", f"{served.retrieval}/v1/collections", admin, {"name": "hr"}).status_code == 201
    bob_email = f"bob@{tenant.name}.example.org"
    bob = make_user(served, admin, bob_email, "member", ["payroll"])
    dee = make_user(served, admin, f"dee@{tenant.name}.example.org", "member", ["payroll"])

    sign_in(page, served.url, admin, "documents")
    page.goto(f"{served.url}/#/documents/hr")
    page.get_by_role("button", name="Access").click()
    state = page.locator("#access-state")
    page.wait_for_function("() => document.querySelector('#access-state')?.dataset.open === 'true'")
    assert "Open" in state.inner_text()

    page.get_by_label("Add a reader").select_option("group:payroll")
    page.get_by_role("button", name="Add reader").click()
    page.get_by_label("Add a writer").select_option(f"user:{dee}")
    page.get_by_role("button", name="Add writer").click()
    page.get_by_label("Add a reader").select_option(f"user:{bob}")
    page.get_by_role("button", name="Add reader").click()
    page.get_by_role("button", name=f"Remove {bob_email} from readers").click()
    page.get_by_role("button", name="Save access list").click()
    page.wait_for_function("() => document.querySelector('#access-state')?.dataset.open === 'false'")
    assert "Restricted" in state.inner_text()
    stored = call("GET", f"{served.retrieval}/v1/collections/hr/access", admin).json()
    assert (stored["open"], stored["readers"], stored["writers"]) == (
        False,
        ["group:payroll"],
        [f"user:{dee}"],
    )
    readers = page.get_by_role("list", name="Readers")
    assert readers.locator("[data-entry]").all_inner_texts()[0].startswith("group payroll")

    # Someone removed meanwhile: the save is refused with the entry named, nothing changes.
    page.get_by_label("Add a reader").select_option(f"user:{bob}")
    page.get_by_role("button", name="Add reader").click()
    assert call("DELETE", f"{served.url}/v1/users/{bob}", admin).status_code == 204
    page.get_by_role("button", name="Save access list").click()
    alert = page.get_by_role("alert").filter(has_text="Not saved")
    alert.wait_for()
    assert f"user:{bob}" in alert.inner_text()
    assert call("GET", f"{served.retrieval}/v1/collections/hr/access", admin).json()["readers"] == [
        "group:payroll"
    ]

    page.get_by_role("button", name="Open to the whole tenant").click()
    page.wait_for_function("() => document.querySelector('#access-state')?.dataset.open === 'true'")
    assert call("GET", f"{served.retrieval}/v1/collections/hr/access", admin).json()["open"] is True
    assert page.page_errors == []
