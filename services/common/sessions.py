"""Browser sessions: a signed-in person's user token, held in an HttpOnly cookie.

A session is nothing new to the services: at sign-in the agent makes a personal token for the
user (``tdu_…``, named "web sign-in", expiring after ``TANDEM_SESSION_TTL_S``) and sets it as
the cookie ``tandem_session`` (HttpOnly, so no script reads it; SameSite=Lax, so another site's
forms and scripts do not send it; Secure when the page came over https; Path=/). The agent
passes it on to the other services as a bearer token, like a token pasted by hand, so a role
change, a revocation or the user's removal ends the session everywhere at once.

Writes signed in by the cookie carry ``X-CSRF-Token`` (services/common/auth.py,
``csrf_refusal``); sign-out revokes the token and clears the cookie.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from starlette.requests import HTTPConnection
from starlette.responses import Response

from services.common.auth import SESSION_COOKIE, TOKEN_PREFIX, hash_key
from services.common.users import Token, User, UserStore

SESSION_TOKEN_NAME = "web sign-in"
# The state of a sign-in in progress, bound to the browser that started it (services/common/oidc.py).
STATE_COOKIE = "tandem_oidc_state"
STATE_COOKIE_PATH = "/v1/auth/oidc"


def is_https(conn: HTTPConnection) -> bool:
    """Whether the page came over TLS (behind a proxy: uvicorn's --proxy-headers set the scheme)."""
    return conn.url.scheme in ("https", "wss")


async def start_session(users: UserStore, user: User, tenant: str, ttl_s: int) -> tuple[str, Token]:
    """A new session token of ``user``, valid for ``ttl_s`` seconds (its ended sessions forgotten)."""
    await users.forget_ended(tenant, user.id, SESSION_TOKEN_NAME)
    return await users.create_token(tenant, user.id, SESSION_TOKEN_NAME, expires_at=users.clock() + ttl_s)


def set_session_cookie(response: Response, token: str, ttl_s: int, secure: bool) -> None:
    response.set_cookie(
        SESSION_COOKIE, token, max_age=ttl_s, path="/", httponly=True, samesite="lax", secure=secure
    )


def clear_session_cookie(response: Response, secure: bool) -> None:
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="lax", secure=secure)


async def session_token_id(client: aioredis.Redis, token: str) -> str | None:
    """The id of a session's token (None for anything that is not a user token we know)."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    found = await client.get(f"tandem:tokens:hash:{hash_key(token)}")
    if found is None:
        return None
    return found.decode() if isinstance(found, bytes) else str(found)


async def end_session(users: UserStore, tenant: str, user_id: str, token: str) -> Token | None:
    """Revokes the session's token; None when it was not a token of that user."""
    token_id = await session_token_id(users.r, token)
    if token_id is None:
        return None
    return await users.revoke_token(tenant, user_id, token_id)
