"""The ASGI guard in front of every service: the API key and the body size, before any work.

FastAPI resolves a route's body before its dependencies run, so an ``Authorization``
dependency alone lets an anonymous client make the service read (and parse) a body of
any size: malformed JSON answered 400 instead of 401, and gigabytes were spooled. This
middleware runs before routing does any of that:

- a route handed to ``create_service_app`` in ``routers`` (and ``/docs``, ``/openapi.json``
  unless ``TANDEM_PUBLIC_DOCS``) needs a valid key, user token, OpenID provider JWT or session
  cookie: without one the answer is 401 at once (saying why: missing, unknown, revoked,
  expired, bad signature, wrong audience) and the body is never read; a write signed in by the
  session cookie without its ``X-CSRF-Token`` is a 403 naming the header;
  a viewer's call to a route that writes is a 403 naming the role, also before the body;
- a JSON body nested deeper than 64 levels or holding ``NaN``/``Infinity`` is a 400 naming
  the field (services/common/jsonsafe.py) before any route parses it;
- every HTTP request has a body limit (per route template, else the service default):
  a ``Content-Length`` above it is a 413 at once, and a chunked body is counted as it
  streams in, so the 413 comes as soon as the running count passes the limit.

Websockets are left to the route's own dependency (browsers send the key as a
subprotocol, and a refused websocket is a close frame, not an HTTP answer).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence

import redis.asyncio as aioredis
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common import jsonsafe
from services.common.auth import (
    JwtAuthenticator,
    Principal,
    authenticate,
    credential,
    csrf_refusal,
    viewer_refusal,
)
from services.common.errors import ErrorJson, TandemError, Unauthorized, error_body
from services.common.ratelimit import TenantLimiter

MIB = 1024 * 1024
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a streamed body passes its limit (FastAPI lets
    HTTPExceptions from body reading through, so it becomes the 413 below)."""

    def __init__(self, limit: int, received: int, hint: str = "") -> None:
        super().__init__(
            413,
            f"request body larger than the limit of {describe_bytes(limit)} for this route "
            f"(received {received} bytes so far){hint}",
        )
        self.limit = limit


def describe_bytes(n: int) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB else f"{n} bytes"


def _json_response(status: int, body: ErrorJson, headers: Mapping[str, str] | None = None) -> list[Message]:
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return [
        {"type": "http.response.start", "status": status, "headers": hdrs},
        {"type": "http.response.body", "body": raw},
    ]


class GuardMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Callable[[], Sequence[tuple[BaseRoute, bool]]],
        protected_paths: Collection[str],
        redis_client: aioredis.Redis,
        default_limit: int,
        limits: Mapping[str, int | tuple[int, str]],
        limiter: TenantLimiter | None = None,
        jwt: JwtAuthenticator | None = None,
    ) -> None:
        self.limiter = limiter if limiter is not None and limiter.enabled else None
        self.jwt = jwt
        self.app = app
        self.routes = routes
        self.protected_paths = frozenset(protected_paths)
        self.redis = redis_client
        self.default_limit = default_limit
        # template -> (bytes, a hint naming the setting behind it)
        self.limits = {k: v if isinstance(v, tuple) else (v, "") for k, v in limits.items()}
        self.default = (default_limit, "TANDEM_MAX_BODY_MB")

    def _route(self, scope: Scope) -> tuple[BaseRoute | None, bool]:
        """(route, needs a key?) of the first route matching path and method (else path only)."""
        partial: tuple[BaseRoute | None, bool] = (None, False)
        for route, protected in self.routes():
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route, protected
            if match == Match.PARTIAL and partial[0] is None:
                partial = (route, protected)
        return partial

    async def _refuse(
        self, send: Send, status: int, body: ErrorJson, headers: Mapping[str, str] | None = None
    ) -> None:
        for message in _json_response(status, body, headers):
            await send(message)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route, protected = self._route(scope)
        template = getattr(route, "path", None)
        limit, hint = self.limits.get(template, self.default) if isinstance(template, str) else self.default
        hint = f" ({hint})" if hint else ""
        if protected or scope["path"] in self.protected_paths:
            conn = HTTPConnection(scope)
            cred = credential(conn)
            principal: Principal | None = None
            why = "missing API key: send 'Authorization: Bearer <key>'"
            if cred is not None:
                try:
                    principal = await authenticate(self.redis, cred.token, jwt=self.jwt)
                except Unauthorized as exc:
                    why = exc.message
                except TandemError as exc:  # a JWT's user maps to no tenant; the provider is away
                    await self._refuse(send, exc.status_code, exc.to_dict(), exc.headers)
                    return
            if principal is None or cred is None:
                await self._refuse(
                    send, 401, error_body("authentication_error", why), {"WWW-Authenticate": "Bearer"}
                )
                return
            forbidden = csrf_refusal(conn, cred) or viewer_refusal(
                principal, scope.get("method", ""), template or scope["path"]
            )
            if forbidden is not None:
                await self._refuse(send, 403, forbidden.to_dict())
                return
            # The route's own dependency finds it here and does not look the key up again.
            scope.setdefault("state", {})["principal"] = principal
            if self.limiter is not None and protected:
                refusal = self.limiter.acquire(principal.tenant)
                if refusal is not None:
                    await self._refuse(
                        send,
                        429,
                        error_body("rate_limit_error", refusal.message, None, "rate_limit_exceeded"),
                        {"Retry-After": str(refusal.retry_after)},
                    )
                    return
                try:
                    await self._guarded(scope, receive, send, limit, hint, template)
                finally:
                    self.limiter.release(principal.tenant)
                return
        await self._guarded(scope, receive, send, limit, hint, template)

    async def _guarded(
        self, scope: Scope, receive: Receive, send: Send, limit: int, hint: str, template: object
    ) -> None:
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(
                send,
                413,
                error_body(
                    "invalid_request_error",
                    f"request body of {declared} bytes is larger than the limit of {describe_bytes(limit)} "
                    f"for {scope.get('method', '')} {template or scope['path']}{hint}",
                    None,
                    "body_too_large",
                ),
            )
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit, received, hint)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        app_receive: Receive = counting_receive
        try:
            if _is_json(scope) and scope.get("method") in ("POST", "PUT", "PATCH"):
                body = await _read_all(counting_receive)
                problem = await _json_problem(body)
                if problem is not None:
                    await self._refuse(send, 400, problem)
                    return
                app_receive = _replay(body, receive)
            await self.app(scope, app_receive, tracking_send)
        except BodyTooLarge as exc:
            if started:
                raise
            await self._refuse(
                send, 413, error_body("invalid_request_error", str(exc.detail), None, "body_too_large")
            )


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers", []):
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return bool(media == b"application/json" or media.endswith(b"+json"))
    return False


async def _read_all(receive: Receive) -> bytes:
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body already read, then the client's later messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _json_problem(body: bytes) -> ErrorJson | None:
    """The error body for JSON too deep or with NaN/Infinity; None if fine or not JSON at all
    (a malformed body is left to the route, whose 400 names the position)."""

    def scan() -> ErrorJson | None:
        try:
            jsonsafe.loads(body)
        except json.JSONDecodeError:
            return None
        except UnicodeDecodeError:
            return None
        except TandemError as exc:
            return exc.to_dict()
        return None

    if not body:
        return None
    # Parsing a large body takes milliseconds per MiB: off the event loop.
    return scan() if len(body) < 256 * 1024 else await run_in_threadpool(scan)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
