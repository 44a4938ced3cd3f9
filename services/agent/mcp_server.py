"""Tandem as an MCP server: Streamable HTTP at ``/mcp`` (the official SDK's ``MCPServer``).

Tools: ``search`` (a collection, with mode, top_k and filters), ``ask`` (the chat-documents
pipeline: an answer with citations), ``list_collections``, and one tool per agent definition;
resources: a collection's documents, ``tandem://collections/{name}/documents/{id}``.

The route is one of the service's keyed routes, so the guard in front of every service
(services/common/guard.py) checks the tenant's API key (a Bearer token), the body size and the
tenant's rate and concurrency before the SDK sees a byte. Every tool then works with the
caller's own key against retrieval and inference, so a tenant reaches only its own collections.
The server is stateless and answers JSON (no long-lived streams hold a concurrency slot).

Tool inputs are the REST routes' pydantic models: ``ask`` and the agent tools take
``POST /v1/pipelines/{name}/run``'s body (``PipelineRunRequest``, less ``stream``), ``search``
the retrieval search route's body with the collection of its path.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import httpx
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp.server.transport_security import TransportSecuritySettings
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from services.agent.events import ErrorEvent
from services.agent.protocol import PipelineRunRequest
from services.agent.runtime import AgentRuntime, Turn, TurnResult, collect
from services.common.auth import Principal, verify_key
from services.common.errors import TandemError
from services.common.http import service_client

MCP_PATH = "/mcp"
ASK_PIPELINE = "chat-documents"
COLLECTION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
DOCUMENT_URI = "tandem://collections/{name}/documents/{id}"


class SearchArguments(BaseModel):
    """``POST /v1/collections/{collection}/search``'s body, with the collection of its path."""

    model_config = ConfigDict(extra="forbid")

    collection: str = Field(..., pattern=COLLECTION_PATTERN, description="The collection to search.")
    query: str = Field(..., min_length=1, max_length=8192)
    top_k: int = Field(10, ge=1, le=100)
    mode: Literal["dense", "sparse", "hybrid"] = "hybrid"
    filters: dict[str, Any] | None = None
    rerank: bool = False


class _Caller:
    """The principal and key of the MCP request being served (from its Authorization header;
    the guard has already refused requests without a valid key)."""

    def __init__(self, principal: Principal, key: str) -> None:
        self.principal = principal
        self.key = key


async def _caller(ctx: Context[Any, Any], runtime_redis: Any) -> _Caller:
    headers = ctx.headers or {}
    scheme, _, token = str(headers.get("authorization", "")).partition(" ")
    principal = await verify_key(runtime_redis, token.strip()) if scheme.lower() == "bearer" else None
    if principal is None:
        raise ToolError("invalid or revoked API key")
    return _Caller(principal, token.strip())


def _tool_error(exc: TandemError) -> ToolError:
    where = f" ({exc.param})" if exc.param else ""
    return ToolError(f"{exc.message}{where}")


def _validated(model: type[BaseModel], arguments: dict[str, Any]) -> Any:
    try:
        return model.model_validate({k: v for k, v in arguments.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ToolError(f"invalid arguments: {problems}") from None


def _model_tool(
    model: type[BaseModel],
    run: Callable[[Any, Context[Any, Any]], Awaitable[dict[str, Any]]],
    skip: tuple[str, ...] = (),
) -> Callable[..., Awaitable[dict[str, Any]]]:
    """A tool function whose arguments are ``model``'s fields (so the SDK publishes, and checks
    calls against, the REST route's own schema); the call is validated by ``model`` itself."""

    async def tool(ctx: Context[Any, Any], **arguments: Any) -> dict[str, Any]:
        return await run(_validated(model, arguments), ctx)

    params = [inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=Context)]
    annotations: dict[str, Any] = {"ctx": Context, "return": dict[str, Any]}
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, annotation=field.annotation, default=field
            )
        )
        annotations[name] = field.annotation
    tool.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    tool.__annotations__ = annotations
    return tool


