"""``/v1/auth``: the web front end's sign-in with the organisation's OpenID provider, its
session, and sign-out (services/common/oidc.py, services/common/sessions.py).

Public (no key): ``GET /v1/auth/config`` (is a provider set up, and its name for the button),
``GET /v1/auth/oidc/login`` (a redirect to the provider), ``GET /v1/auth/oidc/callback`` (the
provider's redirect back: the session cookie is set and the browser goes to the page it came
from) and ``POST /v1/auth/logout``. Behind a key, token or session: ``GET /v1/auth/session``
(who is signed in, and the CSRF value the front end sends on writes).

A failed sign-in answers JSON in the one error shape; a browser (``Accept: text/html``) is sent
back to the sign-in page with the reason instead, where it is shown.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import RedirectResponse

from services.agent.protocol import AuthConfig, SessionInfo
from services.common.app_factory import RouteResponses
from services.common.audit import Actor
from services.common.auth import OPERATOR, Principal, authenticate, credential, csrf_refusal, csrf_token
from services.common.errors import InvalidRequest, NotFound, TandemError, Unauthorized
from services.common.oidc import LOGIN_TTL_S, OidcProvider
from services.common.sessions import (
    STATE_COOKIE,
    STATE_COOKIE_PATH,
    clear_session_cookie,
    end_session,
    is_https,
    session_token_id,
    set_session_cookie,
    start_session,
)
from services.common.users import UserStore

router = APIRouter(tags=["auth"])
public_router = APIRouter(tags=["auth"])

LOGIN = "/v1/auth/oidc/login"
CALLBACK = "/v1/auth/oidc/callback"
# the hash routes of the front end a sign-in may return to (#/chat, #/documents, ...)
NextRoute = Annotated[
    str, Query(alias="next", max_length=32, pattern=r"^[a-z]{1,32}$", description="the page to return to")
]

NOT_SET_UP: RouteResponses = {404: {"description": "no OpenID provider is configured (TANDEM_OIDC_ISSUER)"}}
PROVIDER_DOWN: RouteResponses = {
    503: {"description": "the OpenID provider is unreachable or its documents are unusable"}
}


def _provider(request: Request) -> OidcProvider:
    provider: OidcProvider | None = getattr(request.app.state, "oidc", None)
    if provider is None:
        raise NotFound("no OpenID provider is configured (TANDEM_OIDC_ISSUER): sign in with an API key")
    return provider


def _users(request: Request) -> UserStore:
    store: UserStore = request.app.state.users
    return store


def _wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


@public_router.get("/v1/auth/config", response_model=AuthConfig)
async def auth_config(request: Request) -> AuthConfig:
    """How the sign-in page offers to sign in."""
    provider: OidcProvider | None = getattr(request.app.state, "oidc", None)
    if provider is None:
        return AuthConfig(oidc=False, name="", login_url=None)
    return AuthConfig(oidc=True, name=provider.name, login_url=LOGIN)


@public_router.get(
    LOGIN,
    status_code=302,
    response_class=RedirectResponse,
    responses={
        302: {"description": "to the provider's sign-in page"},
        400: {"description": "an invalid query parameter (named)"},
        **NOT_SET_UP,
        **PROVIDER_DOWN,
    },
)
async def oidc_login(request: Request, next_route: NextRoute = "chat") -> RedirectResponse:
    """Starts a sign-in: state, nonce and PKCE verifier are kept for ten minutes, for one use."""
    provider = _provider(request)
    redirect_uri = provider.redirect_url or str(request.url_for("oidc_callback"))
    url, state = await provider.begin(redirect_uri, next_route)
    response = RedirectResponse(url, status_code=302)
    response.set_cookie(
        STATE_COOKIE,
        state,
        max_age=LOGIN_TTL_S,
        path=STATE_COOKIE_PATH,
        httponly=True,
        samesite="lax",  # sent on the provider's top-level redirect back, not on another site's requests
        secure=is_https(request),
    )
    return response


@public_router.get(
    CALLBACK,
    name="oidc_callback",
    status_code=303,
    response_class=RedirectResponse,
    responses={
        303: {"description": "signed in: the session cookie is set; to the page the sign-in started from"},
        400: {"description": "an unknown, used or expired state, or one from another browser"},
        401: {"description": "the provider refused, or its ID token was refused (the message says why)"},
        403: {"description": "the person maps to no tenant (the message says why)"},
        **NOT_SET_UP,
        **PROVIDER_DOWN,
    },
)
async def oidc_callback(
    request: Request,
    code: Annotated[str | None, Query(max_length=2048)] = None,
    state: Annotated[str | None, Query(max_length=256)] = None,
    error: Annotated[str | None, Query(max_length=256)] = None,
    error_description: Annotated[str | None, Query(max_length=1024)] = None,
) -> Response:
    try:
        return await _sign_in(request, code, state, error, error_description)
    except TandemError as exc:
        if not _wants_html(request):
            raise
        # a browser: back to the sign-in page, which shows why
        response = RedirectResponse(f"/#/signin?error={quote(exc.message[:400])}", status_code=303)
        response.delete_cookie(STATE_COOKIE, path=STATE_COOKIE_PATH)
        return response


async def _sign_in(
    request: Request, code: str | None, state: str | None, error: str | None, error_description: str | None
) -> Response:
    provider = _provider(request)
    if error is not None:
        raise Unauthorized(
            f"the OpenID provider refused the sign-in: {error}"
            + (f" ({error_description})" if error_description else "")
        )
    if not code or not state:
        missing = "code" if not code else "state"
        raise InvalidRequest(f"{missing}: the provider's redirect lacks it", param=missing)
    signin = await provider.finish(state, code, request.cookies.get(STATE_COOKIE))
    who = provider.identity(signin.claims)
    user, _ = await provider.user_of(who)
    common = request.app.state.common
    users = _users(request)
    token, record = await start_session(users, user, who.tenant, common.session_ttl_s)
    actor = Actor(kind="user", id=user.id)
    audit = request.app.state.audit
    await audit.record(
        who.tenant,
        actor,
        "user.sign_in",
        user.id,
        {"via": "oidc", "email": user.email, "groups": user.groups, "session": record.id},
    )
    response = RedirectResponse(f"/#/{signin.next_route}", status_code=303)
    secure = is_https(request)
    set_session_cookie(response, token, common.session_ttl_s, secure)
    response.delete_cookie(STATE_COOKIE, path=STATE_COOKIE_PATH, secure=secure, httponly=True)
    return response


@router.get("/v1/auth/session", response_model=SessionInfo)
async def session(request: Request) -> SessionInfo:
    """Who is signed in; ``csrf`` is the value writes signed in by the cookie send as X-CSRF-Token."""
    principal: Principal = request.state.principal
    cred = credential(request)
    from_cookie = cred is not None and cred.from_cookie
    email: str | None = None
    expires_at: float | None = None
    if principal.user_id:
        email = (await _users(request).get(principal.tenant, principal.user_id)).email
    if cred is not None and from_cookie:
        token_id = await session_token_id(request.app.state.redis, cred.token)
        raw = (
            await request.app.state.redis.hget(f"tandem:tokens:{token_id}", "expires_at")
            if token_id
            else None
        )
        expires_at = float(raw) if raw else None
    return SessionInfo(
        tenant=principal.tenant,
        role=OPERATOR if principal.operator else principal.role,
        user_id=principal.user_id,
        email=email,
        groups=list(principal.groups),
        via="cookie" if from_cookie else "bearer",
        csrf=csrf_token(cred.token) if cred is not None and from_cookie else None,
        expires_at=expires_at,
    )


@public_router.post(
    "/v1/auth/logout",
    status_code=204,
    responses={
        204: {"description": "signed out: the session's token is revoked and its cookie cleared"},
        403: {"description": "a live session without its X-CSRF-Token header (named)"},
    },
)
async def logout(request: Request) -> Response:
    """Ends the browser's session; without one (or with one already expired) only clears the cookie."""
    response = Response(status_code=204)
    cred = credential(request)
    if cred is not None and cred.from_cookie:
        try:
            principal: Principal | None = await authenticate(request.app.state.redis, cred.token)
        except TandemError:  # expired or revoked already: nothing left to end
            principal = None
        if principal is not None and principal.user_id:
            refusal = csrf_refusal(request, cred)
            if refusal is not None:
                raise refusal
            ended = await end_session(_users(request), principal.tenant, principal.user_id, cred.token)
            await request.app.state.audit.record(
                principal.tenant,
                Actor(kind="user", id=principal.user_id),
                "user.sign_out",
                principal.user_id,
                {"session": ended.id if ended else None},
            )
    clear_session_cookie(response, is_https(request))
    return response
