"""Sign-in with an OpenID provider (services/common/oidc.py, services/agent/api/signin.py): the
authorisation-code flow with PKCE against a real provider (npm's oidc-provider, started here),
users made at the first sign-in and placed in a tenant by a claim or by their email's domain,
the session cookie and its CSRF header, sign-out, the audit entries, and the provider's JWTs as
bearer tokens on the agent and on retrieval (refused with a 401 naming why: expired, bad
signature, wrong audience). Real HTTP, real Valkey, the real retrieval service (no model loaded:
these tests only list collections)."""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import httpx
import pytest
from joserfc import jwk, jwt
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from services.agent.api.signin import CALLBACK
from services.common.auth import CSRF_HEADER, SESSION_COOKIE, KeyStore, authenticate
from services.common.errors import Unauthorized
from services.common.redis_conn import async_redis
from services.common.users import UserStore
from tests.conftest import auth
from tests.helpers.oidc_provider import ProviderProcess, oidc_provider, provider_tokens, through_provider
from tests.helpers.servers import free_port, serve_app

CLIENT = "tandem-web"
SECRET = secrets.token_urlsafe(24)
OTHER = "payroll-app"  # another application of the organisation, registered at the same provider
OTHER_SECRET = secrets.token_urlsafe(24)
OTHER_REDIRECT = "http://127.0.0.1:9/payroll/callback"
SCOPES = "openid email profile groups tenant"


@dataclass
class SignInStack:
    agent: str
    retrieval: str
    provider: ProviderProcess
    by_domain: str  # the tenant of example.com addresses
    by_claim: str  # the tenant bob's tenant claim names
    admin_key: str  # an admin key of by_domain
    agent_app: Any
    retrieval_app: Any

    @property
    def callback(self) -> str:
        return self.agent + CALLBACK


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SignInStack]:
    from services.agent.app import create_app as create_agent
    from services.agent.config import AgentSettings
    from services.common.config import CommonSettings
    from services.retrieval.app import create_app as create_retrieval
    from services.retrieval.config import RetrievalSettings

    by_domain, by_claim = f"od{secrets.token_hex(3)}", f"oc{secrets.token_hex(3)}"
    provider_port, agent_port = free_port(), free_port()
    agent_url = f"http://127.0.0.1:{agent_port}"
    accounts = {
        "alice": {"email": "alice@example.com", "email_verified": True, "groups": ["hr", "staff"]},
        "bob": {"email": "bob@corp.example", "email_verified": True, "tenant": by_claim, "groups": ["eng"]},
        "mallory": {"email": "mallory@elsewhere.example", "email_verified": True},
        "eve": {"email": "eve@example.com", "email_verified": False},
    }
    clients = [
        {
            "client_id": CLIENT,
            "client_secret": SECRET,
            "redirect_uris": [agent_url + CALLBACK],
            "grant_types": ["authorization_code"],
            "response_types": ["code"],
        },
        {
            "client_id": OTHER,
            "client_secret": OTHER_SECRET,
            "redirect_uris": [OTHER_REDIRECT],
            "grant_types": ["authorization_code"],
            "response_types": ["code"],
        },
    ]
    with ExitStack() as es:
        provider = es.enter_context(
            oidc_provider(tmp_path_factory.mktemp("oidc"), clients, accounts, port=provider_port)
        )

        def common(home: str, **extra: Any) -> CommonSettings:
            return CommonSettings(
                home=tmp_path_factory.mktemp(home),
                redis_url=redis_url,
                log_json=False,
                oidc_issuer=provider.issuer,
                oidc_client_id=CLIENT,
                oidc_client_secret=SECRET,
                oidc_scopes=SCOPES,
                oidc_tenant_claim="tenant",
                oidc_tenant_domains=f"example.com={by_domain}",
                oidc_name="Example SSO",
                **extra,
            )

        r_app = create_retrieval(common("retrieval"), RetrievalSettings(embedding_model="unloaded"))
        r_url = es.enter_context(serve_app(r_app))
        a_app = create_agent(common("agent", retrieval_url=r_url, agent_url=agent_url), AgentSettings())
        es.enter_context(serve_app(a_app, port=agent_port))
        admin = KeyStore(_sync_redis(redis_url)).create(by_domain, "admin", role="admin")[0]
        yield SignInStack(agent_url, r_url, provider, by_domain, by_claim, admin, a_app, r_app)


def _sync_redis(url: str) -> Any:
    from services.common.redis_conn import sync_redis

    return sync_redis(url)