def build_mcp_server(runtime: AgentRuntime, redis_client: Any) -> MCPServer:
    mcp = MCPServer(
        "tandem",
        instructions="Search and ask the caller's document collections, and run Tandem's agents.",
    )

    async def caller(ctx: Context[Any, Any]) -> _Caller:
        return await _caller(ctx, redis_client)

    async def search(args: SearchArguments, ctx: Context[Any, Any]) -> dict[str, Any]:
        who = await caller(ctx)
        try:
            chunks = await runtime.retrieval(who.key).search(
                args.collection,
                args.query,
                top_k=args.top_k,
                mode=args.mode,
                rerank=args.rerank,
                filters=args.filters,
            )
        except TandemError as exc:
            raise _tool_error(exc) from None
        return {"collection": args.collection, "results": [c.to_result() for c in chunks]}

    def turn_tool(
        target: str,
    ) -> Callable[[PipelineRunRequest, Context[Any, Any]], Awaitable[dict[str, Any]]]:
        async def run(body: PipelineRunRequest, ctx: Context[Any, Any]) -> dict[str, Any]:
            who = await caller(ctx)
            turn = Turn.of_run(target, body)
            result = TurnResult()
            try:
                events = await collect(runtime.turn(who.principal, who.key, turn, result))
            except TandemError as exc:
                raise _tool_error(exc) from None
            errors = [e for e in events if isinstance(e, ErrorEvent)]
            if errors:
                raise ToolError(f"{errors[-1].message} ({errors[-1].code})")
            return result.pipeline_answer(target, turn.message, None)

        return run

    mcp.add_tool(
        _model_tool(SearchArguments, search),
        name="search",
        description="Searches one of your collections (dense, sparse or hybrid); returns the matching passages.",
    )
    mcp.add_tool(
        _model_tool(PipelineRunRequest, turn_tool(ASK_PIPELINE), skip=("stream",)),
        name="ask",
        description="Answers a question from a collection's documents, citing its sources as [n].",
    )
    for name, spec in runtime.agents.items():
        if name in ("search", "ask", "list_collections"):
            continue
        mcp.add_tool(
            _model_tool(PipelineRunRequest, turn_tool(name), skip=("stream",)),
            name=name,
            description=spec.description,
        )

    @mcp.tool(name="list_collections", description="Lists your collections.")
    async def list_collections(ctx: Context[Any, Any]) -> dict[str, Any]:
        who = await caller(ctx)
        async with service_client(runtime.common.url_of("retrieval"), who.key, 30.0) as client:
            try:
                resp = await client.get("/v1/collections")
            except httpx.HTTPError as exc:
                raise ToolError(f"retrieval service unreachable: {type(exc).__name__}") from None
        if resp.status_code != 200:
            raise ToolError(f"retrieval answered {resp.status_code}: {resp.text[:200]}")
        return dict(resp.json())

    @mcp.resource(DOCUMENT_URI, name="document", mime_type="application/json")
    async def document(name: str, id: str, ctx: Context[Any, Any]) -> str:
        """A document of one of your collections (its text and metadata, as JSON)."""
        who = await caller(ctx)
        async with service_client(runtime.common.url_of("retrieval"), who.key, 30.0) as client:
            try:
                resp = await client.get(f"/v1/collections/{name}/documents/{id}")
            except httpx.HTTPError as exc:
                raise ResourceError(f"retrieval service unreachable: {type(exc).__name__}") from None
        if resp.status_code != 200:
            raise ResourceError(f"no document {id!r} in collection {name!r} (retrieval: {resp.status_code})")
        return json.dumps(resp.json())

    return mcp


class _MountedMcp:
    """The ``/mcp`` route's ASGI endpoint: the app's MCP server, built with its runtime
    (``install_mcp``), after the routers were handed to the app factory."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint: ASGIApp = scope["app"].state.mcp_endpoint
        await endpoint(scope, receive, send)


def install_mcp(app: Any, runtime: AgentRuntime) -> MCPServer:
    """Builds the MCP server and its Streamable HTTP endpoint; the app's lifespan runs
    ``app.state.mcp.session_manager.run()``."""
    mcp = build_mcp_server(runtime, app.state.redis)
    # Bearer keys, not cookies: a rebinding attacker's page has no key to send, and the service
    # answers whatever host name it is deployed under.
    http = mcp.streamable_http_app(
        streamable_http_path=MCP_PATH,
        stateless_http=True,
        json_response=True,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    app.state.mcp = mcp
    app.state.mcp_endpoint = next(
        r for r in http.routes if isinstance(r, Route) and r.path == MCP_PATH
    ).endpoint
    return mcp


def mcp_routers() -> tuple[APIRouter, APIRouter]:
    """(the keyed router with ``/mcp``, the public router with the OAuth metadata)."""
    keyed = APIRouter(tags=["mcp"])
    keyed.routes.append(Route(MCP_PATH, endpoint=_MountedMcp(), methods=["GET", "POST", "DELETE"]))
    public = APIRouter(tags=["mcp"])

    def metadata(request: Request) -> JSONResponse:
        base = str(request.base_url).rstrip("/")
        return JSONResponse(
            {
                "resource": f"{base}{MCP_PATH}",
                # No authorization server: Tandem API keys are the scheme (`tandem keys create`).
                "authorization_servers": [],
                "bearer_methods_supported": ["header"],
                "resource_name": "Tandem",
                "tandem_auth": {
                    "scheme": "api_key",
                    "header": "Authorization: Bearer <Tandem API key>",
                    "oauth": False,
                },
            }
        )

    def no_authorization_server(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "type": "not_found_error",
                    "message": "Tandem runs no OAuth authorization server: send a Tandem API key "
                    "as 'Authorization: Bearer <key>'",
                    "param": None,
                    "code": "api_key_auth",
                }
            },
            status_code=404,
        )

    for path in ("/.well-known/oauth-protected-resource", f"/.well-known/oauth-protected-resource{MCP_PATH}"):
        public.add_api_route(path, metadata, methods=["GET"], include_in_schema=False)
    for path in ("/.well-known/oauth-authorization-server", "/.well-known/openid-configuration"):
        public.add_api_route(path, no_authorization_server, methods=["GET"], include_in_schema=False)
    return keyed, public
