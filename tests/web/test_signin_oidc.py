"""Signing in to the web front end with the organisation's OpenID provider, in Debian's chromium:
the sign-in page's provider button, the provider's own login and consent pages (npm's
oidc-provider, on another site than the app), the way back with an HttpOnly session cookie no
script can read, a write made with the session's CSRF header (a new collection, through the
agent's proxy to the real retrieval service), a reload that stays signed in, and sign-out.
A refused person comes back to the sign-in page with the reason."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from services.agent.api.signin import CALLBACK
from services.common.auth import SESSION_COOKIE
from tests.agent.doubles import RecordingTrainer, ScriptedModel, inference_double, trainer_double
from tests.conftest import TEST_CACHE, auth
from tests.helpers.oidc_provider import oidc_provider
from tests.helpers.servers import free_port, serve_app, wait_ready

# a node provider, a browser and the real retrieval service with its embedder loaded
pytestmark = pytest.mark.e2e

CLIENT, SECRET = "tandem-web", secrets.token_urlsafe(24)


@dataclass
class App:
    url: str
    retrieval: str
    tenant: str


@pytest.fixture(scope="module")
def app(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    from services.agent.app import create_app as create_agent
    from services.agent.config import AgentSettings
    from services.common.config import CommonSettings
    from services.retrieval.app import create_app as create_retrieval
    from services.retrieval.config import RetrievalSettings
    from tests.retrieval.conftest import make_tiny_embedder

    tenant = f"w{secrets.token_hex(3)}"
    agent_port = free_port()
    agent_url = f"http://127.0.0.1:{agent_port}"
    root = TEST_CACHE / "retrieval-models"
    root.mkdir(parents=True, exist_ok=True)
    embedder = make_tiny_embedder(root / "tiny-embedder")
    client = {
        "client_id": CLIENT,
        "client_secret": SECRET,
        "redirect_uris": [agent_url + CALLBACK],
        "grant_types": ["authorization_code"],
        "response_types": ["code"],
    }
    accounts = {
        "alice": {"email": "alice@example.com", "email_verified": True, "groups": ["staff"]},
        "mallory": {"email": "mallory@elsewhere.example", "email_verified": True},
    }
    with ExitStack() as es:
        provider = es.enter_context(oidc_provider(tmp_path_factory.mktemp("oidc-web"), [client], accounts))

        def common(home: str, **extra: Any) -> CommonSettings:
            return CommonSettings(
                home=tmp_path_factory.mktemp(home),
                redis_url=redis_url,
                log_json=False,
                model_roots=str(root),
                oidc_issuer=provider.issuer,
                oidc_client_id=CLIENT,
                oidc_client_secret=SECRET,
                oidc_tenant_domains=f"example.com={tenant}",
                oidc_name="Example SSO",
                **extra,
            )

        retrieval = create_retrieval(common("retrieval"), RetrievalSettings(embedding_model=str(embedder)))
        r_url = es.enter_context(serve_app(retrieval))
        wait_ready(r_url)  # its embedder loaded: making a collection needs it
        i_url = es.enter_context(serve_app(inference_double(ScriptedModel())))
        t_url = es.enter_context(serve_app(trainer_double(RecordingTrainer())))
        agent = create_agent(
            common("agent", retrieval_url=r_url, inference_url=i_url, trainer_url=t_url), AgentSettings()
        )
        es.enter_context(serve_app(agent, port=agent_port))
        yield App(agent_url, r_url, tenant)


def _offline(page: Any) -> None:
    """The provider's pages import a web font from the internet, which tests do not reach: refused
    at once rather than left to time out."""
    page.context.route(re.compile(r"^https?://(?!127\.0\.0\.1|localhost)"), lambda route: route.abort())


def _through_provider(page: Any, login: str) -> None:
    """The provider's own pages: its login form, then its consent form."""
    page.wait_for_selector("input[name=login]")
    page.fill("input[name=login]", login)
    page.fill("input[name=password]", "any password")
    page.get_by_role("button", name="Sign-in").click()
    page.get_by_role("button", name="Continue").click()


def test_sign_in_with_the_provider_work_reload_and_sign_out(page: Any, app: App) -> None:
    _offline(page)
    page.goto(f"{app.url}/#/documents")
    page.wait_for_url(re.compile(r".*#/signin\?next=documents$"))
    button = page.get_by_role("link", name="Sign in with Example SSO")
    button.click()
    _through_provider(page, "alice")
    page.wait_for_url(re.compile(r"^http://127\.0\.0\.1:\d+/#/documents$"))
    page.wait_for_function("document.getElementById('who').textContent === 'alice@example.com'")

    cookie = next(c for c in page.context.cookies(app.url) if c["name"] == SESSION_COOKIE)
    assert cookie["httpOnly"] and cookie["sameSite"] == "Lax" and cookie["path"] == "/"
    assert SESSION_COOKIE not in page.evaluate("document.cookie")  # no script reads the session

    # a write: the page sends the session's CSRF header, the proxy passes the session on
    name = f"notes{secrets.token_hex(2)}"
    page.get_by_label("New collection").fill(name)
    page.get_by_role("button", name="Create").click()
    page.get_by_text(name).first.wait_for()
    listed = httpx.get(f"{app.retrieval}/v1/collections", headers=auth(cookie["value"]), timeout=30)
    assert name in listed.text

    page.reload()
    page.wait_for_function("document.getElementById('who').textContent === 'alice@example.com'")
    assert "#/documents" in page.url

    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url(re.compile(r".*#/signin"))
    assert not [c for c in page.context.cookies(app.url) if c["name"] == SESSION_COOKIE]
    gone = httpx.get(f"{app.url}/v1/auth/session", headers=auth(cookie["value"]), timeout=30)
    assert gone.status_code == 401 and "was revoked" in gone.json()["error"]["message"]
    page.reload()
    page.get_by_role("link", name="Sign in with Example SSO").wait_for()
    assert page.page_errors == []


def test_a_refused_person_sees_why_on_the_sign_in_page(page: Any, app: App) -> None:
    _offline(page)
    page.goto(f"{app.url}/#/signin")
    page.get_by_role("link", name="Sign in with Example SSO").click()
    _through_provider(page, "mallory")
    page.wait_for_url(re.compile(r".*#/signin\?error="))
    alert = page.locator("#signin-error")
    alert.wait_for()
    page.wait_for_function(
        "document.getElementById('signin-error').textContent.includes('belongs to no tenant')"
    )
    assert "mallory@elsewhere.example" in alert.text_content()