@dataclass
class Browser:
    """An httpx client signed in through the provider, holding the agent's session cookie."""

    client: httpx.Client
    session: str
    set_cookie: str  # the Set-Cookie header of the session, as the agent sent it
    landed: str  # where the callback sent the browser

    def csrf(self, agent: str) -> str:
        resp = self.client.get(f"{agent}/v1/auth/session")
        assert resp.status_code == 200, resp.text
        return str(resp.json()["csrf"])


def start_sign_in(stack: SignInStack, login: str, next_route: str = "chat") -> tuple[httpx.Client, str]:
    """(the browser, the callback URL the provider sends it to) after signing in at the provider."""
    client = httpx.Client(timeout=30)
    start = client.get(f"{stack.agent}/v1/auth/oidc/login", params={"next": next_route})
    assert start.status_code == 302, start.text
    return client, through_provider(client, start, login, stack.callback)


def sign_in(stack: SignInStack, login: str, next_route: str = "chat") -> Browser:
    client, callback = start_sign_in(stack, login, next_route)
    done = client.get(callback)
    assert done.status_code == 303, done.text
    set_cookie = next(v for v in done.headers.get_list("set-cookie") if v.startswith(SESSION_COOKIE))
    return Browser(client, client.cookies[SESSION_COOKIE], set_cookie, done.headers["location"])


def users_of(stack: SignInStack, tenant: str) -> list[Any]:
    import asyncio

    async def read() -> list[Any]:
        client = async_redis(stack.agent_app.state.common.redis_url)
        try:
            return await UserStore(client).users(tenant)
        finally:
            await client.aclose()

    return asyncio.run(read())


def audit(stack: SignInStack, action: str) -> list[dict[str, Any]]:
    resp = httpx.get(
        f"{stack.agent}/v1/audit", params={"action": action}, headers=auth(stack.admin_key), timeout=30
    )
    assert resp.status_code == 200, resp.text
    entries: list[dict[str, Any]] = resp.json()["data"]
    return entries


# -- the sign-in ---------------------------------------------------------------------------------


def test_the_sign_in_page_learns_of_the_provider_without_a_key(stack: SignInStack) -> None:
    resp = httpx.get(f"{stack.agent}/v1/auth/config")
    assert resp.status_code == 200
    assert resp.json() == {"oidc": True, "name": "Example SSO", "login_url": "/v1/auth/oidc/login"}


def test_login_redirects_to_the_provider_with_pkce_state_and_nonce(stack: SignInStack) -> None:
    resp = httpx.get(f"{stack.agent}/v1/auth/oidc/login", params={"next": "documents"})
    assert resp.status_code == 302
    url = urlsplit(resp.headers["location"])
    query = {k: v[0] for k, v in parse_qs(url.query).items()}
    assert f"{url.scheme}://{url.netloc}" == stack.provider.issuer
    assert query["client_id"] == CLIENT and query["response_type"] == "code"
    assert query["redirect_uri"] == stack.callback and query["scope"] == SCOPES
    assert query["code_challenge_method"] == "S256" and len(query["code_challenge"]) == 43
    assert len(query["state"]) >= 32 and len(query["nonce"]) >= 32
    state_cookie = resp.headers["set-cookie"]
    assert state_cookie.startswith(f"tandem_oidc_state={query['state']};")
    assert "HttpOnly" in state_cookie and "SameSite=lax" in state_cookie


def test_first_sign_in_makes_the_user_in_the_tenant_of_its_domain(stack: SignInStack) -> None:
    browser = sign_in(stack, "alice", "documents")
    assert browser.landed == "/#/documents"
    cookie = SimpleCookie(browser.set_cookie)[SESSION_COOKIE]
    assert cookie.value.startswith("tdu_")
    assert cookie["httponly"] and cookie["samesite"].lower() == "lax" and cookie["path"] == "/"
    assert not cookie["secure"]  # served over plain http here; https sets Secure
    assert 43_000 <= int(cookie["max-age"]) <= 43_200

    alice = [u for u in users_of(stack, stack.by_domain) if u.email == "alice@example.com"]
    assert len(alice) == 1
    assert alice[0].role == "member" and alice[0].groups == ["hr", "staff"]

    who = browser.client.get(f"{stack.agent}/v1/auth/session").json()
    assert who["tenant"] == stack.by_domain and who["user_id"] == alice[0].id
    assert who["email"] == "alice@example.com" and who["role"] == "member"
    assert who["groups"] == ["hr", "staff"] and who["via"] == "cookie"
    assert len(who["csrf"]) == 64 and who["expires_at"] > time.time() + 43_000

    signed_in = [e for e in audit(stack, "user.sign_in") if e["actor"]["id"] == alice[0].id]
    assert signed_in and signed_in[0]["actor"]["kind"] == "user"
    assert signed_in[0]["detail"]["via"] == "oidc"
    made = [e for e in audit(stack, "user.create") if e["target"] == alice[0].id]
    assert len(made) == 1 and made[0]["detail"]["via"] == "oidc"


