"""The one way every service builds its FastAPI app.

It wires what all services share: logging, request ids, metrics, the error
shape, health and readiness, Redis, and API-key auth on every route that a
service hands over in ``routers`` (health, readiness and metrics stay public).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from pydantic import BaseModel
from starlette.routing import BaseRoute

from services.common.audit import AuditLog
from services.common.auth import OPERATOR, Principal, require_principal
from services.common.config import CommonSettings
from services.common.errors import ErrorResponse, install_error_handlers
from services.common.guard import DOCS_PATHS, MIB, GuardMiddleware
from services.common.jsonsafe import JsonObject
from services.common.logs import configure_logging
from services.common.observability import Readiness, ReadinessCheck, install_observability
from services.common.oidc import OidcProvider
from services.common.ratelimit import TenantLimiter, TenantLimits
from services.common.redis_conn import async_redis
from services.common.telemetry import instrument_app, shutdown

# A route's ``responses=``: OpenAPI response objects by status code, in FastAPI's own type.
RouteResponses = dict[int | str, dict[str, Any]]

# What the guard answers on any route that needs a key, declared so the OpenAPI schema tells the truth.
GUARD_RESPONSES: RouteResponses = {
    400: {
        "model": ErrorResponse,
        "description": "invalid request: the message names the field and value (JSON nested too deep, NaN, ...)",
    },
    401: {"model": ErrorResponse, "description": "missing, unknown or revoked API key"},
    413: {"model": ErrorResponse, "description": "request body larger than the route's limit"},
    429: {
        "model": ErrorResponse,
        "description": "the tenant is over its concurrency or rate limit (Retry-After says when to retry)",
    },
}
# Routes that answer JSON, or a server-sent event stream when the request asks for one.
JSON_OR_SSE: RouteResponses = {
    200: {
        "description": "JSON, or a server-sent event stream when the request has stream: true",
        "content": {"text/event-stream": {}},
    }
}


def json_or_sse(model: type[Any]) -> RouteResponses:
    """``JSON_OR_SSE`` with the JSON answer's schema: ``model``."""
    return {**JSON_OR_SSE, 200: {**JSON_OR_SSE[200], "model": model}}


# Routes that answer only with a server-sent event stream (with response_class=StreamingResponse,
# which declares no JSON of its own).
SSE: RouteResponses = {
    200: {"description": "a server-sent event stream", "content": {"text/event-stream": {}}}
}
_ERROR_SCHEMA = {"$ref": "#/components/schemas/ErrorResponse"}


Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


class WhoAmI(BaseModel):
    """``GET /v1/whoami``: the caller as the service sees it."""

    tenant: str
    key_id: str
    service: str
    role: str
    user_id: str | None
    groups: list[str]


def whoami_router(service: str) -> APIRouter:
    router = APIRouter(tags=["auth"])

    @router.get("/v1/whoami")
    async def whoami(principal: Principal = Depends(require_principal)) -> WhoAmI:
        """Which tenant the presented key or token belongs to, with what role (``operator``,
        ``admin``, ``member`` or ``viewer``), and, for a person's token, the user and its
        groups: the web front end's sign-in check, and what it shows or hides."""
        return WhoAmI(
            tenant=principal.tenant,
            key_id=principal.key_id,
            service=service,
            role=OPERATOR if principal.operator else principal.role,
            user_id=principal.user_id,
            groups=list(principal.groups),
        )

    return router


def _declare_errors(app: FastAPI) -> None:
    """Make the OpenAPI schema say what the service answers: invalid input is a 400 in the
    one error shape (install_error_handlers), never FastAPI's 422, so its 422s go; and an
    error a router declares with a description only (``{404: {"description": ...}}``) gets
    the error shape, so routers list their errors without repeating the model."""
    build = app.openapi

    def openapi() -> JsonObject:
        schema = build()  # cached by FastAPI until routes change; the edits below are idempotent
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                responses.pop("422", None)
                for status, response in responses.items():
                    if status[0] in "45" and "content" not in response:
                        response["content"] = {"application/json": {"schema": dict(_ERROR_SCHEMA)}}
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_service_app(
    service: str,
    common: CommonSettings,
    *,
    routers: Sequence[APIRouter] = (),
    public_routers: Sequence[APIRouter] = (),
    readiness: dict[str, ReadinessCheck] | None = None,
    lifespan: Lifespan | None = None,
    version: str = "0.1.0",
    body_limits: Mapping[str, int | tuple[int, str]] | None = None,
    tenant_limits: TenantLimits | None = None,
) -> FastAPI:
    """``body_limits``: bytes (or bytes and a hint naming the setting) per route template
    (``/v1/files``) for routes that take more than ``TANDEM_MAX_BODY_MB`` (uploads); every
    other route gets that default. ``tenant_limits``: per-tenant concurrency and rate on
    the routes that need a key (429 with Retry-After beyond them)."""
    configure_logging(service, common.log_level, common.log_json)
    redis_client = async_redis(common.redis_url)

    async def redis_ready() -> None:
        await redis_client.ping()

    checks: dict[str, ReadinessCheck] = {"redis": redis_ready, **(readiness or {})}

    @asynccontextmanager
    async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            if lifespan is None:
                yield
            else:
                async with lifespan(app):
                    yield
        finally:
            await redis_client.aclose()
            shutdown(app.state.tracing)  # the spans still buffered go out

    app = FastAPI(title=f"Tandem {service}", version=version, lifespan=_lifespan)
    _declare_errors(app)
    # (route, needs a key?) as the routers declare them: the guard matches requests against
    # these itself, before FastAPI's router (which, since 0.165, nests included routers).
    guarded: list[tuple[BaseRoute, bool]] = []
    app.state.service = service
    app.state.common = common
    app.state.redis = redis_client
    # who did what, in the tenant's append-only log (services/common/audit.py)
    app.state.audit = AuditLog.from_settings(redis_client, common)
    app.state.readiness = Readiness(checks)
    install_error_handlers(app)
    # One limiter per process: the guard asks it per HTTP request, the agent's websocket per turn.
    limiter = TenantLimiter(tenant_limits, service) if tenant_limits is not None else None
    app.state.limiter = limiter
    # The organisation's OpenID provider, when configured: its JWTs are bearer tokens here too.
    app.state.oidc = OidcProvider.from_settings(common, redis_client, app.state.audit)
    # Added before observability so that the access log and metrics also see the guard's 401s and 413s.
    app.add_middleware(
        GuardMiddleware,
        routes=lambda: guarded,
        protected_paths=() if common.public_docs else DOCS_PATHS,
        redis_client=redis_client,
        default_limit=common.max_body_mb * MIB,
        limits=body_limits or {},
        limiter=limiter,
        jwt=app.state.oidc,
    )
    app.state.metrics = install_observability(app, service, app.state.readiness)
    # OpenTelemetry server spans (the caller's traceparent continued); OTLP export when configured
    app.state.tracing = instrument_app(app, service, app.state.metrics.registry)
    for router in (whoami_router(service), *routers):
        app.include_router(router, dependencies=[Depends(require_principal)], responses=GUARD_RESPONSES)
        guarded.extend((r, True) for r in router.routes)
    for router in public_routers:
        app.include_router(router)
        guarded.extend((r, False) for r in router.routes)
    return app