def test_a_tenant_claim_places_the_user_and_the_next_sign_in_finds_it_again(stack: SignInStack) -> None:
    first = sign_in(stack, "bob")
    bob = [u for u in users_of(stack, stack.by_claim) if u.email == "bob@corp.example"]
    assert len(bob) == 1 and bob[0].groups == ["eng"]
    # the provider moves bob to another group: his next sign-in brings the change, same user
    stack.provider.set_account("bob", {**stack.provider.config["accounts"]["bob"], "groups": ["eng", "ops"]})
    second = sign_in(stack, "bob")
    again = [u for u in users_of(stack, stack.by_claim) if u.email == "bob@corp.example"]
    assert [u.id for u in again] == [bob[0].id] and again[0].groups == ["eng", "ops"]
    assert first.session != second.session  # a session per sign-in


def test_a_code_is_exchanged_once_and_only_in_the_browser_that_started(stack: SignInStack) -> None:
    _, callback = start_sign_in(stack, "alice")
    stranger = httpx.get(callback, timeout=30)  # the callback URL, in another browser
    assert stranger.status_code == 400
    assert "started in another browser" in stranger.json()["error"]["message"]
    # the state was spent by that attempt: the real browser must start again
    client2, callback2 = start_sign_in(stack, "alice")
    assert client2.get(callback2).status_code == 303
    replay = client2.get(callback2)
    assert replay.status_code == 400
    assert replay.json()["error"]["param"] == "state"
    assert "no sign-in is waiting" in replay.json()["error"]["message"]


def test_a_person_of_no_tenant_is_refused_saying_why(stack: SignInStack) -> None:
    client, callback = start_sign_in(stack, "mallory")
    resp = client.get(callback)
    assert resp.status_code == 403
    message = resp.json()["error"]["message"]
    assert "mallory@elsewhere.example belongs to no tenant" in message
    assert "'elsewhere.example'" in message and "TANDEM_OIDC_TENANT_DOMAINS" in message
    assert not users_of(stack, "elsewhere.example")
    # an unverified address does not get in by its domain
    client, callback = start_sign_in(stack, "eve")
    resp = client.get(callback)
    assert resp.status_code == 403 and "not verified" in resp.json()["error"]["message"]
    assert SESSION_COOKIE not in client.cookies


def test_a_browser_is_sent_back_to_the_sign_in_page_with_the_reason(stack: SignInStack) -> None:
    client, callback = start_sign_in(stack, "mallory")
    resp = client.get(callback, headers={"Accept": "text/html,application/xhtml+xml"})
    assert resp.status_code == 303
    location = resp.headers["location"]
    assert location.startswith("/#/signin?error=")
    assert "belongs to no tenant" in unquote(location)


def test_the_provider_refusing_is_a_401_naming_its_error(stack: SignInStack) -> None:
    resp = httpx.get(
        stack.callback, params={"error": "access_denied", "error_description": "End-User aborted interaction"}
    )
    assert resp.status_code == 401
    assert resp.json()["error"]["message"] == (
        "the OpenID provider refused the sign-in: access_denied (End-User aborted interaction)"
    )


# -- the session ---------------------------------------------------------------------------------


def test_writes_by_cookie_need_the_csrf_header(stack: SignInStack) -> None:
    browser = sign_in(stack, "alice")
    who = browser.client.get(f"{stack.agent}/v1/auth/session").json()
    tokens = f"{stack.agent}/v1/users/{who['user_id']}/tokens"
    assert browser.client.get(tokens).status_code == 200  # reads need no header

    missing = browser.client.post(tokens, json={"name": "laptop"})
    assert missing.status_code == 403
    assert missing.json()["error"]["param"] == CSRF_HEADER
    assert f"missing {CSRF_HEADER} header" in missing.json()["error"]["message"]
    wrong = browser.client.post(tokens, json={"name": "laptop"}, headers={CSRF_HEADER: "0" * 64})
    assert wrong.status_code == 403 and "does not match this session" in wrong.json()["error"]["message"]

    made = browser.client.post(tokens, json={"name": "laptop"}, headers={CSRF_HEADER: who["csrf"]})
    assert made.status_code == 201, made.text
    # a bearer header needs no CSRF value: no other site can make a browser send one
    bearer = httpx.get(f"{stack.agent}/v1/auth/session", headers=auth(made.json()["token"]))
    assert bearer.json()["via"] == "bearer" and bearer.json()["csrf"] is None


def test_the_session_reaches_the_other_services_through_the_proxy(stack: SignInStack) -> None:
    browser = sign_in(stack, "alice")
    listed = browser.client.get(f"{stack.agent}/api/retrieval/v1/collections")
    assert listed.status_code == 200, listed.text  # retrieval checked the session's token itself
    name = f"c{secrets.token_hex(3)}"
    refused = browser.client.post(f"{stack.agent}/api/retrieval/v1/collections", json={"name": name})
    assert refused.status_code == 403 and refused.json()["error"]["param"] == CSRF_HEADER
    assert name not in httpx.get(f"{stack.retrieval}/v1/collections", headers=auth(stack.admin_key)).text


def test_a_cookie_websocket_must_come_from_the_page_itself(stack: SignInStack) -> None:
    browser = sign_in(stack, "alice")
    url = stack.agent.replace("http://", "ws://") + "/v1/ws/chat"
    cookie = f"{SESSION_COOKIE}={browser.session}"
    with connect(url, additional_headers={"Cookie": cookie, "Origin": stack.agent}, open_timeout=30):
        pass
    with pytest.raises(InvalidStatus) as refused:
        connect(url, additional_headers={"Cookie": cookie, "Origin": "http://evil.example"}, open_timeout=30)
    assert refused.value.response.status_code == 403


def test_sign_out_revokes_the_session_and_clears_the_cookie(stack: SignInStack) -> None:
    browser = sign_in(stack, "alice")
    csrf = browser.csrf(stack.agent)
    user_id = browser.client.get(f"{stack.agent}/v1/auth/session").json()["user_id"]
    refused = browser.client.post(f"{stack.agent}/v1/auth/logout")
    assert refused.status_code == 403  # another site cannot sign the person out either

    out = browser.client.post(f"{stack.agent}/v1/auth/logout", headers={CSRF_HEADER: csrf})
    assert out.status_code == 204
    cleared = SimpleCookie(out.headers["set-cookie"])[SESSION_COOKIE]
    assert cleared.value == "" and cleared["max-age"] == "0"
    # the token behind the cookie no longer works, wherever it is sent
    after = httpx.get(f"{stack.agent}/v1/auth/session", headers=auth(browser.session))
    assert after.status_code == 401 and "was revoked" in after.json()["error"]["message"]
    assert httpx.get(f"{stack.retrieval}/v1/collections", headers=auth(browser.session)).status_code == 401
    signed_out = [e for e in audit(stack, "user.sign_out") if e["actor"]["id"] == user_id]
    assert signed_out and signed_out[0]["actor"]["kind"] == "user"
    # signing out again, with the stale cookie, only clears it
    assert (
        httpx.post(f"{stack.agent}/v1/auth/logout", cookies={SESSION_COOKIE: browser.session}).status_code
        == 204
    )


# -- the provider's JWTs as bearer tokens ---------------------------------------------------------


def _alice_tokens(stack: SignInStack, client_id: str = CLIENT) -> dict[str, Any]:
    if client_id == CLIENT:
        return provider_tokens(stack.provider, CLIENT, SECRET, stack.callback, "alice", SCOPES)
    return provider_tokens(stack.provider, OTHER, OTHER_SECRET, OTHER_REDIRECT, "alice", SCOPES)


def test_an_id_token_of_the_provider_is_a_bearer_token_on_every_service(stack: SignInStack) -> None:
    id_token = _alice_tokens(stack)["id_token"]
    who = httpx.get(f"{stack.agent}/v1/auth/session", headers=auth(id_token))
    assert who.status_code == 200, who.text
    assert who.json()["email"] == "alice@example.com" and who.json()["tenant"] == stack.by_domain
    assert who.json()["via"] == "bearer"
    listed = httpx.get(f"{stack.retrieval}/v1/collections", headers=auth(id_token))
    assert listed.status_code == 200, listed.text


def test_a_person_first_seen_by_a_bearer_jwt_is_made_and_audited(stack: SignInStack) -> None:
    stack.provider.set_account("frank", {"email": "frank@example.com", "email_verified": True})
    id_token = provider_tokens(stack.provider, CLIENT, SECRET, stack.callback, "frank", SCOPES)["id_token"]
    assert not [u for u in users_of(stack, stack.by_domain) if u.email == "frank@example.com"]
    who = httpx.get(f"{stack.agent}/v1/auth/session", headers=auth(id_token))
    assert who.status_code == 200, who.text
    (frank,) = [u for u in users_of(stack, stack.by_domain) if u.email == "frank@example.com"]
    made = [e for e in audit(stack, "user.create") if e["target"] == frank.id]
    assert len(made) == 1 and made[0]["detail"]["via"] == "bearer JWT", made


@pytest.mark.anyio
async def test_an_id_token_works_for_the_mcp_server_s_tools(stack: SignInStack) -> None:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    id_token = _alice_tokens(stack)["id_token"]
    http = httpx2.AsyncClient(headers=auth(id_token), timeout=60)
    async with Client(streamable_http_client(f"{stack.agent}/mcp", http_client=http)) as mcp:
        listed = await mcp.call_tool("list_collections", {})  # retrieval asked with the same JWT
    assert not listed.is_error, listed.content
    assert "collections" in (listed.structured_content or {})


def test_a_token_for_another_application_is_the_wrong_audience(stack: SignInStack) -> None:
    id_token = _alice_tokens(stack, OTHER)["id_token"]
    for url in (f"{stack.agent}/v1/auth/session", f"{stack.retrieval}/v1/collections"):
        resp = httpx.get(url, headers=auth(id_token))
        assert resp.status_code == 401
        assert "wrong audience" in resp.json()["error"]["message"]
        assert OTHER in resp.json()["error"]["message"]


def test_an_expired_token_is_refused_as_expired(stack: SignInStack) -> None:
    id_token = _alice_tokens(stack)["id_token"]
    oidc = stack.agent_app.state.oidc
    oidc.clock = lambda: time.time() + 3600 + 120  # the provider's ID tokens last an hour
    try:
        resp = httpx.get(f"{stack.agent}/v1/auth/session", headers=auth(id_token))
    finally:
        oidc.clock = time.time
    assert resp.status_code == 401
    assert resp.json()["error"]["message"].startswith("JWT refused: expired at ")


def _segments(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    head, body, _ = token.split(".")
    return (
        json.loads(base64.urlsafe_b64decode(head + "==")),
        json.loads(base64.urlsafe_b64decode(body + "==")),
    )


def _b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def test_forged_tokens_are_refused_as_bad_signatures(stack: SignInStack) -> None:
    id_token = _alice_tokens(stack)["id_token"]
    header, claims = _segments(id_token)
    # signed by a key of the forger's own, under the provider's key id
    own = jwk.RSAKey.generate_key(2048, parameters={"kid": header["kid"]})
    forged = jwt.encode({"alg": "RS256", "kid": header["kid"]}, claims, own)
    # the provider's signature over other claims (someone else's email)
    head, _, signature = id_token.split(".")
    tampered = f"{head}.{_b64({**claims, 'email': 'ceo@example.com'})}.{signature}"
    # no signature at all
    unsigned = f"{_b64({'alg': 'none'})}.{_b64(claims)}."
    for token, why in (
        (forged, "bad signature (not signed by the provider's key"),
        (tampered, "bad signature (not signed by the provider's key"),
        (unsigned, "bad signature (algorithm 'none' is not accepted"),
    ):
        resp = httpx.get(f"{stack.agent}/v1/auth/session", headers=auth(token))
        assert resp.status_code == 401, resp.text
        assert why in resp.json()["error"]["message"]
    unknown = jwt.encode({"alg": "RS256", "kid": "not-the-providers"}, claims, own)
    resp = httpx.get(f"{stack.retrieval}/v1/collections", headers=auth(unknown))
    assert resp.status_code == 401
    assert "the provider has no signing key with id 'not-the-providers'" in resp.json()["error"]["message"]


def test_a_jwt_where_no_provider_is_configured_says_so(redis_url: str) -> None:
    import asyncio

    token = f"{_b64({'alg': 'RS256'})}.{_b64({'sub': 'x'})}.c2ln"

    async def check() -> str:
        client = async_redis(redis_url)
        try:
            await authenticate(client, token)
        except Unauthorized as exc:
            return exc.message
        finally:
            await client.aclose()
        return ""

    assert "no OpenID provider is configured (TANDEM_OIDC_ISSUER)" in asyncio.run(check())
